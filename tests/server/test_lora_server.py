"""LoRA adapters over HTTP: /v1/models lists them, a request naming one as its model runs it
(tokens equal to transformers + peft), and adapters are loaded and unloaded at run time."""

import copy

import httpx
import pytest
import torch

from tests.models.test_lora import ALL, save_adapter
from tests.server.conftest import start

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PROMPT = [3, 17, 42, 9, 88, 5, 61, 23]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    base = transformers.LlamaForCausalLM(cfg).eval()
    base.save_pretrained(root / "base", safe_serialization=True)
    save_adapter(base, root / "sql", 1, r=4, lora_alpha=8, target_modules=ALL)
    save_adapter(base, root / "chat", 2, r=4, lora_alpha=16, target_modules=["q_proj", "up_proj"])
    from kvserve.models.registry import load_weights
    return dict(root=root, base=base, loaded=load_weights(str(root / "base")))


def greedy_reference(adapters, name, steps):
    model = adapters["base"] if name is None else peft.PeftModel.from_pretrained(
        copy.deepcopy(adapters["base"]), str(adapters["root"] / name)).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def complete(server, model):
    r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                   json={"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 0})
    return r


def tokens_of(r):
    """The sampled ids (a model without a tokenizer names each token by its id)."""
    return [int(t) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def test_models_requests_and_run_time_loading(adapters):
    root = adapters["root"]
    with start(adapters["loaded"], "tiny", lora_modules=[f"sql={root / 'sql'}"], block_size=4) as server:
        listed = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in listed] == [("tiny", None), ("sql", "tiny")]
        assert httpx.get(f"{server.url}/v1/models/sql").json()["root"] == str(root / "sql")

        base, sql = complete(server, "tiny"), complete(server, "sql")
        assert sql.status_code == 200 and sql.json()["model"] == "sql"
        assert server.engine.runner.lora is not None
        assert complete(server, "chat").status_code == 404

        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(root / "chat")})
        assert r.status_code == 200, r.text
        assert [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]] == ["tiny", "sql", "chat"]
        chat = complete(server, "chat")
        assert chat.status_code == 200 and chat.json()["model"] == "chat"
        got = {name: tuple(tokens_of(r)) for name, r in (("tiny", base), ("sql", sql), ("chat", chat))}
        assert len(set(got.values())) == 3  # three models, three continuations

        r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 200, r.text
        assert complete(server, "sql").status_code == 404
        r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 404 and "unknown LoRA adapter 'sql'" in r.json()["error"]["message"]
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root / "nope")})
        assert r.status_code == 400 and "is not a directory" in r.json()["error"]["message"]
        server.wait_idle()


def test_an_adapter_request_gives_transformers_peft_tokens(adapters):
    root = adapters["root"]
    with start(adapters["loaded"], "tiny", lora_modules=[f"sql={root / 'sql'}"], block_size=4) as server:
        for model, name in (("sql", "sql"), ("tiny", None)):
            r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                           json={"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 0})
            assert r.status_code == 200, r.text
            assert tokens_of(r) == greedy_reference(adapters, name, 5), model
        server.wait_idle()


def write_adapter(path, config, layers, seed):
    """A PEFT-format adapter for SmolLM2's shapes (hidden 576, MLP 1536), random weights, written
    as PEFT writes it (what read_adapter takes is pinned to peft's own files above)."""
    import json
    from safetensors.torch import save_file
    shapes = {"q_proj": (576, 576), "down_proj": (1536, 576)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers:
        for name, (fan_in, fan_out) in shapes.items():
            block = "self_attn" if name == "q_proj" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(8, fan_in, generator=g) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, 8, generator=g) * 0.1
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": list(shapes), "bias": "none", **config}))


def test_chat_and_responses_run_the_adapter_their_model_names(smollm2, tmp_path):
    """SmolLM2 (packed weights: fused q|k|v and gate|up products): a chat completion and a
    response naming the adapter equal the engine's own generation with it, and differ from the
    base model's reply."""
    import openai
    write_adapter(tmp_path / "style", {}, range(0, 30, 3), 7)
    with start(smollm2, "smol", lora_modules=[f"style={tmp_path / 'style'}"], num_blocks=128,
               max_model_len=512) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Name a colour."}]
        replies = {m: client.chat.completions.create(model=m, messages=messages, max_tokens=8, temperature=0)
                   for m in ("smol", "style")}
        assert replies["style"].model == "style" and replies["smol"].model == "smol"
        assert replies["style"].choices[0].message.content != replies["smol"].choices[0].message.content
        response = client.responses.create(model="style", input="Name a colour.", max_output_tokens=8,
                                           temperature=0)
        assert response.model == "style"
        assert response.output_text == replies["style"].choices[0].message.content
        server.wait_idle()
    engine = server.engine  # the server has stopped: its engine is ours to step
    own = run_engine(engine, engine.tokenizer.encode_chat(messages), "style")
    assert own.outputs[0].text == replies["style"].choices[0].message.content


def run_engine(engine, ids, adapter):
    from tests.conftest import greedy
    rid = engine.add_request(None, ids, greedy(8, lora_request=adapter))
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out
    raise AssertionError("the request never finished")
