"""Stored runs: each machine kind's history grows by appends; the docs' tables are drawn from
each kind's latest run into their marked section and nowhere else."""

import json

import pytest

from kvserve.bench.history import append_run, latest_runs, replace_section, write_tables
from kvserve.bench.peer_tables import peers_tables, serving_tables

MACHINE = {"kind": "amd-epyc-zen3-avx2", "cpu_model": "AMD EPYC 7B13", "cores": 2, "threads": 2,
           "kernel_level": "avx2", "torch": "2.13.0"}


def peers_run(date, decode):
    return {"date": date, "machine": MACHINE, "load_before": [0.1, 0.2, 0.3],
            "contenders": {"kvserve defaults": [], "kvserve best": ["--packed-activations", "int8"]},
            "batch1": {"runs": {"kvserve defaults": [{}, {}, {}]}, "llama_cpp": "run",
                       "medians": {"kvserve defaults": {"decode": decode, "prefill": 600.0},
                                   "llama.cpp": {"decode": 100.0, "prefill": 300.0}},
                       "decode_breakdown_ms": {"kvserve defaults": {"matmul": 3.5, "step": 5.0}}},
            "throughput": {"num_prompts": 64, "vllm": "run in float32",
                           "medians": {"kvserve defaults": 300.0, "vLLM-CPU float32": 200.0}}}


def test_runs_are_appended_per_machine_kind(tmp_path):
    append_run(tmp_path, "amd-epyc-zen3-avx2", peers_run("2026-01-01T00:00:00Z", 90.0))
    append_run(tmp_path, "amd-epyc-zen3-avx2", peers_run("2026-01-02T00:00:00Z", 180.0))
    append_run(tmp_path, "intel-xeon-amx", {**peers_run("2026-01-01T00:00:00Z", 150.0)})
    history = json.loads((tmp_path / "amd-epyc-zen3-avx2.json").read_text())
    assert history["machine_kind"] == "amd-epyc-zen3-avx2"
    assert [r["batch1"]["medians"]["kvserve defaults"]["decode"] for r in history["runs"]] == [90.0, 180.0]
    latest = latest_runs(tmp_path)
    assert list(latest) == ["amd-epyc-zen3-avx2", "intel-xeon-amx"]
    assert latest["amd-epyc-zen3-avx2"]["date"] == "2026-01-02T00:00:00Z"
    assert not list(tmp_path.glob("*.tmp"))


def test_each_part_comes_from_the_newest_run_that_has_it(tmp_path):
    append_run(tmp_path, "intel-xeon-amx", peers_run("2026-01-01T00:00:00Z", 150.0))
    append_run(tmp_path, "intel-xeon-amx", {"date": "2026-01-02T00:00:00Z", "throughput": {"x": 1.0}})
    append_run(tmp_path, "intel-xeon-amx", {"date": "2026-01-03T00:00:00Z", "batch1": {"y": 2.0},
                                            "contenders": {"kvserve int8 cache": ["--kv-cache-dtype", "int8"]}})
    latest = latest_runs(tmp_path)["intel-xeon-amx"]
    assert latest["batch1"] == {"y": 2.0}
    assert latest["throughput"] == {"x": 1.0} and latest["date"] == "2026-01-03T00:00:00Z"  # kept from the older run
    # the settings of every contender of the parts kept, not only the newest run's
    assert latest["contenders"] == {"kvserve defaults": [], "kvserve best": ["--packed-activations", "int8"],
                                    "kvserve int8 cache": ["--kv-cache-dtype", "int8"]}


def test_a_history_of_another_kind_is_refused(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"machine_kind": "y", "runs": []}))
    with pytest.raises(ValueError, match="'y'"):
        append_run(tmp_path, "x", {})


def test_replace_section_keeps_the_rest():
    doc = "# A\nbefore\n<!-- tables: peers -->\nold\n<!-- end tables: peers -->\nafter\n"
    assert replace_section(doc, "peers", "new") == \
        "# A\nbefore\n<!-- tables: peers -->\nnew\n<!-- end tables: peers -->\nafter\n"
    with pytest.raises(ValueError, match="tables: other"):
        replace_section(doc, "other", "new")


def test_peers_tables_written_from_the_latest_run(tmp_path):
    results = tmp_path / "peers"
    append_run(results, "amd-epyc-zen3-avx2", peers_run("2026-01-01T00:00:00Z", 90.0))
    append_run(results, "amd-epyc-zen3-avx2", peers_run("2026-01-02T00:00:00Z", 180.0))
    doc = tmp_path / "benchmarks.md"
    doc.write_text("intro\n<!-- tables: peers -->\n<!-- end tables: peers -->\nrest\n")
    write_tables(doc, "peers", results, peers_tables)
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("<!-- end tables: peers -->\nrest\n")
    assert "**amd-epyc-zen3-avx2**: AMD EPYC 7B13" in text and "load average before: 0.10 0.20 0.30" in text
    # the newest run's figures and their ratios to the peers, not the older run's
    assert "| kvserve defaults | 180.0 | 600.0 | 1.80× | 2.00× |" in text
    assert "| kvserve defaults | 300.0 | 1.50× |" in text
    assert "| kvserve defaults | 3.50 | 5.00 |" in text
    assert "90.0" not in text
    assert "kvserve best: `--packed-activations int8`" in text


def test_serving_table_ratios_and_errors():
    def figures(tok_s):
        return {"output_throughput": tok_s, "ttft_ms": {"median": 120.0, "p99": 300.0},
                "itl_ms": {"median": 9.5, "p99": 20.0}}
    run = {"workload": {"num_prompts": 32, "input_len": 128, "output_len": 64},
           "servers": {"kvserve serve": "defaults", "llama-server": "-np C"},
           "results": {"1": {"kvserve serve": figures(50.0), "llama-server": figures(100.0)},
                       "4": {"kvserve serve": figures(80.0), "llama-server": {"error": "usage counted 0 of 2048"}}},
           "overhead": {"per_request_ms": 3.2, "per_token_ms": 0.41}}
    text = serving_tables(run)
    assert "| 1 | kvserve serve | 50.0 | 120 / 300 | 9.5 / 20.0 | 0.50× |" in text
    assert "| 4 | kvserve serve | 80.0 | 120 / 300 | 9.5 / 20.0 |  |" in text
    assert "| 4 | llama-server | usage counted 0 of 2048 |" in text
    assert "3.2 ms a request, 0.41 ms a streamed token" in text
    assert "noise" not in text


def test_serving_overhead_below_the_noise_shows_both_medians():
    """A server faster than the engine in process (a negative overhead) gives both runs' medians
    in place of the negative figure."""
    run = {"workload": {"num_prompts": 8, "input_len": 128, "output_len": 64}, "servers": {}, "results": {},
           "overhead": {"per_request_ms": -12.04, "per_token_ms": 0.72,
                        "served": {"ttft_ms": 122.8, "tpot_ms": 7.17},
                        "in_process": {"ttft_ms": 134.84, "tpot_ms": 6.45}}}
    text = serving_tables(run)
    assert "-12.0" not in text
    assert ("below the two runs' noise a request (median TTFT 122.8 ms served against 134.8 in process), "
            "0.72 ms a streamed token") in text
    run["overhead"].update(per_token_ms=-0.3)
    assert ("below the two runs' noise a streamed token (median time per output token 7.17 ms served "
            "against 6.45 in process)") in serving_tables(run)
    del run["overhead"]["served"], run["overhead"]["in_process"]  # a run stored without the medians
    assert "-12.0 ms a request, -0.30 ms a streamed token" in serving_tables(run)
