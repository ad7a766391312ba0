"""What an open dashboard costs the server: output tok/s of `kvserve serve` under 32 concurrent
streams, with and without a watcher reading /v1/kv/state at the dashboard's rate (every 0.4 s,
the JSON parsed as the page does), interleaved, medians of repeats. The state is taken on the
engine thread between two steps, so its cost is paid by the engine; the page's drawing runs in
the viewer's browser.

    .venv/bin/python benchmarks/dashboard_cost.py [--dtype bfloat16] [--streams 32] [--tokens 128] [--repeats 3]

Writes benchmarks/results/dashboard_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.engine.llm_engine import LLMEngine  # noqa: E402
from kvserve.models.registry import load_weights  # noqa: E402
from kvserve.server.app import create_app  # noqa: E402
from tests.server.conftest import RunningServer  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "dashboard_cost.json"
POLL_S = 0.4


def run(server: RunningServer, streams: int, tokens: int, watch: bool, seed: int) -> dict[str, float]:
    stop = threading.Event()
    polls, poll_s = [0], [0.0]

    def watcher() -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                t = time.perf_counter()
                json.loads(c.get(server.url + "/v1/kv/state").content)
                polls[0] += 1
                poll_s[0] += time.perf_counter() - t
                stop.wait(POLL_S)

    counts = [0] * streams

    def stream(i: int) -> None:
        body = {"prompt": f"Tell me story number {i} about a dragon and a knight.", "max_tokens": tokens,
                "temperature": 1.0, "seed": seed * 1000 + i, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=600) as r:
            counts[i] = sum(1 for line in r.iter_lines() if line.startswith("data: {") and '"text"' in line)

    w = threading.Thread(target=watcher) if watch else None
    if w:
        w.start()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t0
    stop.set()
    if w:
        w.join()
    return {"tok_s": streams * tokens / elapsed, "polls": polls[0],
            "poll_ms": 1000 * poll_s[0] / polls[0] if polls[0] else 0.0}


def state_build_ms(engine: LLMEngine, streams: int) -> float:
    """What one state costs the engine: kv_state timed with `streams` requests mid-decode."""
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.kv_state import kv_state
    for i in range(streams):
        engine.add_request(None, f"Story {i}: once upon a time", SamplingParams(max_tokens=64, ignore_eos=True))
    for _ in range(16):
        engine.step()
    times = []
    for _ in range(50):
        t = time.perf_counter()
        kv_state(engine)
        times.append(1000 * (time.perf_counter() - t))
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    engine = LLMEngine.from_options("SmolLM2-135M-Instruct", loaded=load_weights("SmolLM2-135M-Instruct"),
                                    dtype=a.dtype, max_num_seqs=a.streams, max_model_len=1024)
    rows: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    with RunningServer(create_app(engine, "smollm2"), engine) as server:
        run(server, 4, 8, False, 99)  # warm up
        for r in range(a.repeats):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                rows[mode].append(run(server, a.streams, a.tokens, mode == "on", r))
                print(f"repeat {r} dashboard {mode:3}: {rows[mode][-1]['tok_s']:.1f} tok/s "
                      f"({rows[mode][-1]['polls']} state reads, {rows[mode][-1]['poll_ms']:.1f} ms each)", flush=True)
        blocks = engine.plan.num_blocks
    build_ms = state_build_ms(engine, a.streams)
    off = statistics.median(x["tok_s"] for x in rows["off"])
    on = statistics.median(x["tok_s"] for x in rows["on"])
    summary = {"dtype": a.dtype, "streams": a.streams, "tokens": a.tokens, "num_blocks": blocks,
               "tok_s_without": off, "tok_s_with": on, "cost_pct": 100 * (off - on) / off,
               "state_read_ms": statistics.median(x["poll_ms"] for x in rows["on"]),
               "state_build_ms": build_ms, "engine_time_pct_bound": 100 * build_ms / 1000 / POLL_S, "runs": rows}
    print(f"\n{a.streams} streams x {a.tokens} tokens, {blocks} blocks: {off:.1f} tok/s without the dashboard, "
          f"{on:.1f} with it: {summary['cost_pct']:+.2f}% (a state read waits {summary['state_read_ms']:.0f} ms "
          f"for the step in flight)")
    print(f"building the state with {a.streams} requests running: {build_ms:.2f} ms on the engine thread, "
          f"every {POLL_S} s: at most {summary['engine_time_pct_bound']:.2f}% of the engine's time")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
