"""Stored benchmark figures, one file a machine kind, every run kept; and the docs' tables drawn
from them.

    benchmarks/results/peers/intel-xeon-amx.json
    {"machine_kind": "intel-xeon-amx", "runs": [{"date": ..., "machine": {...}, "load_before": [...], ...}, ...]}

A run is appended, never overwritten, so figures from different days (and quieter or busier
machines: each run keeps /proc/loadavg from before it) stay side by side. The docs show the
latest run of each kind, in a section between two markers that only the table writer touches:

    <!-- tables: peers -->
    ... written by `python benchmarks/peers.py --tables` ...
    <!-- end tables: peers -->
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

Run = dict[str, Any]


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def append_run(directory: Path, kind: str, run: Run) -> Path:
    """Add `run` to directory/<kind>.json (created where missing); the file is replaced whole,
    through a temporary file, so an interrupted write leaves the old history intact."""
    path = directory / f"{kind}.json"
    history: dict[str, Any] = load_history(path) if path.exists() else {"machine_kind": kind, "runs": []}
    if history.get("machine_kind") != kind:
        raise ValueError(f"{path} holds runs of {history.get('machine_kind')!r}, not {kind!r}")
    history["runs"].append(run)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(history, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def load_history(path: Path) -> dict[str, Any]:
    history = json.loads(path.read_text())
    if not isinstance(history, dict) or not isinstance(history.get("runs"), list):
        raise ValueError(f"{path} is not a run history (a machine_kind and a list of runs)")
    return history


def latest_runs(directory: Path) -> dict[str, Run]:
    """Each machine kind's newest figures, by kind (sorted): {"amd-epyc-zen3-avx2": {...}, ...}.
    A run may measure only some parts (`--only throughput`), so each part comes from the newest
    run that has it: the runs merged oldest first, a newer run's parts replacing an older's. The
    contenders' settings are merged by name, each from the newest run that names it, so a part
    kept from an older run still has its contenders' settings (a contender whose flags changed
    under the same name shows the newer flags)."""
    latest: dict[str, Run] = {}
    for path in sorted(directory.glob("*.json")):
        runs = sorted(load_history(path)["runs"], key=lambda r: r.get("date", ""))
        if runs:
            merged: Run = {}
            for run in runs:
                contenders = {**merged.get("contenders", {}), **run.get("contenders", {})}
                merged.update(run)
                if contenders:
                    merged["contenders"] = contenders
            latest[path.stem] = merged
    return latest


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def machine_line(run: Run) -> str:
    """One line naming where and when a run's figures were taken, and how busy the machine was."""
    m = run["machine"]
    load = run.get("load_before")
    busy = f"; load average before: {' '.join(f'{x:.2f}' for x in load)}" if load else ""
    return (f"**{m['kind']}**: {m['cpu_model']}, {m['cores']} cores, {m['threads']} threads, kernels at "
            f"{m['kernel_level']}, torch {m['torch']}; newest run {run['date']}{busy}")


def replace_section(doc: str, name: str, body: str) -> str:
    """`doc` with the text between its `name` markers replaced by `body` (an error where the
    markers are missing: the section is placed by hand once, then rewritten)."""
    start, end = f"<!-- tables: {name} -->", f"<!-- end tables: {name} -->"
    head, sep, rest = doc.partition(start)
    _, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise ValueError(f"the document has no {start} ... {end} section")
    return f"{head}{start}\n{body.strip()}\n{end}{tail}"


def write_tables(doc_path: Path, name: str, directory: Path, render: Callable[[Run], str]) -> str:
    """Rewrite the doc's `name` section: one table a machine kind, from its latest stored run."""
    latest = latest_runs(directory)
    if not latest:
        raise ValueError(f"no stored runs under {directory}")
    body = "\n\n".join(f"{machine_line(run)}\n\n{render(run)}" for run in latest.values())
    doc_path.write_text(replace_section(doc_path.read_text(), name, body))
    return body


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b else "—"
