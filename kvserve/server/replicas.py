"""`kvserve serve --data-parallel-size N`: N replica servers, each its own process with its own
engine and cache on a loopback port, behind the cache-aware router on the given address."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
from typing import Any

from kvserve.server.args import ServeOptions
from kvserve.server.router import RoutingPolicy, run_router, wait_healthy

logger = logging.getLogger("kvserve")
START_TIMEOUT_S = 300.0


def _replica_main(model: str, engine_options: dict[str, Any], options: ServeOptions) -> None:
    from kvserve.server.app import serve
    serve(model, engine_options, options)


def serve_replicas(model: str, engine_options: dict[str, Any], options: ServeOptions) -> int:
    from kvserve.distributed.workers import free_port
    from kvserve.config import env_api_key
    ctx = mp.get_context("spawn")
    api_key = options.api_key or env_api_key()
    procs, urls = [], []
    for i in range(options.data_parallel_size):
        port = free_port()
        child = dataclasses.replace(options, host="127.0.0.1", port=port, data_parallel_size=1, api_key=api_key)
        proc = ctx.Process(target=_replica_main, args=(model, engine_options, child), name=f"kvserve-replica{i}")
        proc.start()
        procs.append(proc)
        urls.append(f"http://127.0.0.1:{port}")
    try:
        wait_healthy(urls, START_TIMEOUT_S, procs)
        return run_router(urls, options.host, options.port, api_key, RoutingPolicy())
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join(options.shutdown_timeout + 5)
            if proc.is_alive():
                proc.kill()
