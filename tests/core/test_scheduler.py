from kvserve.core.request import RequestStatus
from tests.core.factories import fake_step, make_request, make_scheduler


def run_to_end(sched, limit=500):
    steps = []
    for _ in range(limit):
        if not sched.has_unfinished():
            return steps
        steps.append(fake_step(sched))
    raise AssertionError("scheduler did not finish")


def test_chunked_prefill_respects_budget_and_decodes_go_first():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=8, max_prefill_chunk=8)
    short = make_request(range(3), max_tokens=5)
    sched.add_request(short)
    fake_step(sched)  # short prefilled, decoding from now on
    long = make_request(range(20), max_tokens=2)
    sched.add_request(long)
    out = fake_step(sched)
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [(short.request_id, 1), (long.request_id, 7)]
    assert out.num_batched_tokens <= 8
    out = fake_step(sched)
    assert out.scheduled[0].request_id == short.request_id  # never stalled behind the prompt
    assert long.num_computed_tokens == 14 and long.num_output_tokens == 0
    run_to_end(sched)
    assert long.num_output_tokens == 2 and short.num_output_tokens == 5


def test_positions_start_at_the_cache_length():
    sched = make_scheduler()
    req = make_request(range(5), max_tokens=3)
    sched.add_request(req)
    starts = [fake_step(sched).scheduled[0].start_position for _ in range(3)]
    assert starts == [0, 5, 6]


def test_max_num_seqs_limits_running():
    sched = make_scheduler(num_blocks=64, max_num_seqs=2)
    for _ in range(4):
        sched.add_request(make_request(range(3)))
    out = fake_step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 2


def test_recompute_preemption_frees_and_requeues_newest():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=4)
    a, b = make_request(range(4), max_tokens=6), make_request(range(10, 14), max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    # at position 8 both need a third block and only four exist: b (the newest) goes
    steps = run_to_end(sched)
    assert sched.num_preemptions >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0
    assert sum(s.num_preempted for s in steps) == sched.num_preemptions
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    assert sched.kv.pool.num_free_blocks == 4


def test_swap_preemption_keeps_computed_tokens():
    sched = make_scheduler(num_blocks=4, block_size=4, cpu_blocks=8, preemption_mode="swap")
    a, b = make_request(range(4), max_tokens=6), make_request(range(10, 14), max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    swapped_seen = False
    while sched.has_unfinished():
        fake_step(sched)
        if b.status == RequestStatus.SWAPPED:
            swapped_seen = True
            assert b.num_computed_tokens > 0  # nothing to recompute
    assert swapped_seen and a.num_output_tokens == b.num_output_tokens == 6
    assert sched.kv.cpu_pool.num_free_blocks == 8 and sched.kv.pool.num_free_blocks == 4


def late_high_priority_run(max_num_seqs, num_lows):
    """Low-priority requests start; a high-priority one arrives a step later. Returns the
    requests and the order they finished in."""
    sched = make_scheduler(num_blocks=64, max_num_seqs=max_num_seqs, policy="priority")
    lows = [make_request(range(3), max_tokens=4, priority=5) for _ in range(num_lows)]
    for r in lows:
        sched.add_request(r)
    fake_step(sched)
    high = make_request(range(3), max_tokens=4, priority=0)
    sched.add_request(high)
    order = []
    while sched.has_unfinished():
        fake_step(sched)
        order += [r for r in lows + [high] if r.is_finished and r not in order]
    return lows, high, order


def test_priority_request_admitted_late_takes_a_seat():
    lows, high, finished = late_high_priority_run(max_num_seqs=1, num_lows=3)
    assert finished[0] is high
    assert lows[0].num_preemptions == 1  # it gave its seat up and resumed later
    assert [r.num_output_tokens for r in lows] == [4, 4, 4]


def test_priority_order_among_waiting():
    lows, high, order = late_high_priority_run(max_num_seqs=2, num_lows=4)
    assert order.index(high) < order.index(lows[2]) and order.index(high) < order.index(lows[3])


def test_abort_frees_blocks_immediately():
    sched = make_scheduler(num_blocks=8)
    req = make_request(range(9), max_tokens=50)
    sched.add_request(req)
    fake_step(sched)
    assert sched.kv.pool.num_free_blocks < 8
    sched.finish_request(req.request_id, RequestStatus.FINISHED_ABORTED)
    assert sched.kv.pool.num_free_blocks == 8 and not sched.has_unfinished()
    assert req.finish_reason == "abort"
    sched.kv.check_integrity()


def test_sequence_too_large_for_the_cache_errors_instead_of_looping():
    sched = make_scheduler(num_blocks=2, block_size=4, max_model_len=64)
    req = make_request(range(6), max_tokens=20, ignore_eos=True)
    sched.add_request(req)
    run_to_end(sched)
    assert req.status == RequestStatus.FINISHED_ERROR and "too small" in req.error
    assert sched.kv.pool.num_free_blocks == 2


def test_n_samples_fork_the_prompt_blocks():
    sched = make_scheduler(num_blocks=16, block_size=4)
    req = make_request(range(6), max_tokens=3, n=3, temperature=1.0)
    sched.add_request(req)
    out = sched.schedule()
    assert out.scheduled[0].num_samples == 3
    from kvserve.core.outputs import ModelRunnerOutput
    sched.update(out, ModelRunnerOutput({req.request_id: [1]}, forked_token_ids={req.request_id: [2, 3]}))
    children = req.group.members[1:]
    assert [c.sample_index for c in children] == [1, 2] and all(c in sched.running for c in children)
    assert [c.output_token_ids for c in children] == [[2], [3]]
    table = sched.kv.block_table(req.request_id)
    assert all(sched.kv.block_table(c.request_id) == table for c in children)
    run_to_end(sched)
    assert sched.kv.pool.num_free_blocks == 16


def test_length_and_stop_token_finish():
    sched = make_scheduler()
    req = make_request(range(3), max_tokens=10, stop_token_ids=(7,))
    sched.add_request(req)
    run_to_end(sched)
    assert req.finish_reason == "stop" and req.output_token_ids == [7]
    req2 = make_request(range(60), max_tokens=10)  # max_model_len 64 cuts it at 4 tokens
    sched.add_request(req2)
    run_to_end(sched)
    assert req2.finish_reason == "length" and req2.num_tokens == 64


def test_token_lists_are_kept_not_rebuilt():
    """A request's tokens are one list that grows in place: reading them each step costs nothing."""
    req = make_request(range(5))
    tokens = req.all_token_ids
    req.append_token(9)
    assert req.all_token_ids is tokens and tokens == [0, 1, 2, 3, 4, 9] and req.output_token_ids == [9]
    req.truncate_output(0)
    assert req.all_token_ids is tokens and tokens == [0, 1, 2, 3, 4] and req.num_truncations == 1


def beam_step(sched, beams):
    """One step with beam search's rule, as kvserve.engine.beam_search applies it: the beams
    advance (the first one forking into its width after the prompt) only when every live beam
    got its row this step; rows of a split group are taken back."""
    from kvserve.core.outputs import ModelRunnerOutput
    out = sched.schedule()
    sampled = {s.request_id: [7] for s in out.scheduled if s.num_samples}
    rows = {s.request_id for s in out.scheduled if s.num_logit_rows}
    sched.update(out, ModelRunnerOutput(sampled))
    live = [m for m in beams.group.members if not m.is_finished]
    got = [m for m in live if m.request_id in rows]
    if got and len(got) < len(live):
        for m in got:
            sched.rollback(m, m.num_computed_tokens - 1)
    elif got:
        if len(live) == 1 and not live[0].num_output_tokens:
            live += sched.fork(live[0], beams.sampling_params.beam_width - 1)
        for m in live:
            sched.extend(m, [8])
    sched.check_integrity()
    return out


def test_a_groups_beams_are_preempted_and_admitted_together():
    """A request that came first needs the pool: the beams give way all at once (never one beam
    left running, or spinning on rows taken back), and come back together once it has room."""
    sched = make_scheduler(num_blocks=16, block_size=4, max_model_len=64, max_num_seqs=8)
    first = make_request(range(8), max_tokens=28, ignore_eos=True)  # grows to 9 blocks
    beams = make_request(range(20, 24), max_tokens=12, use_beam_search=True, beam_width=4, temperature=0)
    sched.add_request(first)
    sched.add_request(beams)
    assert sched.worst_case_blocks(beams) == 1 + 4 * 3  # the prompt's block, then 3 blocks each
    for _ in range(200):
        if not sched.has_unfinished():
            break
        before = {m.request_id for m in beams.group.members if not m.is_finished}
        out = beam_step(sched, beams)
        live = [m for m in beams.group.members if not m.is_finished]
        running = [m for m in live if m.status == RequestStatus.RUNNING]
        assert len(running) in (0, len(live))
        assert len([s for s in out.scheduled if s.request_id in before]) in (0, len(before))
    assert not sched.has_unfinished()
    assert first.num_output_tokens == 28 and first.num_preemptions == 0
    assert len(beams.group.members) == 4 and all(m.num_output_tokens == 12 for m in beams.group.members)
    assert all(m.num_preemptions == 1 for m in beams.group.members)  # once, together
    assert sched.kv.pool.num_free_blocks == 16


def test_beams_that_cannot_fit_alone_fail_instead_of_spinning():
    from kvserve.core.outputs import ModelRunnerOutput
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=64, max_num_seqs=8)
    beams = make_request(range(4), max_tokens=4, use_beam_search=True, beam_width=2, temperature=0)
    sched.add_request(beams)
    out = sched.schedule()  # its worst case, 1 + 2 * 1 blocks, fits: admitted
    sched.update(out, ModelRunnerOutput({}))
    members = [beams] + sched.fork(beams, 4)  # wider than it said: 5 beams that each need a block of their own
    for m in members:
        sched.extend(m, [8])
    out = sched.schedule()
    assert not out.scheduled and not sched.has_unfinished()
    assert all(m.finish_reason == "error" and "too small to hold the 5 beams" in m.error for m in members)
    assert sched.take_failed() == members and sched.take_failed() == []
    assert sched.kv.pool.num_free_blocks == 4
    sched.check_integrity()


# ---- pause and resume (a stream whose reader has fallen behind) ----
def test_a_paused_request_computes_nothing_and_resumes_where_it_was():
    sched = make_scheduler(num_blocks=32, block_size=4)
    a, b = make_request(range(5), max_tokens=6), make_request(range(10, 15), max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    fake_step(sched)
    assert sched.pause(a.group_id) and not sched.pause("no such group")
    held = sched.kv.num_held_blocks(a.request_id)
    for _ in range(3):
        assert [s.request_id for s in fake_step(sched).scheduled] == [b.request_id]
        sched.check_integrity()
    assert a.num_output_tokens == 1 and a.status == RequestStatus.RUNNING
    assert sched.kv.num_held_blocks(a.request_id) == held  # it keeps its blocks while nobody needs them
    sched.resume(a.group_id)
    run_to_end(sched)
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6 and not sched.paused


def test_a_paused_request_is_not_admitted_and_does_not_block_the_queue():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=1)
    a, b = make_request(range(5), max_tokens=3), make_request(range(10, 15), max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    sched.pause(a.group_id)
    assert sched.has_runnable()  # b can run
    run_until = [fake_step(sched) for _ in range(3)]
    assert all(s.request_id == b.request_id for out in run_until for s in out.scheduled)
    assert b.is_finished and a.status == RequestStatus.WAITING and not sched.has_runnable()
    assert fake_step(sched).is_empty
    sched.resume(a.group_id)
    run_to_end(sched)
    assert a.num_output_tokens == 3


def test_a_paused_request_gives_its_blocks_up_first():
    """Four blocks of 4: a paused request holding two is preempted for the running one that needs
    them, though the policy would take the newest (the running one) first."""
    sched = make_scheduler(num_blocks=4, block_size=4)
    old, new = make_request(range(6), max_tokens=8), make_request(range(10, 16), max_tokens=8)
    sched.add_request(old)
    sched.add_request(new)
    fake_step(sched)
    sched.pause(old.group_id)
    fake_step(sched)
    fake_step(sched)  # new reaches 8 tokens: it needs a third block, and only old's are left
    fake_step(sched)
    assert old.num_preemptions == 1 and new.num_preemptions == 0
    assert old.status == RequestStatus.PREEMPTED and sched.kv.num_held_blocks(old.request_id) == 0
    sched.check_integrity()
    sched.resume(old.group_id)
    run_to_end(sched)
    assert old.num_output_tokens == 8 and new.num_output_tokens == 8


def test_paused_requests_give_their_seats_and_blocks_to_waiting_ones():
    """Both seats taken by paused requests: a new request is admitted at once (the worst paused
    one is preempted), not left waiting behind requests that compute nothing."""
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=2)
    a, b, c = (make_request(range(i, i + 5), max_tokens=4) for i in (0, 10, 20))
    sched.add_request(a)
    sched.add_request(b)
    fake_step(sched)
    sched.pause(a.group_id)
    sched.pause(b.group_id)
    sched.add_request(c)
    out = fake_step(sched)
    assert [s.request_id for s in out.scheduled] == [c.request_id]
    assert b.status == RequestStatus.PREEMPTED and a.status == RequestStatus.RUNNING  # the newest went
    sched.check_integrity()
    for _ in range(6):
        fake_step(sched)
    assert c.is_finished and not a.is_finished
    sched.resume(a.group_id)
    sched.resume(b.group_id)
    run_to_end(sched)
    assert a.num_output_tokens == b.num_output_tokens == 4


def test_ending_a_paused_group_forgets_the_pause():
    sched = make_scheduler()
    a = make_request(range(5))
    sched.add_request(a)
    sched.pause(a.group_id)
    sched.finish_group(a.group_id, RequestStatus.FINISHED_ABORTED)
    assert not sched.paused
    sched.check_integrity()
