"""Arguments of `kvserve bench throughput` and `kvserve bench serve`."""

from __future__ import annotations

import argparse


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len-min", type=int, default=16)
    p.add_argument("--input-len-max", type=int, default=256)
    p.add_argument("--output-len-min", type=int, default=16)
    p.add_argument("--output-len-max", type=int, default=256)
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the workload")
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="static batch size of the Hugging Face run (default: --max-num-seqs)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face comparison")
    p.add_argument("--output-json", default=None, help="write the figures here too")


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson arrivals); inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=int, default=128, help="approximate prompt words")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--output-json", default=None)
