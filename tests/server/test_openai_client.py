"""The official openai client against the real server: outputs equal offline LLM.generate."""

import asyncio

import openai
import pytest

from kvserve.core.sampling_params import SamplingParams
from tests.conftest import make_llm
from tests.server.conftest import API_KEY


def client(server, key=API_KEY):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def offline(stories):
    return make_llm(stories)


def test_models_endpoint(stories_server):
    models = client(stories_server).models.list()
    assert [m.id for m in models.data] == ["stories260K"]


def test_completion_equals_offline_greedy(stories_server, offline):
    c = client(stories_server).completions.create(model="stories260K", prompt="Once upon a time",
                                                  max_tokens=30, temperature=0)
    ref = offline.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=30))[0]
    assert c.choices[0].text == ref.outputs[0].text
    assert c.choices[0].finish_reason == "length"
    assert c.usage.prompt_tokens == len(ref.prompt_token_ids) and c.usage.completion_tokens == 30


def test_streaming_completion_equals_non_streaming(stories_server):
    cl = client(stories_server)
    full = cl.completions.create(model="stories260K", prompt="Tom had a dog", max_tokens=25, temperature=0)
    chunks = list(cl.completions.create(model="stories260K", prompt="Tom had a dog", max_tokens=25,
                                        temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 25
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_n_and_stop_strings(stories_server, offline):
    cl = client(stories_server)
    c = cl.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=20, n=2,
                              temperature=0.9, seed=5)
    assert len(c.choices) == 2 and {ch.index for ch in c.choices} == {0, 1}
    s = cl.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=40, temperature=0,
                              stop=["Lily"])
    ref = offline.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40, stop=["Lily"]))[0]
    assert s.choices[0].text == ref.outputs[0].text and s.choices[0].finish_reason == "stop"
    assert "Lily" not in s.choices[0].text


def test_logprobs_and_cache_salt_usage(stories_server):
    cl = client(stories_server)
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside. " * 3
    c = cl.completions.create(model="stories260K", prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                              extra_body={"cache_salt": "tenant-x"})
    assert len(c.choices[0].logprobs.token_logprobs) == 3
    again = cl.completions.create(model="stories260K", prompt=prompt, max_tokens=3, temperature=0,
                                  extra_body={"cache_salt": "tenant-x"})
    other = cl.completions.create(model="stories260K", prompt=prompt, max_tokens=3, temperature=0,
                                  extra_body={"cache_salt": "tenant-y"})
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.slow
def test_chat_completions_on_smollm2(smollm2_server, smollm2):
    cl = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = cl.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=20, temperature=0)
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    ref = make_llm(smollm2, num_blocks=64, exact=True).chat(msgs, SamplingParams(temperature=0, max_tokens=20))
    assert r.choices[0].message.content == ref.outputs[0].text
    streamed = "".join(ch.choices[0].delta.content or "" for ch in cl.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=20, temperature=0, stream=True) if ch.choices)
    assert streamed == r.choices[0].message.content


def test_64_concurrent_streaming_clients(stories_server, offline):
    prompts = [f"Once upon a time {w}" for w in ("Tom", "Lily", "the dog", "a cat") * 16]
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = [o.outputs[0].text for o in offline.generate(prompts, params)]
    before = _metric(stories_server, 'kvserve_requests_total{status="length"}')
    before_tokens = _metric(stories_server, "kvserve_generation_tokens_total")

    async def one(cl, p):
        stream = await cl.completions.create(model="stories260K", prompt=p, max_tokens=24, temperature=0,
                                             stream=True)
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    async def main():
        cl = openai.AsyncOpenAI(base_url=stories_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(cl, p) for p in prompts)), 180)
        finally:
            await cl.close()

    assert asyncio.run(main()) == expected
    stories_server.wait_idle()
    assert _metric(stories_server, 'kvserve_requests_total{status="length"}') - before == 64
    assert _metric(stories_server, "kvserve_generation_tokens_total") - before_tokens == 64 * 24
    assert stories_server.engine.kv.pool.num_used_blocks == 0


def _metric(server, name):
    import httpx
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{") and line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_beam_search_through_the_api(stories_server, offline):
    """vLLM's extra parameters: n beams returned out of best_of, streamed or not."""
    ref = offline.generate(["Lily and Tom"], SamplingParams(use_beam_search=True, beam_width=3, n=2, temperature=0,
                                                              max_tokens=12, length_penalty=0.8))[0]
    cl = client(stories_server)
    extra = {"use_beam_search": True, "best_of": 3, "length_penalty": 0.8}
    c = cl.completions.create(model="stories260K", prompt="Lily and Tom", max_tokens=12, n=2, temperature=0,
                              extra_body=extra)
    assert [ch.text for ch in c.choices] == [o.text for o in ref.outputs]
    streamed = ["", ""]
    for chunk in cl.completions.create(model="stories260K", prompt="Lily and Tom", max_tokens=12, n=2,
                                       temperature=0, extra_body=extra, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] += ch.text
    assert streamed == [o.text for o in ref.outputs]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        cl.completions.create(model="stories260K", prompt="x", max_tokens=4, temperature=0.7,
                              extra_body={"use_beam_search": True})
