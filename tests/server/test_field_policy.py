"""What clients set: fields that cannot change the output are accepted, named in a header and
logged once each; fields that would change it and are not served are a 400 naming them; logit_bias
and logprobs on completions; GET /v1/models/{id}. docs/api.md lists both tables."""

from pathlib import Path

import httpx
import openai
import pytest

from kvserve.server.fields import IGNORED, IGNORED_HEADER, REFUSED
from kvserve.server.responses import RESPONSES_REFUSED
from tests.server.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def post(server, body, path="/v1/completions"):
    return httpx.post(server.url + path, headers=AUTH, timeout=60, json=body)


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_ignored_fields_are_accepted_named_and_logged_once(stories_server):
    extra = {"metadata": {"k": "v"}, "service_tier": "default", "store": True, "prompt_cache_key": "a",
             "safety_identifier": "u1", "user": "u2", "reasoning_effort": "low", "verbosity": "low",
             "prediction": {"type": "content", "content": "x"}}
    plain = post(stories_server, {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0})
    assert IGNORED_HEADER not in plain.headers
    for _ in range(2):
        r = post(stories_server, {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]  # unchanged
        assert r.headers[IGNORED_HEADER].split(", ") == sorted(extra)
    logged = [line for line in stories_server.log.lines if "accepted and ignored the field 'metadata'" in line]
    assert len(logged) == 1
    with httpx.stream("POST", stories_server.url + "/v1/completions", headers=AUTH, timeout=60, json={
            "prompt": "Once", "max_tokens": 3, "stream": True, "metadata": {}}) as s:
        assert s.headers[IGNORED_HEADER] == "metadata"
        s.read()


@pytest.mark.parametrize("field, value", [("suffix", "The end."), ("modalities", ["text", "audio"]),
                                          ("functions", [{"name": "f"}]), ("audio", {"voice": "x"}),
                                          ("web_search_options", {"search_context_size": "low"}),
                                          ("function_call", "auto")])
def test_fields_that_would_change_the_output_are_a_400_naming_them(stories_server, field, value):
    r = post(stories_server, {"prompt": "Once", "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert "not supported" in r.json()["error"]["message"]


def test_refused_fields_asking_for_nothing_pass(stories_server):
    r = post(stories_server, {"prompt": "Once", "max_tokens": 2, "suffix": None, "modalities": ["text"],
                              "functions": [], "stream_options": None})
    assert r.status_code == 200, r.text


def test_docs_table_lists_every_field():
    text = DOCS.read_text()
    for name in [*IGNORED, *REFUSED, *RESPONSES_REFUSED]:
        assert f"`{name}`" in text, name


def test_models_retrieve(stories_server):
    cl = client(stories_server)
    assert cl.models.retrieve("stories260K").id == "stories260K"
    with pytest.raises(openai.NotFoundError, match="gpt-9"):
        cl.models.retrieve("gpt-9")


def test_logit_bias_forces_and_bans_on_completions(stories_server):
    tok = stories_server.engine.tokenizer
    cl = client(stories_server)
    plain = cl.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=4, temperature=0,
                                  logprobs=0)
    first = tok.encode(plain.choices[0].logprobs.tokens[0], add_special_tokens=False)[-1]
    banned = cl.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=4, temperature=0,
                                   logprobs=0, logit_bias={str(first): -100})
    assert banned.choices[0].logprobs.tokens[0] != plain.choices[0].logprobs.tokens[0]
    forced = cl.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=4, temperature=1.0,
                                   seed=4, logit_bias={"500": 100})
    assert forced.choices[0].text == tok.decode([500] * 4)


@pytest.mark.parametrize("bias, needle", [({"x": 1}, "token ids"), ({"5": 100.5}, "[-100, 100]"),
                                          ({"99999": 1}, "vocabulary"), ({"5": "1"}, "logit_bias")])
def test_bad_logit_bias_is_a_400_naming_it(stories_server, bias, needle):
    r = post(stories_server, {"prompt": "Once", "max_tokens": 2, "logit_bias": bias})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    assert needle in r.json()["error"]["message"]


def test_completions_top_logprobs_are_the_top_k_and_the_sampled_token(stories_server):
    r = post(stories_server, {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 2,
                              "logprobs": 2}).json()
    lp = r["choices"][0]["logprobs"]
    for token, top in zip(lp["tokens"], lp["top_logprobs"]):
        assert token in top and len(top) in (2, 3)
        assert len(top) == 2 or min(top.values()) == top[token]  # a third entry is the sampled token
