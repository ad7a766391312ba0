"""Figures for the benchmarks (`--plot FILE.png`): latency distributions and tokens/s over time
for `kvserve bench throughput|serve`, reserved vs used memory for the paged-cache benchmark.
matplotlib draws them off-screen (the `plot` extra: pip install 'kvserve[plot]')."""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

COLOURS = ["#2563eb", "#f97316", "#16a34a", "#9333ea"]


def check_plot_path(path: Optional[str]) -> None:
    """Refuse a --plot that cannot be written, before any benchmark runs."""
    if path is None:
        return
    if not path.lower().endswith(".png"):
        raise ValueError(f"--plot: write a .png file, got {path!r}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"--plot: no directory {parent!r} to write {os.path.basename(path)!r} in")
    _pyplot()


def _pyplot() -> Any:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install 'kvserve[plot]'") from e
    return plt


def rate_over_time(timeline: Sequence[Sequence[float]], bins: int = 40) -> tuple[list[float], list[float]]:
    """Tokens/s in equal time bins from a cumulative [(seconds, tokens so far)] series."""
    times, counts = [t for t, _ in timeline], [n for _, n in timeline]
    if len(times) < 2 or times[-1] <= 0:
        return [], []
    width = times[-1] / bins
    edges = [width * (i + 1) for i in range(bins)]
    xs, ys, j, prev = [], [], 0, 0
    for edge in edges:
        while j < len(times) and times[j] <= edge:
            j += 1
        total = counts[j - 1] if j else 0
        xs.append(edge - width / 2)
        ys.append((total - prev) / width)
        prev = total
    return xs, ys


def latency_figure(path: str, title: str, latencies: dict[str, dict[str, list[float]]],
                   timelines: dict[str, Sequence[Sequence[float]]]) -> None:
    """One histogram per latency (TTFT, TPOT, ...: milliseconds) with every contender on it, and
    output tokens/s over the run below."""
    plt = _pyplot()
    metrics = [m for m in ("ttft", "tpot", "itl", "e2el") if any(latencies[c].get(m) for c in latencies)]
    fig, axes = plt.subplots(2, max(len(metrics), 1), figsize=(4.2 * max(len(metrics), 2), 7), squeeze=False)
    for k, m in enumerate(metrics):
        ax = axes[0][k]
        for i, (name, lat) in enumerate(latencies.items()):
            xs = lat.get(m) or []
            if xs:
                ax.hist(xs, bins=30, alpha=0.55, color=COLOURS[i % len(COLOURS)], label=f"{name} (n={len(xs)})")
        _labels(ax, f"{m.upper()} (ms)", "ms", "count")
    for k in range(len(metrics), axes.shape[1]):
        axes[0][k].axis("off")
    ax = plt.subplot2grid((2, axes.shape[1]), (1, 0), colspan=axes.shape[1], fig=fig)
    for i, (name, timeline) in enumerate(timelines.items()):
        xs, ys = rate_over_time(timeline)
        ax.plot(xs, ys, color=COLOURS[i % len(COLOURS)], label=name, drawstyle="steps-mid")
    _labels(ax, "output tokens/s over the run", "seconds since start", "tokens/s")
    _save(plt, fig, path, title)


def memory_figure(path: str, title: str, runs: list[dict[str, Any]]) -> None:
    """Per layout: bytes reserved vs bytes holding tokens at every step, and sequences running."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=False)
    for i, r in enumerate(runs):
        c = COLOURS[i % len(COLOURS)]
        steps = range(len(r["reserved"]))
        top.plot(steps, [b / 2**20 for b in r["reserved"]], color=c, label=f"{r['name']}: reserved")
        top.plot(steps, [b / 2**20 for b in r["used"]], color=c, linestyle=":", label=f"{r['name']}: holding tokens")
        bottom.plot(steps, r["running"], color=c, label=f"{r['name']} ({r['waste_pct']:.1f}% waste)")
    _labels(top, "KV memory reserved vs holding tokens, per step", None, "MiB")
    _labels(bottom, None, "scheduler step", "sequences running")
    _save(plt, fig, path, title)


def _labels(ax: Any, title: Optional[str], x: Optional[str], y: str) -> None:
    if title:
        ax.set_title(title)
    if x:
        ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.legend(fontsize=8)


def _save(plt: Any, fig: Any, path: str, title: str) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
