"""`kvserve serve --data-parallel-size N`: N replica servers, each its own process with its own
engine and cache on a loopback port, behind the cache-aware router on the given address.

On SIGTERM (or SIGINT) the router starts its graceful shutdown and the replicas get SIGTERM at
the same moment, so both wind down within one `--shutdown-timeout` (a replica ends its streams
just before the grace ends, and the router relays their last events); a replica still running
half a second past the grace is killed. A SIGTERM during start-up stops the replicas started."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import signal
import threading
import time
from typing import Any, Optional, Sequence

from kvserve.server.args import ServeOptions
from kvserve.server.router import RouterOptions, load_tokenizer, run_router, wait_healthy

logger = logging.getLogger("kvserve")
START_TIMEOUT_S = 300.0
STOP_SLACK_S = 0.5  # past the grace (its requests ended), a replica's time to exit before SIGKILL
KILL_WAIT_S = 5.0


def _replica_main(model: str, engine_options: dict[str, Any], options: ServeOptions) -> None:
    from kvserve.server.app import serve
    serve(model, engine_options, options)


class _ReplicaProcesses:
    """The replicas' processes, stopped within one grace: `terminate` (SIGTERM) when the
    router's shutdown begins, `stop` when it has ended (SIGKILL to any left past the grace)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.procs: list[Any] = []
        self.deadline: Optional[float] = None

    def start(self, model: str, engine_options: dict[str, Any], options: Sequence[ServeOptions]) -> None:
        ctx = mp.get_context("spawn")
        for i, child in enumerate(options):
            proc = ctx.Process(target=_replica_main, args=(model, engine_options, child), name=f"kvserve-replica{i}")
            proc.start()
            self.procs.append(proc)

    def terminate(self) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + self.grace_s + STOP_SLACK_S
            for proc in self.procs:
                proc.terminate()

    def stop(self) -> None:
        self.terminate()
        assert self.deadline is not None
        for proc in self.procs:
            proc.join(max(0.0, self.deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                logger.warning("replica %s did not exit within the grace; killing it", proc.name)
                proc.kill()
                proc.join(KILL_WAIT_S)


def serve_replicas(model: str, engine_options: dict[str, Any], options: ServeOptions) -> int:
    from kvserve.config import env_api_key
    from kvserve.distributed.workers import free_port
    api_key = options.api_key or env_api_key()
    ports = [free_port() for _ in range(options.data_parallel_size)]
    children = [dataclasses.replace(options, host="127.0.0.1", port=p, data_parallel_size=1, api_key=api_key)
                for p in ports]
    replicas = _ReplicaProcesses(options.shutdown_timeout)
    in_main_thread = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = signal.signal(signal.SIGTERM, _exit_on_signal) if in_main_thread else None  # until uvicorn's
    try:
        replicas.start(model, engine_options, children)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        wait_healthy(urls, START_TIMEOUT_S, replicas.procs)
        router = RouterOptions(options.host, options.port, api_key, options.max_body_bytes, options.shutdown_timeout)
        tokenizer = load_tokenizer(model, engine_options.get("tokenizer"))  # requests are routed on tokens
        return run_router(urls, router, on_shutdown=replicas.terminate, tokenizer=tokenizer)
    finally:
        replicas.stop()
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)


def _exit_on_signal(signum: int, _: Any) -> None:
    raise SystemExit(128 + signum)
