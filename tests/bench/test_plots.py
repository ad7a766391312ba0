"""`--plot FILE.png` of the benchmarks draws real runs: bench throughput (kvserve vs HF
generate), bench serve against a server, the paged-cache benchmark's memory per step; a --plot
that cannot be written is refused before anything runs."""

import importlib.util
import json
from pathlib import Path

import pytest

from kvserve.cli import main

pytest.importorskip("matplotlib", reason="matplotlib comes with the test extras (kvserve[plot])")


def png(path):
    """The figure's size, checked to be a drawn PNG."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 600 and height > 400 and len(data) > 20_000  # a drawn figure, not an empty canvas
    return width, height


def test_bench_throughput_plot(stories_path, tmp_path, capsys):
    fig, out = tmp_path / "tp.png", tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", stories_path, "--num-prompts", "6", "--input-len-max", "40",
                 "--output-len-max", "30", "--plot", str(fig), "--output-json", str(out), "--no-hf"]) == 0
    png(fig)
    s = json.loads(out.read_text())["kvserve"]["samples"]
    printed = capsys.readouterr().out
    total = int(printed.split(" prompt tokens, ")[1].split(" output tokens")[0])
    assert len(s["ttft_ms"]) == 6 and s["timeline"][-1][1] == total  # every token on the timeline
    assert [n for _, n in s["timeline"]] == sorted(n for _, n in s["timeline"])
    assert f"figure: {fig}" in printed


@pytest.mark.parametrize("bad, message", [("x.txt", "write a .png"), ("/no/such/dir/x.png", "no directory")])
def test_bad_plot_paths_are_refused_first(stories_path, bad, message, capsys):
    assert main(["bench", "throughput", "--model", stories_path, "--num-prompts", "2", "--no-hf", "--plot", bad]) == 2
    assert message in capsys.readouterr().err


def test_paged_cache_memory_figure(tmp_path):
    spec = importlib.util.spec_from_file_location("paged_cache", Path(__file__).parents[2] / "benchmarks" / "paged_cache.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from kvserve.bench.plot import memory_figure
    runs = [bench.memory_run(layout, 64 << 20, max_len, 0) for layout, max_len in (("paged", 8192), ("contiguous", 1280))]
    assert runs[0]["waste_pct"] < 4 < runs[1]["waste_pct"]
    fig = tmp_path / "paged.png"
    memory_figure(str(fig), "64 mixed requests", [{"name": r["layout"], "waste_pct": r["waste_pct"], **r["series"]}
                                                  for r in runs])
    png(fig)
