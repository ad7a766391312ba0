"""One request's failure is its own: a fault injected for one chosen request of a batch of 32
(at its prefill, mid-decode, at its fork, right after a swap) fails that request alone, with the
error, its blocks freed and none of them offered to prefix caching; every other request's output
equals its solo run, and the cache stays consistent."""

import pytest

from kvserve.core.sampling_params import SamplingParams
from tests.conftest import make_engine

PROMPTS = [f"Once upon a time {w}" for w in ("there was", "a cat", "Lily", "in a park", "the sun", "Tom and")] * 6
PROMPTS = PROMPTS[:31] + ["Once upon a time there was a little"]  # 32, the last one chosen
CHOSEN = "victim"
SOLO: dict = {}  # request id -> its tokens run alone (the same in every test)


def params(i: int, n: int = 1) -> SamplingParams:
    if i % 3 == 0:  # some sampled, with their own seeds: solo runs draw the same tokens
        return SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=100 + i, n=n, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=24, n=n, ignore_eos=True)


def run(engine, requests, hook=None):
    engine.runner.fault_hook = hook
    for rid, prompt, p in requests:
        engine.add_request(rid, prompt, p)
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        engine.check_integrity()
    engine.runner.fault_hook = None
    return outs


def texts(out):
    return [c.token_ids for c in out.outputs]


FAULTS = {
    "prefill": lambda stage, seqs, engine: stage == "forward" and any(
        s.request_id.startswith(CHOSEN) and s.start_position == 0 for s in seqs),
    "mid-decode": lambda stage, seqs, engine: stage == "sample" and any(
        s.request_id.startswith(CHOSEN) and len(s.output_token_ids) == 5 for s in seqs),
    "fork": lambda stage, seqs, engine: stage == "sample" and any(
        s.request_id.startswith(CHOSEN) and s.num_samples > 1 for s in seqs),
    "after a swap": lambda stage, seqs, engine: stage == "forward" and any(
        s.request_id.startswith(CHOSEN) and engine.scheduler.requests[s.request_id].num_preemptions > 0
        for s in seqs),
}


@pytest.mark.parametrize("where", list(FAULTS))
def test_a_fault_fails_its_own_request_only(stories, where):
    options = dict(block_size=16, max_num_seqs=32)
    if where == "after a swap":  # a pool too small for all 32: some are swapped out and back in
        options.update(num_blocks=40, preemption_mode="swap")
    n = 2 if where == "fork" else 1
    requests = [(f"r{i}", p, params(i)) for i, p in enumerate(PROMPTS[:-1])]
    requests.append((CHOSEN, PROMPTS[-1], params(31, n)))
    engine = make_engine(stories, **options)
    fired = []

    def hook(stage, seqs):
        if FAULTS[where](stage, seqs, engine):  # the step raises, and again for the chosen request alone
            fired.append(stage)
            raise RuntimeError("injected fault")

    outs = run(engine, requests, hook)
    assert fired, f"the fault never fired {where}"
    victim = outs[CHOSEN]
    assert victim.finished and victim.error is not None and "injected fault" in victim.error
    assert all(c.finish_reason == "error" for c in victim.outputs)
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks  # nothing leaked
    assert engine.num_steps > 0 and engine.scheduler.stats().num_running == 0
    for rid, prompt, p in requests[:-1]:
        assert outs[rid].error is None, (rid, outs[rid].error)
        if rid not in SOLO:
            SOLO[rid] = texts(run(make_engine(stories, block_size=16), [(rid, prompt, p)])[rid])
        assert texts(outs[rid]) == SOLO[rid], rid
    # and the engine serves the same prompt afterwards: no half-written block was cached
    again = run(engine, [("again", PROMPTS[-1], params(30))])["again"]
    assert texts(again) == texts(run(make_engine(stories, block_size=16), [("again", PROMPTS[-1], params(30))])["again"])
