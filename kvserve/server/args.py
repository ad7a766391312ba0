"""Options of `kvserve serve`: the command line's arguments and the typed options they become."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional


LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: Optional[str] = None
    api_key: Optional[str] = None
    max_waiting: int = 256
    max_body_bytes: int = 1 << 20
    shutdown_timeout: float = 30.0
    log_stats_interval: float = 10.0
    tool_call_parser: str = "auto"
    data_parallel_size: int = 1
    log_level: str = "info"


def add_serve_args(p: argparse.ArgumentParser) -> None:
    d = ServeOptions()
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host, help="bind address (loopback by default)")
    g.add_argument("--port", type=int, default=d.port)
    g.add_argument("--served-model-name", default=None, help="name clients use (default: the model's)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' "
                   "(or set KVSERVE_API_KEY)")
    g.add_argument("--max-waiting", type=int, default=d.max_waiting, help="queue bound; beyond it, 503")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="seconds in-flight requests get to finish on SIGTERM")
    g.add_argument("--log-stats-interval", type=float, default=d.log_stats_interval)
    g.add_argument("--log-level", choices=LOG_LEVELS, default=d.log_level,
                   help="info (default) also says where start-up went: reading weights, building the "
                        "model and its kernels, allocating the cache")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=d.data_parallel_size,
                   help="N engine replicas (each its own process and cache) behind one cache-aware router")
    g.add_argument("--tool-call-parser", choices=["auto", "hermes", "llama3_json"], default=d.tool_call_parser,
                   help="how tool calls are read from the model's text (auto: by its chat template; "
                   "hermes <tool_call> tags where the template has no tools of its own)")
