"""The docs' tables of the peers comparisons, drawn from one stored run (kvserve.bench.history):
benchmarks/peers.py's (batch 1 beside llama.cpp, offline throughput beside vLLM-CPU, where a
decode step goes) and benchmarks/serving_peers.py's (kvserve serve beside llama-server)."""

from __future__ import annotations

from typing import Any, Optional

from kvserve.bench.history import Run, markdown_table, ratio

LLAMA_CPP = "llama.cpp"


def _num(x: float) -> str:
    return f"{x:,.1f}"


def batch1_table(b: dict[str, Any]) -> str:
    """Decode (tg128) and prefill (pp512) tok/s, medians, each beside llama.cpp's."""
    med = b["medians"]
    peer = med.get(LLAMA_CPP)
    header = ["", "decode tok/s", "prefill tok/s"] + (["decode vs llama.cpp", "prefill vs llama.cpp"] if peer else [])
    rows = []
    for name, v in med.items():
        row = [name, _num(v["decode"]), _num(v["prefill"])]
        if peer:
            row += ["", ""] if name == LLAMA_CPP else [ratio(v["decode"], peer["decode"]), ratio(v["prefill"], peer["prefill"])]
        rows.append(row)
    return markdown_table(header, rows)


def throughput_table(t: dict[str, Any]) -> str:
    """Offline output tok/s, medians, each kvserve row beside vLLM-CPU's."""
    med = t["medians"]
    peer = next((k for k in med if k.startswith("vLLM")), None)
    header = ["", "output tok/s"] + ([f"vs {peer}"] if peer else [])
    rows = [[name, _num(v)] + ([ratio(v, med[peer]) if name != peer else ""] if peer else []) for name, v in med.items()]
    return markdown_table(header, rows)


def breakdown_table(parts: dict[str, dict[str, float]]) -> str:
    """Milliseconds a batch-1 decode step spends in each part, one row a contender."""
    names = list(dict.fromkeys(k for p in parts.values() for k in p))
    rows = [[who] + [f"{p.get(k, 0.0):.2f}" for k in names] for who, p in parts.items()]
    return markdown_table(["ms a step"] + names, rows)


def peers_tables(run: Run) -> str:
    """Everything one benchmarks/peers.py run measured, as markdown."""
    out = []
    if "batch1" in run:
        b = run["batch1"]
        out.append(f"Batch 1, SmolLM2-135M Q4_1 GGUF, medians of {len(next(iter(b['runs'].values())))} "
                   f"interleaved repeats (llama.cpp: {b['llama_cpp']}):\n\n{batch1_table(b)}")
        out.append("Where a batch-1 decode step goes (each kernel timed on its own, so a decoder layer is not "
                   "one compiled call here and the step is slower than the engine's):\n\n"
                   f"{breakdown_table(b['decode_breakdown_ms'])}")
    if "throughput" in run:
        t = run["throughput"]
        out.append(f"Offline throughput, {t['num_prompts']} requests, prompts and outputs 64-192 tokens, EOS "
                   f"ignored (vLLM-CPU: {t['vllm']}):\n\n{throughput_table(t)}")
    flags = run.get("contenders", {})
    if flags:
        out.append("Settings: " + "; ".join(f"{k}: `{' '.join(v) or '(no flags)'}`" for k, v in flags.items()))
    return "\n\n".join(out)


def serving_table(run: Run) -> str:
    """Output tok/s and TTFT / ITL percentiles per server and concurrency, with kvserve's ratios
    to the peer at the same concurrency."""
    header = ["concurrency", "server", "output tok/s", "TTFT median / p99 (ms)", "ITL median / p99 (ms)",
              "tok/s vs llama-server"]
    rows = []
    for c, servers in run["results"].items():
        peer = servers.get("llama-server")
        for name, s in servers.items():
            if "error" in s:
                rows.append([c, name, s["error"], "", "", ""])
                continue
            vs = ratio(s["output_throughput"], peer["output_throughput"]) \
                if peer and "error" not in peer and name != "llama-server" else ""
            rows.append([c, name, _num(s["output_throughput"]),
                         f"{s['ttft_ms']['median']:,.0f} / {s['ttft_ms']['p99']:,.0f}",
                         f"{s['itl_ms']['median']:,.1f} / {s['itl_ms']['p99']:,.1f}", vs])
    return markdown_table(header, rows)


def serving_tables(run: Run) -> str:
    w = run["workload"]
    text = (f"{w['num_prompts']} requests a concurrency, ~{w['input_len']} prompt words, {w['output_len']} output "
            f"tokens (EOS ignored), streamed /v1/completions; servers: "
            + "; ".join(f"{k}: `{v}`" for k, v in run["servers"].items()) + "\n\n" + serving_table(run))
    if run.get("overhead"):
        o = run["overhead"]
        served, direct = o.get("served", {}), o.get("in_process", {})
        request = _overhead(o["per_request_ms"], 1, "a request", "TTFT", served.get("ttft_ms"),
                            direct.get("ttft_ms"))
        token = _overhead(o["per_token_ms"], 2, "a streamed token", "time per output token",
                          served.get("tpot_ms"), direct.get("tpot_ms"))
        text += (f"\n\nkvserve's server overhead at concurrency 1 against the same tokens through the engine in "
                 f"process: {request}, {token}"
                 + (f" ({o['cpu_per_token_ms']:.3f} ms of CPU a token)" if "cpu_per_token_ms" in o else ""))
    return text


def _overhead(ms: float, digits: int, per: str, what: str, served: Optional[float],
              direct: Optional[float]) -> str:
    """One overhead figure; a negative one (the server faster than the engine in process: the two
    runs, minutes apart, differ by more than the server costs) as the two runs' medians."""
    if ms >= 0 or served is None or direct is None:
        return f"{ms:.{digits}f} ms {per}"
    return (f"below the two runs' noise {per} (median {what} {served:,.{digits}f} ms served against "
            f"{direct:,.{digits}f} in process)")
