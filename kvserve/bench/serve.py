"""`kvserve bench serve`: a seeded load against a running OpenAI-compatible server, printing the
figures `vllm bench serve` prints (throughput, TTFT, TPOT, ITL, end-to-end latency).

Requests stream (/v1/completions, stream=true, usage included); arrivals are Poisson at
--request-rate (all at once when it is inf), optionally capped by --max-concurrency.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from kvserve.bench.args import ServeBenchOptions

WORDS = ("the cache keeps keys and values of every token so each new step reads them once "
         "instead of recomputing the whole sequence blocks tables prefix hits share memory").split()


@dataclass
class Result:
    ok: bool = False
    ttft: Optional[float] = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""
    times: list[float] = field(default_factory=list)  # when each text chunk arrived (perf_counter)


async def one(client: Any, url: str, headers: dict[str, str], body: dict[str, Any]) -> Result:
    r = Result()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    r.output_tokens = chunk["usage"]["completion_tokens"]
                    r.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    r.times.append(now)
                    if r.ttft is None:
                        r.ttft = now - start
                    else:
                        r.itl.append(now - last)
                    last = now
        r.e2e = time.perf_counter() - start
        r.ok = r.ttft is not None
    except Exception as e:  # a failed request is counted, not fatal
        r.error = f"{type(e).__name__}: {e}"
    return r


async def run(a: ServeBenchOptions) -> dict[str, Any]:
    import httpx
    rng = random.Random(a.bench_seed)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    # a connection a request: a server may close a kept-alive connection just as the next request
    # goes out on it (llama-server closes one after a few requests), which fails that request.
    # (The limits also lift httpx's default cap of 100 connections, whose queue TTFT would count.)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        model = a.model or (await client.get(a.url + "/v1/models", headers=headers)).json()["data"][0]["id"]
        bodies = [{"model": model, "prompt": " ".join(rng.choice(WORDS) for _ in range(a.input_len)),
                   "max_tokens": a.output_len, "temperature": 0, "ignore_eos": True, "stream": True,
                   "stream_options": {"include_usage": True}} for _ in range(a.num_prompts)]
        gate = asyncio.Semaphore(a.max_concurrency or a.num_prompts)

        async def limited(body: dict[str, Any]) -> Result:
            async with gate:
                return await one(client, a.url, headers, body)

        tasks = []
        start = time.perf_counter()
        for body in bodies:
            tasks.append(asyncio.create_task(limited(body)))
            if a.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(a.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(results, duration, a)
    arrivals = sorted(t - start for r in results if r.ok for t in r.times)
    summary["samples"] = {"ttft_ms": [1000 * r.ttft for r in results if r.ok and r.ttft is not None],
                          "tpot_ms": [1000 * (r.e2e - r.ttft) / (r.output_tokens - 1) for r in results
                                      if r.ok and r.ttft is not None and r.output_tokens > 1],
                          "itl_ms": [1000 * x for r in results if r.ok for x in r.itl],
                          "timeline": [[t, i + 1] for i, t in enumerate(arrivals)]}
    return summary


def _ms(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    from kvserve.bench.throughput import percentile
    ms = [1000 * x for x in xs]
    return {"mean": statistics.fmean(ms), "median": statistics.median(ms), "p99": percentile(ms, 99)}


def summarize(results: list[Result], duration: float, a: ServeBenchOptions) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    return {
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration, "request_rate": a.request_rate,
        "total_input_tokens": sum(r.prompt_tokens for r in ok), "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "ttft_ms": _ms([r.ttft for r in ok if r.ttft is not None]), "tpot_ms": _ms(tpots),
        "itl_ms": _ms([x for r in ok for x in r.itl]), "e2el_ms": _ms([r.e2e for r in ok]),
    }


def print_summary(s: dict[str, Any]) -> None:
    print("============ Serving Benchmark Result ============")
    rows = [("Successful requests", s["successful_requests"]), ("Failed requests", s["failed_requests"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Total input tokens", s["total_input_tokens"]), ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    for name, v in rows:
        print(f"{name:<40}{v:>10}")
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        print(f"{'-' * 15}{title}{'-' * 15}")
        short = key.split("_")[0].upper()
        for stat in ("mean", "median", "p99"):
            label = "P99" if stat == "p99" else stat.capitalize()
            print(f"{label + ' ' + short + ' (ms):':<40}{s[key][stat]:>10.2f}")
    if s["errors"]:
        print("errors:", *s["errors"], sep="\n  ")
    print("=" * 50)


def run_serve_bench(a: ServeBenchOptions) -> int:
    from kvserve.bench.plot import check_plot_path
    check_plot_path(a.plot)
    summary = asyncio.run(run(a))
    print_summary(summary)
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(summary, f, indent=2)
    if a.plot:
        from kvserve.bench.plot import latency_figure
        s = summary["samples"]
        latency_figure(a.plot, f"bench serve: {a.num_prompts} requests at {a.request_rate} req/s, {a.url}",
                       {"kvserve": {"ttft": s["ttft_ms"], "tpot": s["tpot_ms"], "itl": s["itl_ms"]}},
                       {"kvserve": s["timeline"]})
        print(f"figure: {a.plot}")
    return 0 if summary["failed_requests"] == 0 else 1
