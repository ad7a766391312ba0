"""Two engine settings on the peers' offline throughput workload, by turns in one process: how
much of a gap between two rows of `benchmarks/peers.py`'s throughput table is the settings' own.

peers.py runs its contenders one after another, each a fresh engine, a few repeats. On a
machine whose freed memory goes back to its host (a KVM or Firecracker guest with free page
reporting), a fresh engine's KV cache pages cost a wait on their first write (docs/cache.md),
and how long depends on what ran just before: a contender after vLLM's process, or first, gets
memory back from the host; one after another kvserve engine, pages that engine freed moments
ago. Here the two settings alternate after a warm-up engine (discarded), the order swapped every
pair, each engine fresh, and the figure is the median of the pairs' ratios (B's output tok/s
over A's: above 1, B is faster) beside each setting's median. Engines run moments apart reuse
memory the one before freed, so a setting that avoids first writes gains less here than in a
fresh process.

SmolLM2-135M-Instruct Q4_1 (the default GGUF), peers.py's workload and engine options
(`throughput_workload`, `throughput_run`: 64 requests, prompts and outputs of 64-192 tokens,
EOS ignored, max_model_len 1024, no prefix caching):

    .venv/bin/python benchmarks/throughput_pairs.py --b --kv-cache-populate --pairs 8
    .venv/bin/python benchmarks/throughput_pairs.py --b --packed-activations int8 --both --kv-cache-populate

`--a` and `--b` take engine flags (as `kvserve generate` does; none: the defaults), `--both`
flags that both settings get (a flag given to one setting and to both: refused). Each list runs
to the next of those three or of this script's options (`--pairs N`, `--threads N`, `--warmup
N`, or their `--pairs=N` forms). Each run is added to
benchmarks/results/throughput_pairs/<machine kind>.json with its machine, date and command.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import options_of, throughput_run, throughput_workload  # noqa: E402

from kvserve.bench.history import append_run, now_utc  # noqa: E402
from kvserve.bench.machine import Machine, load_average  # noqa: E402
from kvserve.models.registry import default_model_path, load_weights  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "throughput_pairs"
SETTINGS = ("--a", "--b", "--both")
OWN = ("--pairs", "--threads", "--warmup")


def main() -> None:
    a, settings = parse()
    torch.set_num_threads(a.threads)
    machine, load = Machine.here(a.threads), load_average()
    runs = run_pairs(settings, a.pairs, a.warmup)
    ratios = [b / x for x, b in zip(runs["A"], runs["B"])]
    medians = {k: statistics.median(v) for k, v in runs.items()}
    for k in settings:
        shown = " ".join(settings[k]) or "(defaults)"
        print(f"{k} {shown}: {medians[k]:.1f} output tok/s (median of {a.pairs})")
    print(f"B / A, median of the pairs' ratios: {statistics.median(ratios):.3f} "
          f"(pairs {', '.join(f'{r:.3f}' for r in ratios)})")
    path = append_run(RESULTS, machine.kind, {
        "date": now_utc(), "machine": machine.as_dict(), "load_before": load,
        "command": " ".join(["benchmarks/throughput_pairs.py", *sys.argv[1:]]), "settings": settings,
        "warmup": a.warmup, "runs": runs, "medians": medians, "ratios": ratios,
        "median_ratio": statistics.median(ratios)})
    print(f"stored in {path}")


def parse() -> tuple[argparse.Namespace, dict[str, list[str]]]:
    """The script's options and the two settings' engine flags (A, B), checked."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=(
        "--a FLAGS..., --b FLAGS..., --both FLAGS...: engine flags of setting A, of setting B, of both "
        "(each list runs to the next of these or of the options above)"))
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1, help="engines run and discarded before the pairs")
    own, flags = split_args(sys.argv[1:])
    a = p.parse_args(own)
    for name in ("pairs", "threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be at least 1")
    if a.warmup < 0:
        p.error("--warmup must be 0 or more")
    for side in ("--a", "--b"):
        shared = set(_names(flags[side])) & set(_names(flags["--both"]))
        if shared:
            p.error(f"{', '.join(sorted(shared))} given to {side} and to --both: give it to one of them")
    settings = {"A": flags["--a"] + flags["--both"], "B": flags["--b"] + flags["--both"]}
    for name, given in settings.items():
        try:
            options_of(given)  # a bad flag is named here, before any run
        except SystemExit:
            p.error(f"setting {name}'s flags {' '.join(given)!r} are not engine flags "
                    "(kvserve generate --help)")
    return a, settings


def run_pairs(settings: dict[str, list[str]], pairs: int, warmup: int) -> dict[str, list[float]]:
    """Output tok/s of each setting, `pairs` of them by turns (A first in even pairs, B in odd
    ones), after `warmup` runs of A discarded; each run a fresh engine, freed before the next."""
    loaded = load_weights(default_model_path())
    w = throughput_workload(loaded.config.vocab_size, 64)

    for i in range(warmup):
        got = throughput_run(loaded, w, settings["A"])
        print(f"warm-up {i}: A {got:.1f} output tok/s (discarded)", flush=True)
    runs: dict[str, list[float]] = {k: [] for k in settings}
    for i in range(pairs):
        for name in (["A", "B"] if i % 2 == 0 else ["B", "A"]):
            runs[name].append(throughput_run(loaded, w, settings[name]))
        print(f"pair {i}: A {runs['A'][-1]:.1f}, B {runs['B'][-1]:.1f} output tok/s", flush=True)
    return runs


def split_args(argv: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """The script's own arguments, and the engine flags after each of --a, --b and --both (up to
    the next of those or of the script's own options). split_args(["--b", "--kv-cache-dtype",
    "int8", "--pairs=8"]) == (["--pairs=8"], {"--a": [], "--b": ["--kv-cache-dtype", "int8"],
    "--both": []})"""
    flags: dict[str, list[str]] = {k: [] for k in SETTINGS}
    own: list[str] = []
    into: Optional[list[str]] = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in flags:
            into = flags[arg]
        elif arg in ("-h", "--help") or arg.split("=", 1)[0] in OWN:
            into = None
            own.append(arg)
            if arg in OWN and i + 1 < len(argv):  # its value (a missing one: argparse says so)
                own.append(argv[i + 1])
                i += 1
        elif into is not None:
            into.append(arg)
        else:
            own.append(arg)  # argparse names what it does not know
        i += 1
    return own, flags


def _names(flags: list[str]) -> list[str]:
    """The options among engine flags, without their values: ["--kv-cache-dtype", "int8"] ->
    ["--kv-cache-dtype"]."""
    return [f.split("=", 1)[0] for f in flags if f.startswith("--")]


if __name__ == "__main__":
    main()
