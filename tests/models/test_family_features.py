"""The engine's features on the new dense families (Qwen3, Phi-3, Phi-4-mini's partial rotary,
OLMo-2, SmolLM3, Granite), tiny random configs: every KV format (float ones as exact as the
float32 cache, lossy ones as close to it as their codes allow, each batched and chunked the same
as alone, as tests/engine/test_quantized_cache.py shows); a sliding window equal to transformers
under the same banded mask; attention sinks equal to transformers over the tokens StreamingLLM
keeps (refused for NoPE layers and partial rotary); greedy decoding with n-gram and draft
guesses equal to plain greedy; beam search equal to transformers'; tensor parallelism over 2
ranks equal to one rank where the heads split (OLMo-2's whole-projection norms are refused); one
chat request through the server's app; and K-quant weights split over ranks on their
256-weight blocks (refused by name where a split falls inside a block)."""

import dataclasses

import pytest
import torch

from tests.conftest import greedy, make_engine, random_llama, run_collecting_logits
from tests.distributed.conftest import no_process_left  # noqa: F401 - stops what a failed test left running
from tests.engine.test_beam_search import assert_like_hf, beam_params, hf_beams, run_beams
from tests.models.test_dense_families import FAMILIES, prompt, save_family

transformers = pytest.importorskip("transformers")

FLOAT_KV = ("bfloat16", "float16")
KV_BOUNDS = {"bfloat16": 0.01, "float16": 0.002, "int8": 0.02, "fp8_e4m3": 0.1, "fp8_e5m2": 0.15, "int4": 0.15}
WINDOW = 8
SAME_CODE_AS = {"phi3": "phi4-partial-rotary"}  # the costlier tests run one of two configs of one code


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, the transformers model, kvserve's load, the saved directory)."""
    from kvserve.models.registry import load_weights
    path = tmp_path_factory.mktemp(request.param)
    hf = save_family(request.param, path)
    return request.param, hf, load_weights(str(path)), str(path)


def run(engine, prompts, max_tokens=8):
    outs, logits = run_collecting_logits(engine, prompts, greedy(max_tokens, ignore_eos=True))
    assert engine.kv.pool.num_used_blocks == 0
    return [o.outputs[0].token_ids for o in outs], [torch.stack(v) for v in logits.values()]


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# ---- KV formats ----
PROMPTS = [prompt(13, 1), prompt(13, 1)[:9] + prompt(6, 2)]  # the second reads the first's 2 blocks


def test_every_kv_format_stays_near_the_float32_cache(family):
    """Each format, two prompts batched, prefilled in chunks of 5 with prefix caching (the
    second reads the first's blocks): the first step's logits, read from the cache chunked
    prefill wrote, are within the format's error of the float32 cache's (itself transformers',
    tests/models/test_dense_families.py), as a fraction of the largest logit (measured on these
    configs: bf16 0.005, fp16 0.0005, int8 0.008, fp8 e4m3 0.05, e5m2 0.08, int4 0.09); float
    formats keep every token. That each format batched equals it alone is shown for every format
    in tests/engine/test_quantized_cache.py."""
    name, hf, loaded, _ = family
    options = dict(block_size=4, max_num_batched_tokens=12, max_prefill_chunk=5)
    exact = run(make_engine(loaded, **options), PROMPTS, max_tokens=6)
    size = max(x.abs().max().item() for x in exact[1])
    for fmt, bound in KV_BOUNDS.items():
        engine = make_engine(loaded, kv_cache_dtype=fmt, **options)
        got = run(engine, PROMPTS, max_tokens=6)
        assert engine.stats().scheduler.prefix_hit_rate > 0, fmt
        first = max_diff([x[0] for x in got[1]], [x[0] for x in exact[1]])
        assert 0 < first < bound * size, (fmt, first, size)
        assert fmt not in FLOAT_KV or got[0] == exact[0], fmt


# ---- sliding window (and where attention sinks are refused: tests/models/test_dense_families.py) ----
def banded_reference(hf, seq, window):
    """transformers' logits with every position attending to its last `window` positions."""
    i = torch.arange(len(seq))
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    with torch.no_grad():
        return hf(torch.tensor([seq]), attention_mask=band[None, None]).logits[0]


def test_sliding_window_equals_transformers_under_the_same_band(family):
    """A 12-token prompt in chunks of 5, then 20 tokens decoded past the window of 8: every
    step's logits are transformers' under the banded mask (1e-4), and the cache keeps only the
    window's blocks."""
    name, hf, loaded, _ = family
    ids = prompt(12, 4)
    engine = make_engine(loaded, block_size=4, sliding_window=WINDOW, max_num_batched_tokens=8, max_prefill_chunk=5)
    (tokens,), (logits,) = run(engine, [ids], max_tokens=20)
    ref = banded_reference(hf, ids + tokens, WINDOW)[len(ids) - 1:-1]
    assert (logits - ref).abs().max().item() < 1e-4
    assert tokens == ref.argmax(-1).tolist()
    assert (logits - banded_reference(hf, ids + tokens, 10 ** 6)[len(ids) - 1:-1]).abs().max().item() > 1e-3


def one_layer(hf, tmp_path):
    """The model cut to its first layer (saved, and loaded by kvserve): its keys and values are
    then functions of each token alone, so StreamingLLM's cache equals a fresh pass over the
    tokens it keeps, at their ranks."""
    from kvserve.models.registry import load_weights
    hf.model.layers = hf.model.layers[:1]
    hf.config.num_hidden_layers = 1
    if getattr(hf.config, "layer_types", None):
        hf.config.layer_types = hf.config.layer_types[:1]
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return load_weights(str(tmp_path))


def test_attention_sinks_equal_a_pass_over_the_kept_tokens(family, tmp_path):
    """Window 8 with 2 sinks, 16 tokens decoded past it: each step's logits are transformers' over
    the 2 first and 6 last tokens (1e-4); SmolLM3 (NoPE layers) and partial rotary are refused."""
    name, _, loaded, _ = family
    sinks = 2
    if name in ("smollm3", "phi4-partial-rotary"):
        with pytest.raises(ValueError, match="attention sinks"):
            make_engine(loaded, sliding_window=WINDOW, attention_sinks=sinks)
        return
    torch.manual_seed(0)
    hf = FAMILIES[name]().eval()
    ids = prompt(5, 7)
    engine = make_engine(one_layer(hf, tmp_path), block_size=4, sliding_window=WINDOW, attention_sinks=sinks)
    (tokens,), (logits,) = run(engine, [ids], max_tokens=16)
    seq = ids + tokens
    kept = [seq[:p + 1] if p < WINDOW else seq[:sinks] + seq[p + 1 - (WINDOW - sinks):p + 1]
            for p in range(len(ids) - 1, len(seq) - 1)]
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([k])).logits[0, -1] for k in kept])
        window_only = torch.stack([hf(torch.tensor([seq[max(0, p + 1 - WINDOW):p + 1]])).logits[0, -1]
                                   for p in range(len(ids) - 1, len(seq) - 1)])
    assert (logits - ref).abs().max().item() < 1e-4
    assert (logits - window_only).abs().max().item() > 1e-3  # the sinks count


# ---- speculative decoding and beam search ----
def test_guessed_greedy_equals_plain_greedy(family):
    """N-gram lookup on a repetitive prompt, and the model as its own draft: the same tokens."""
    name, hf, loaded, path = family
    if name in SAME_CODE_AS:
        pytest.skip(f"{name} runs {SAME_CODE_AS[name]}'s code")
    prompts = [[5, 6, 7, 8] * 4, prompt(9, 5)]
    plain = run(make_engine(loaded, block_size=4), prompts, max_tokens=16)[0]
    for spec in (dict(speculative="ngram"), dict(speculative="draft", speculative_model=path)):
        engine = make_engine(loaded, block_size=4, num_speculative_tokens=3, **spec)
        assert run(engine, prompts, max_tokens=16)[0] == plain, spec
        assert engine.num_spec_accepted > 0, spec


def test_beam_search_equals_transformers(family):
    name, hf, loaded, _ = family
    params = beam_params(2, 8, ignore_eos=True)
    p = prompt(7, 6)
    out, _ = run_beams(make_engine(loaded, block_size=4), p, params)
    assert_like_hf(out, *hf_beams(hf, p, params, ()))


# ---- tensor parallelism ----
def test_tensor_parallel_2_equals_1(family):
    name, hf, loaded, _ = family
    if name in SAME_CODE_AS:
        pytest.skip(f"{name} runs {SAME_CODE_AS[name]}'s code")
    if name == "olmo2":
        with pytest.raises(ValueError, match="q and k norms span every head"):
            make_engine(loaded, tensor_parallel_size=2)
        return
    options = dict(block_size=4, max_num_batched_tokens=12, max_prefill_chunk=5)
    want = run(make_engine(loaded, **options), PROMPTS)
    split = make_engine(loaded, tensor_parallel_size=2, **options)
    try:
        got = run(split, PROMPTS)
        assert split.comm.num_all_reduces > 0
    finally:
        split.close()
    assert got[0] == want[0] and max_diff(got[1], want[1]) < 1e-4


def q4_k_llama(hidden):
    """A random Llama with every layer matrix packed as Q4_K (256 weights a block), random valid blocks."""
    from tests.kernels.kquant_blocks import random_packed
    loaded = random_llama(num_layers=1, hidden=hidden, heads=4, kv_heads=2, seed=2)
    sd = {k: random_packed(*v.shape, "q4_k", seed=i, scale=0.002) if k.startswith("model.layers.") and v.dim() == 2
          else v for i, (k, v) in enumerate(loaded.state_dict.items())}
    return dataclasses.replace(loaded, state_dict=sd)


def test_q4_k_weights_split_on_their_blocks():
    from kvserve.distributed.tensor_parallel import shard_weights
    from kvserve.models.packed import PackedWeight
    loaded = q4_k_llama(512)  # o_proj: 256 columns a rank, down_proj: 512
    parts = [shard_weights(loaded, r, 2).state_dict for r in range(2)]
    for key in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        shards = [pt[key] for pt in parts]
        assert all(isinstance(s, PackedWeight) and s.fmt.name == "q4_k" for s in shards)
        assert torch.equal(torch.cat([s.dequantize() for s in shards], dim=1), loaded.state_dict[key].dequantize())
    prompts = [[(7 * i + j) % 120 + 3 for j in range(6 + 5 * i)] for i in range(2)]
    want = run(make_engine(loaded, block_size=4, exact=True), prompts)
    split = make_engine(loaded, block_size=4, tensor_parallel_size=2, exact=True)
    try:
        got = run(split, prompts)
    finally:
        split.close()
    assert got[0] == want[0] and max_diff(got[1], want[1]) < 1e-4


def test_a_split_inside_a_k_quant_block_is_refused():
    from kvserve.distributed.tensor_parallel import shard_weights
    loaded = q4_k_llama(256)  # o_proj: 128 columns a rank, half a block
    with pytest.raises(ValueError, match=r"o_proj.weight is packed as q4_k \(256 weights a block\).*\[128, 256\)"):
        shard_weights(loaded, 1, 2)
    with pytest.raises(ValueError, match=r"o_proj.weight is packed as q4_k \(256 weights a block\)"):
        make_engine(loaded, tensor_parallel_size=2)


# ---- the server ----
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer():
    """A byte-level vocabulary of 128 tokens (printable ASCII, space, newline, ChatML's markers)."""
    from kvserve.tokenizer.hf import CONTROL, from_gguf_bpe
    tokens = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a", "<|im_start|>", "<|im_end|>"]
    tokens += [f"<unused{i}>" for i in range(128 - len(tokens))]
    types = [CONTROL if t.startswith("<|") else 1 for t in tokens]
    return from_gguf_bpe(tokens, [], types, "qwen2", None, [tokens.index("<|im_end|>")], False, CHATML)


@pytest.mark.parametrize("name", ["qwen3", "phi4-partial-rotary"])
def test_one_chat_request_through_the_server(name, tmp_path):
    import httpx
    from kvserve.models.registry import load_weights
    from tests.server.conftest import start
    torch.manual_seed(0)
    FAMILIES[name]().save_pretrained(tmp_path, safe_serialization=True)
    loaded = dataclasses.replace(load_weights(str(tmp_path)), tokenizer=chat_tokenizer())
    with start(loaded, name, block_size=4) as server:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": name, "messages": [{"role": "user", "content": "Hi there!"}], "max_tokens": 6,
            "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] >= 1 and isinstance(body["choices"][0]["message"]["content"], str)
    assert body["usage"]["prompt_tokens"] == len(loaded.tokenizer.encode_chat(
        [{"role": "user", "content": "Hi there!"}]))
