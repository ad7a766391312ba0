"""kvserve's server beside llama.cpp's (llama-server) on the same GGUF and threads: each started in
turn alone on the machine, driven by `kvserve bench serve`'s client (streamed /v1/completions,
a fixed number of prompts, a fixed output length, EOS ignored) at concurrency 1, 4 and 16;
output tok/s and TTFT / ITL percentiles side by side, with ratios. Then kvserve's own server
overhead: the same requests at concurrency 1 through the server and through the engine in this
process (the same token ids), in ms a request and ms a streamed token.

    bash benchmarks/setup_peers.sh          # once: builds llama-server (with llama-bench)
    .venv/bin/python benchmarks/serving_peers.py [--threads 2] [--concurrency 1,4,16] [--num-prompts 32]
    .venv/bin/python benchmarks/serving_peers.py --only overhead     # kvserve's overhead only
    .venv/bin/python benchmarks/serving_peers.py --tables            # docs/benchmarks.md's table

`kvserve serve` runs with its defaults; llama-server with one slot a concurrent request
(`-np C`, restarted for each concurrency), `-c` enough for every slot, continuous batching on.
Both get --threads threads. Every process started here runs in its own process group and is
stopped on the way out, on failure or Ctrl-C too. Each run is appended, with its machine and
the load average before it, to benchmarks/results/serving_peers/<machine kind>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.bench.args import ServeBenchOptions  # noqa: E402
from kvserve.bench.history import append_run, now_utc, write_tables  # noqa: E402
from kvserve.bench.machine import Machine, load_average  # noqa: E402
from kvserve.models.registry import default_model_path  # noqa: E402

HERE = Path(__file__).parent
ROOT = HERE.parent
LLAMA_SERVER = HERE / ".peers" / "llama.cpp" / "build" / "bin" / "llama-server"
RESULTS = HERE / "results" / "serving_peers"
DOC = ROOT / "docs" / "benchmarks.md"
KVSERVE = "kvserve serve"
PEER = "llama-server"


class Server:
    """A server process in its own process group, its log in a temporary file; leaving the
    context stops the whole group (SIGTERM, then SIGKILL), however the block was left."""

    def __init__(self, name: str, argv: list[str], port: int, threads: int) -> None:
        self.name, self.argv, self.port = name, argv, port
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.log = tempfile.TemporaryFile()
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def __enter__(self) -> "Server":
        # run from a neutral directory: the checkout's own would come first on the server's
        # sys.path, ahead of PYTHONPATH (which may name another kvserve to compare with)
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=tempfile.gettempdir())
        try:
            self._wait_ready(timeout_s=180)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _wait_ready(self, timeout_s: float) -> None:
        import httpx
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s: {self.tail()}")

    def tail(self, num_lines: int = 3) -> str:
        """The last lines of the server's log."""
        self.log.seek(0)
        return "\n".join(self.log.read().decode(errors="replace").strip().splitlines()[-num_lines:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


def free_port() -> int:
    from kvserve.distributed.workers import free_port as port
    return port()  # type: ignore[no-any-return]


def kvserve_server(model: str, threads: int) -> Server:
    port = free_port()
    argv = [sys.executable, "-c", "import sys; from kvserve.cli import main; sys.exit(main(sys.argv[1:]))",
            "serve", "--model", model, "--port", str(port)]
    return Server(KVSERVE, argv, port, threads)


def llama_server(model: str, threads: int, slots: int, ctx_per_slot: int) -> Server:
    port = free_port()
    argv = [str(LLAMA_SERVER), "-m", model, "-t", str(threads), "-tb", str(threads), "-np", str(slots),
            "-c", str(slots * ctx_per_slot), "-cb", "--host", "127.0.0.1", "--port", str(port)]
    return Server(PEER, argv, port, threads)


def drive(url: str, concurrency: int, a: argparse.Namespace) -> dict[str, Any]:
    """`kvserve bench serve`'s load at one concurrency; its summary, the samples left out."""
    from kvserve.bench.serve import run
    o = ServeBenchOptions(url=url, num_prompts=a.num_prompts, max_concurrency=concurrency,
                          input_len=a.input_len, output_len=a.output_len)
    s = asyncio.run(run(o))
    samples = s.pop("samples")
    expected = a.num_prompts * a.output_len
    if s["failed_requests"]:
        s["error"] = f"{s['failed_requests']} failed: {s['errors'][:1]}"
    elif s["total_output_tokens"] != expected:  # usage must count every token, EOS ignored
        s["error"] = f"usage counted {s['total_output_tokens']} output tokens of {expected}"
    s["num_itl_samples"] = len(samples["itl_ms"])  # the samples themselves are left out: the percentiles suffice
    return s


def median_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over repeats (the first run's error, if any run failed)."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return {"error": failed[0]["error"]}
    out: dict[str, Any] = {"output_throughput": statistics.median(r["output_throughput"] for r in runs)}
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms"):
        out[key] = {stat: statistics.median(r[key][stat] for r in runs) for stat in ("mean", "median", "p99")}
    out["load_before"] = [r["load_before"] for r in runs]
    return out


def serving(model: str, a: argparse.Namespace) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Each server alone, every concurrency, repeats interleaved server by server."""
    levels = [int(c) for c in a.concurrency.split(",")]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {str(c): {} for c in levels}
    servers = {KVSERVE: "kvserve serve (defaults), OMP_NUM_THREADS=%d" % a.threads}
    peer_reason = None if LLAMA_SERVER.exists() else \
        f"{LLAMA_SERVER.relative_to(ROOT)} missing: run bash benchmarks/setup_peers.sh"
    servers[PEER] = f"not run: {peer_reason}" if peer_reason else \
        f"llama-server -t {a.threads} -tb {a.threads} -np C -c C*{a.ctx_per_slot} -cb"
    for r in range(a.repeats):
        with kvserve_server(model, a.threads) as s:
            for c in levels:
                drive(s.url, 1, argparse.Namespace(num_prompts=2, input_len=a.input_len, output_len=4))  # warm up
                load = load_average()
                runs[str(c)].setdefault(KVSERVE, []).append({**drive(s.url, c, a), "load_before": load})
                print(f"repeat {r} concurrency {c} {KVSERVE}: {brief(runs[str(c)][KVSERVE][-1])}", flush=True)
        for c in levels if peer_reason is None else ():
            runs[str(c)].setdefault(PEER, []).append(peer_run(model, c, a))
            print(f"repeat {r} concurrency {c} {PEER}: {brief(runs[str(c)][PEER][-1])}", flush=True)
    return {c: {name: median_summary(rs) for name, rs in by.items()} for c, by in runs.items()}, servers


def peer_run(model: str, concurrency: int, a: argparse.Namespace) -> dict[str, Any]:
    """llama-server with one slot a concurrent request, driven at that concurrency; a server
    that does not start is recorded with its last log line, and the benchmark goes on."""
    try:
        with llama_server(model, a.threads, concurrency, a.ctx_per_slot) as s:
            drive(s.url, 1, argparse.Namespace(num_prompts=2, input_len=a.input_len, output_len=4))
            load = load_average()
            return {**drive(s.url, concurrency, a), "load_before": load}
    except RuntimeError as e:
        return {"error": " / ".join(str(e).split("\n")), "load_before": None}


def brief(s: dict[str, Any]) -> str:
    if "error" in s:
        return s["error"]
    return (f"{s['output_throughput']:.1f} tok/s, TTFT median {s['ttft_ms']['median']:.0f} ms, "
            f"ITL median {s['itl_ms']['median']:.1f} ms")


def report(results: dict[str, dict[str, Any]]) -> None:
    from kvserve.bench.peer_tables import serving_table
    print("\n" + serving_table({"results": results}))


def overhead(model: str, a: argparse.Namespace) -> dict[str, Any]:
    """kvserve's server overhead: the same requests at concurrency 1 through `kvserve serve`
    (streamed) and through the engine in this process, the server stopped (same token ids,
    greedy, EOS ignored). Overhead a request = the medians' difference in time to the first
    token; a token = the difference in time per output token after the first."""
    import httpx
    with kvserve_server(model, a.threads) as s:
        drive(s.url, 1, argparse.Namespace(num_prompts=2, input_len=a.input_len, output_len=4))
        load = load_average()
        cpu_before = process_cpu_s(s)
        served = asyncio.run(_served(s.url, a))
        served_cpu_s = process_cpu_s(s) - cpu_before
        prompts = [httpx.post(s.url + "/tokenize", json={"prompt": p}, timeout=30).json()["tokens"]
                   for p in served["prompts"]]
    direct = in_process(model, prompts, a.output_len, a.threads)
    direct_cpu_s = direct.pop("cpu_s")[0]
    ttft = statistics.median(served["ttft_ms"]) - statistics.median(direct["ttft_ms"])
    tpot = statistics.median(served["tpot_ms"]) - statistics.median(direct["tpot_ms"])
    num_tokens = a.overhead_prompts * a.output_len
    result = {"per_request_ms": ttft, "per_token_ms": tpot, "load_before": load,
              # CPU time is less moved by a busy machine than wall time: the server's process
              # against this one's over the same requests, per output token
              "cpu_per_token_ms": 1000 * (served_cpu_s - direct_cpu_s) / num_tokens,
              "served": {**{k: statistics.median(v) for k, v in served.items() if k != "prompts"},
                         "cpu_s": served_cpu_s},
              "in_process": {**{k: statistics.median(v) for k, v in direct.items()}, "cpu_s": direct_cpu_s}}
    print(f"\nkvserve server overhead at concurrency 1 ({a.overhead_prompts} requests, {a.output_len} tokens each): "
          f"{ttft:.2f} ms a request (TTFT {result['served']['ttft_ms']:.1f} against "
          f"{result['in_process']['ttft_ms']:.1f} in process), {tpot:.3f} ms a token (TPOT "
          f"{result['served']['tpot_ms']:.2f} against {result['in_process']['tpot_ms']:.2f}); CPU {result['cpu_per_token_ms']:.3f} ms a token "
          f"({served_cpu_s:.2f} s served against {direct_cpu_s:.2f} s in process)")
    return result


def process_cpu_s(server: Server) -> float:
    """CPU seconds (user + system, every thread) the server's process has used so far."""
    assert server.proc is not None
    with open(f"/proc/{server.proc.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _served(url: str, a: argparse.Namespace) -> dict[str, Any]:
    """TTFT and TPOT of each request, one at a time, and the prompts sent."""
    import random

    import httpx

    from kvserve.bench.serve import WORDS, one
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(a.input_len)) for _ in range(a.overhead_prompts)]
    ttft, tpot = [], []
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        for p in prompts:
            r = await one(client, url, {}, {"model": model, "prompt": p, "max_tokens": a.output_len, "temperature": 0,
                                            "ignore_eos": True, "stream": True,
                                            "stream_options": {"include_usage": True}})
            if not r.ok or r.ttft is None or r.output_tokens != a.output_len:
                raise RuntimeError(f"a request through the server failed: {r.error or r.output_tokens}")
            ttft.append(1000 * r.ttft)
            tpot.append(1000 * (r.e2e - r.ttft) / (r.output_tokens - 1))
    return {"prompts": prompts, "ttft_ms": ttft, "tpot_ms": tpot}


def in_process(model: str, prompts: list[list[int]], output_len: int, threads: int) -> dict[str, list[float]]:
    """The same requests, one at a time, through an engine built with `kvserve serve`'s defaults."""
    import torch

    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.llm_engine import LLMEngine
    torch.set_num_threads(threads)
    engine = LLMEngine.from_options(model)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine.add_request("warm", prompts[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    ttft, tpot = [], []
    cpu_start = time.process_time()
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
        start, first = time.perf_counter(), None
        while engine.has_unfinished():
            outs = engine.step()
            if first is None and any(c.token_ids for o in outs for c in o.outputs):
                first = time.perf_counter()
        end = time.perf_counter()
        assert first is not None
        ttft.append(1000 * (first - start))
        tpot.append(1000 * (end - first) / (output_len - 1))
    return {"ttft_ms": ttft, "tpot_ms": tpot, "cpu_s": [time.process_time() - cpu_start]}


def write_docs() -> None:
    from kvserve.bench.peer_tables import serving_tables
    write_tables(DOC, "serving peers", RESULTS, serving_tables)
    print(f"wrote the serving tables of {DOC.relative_to(ROOT)} from {RESULTS.relative_to(ROOT)}/")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated --max-concurrency levels")
    p.add_argument("--num-prompts", type=int, default=32, help="requests at each concurrency")
    p.add_argument("--input-len", type=int, default=128, help="prompt words (about as many tokens)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--ctx-per-slot", type=int, default=512, help="llama-server's context a slot (-c is C times it)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--overhead-prompts", type=int, default=8, help="requests of the overhead measurement")
    p.add_argument("--only", choices=["all", "serving", "overhead"], default="all")
    p.add_argument("--tables", action="store_true", help="only write docs/benchmarks.md's table from the stored runs")
    return p.parse_args()


def main() -> None:
    a = parse_args()
    if a.tables:
        return write_docs()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SIGTERM unwinds too: the servers stop
    machine = Machine.here(a.threads)
    model = default_model_path()
    run: dict[str, Any] = {"date": now_utc(), "machine": machine.as_dict(), "load_before": load_average(),
                           "command": " ".join(["benchmarks/serving_peers.py", *sys.argv[1:]])}
    if a.only in ("all", "serving"):  # the workload stored with the results it gave (tables merge parts by run)
        run["workload"] = {"num_prompts": a.num_prompts, "input_len": a.input_len, "output_len": a.output_len,
                           "repeats": a.repeats}
        run["results"], run["servers"] = serving(model, a)
        report(run["results"])
    if a.only in ("all", "overhead"):
        run["overhead"] = overhead(model, a)
    path = append_run(RESULTS, machine.kind, run)
    print(f"stored in {path.relative_to(ROOT)} (machine kind {machine.kind})")


if __name__ == "__main__":
    main()
