"""The decode plan (kvserve/runner/decode_plan.py) runs decode steps as the modules would: the
same tokens and the same logits, bit for bit, over packed weights with float or int8 activations,
every cache format, a sliding window and batches of sequences at different lengths; and it stands
aside where it does not apply."""

import pytest
import torch

from kvserve import kernels
from kvserve.runner import decode_plan
from kvserve.runner.decode_plan import DecodePlan
from tests.conftest import greedy, make_engine, run_collecting_logits


def plan_kernels_built() -> bool:
    ops = kernels.load("layer_ops")
    return ops is not None and ops.isa() != "portable" and kernels.load("paged_attention") is not None


needs_plan = pytest.mark.skipif(not plan_kernels_built(), reason="the decode plan runs on the compiled layer "
                                "kernels' vector builds (KVSERVE_KERNELS holds them off or to the portable path)")


def with_and_without(loaded, prompts, max_tokens=12, **options):
    """Tokens and logits of the same requests with the plan (counting its steps) and without."""
    calls = []
    original = DecodePlan.__call__

    def counted(self, *args):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape[0])
        return original(self, *args)

    runs = {}
    for use in (True, False):
        engine = make_engine(loaded, max_num_seqs=4, **options)
        assert engine.model.decode_plan is not None
        if not use:
            engine.model.decode_plan = None
        DecodePlan.__call__ = counted  # type: ignore[method-assign]
        try:
            runs[use] = run_collecting_logits(engine, prompts, greedy(max_tokens, ignore_eos=True))
        finally:
            DecodePlan.__call__ = original  # type: ignore[method-assign]
        if use:
            assert calls and max(calls) > 1  # decode steps of several sequences ran through it
    return runs, calls


def assert_same(runs):
    (out_a, logits_a), (out_b, logits_b) = runs[True], runs[False]
    assert [o.outputs[0].token_ids for o in out_a] == [o.outputs[0].token_ids for o in out_b]
    for rows, other in zip(logits_a.values(), logits_b.values()):  # both in the prompts' order
        assert len(rows) == len(other) and all(torch.equal(a, b) for a, b in zip(rows, other))


PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park"


@needs_plan
@pytest.mark.parametrize("options", [
    dict(weight_dtype="int8"),
    dict(weight_dtype="int4", packed_activations="int8"),
    dict(weight_dtype="int4", kv_cache_dtype="int8"),
    dict(weight_dtype="int4", kv_cache_dtype="int4"),
    dict(weight_dtype="int8", kv_cache_dtype="fp8"),
    dict(weight_dtype="int8", sliding_window=20),
    dict(weight_dtype="int8", dtype="bfloat16"),
], ids=["q8", "q4-int8-act", "int8-cache", "int4-cache", "fp8-cache", "window", "bf16"])
def test_plan_gives_the_modules_results(stories, options):
    ids = stories.tokenizer.encode(PROMPT)
    prompts = [ids[:n] for n in (3, 9, 17, 24, 6)]  # more than max_num_seqs: admissions mid-run
    runs, _ = with_and_without(stories, prompts, max_tokens=30, **options)
    assert_same(runs)


@needs_plan
def test_plan_on_smollm2_with_int8_activations(smollm2):
    ids = smollm2.tokenizer.encode("The cache keeps the keys and values of every token it has seen.")
    runs, _ = with_and_without(smollm2, [ids[:n] for n in (4, 11, 7)], max_tokens=8, packed_activations="int8")
    assert_same(runs)


@needs_plan
def test_plan_stands_aside_where_it_does_not_apply(stories):
    assert make_engine(stories, weight_dtype="float32").model.decode_plan is None  # nothing fused
    assert make_engine(stories, weight_dtype="int8", attention_backend="torch").model.decode_plan is None
    # attention sinks: the plan exists, but no step with sinks is one it covers
    ids = stories.tokenizer.encode(PROMPT)
    calls = []
    original = DecodePlan.covers

    def covers(self, *args):  # type: ignore[no-untyped-def]
        calls.append(original(self, *args))
        return calls[-1]

    DecodePlan.covers = covers  # type: ignore[method-assign]
    try:
        engine = make_engine(stories, weight_dtype="int8", sliding_window=16, attention_sinks=4)
        run_collecting_logits(engine, [ids[:20]], greedy(8, ignore_eos=True))
    finally:
        DecodePlan.covers = original  # type: ignore[method-assign]
    assert calls and not any(calls)


def test_no_plan_without_the_layer_kernels(stories, monkeypatch):
    """Kernels off (or not built): the runner keeps the modules, and the engine decodes through them."""
    monkeypatch.setattr(decode_plan.kernels, "load", lambda name, isa=None: None)
    engine = make_engine(stories, weight_dtype="int8")
    assert engine.model.decode_plan is None
    out, _ = run_collecting_logits(engine, [stories.tokenizer.encode(PROMPT)[:5]], greedy(4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
