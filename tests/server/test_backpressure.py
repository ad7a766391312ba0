"""Backpressure: what a stream's reader has not taken is one output, however far behind it falls,
and a reader that stops taking anything has its request aborted and its blocks freed."""

from __future__ import annotations

import asyncio
import time

from kvserve.server.async_engine import STOPPED_READING, AsyncEngine
from tests.conftest import greedy, make_engine, run_collecting_logits


async def run_reader(aengine: AsyncEngine, rid: str, prompt: str, params, pause_after: int, pause_s: float):
    """Read the request's outputs, pausing pause_s after the first pause_after of them."""
    outs = []
    async for out in aengine.generate(rid, prompt, params):
        outs.append(out)
        if len(outs) == pause_after:
            await asyncio.sleep(pause_s)
    return outs


def solo_token_ids(stories, prompt, params) -> list[int]:
    """The request's tokens run alone on a fresh engine."""
    outs, _ = run_collecting_logits(make_engine(stories), [prompt], params)
    return outs[0].outputs[0].token_ids


def test_a_reader_that_falls_behind_gets_everything_in_one_output(stories):
    engine = make_engine(stories, max_num_seqs=4)
    params = greedy(120, ignore_eos=True)
    aengine = AsyncEngine(engine)
    aengine.start()
    try:
        outs = asyncio.run(run_reader(aengine, "slow", "Once upon a time", params, pause_after=1, pause_s=1.5))
    finally:
        aengine.stop()
    final = outs[-1].outputs[0]
    assert final.finished and len(final.token_ids) == 120
    assert len(outs) < 20  # the steps made while it slept came as one output, not one each
    assert "".join(o.outputs[0].delta for o in outs) == final.text
    assert [t for o in outs for t in o.outputs[0].delta_token_ids] == final.token_ids
    assert final.token_ids == solo_token_ids(stories, "Once upon a time", params)


def test_a_reader_that_stops_reading_is_aborted_and_its_blocks_freed(stories):
    engine = make_engine(stories, max_num_seqs=4, sliding_window=32)
    aengine = AsyncEngine(engine, max_unread_s=0.5)
    aengine.start()

    async def stall() -> list:
        outs = []
        stream = aengine.generate("stalled", "Once upon a time", greedy(20000, ignore_eos=True))
        outs.append(await stream.__anext__())
        deadline = time.monotonic() + 30
        while aengine.stats.scheduler.num_running and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # read nothing
        async for out in stream:
            outs.append(out)
        return outs

    try:
        outs = asyncio.run(stall())
        assert outs[-1].finished and outs[-1].error == STOPPED_READING
        assert len(outs[-1].outputs) == 0 and len(outs) == 2
        assert not engine.has_unfinished() and engine.kv.pool.num_used_blocks == 0
        engine.check_integrity()
    finally:
        aengine.stop()


def test_a_reader_that_falls_behind_pauses_its_request_until_it_reads(stories):
    """The reader sleeps 2 s after its first output: within pause_after_s its request stops
    computing (the engine thread waits instead of stepping), then goes on when the reader reads
    again, and ends with the tokens it has alone."""
    engine = make_engine(stories, max_num_seqs=4)
    params = greedy(400, ignore_eos=True)
    aengine = AsyncEngine(engine, pause_after_s=0.3)
    aengine.start()
    seen = []

    async def read() -> list:
        outs = []
        async for out in aengine.generate("slow", "Once upon a time", params):
            outs.append(out)
            if len(outs) == 1:
                for _ in range(20):  # 2 s without reading: what has it computed meanwhile?
                    await asyncio.sleep(0.1)
                    seen.append((engine.num_steps, aengine.num_in_flight))
        return outs

    try:
        outs = asyncio.run(read())
    finally:
        aengine.stop()
    steps = [s for s, _ in seen]
    assert steps[-1] == steps[len(steps) // 2], f"the engine kept stepping while paused: {steps}"
    assert steps[-1] < 300  # paused well before its 400 tokens
    final = outs[-1].outputs[0]
    assert final.finished and len(final.token_ids) == 400 and not engine.scheduler.paused
    assert final.token_ids == solo_token_ids(stories, "Once upon a time", params)


def test_a_paused_reader_that_never_reads_again_is_aborted(stories):
    """Paused at once, the request makes no more output, so the abort comes from the clock:
    max_unread_s after the last read, with its blocks freed."""
    engine = make_engine(stories, max_num_seqs=4)
    aengine = AsyncEngine(engine, pause_after_s=0.2, max_unread_s=1.5)
    aengine.start()

    async def stall() -> list:
        stream = aengine.generate("stalled", "Once upon a time", greedy(20000, ignore_eos=True))
        outs = [await stream.__anext__()]
        await asyncio.sleep(3)
        async for out in stream:
            outs.append(out)
        return outs

    try:
        outs = asyncio.run(stall())
        assert outs[-1].finished and outs[-1].error == STOPPED_READING
        assert not engine.has_unfinished() and engine.kv.pool.num_used_blocks == 0
        assert not engine.scheduler.paused
        engine.check_integrity()
    finally:
        aengine.stop()
