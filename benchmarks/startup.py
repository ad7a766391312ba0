"""Start-up: the time from launching `kvserve serve` to its first answered request, and where it
goes (measured in one process: imports, reading the model, building the engine and its kernels).

The server is started the way a user starts it (`kvserve serve`, the default model, port 8000+)
on a warm machine (model files in the page cache, compiled kernels already built); as soon as
/health answers, one completion of one token is sent, and the clock stops when it comes back.
Medians of --runs fresh processes.

    .venv/bin/python benchmarks/startup.py [--runs 5]

Writes benchmarks/results/startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_once(tree: str | None = None) -> dict:
    """One fresh `kvserve serve`; tree: another checkout of this repository to run instead."""
    import httpx
    port = free_port()
    env = {**os.environ, "PYTHONPATH": tree} if tree else None
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port)], env=env,
                            cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvserve serve exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.02)
        health = time.perf_counter() - start
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 1}, timeout=60)
        r.raise_for_status()
        answered = time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(30)
    return {"health_s": health, "first_answer_s": answered}


def stages() -> dict:
    """Where a start goes, measured in this process in the order the server does it."""
    t0 = time.perf_counter()
    import torch  # noqa: F401
    t1 = time.perf_counter()
    from kvserve.models.registry import load_weights
    loaded = load_weights("SmolLM2-135M-Instruct")
    t2 = time.perf_counter()
    from kvserve.engine.llm_engine import LLMEngine
    engine = LLMEngine.from_options("SmolLM2-135M-Instruct", loaded=loaded)
    t3 = time.perf_counter()
    import fastapi  # noqa: F401
    import uvicorn  # noqa: F401
    t4 = time.perf_counter()
    return {"import_torch_s": t1 - t0, "read_model_s": t2 - t1, "build_engine_s": t3 - t2,
            "import_server_s": t4 - t3, "kv_blocks": engine.plan.num_blocks}


def timed(label: str, runs: int, tree: str | None = None) -> dict:
    serve_once(tree)  # warm: page cache, kernel builds
    times = [serve_once(tree) for _ in range(runs)]
    result = {key: statistics.median(r[key] for r in times) for key in times[0]}
    print(f"{label}: kvserve serve (SmolLM2) answers /health after {result['health_s']:.2f} s, its first "
          f"completion after {result['first_answer_s']:.2f} s (median of {runs})")
    return {**result, "runs": times}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--rev", default=None, help="also measure this git revision (before)")
    a = p.parse_args()
    result: dict = {}
    if a.rev:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with tempfile.TemporaryDirectory() as tmp:
            tree = os.path.join(tmp, "tree")
            subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", tree, a.rev], check=True,
                           capture_output=True)
            try:
                result["before"] = {"rev": a.rev, **timed(a.rev, a.runs, tree)}
            finally:
                subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", tree], capture_output=True)
    result.update(timed("now", a.runs))
    s = stages()
    result["stages"] = s
    print("stages: " + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.2f} s" for k, v in s.items() if k.endswith("_s")))
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "startup.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
