"""Options of `kvserve bench throughput` and `kvserve bench serve`: the command line's arguments
and the typed options they become."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ThroughputOptions:
    num_prompts: int = 64
    input_len_min: int = 16
    input_len_max: int = 256
    output_len_min: int = 16
    output_len_max: int = 256
    bench_seed: int = 0
    hf_batch_size: Optional[int] = None
    no_hf: bool = False
    output_json: Optional[str] = None
    plot: Optional[str] = None


@dataclass(frozen=True)
class ServeBenchOptions:
    url: str = "http://127.0.0.1:8000"
    model: Optional[str] = None
    num_prompts: int = 64
    request_rate: float = float("inf")
    max_concurrency: Optional[int] = None
    input_len: int = 128
    output_len: int = 64
    bench_seed: int = 0
    api_key: Optional[str] = None
    output_json: Optional[str] = None
    plot: Optional[str] = None


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    d = ThroughputOptions()
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--input-len-min", type=int, default=d.input_len_min)
    p.add_argument("--input-len-max", type=int, default=d.input_len_max)
    p.add_argument("--output-len-min", type=int, default=d.output_len_min)
    p.add_argument("--output-len-max", type=int, default=d.output_len_max)
    p.add_argument("--bench-seed", type=int, default=d.bench_seed, help="seed of the workload")
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="static batch size of the Hugging Face run (default: --max-num-seqs)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face comparison")
    p.add_argument("--output-json", default=None, help="write the figures here too")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw latency distributions and tokens/s over time (needs matplotlib)")


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    d = ServeBenchOptions()
    p.add_argument("--url", default=d.url)
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--request-rate", type=float, default=d.request_rate,
                   help="requests per second (Poisson arrivals); inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=int, default=d.input_len, help="approximate prompt words")
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--bench-seed", type=int, default=d.bench_seed)
    p.add_argument("--api-key", default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw TTFT/TPOT/ITL distributions and tokens/s over time (needs matplotlib)")
