"""The watchdog reports a group that runs without progress for max_stalled_steps steps in a row
(with why), or that blocks an engine running nothing; never one that progresses, recomputes
after a preemption, or waits behind others. Driven by the real scheduler with scripted tokens."""

from kvserve.core.outputs import ModelRunnerOutput
from kvserve.engine.watchdog import Watchdog
from tests.core.factories import make_request, make_scheduler


def step(sched, watchdog, take_back=()):
    """Schedule, 'run' (each sample gets token 7), update; the requests in take_back lose what
    the step gave them (a beam whose row was taken back). Returns what the watchdog reports."""
    before = {r.request_id: (r.num_computed_tokens, r.num_output_tokens) for r in take_back}
    out = sched.schedule()
    watchdog.watch(out, sched)
    sched.update(out, ModelRunnerOutput({s.request_id: [7] for s in out.scheduled if s.num_samples}))
    for req in take_back:
        sched.rollback(req, *before[req.request_id])
    sched.check_integrity()
    return watchdog.stalled(sched)


def test_a_request_that_runs_without_progress_is_reported_alone():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=2)
    spin, steady, queued = (make_request(range(i, i + 5), max_tokens=40, ignore_eos=True)
                            for i in (0, 10, 20))
    for req in (spin, steady, queued):  # queued waits for a seat the whole time
        sched.add_request(req)
    watchdog = Watchdog(max_stalled_steps=5)
    assert step(sched, watchdog) == []  # both prefilled: progress
    reports = [step(sched, watchdog, take_back=[spin]) for _ in range(5)]
    assert reports[:4] == [[]] * 4
    [(rid, why)] = reports[4]
    assert rid == spin.request_id and why.startswith("no progress in 5 steps: the request ran without")
    assert steady.num_output_tokens == 6 and queued.num_computed_tokens == 0


def test_progress_resets_the_count():
    sched = make_scheduler(num_blocks=32, block_size=4)
    req = make_request(range(5), max_tokens=40, ignore_eos=True)
    sched.add_request(req)
    watchdog = Watchdog(max_stalled_steps=3)
    for _ in range(4):
        assert step(sched, watchdog, take_back=[req]) == [] and step(sched, watchdog, take_back=[req]) == []
        assert step(sched, watchdog) == []


def test_a_request_that_blocks_an_idle_engine_is_reported_and_the_next_is_not():
    sched = make_scheduler(num_blocks=2, block_size=4, max_model_len=64)
    too_long = make_request(range(12), max_tokens=4)  # 3 blocks of the 2: never admitted
    behind = make_request(range(3), max_tokens=4)
    sched.add_request(too_long)
    sched.add_request(behind)
    watchdog = Watchdog(max_stalled_steps=3)
    assert step(sched, watchdog) == [] and step(sched, watchdog) == []
    [(rid, why)] = step(sched, watchdog)
    assert rid == too_long.request_id and "waited while nothing ran" in why
    sched.finish_request(rid, too_long.status.FINISHED_ERROR)  # what the engine does with the report
    for _ in range(6):
        assert step(sched, watchdog) == []
    assert behind.is_finished and behind.num_output_tokens == 4
