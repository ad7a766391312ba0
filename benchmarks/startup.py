"""Start-up: the time from launching `kvserve serve` to its first answered request, and where it
goes (measured in one process: imports, reading the model, building the engine and its kernels).

The server is started the way a user starts it (`kvserve serve`, the default model, port 8000+);
as soon as /health answers, one completion of one token is sent, and the clock stops when it comes
back. Medians of --runs fresh processes. By default the machine is warm (model files in the page
cache, one start before the timed ones); --cold times first starts instead: no warm-up start, the
page cache dropped where this user may, and torch's extension cache an empty folder for each run
(so a revision that compiled its kernels on first use, --rev, pays for that as a new user did).

    .venv/bin/python benchmarks/startup.py [--runs 5] [--cold] [--rev REV]

Writes benchmarks/results/startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


def drop_page_cache() -> bool:
    """Empty the page cache (root only; False where this machine does not allow it)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def serve_once(tree: str | None = None, cold: bool = False) -> dict:
    """One fresh `kvserve serve`; tree: another checkout of this repository to run instead;
    cold: with an empty extension cache and, where allowed, an empty page cache."""
    import httpx
    port = free_port()
    env = {**os.environ, **({"PYTHONPATH": tree} if tree else {})}
    scratch = tempfile.mkdtemp(prefix="kvserve-startup-")
    if cold:
        env["TORCH_EXTENSIONS_DIR"] = scratch
        drop_page_cache()
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
        shutil.rmtree(scratch, ignore_errors=True)
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


def timed(label: str, runs: int, tree: str | None = None, cold: bool = False) -> dict:
    if not cold:
        serve_once(tree)  # warm: page cache, kernel builds
    times = [serve_once(tree, cold) for _ in range(runs)]
    result = {key: statistics.median(r[key] for r in times) for key in times[0]}
    print(f"{label}: kvserve serve (SmolLM2) answers /health after {result['health_s']:.2f} s, its first "
          f"completion after {result['first_answer_s']:.2f} s (median of {runs}, {'cold' if cold else 'warm'})")
    return {**result, "runs": times}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--rev", default=None, help="also measure this git revision (before)")
    p.add_argument("--cold", action="store_true", help="first starts: no warm-up, empty caches")
    a = p.parse_args()
    result: dict = {"cold": a.cold, "page_cache_dropped": drop_page_cache() if a.cold else None}
    if a.rev:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with tempfile.TemporaryDirectory() as tmp:
            tree = os.path.join(tmp, "tree")
            subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", tree, a.rev], check=True,
                           capture_output=True)
            try:
                result["before"] = {"rev": a.rev, **timed(a.rev, a.runs, tree, a.cold)}
            finally:
                subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", tree], capture_output=True)
    result.update(timed("now", a.runs, cold=a.cold))
    s = stages()
    result["stages"] = s
    print("stages: " + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.2f} s" for k, v in s.items() if k.endswith("_s")))
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "startup_cold.json" if a.cold else "startup.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
