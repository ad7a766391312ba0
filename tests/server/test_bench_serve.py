"""`kvserve bench serve` against a real server: every request is counted, the token totals are
what was asked for, and the latency figures are consistent with one another."""

from __future__ import annotations

import json
import math

from kvserve.cli import main
from tests.server.conftest import API_KEY


def bench(server, tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--url", server.url, "--num-prompts", "8", "--input-len", "12",
               "--output-len", "10", "--output-json", str(out), *extra])
    return rc, json.loads(out.read_text())


def test_bench_serve_counts_every_request_and_token(stories_server, tmp_path, capsys):
    before = stories_server.engine.stats().scheduler
    rc, s = bench(stories_server, tmp_path, "--api-key", API_KEY, "--request-rate", "50", "--max-concurrency", "4")
    assert rc == 0 and s["successful_requests"] == 8 and s["failed_requests"] == 0
    assert s["total_output_tokens"] == 8 * 10  # ignore_eos: every request runs to max_tokens
    assert s["total_input_tokens"] >= 8 * 12
    assert s["request_throughput"] == s["successful_requests"] / s["duration_s"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        stats = s[key]
        assert all(math.isfinite(v) and v > 0 for v in stats.values()), key
        assert stats["median"] <= stats["p99"]
    assert s["ttft_ms"]["mean"] < s["e2el_ms"]["mean"]
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Mean TTFT (ms):" in printed and "P99 ITL (ms):" in printed
    stories_server.wait_idle()
    assert stories_server.engine.stats().scheduler.num_free_blocks == before.num_free_blocks


def test_bench_serve_reports_failures_and_exits_nonzero(stories_server, tmp_path, capsys):
    rc, s = bench(stories_server, tmp_path, "--api-key", "wrong-key", "--model", "stories260K")
    assert rc == 1 and s["successful_requests"] == 0 and s["failed_requests"] == 8
    assert any("HTTP 401" in e for e in s["errors"])


def test_bench_serve_plot(stories_server, tmp_path):
    fig = tmp_path / "serve.png"
    assert main(["bench", "serve", "--url", stories_server.url, "--num-prompts", "8", "--input-len", "12",
                 "--output-len", "10", "--api-key", API_KEY, "--plot", str(fig)]) == 0
    from tests.bench.test_plots import png
    png(fig)
