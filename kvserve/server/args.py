"""Options of `kvserve serve`: the command line's arguments and the typed options they become.

The engine's own options (kvserve.engine.args) are the server's too; a server sets two of them
other than a library engine does (SERVE_ENGINE_DEFAULTS)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Optional

from kvserve.config import OptionError, check_at_least, check_seconds

LOG_LEVELS = ("debug", "info", "warning", "error")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")
MAX_PORT = 65535  # 0: any free port, as the OS picks
# Engine options a server sets otherwise: a library engine queues without bound and logs no
# stats; a server answers 503 past 256 waiting requests and logs stats every 10 s.
SERVE_ENGINE_DEFAULTS: dict[str, Any] = {"max_waiting": 256, "log_stats_interval_s": 10.0}


@dataclass(frozen=True)
class ServeOptions:
    """Validated on construction, so `kvserve serve` refuses a setting before the model loads.
    OptionError names the option as the command line spells it (port: --port)."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: Optional[str] = None
    api_key: Optional[str] = None
    max_body_bytes: int = 1 << 20
    shutdown_timeout: float = 30.0
    tool_call_parser: str = "auto"
    data_parallel_size: int = 1
    log_level: str = "info"

    def __post_init__(self) -> None:
        check_port(self.port)
        check_at_least("max_body_bytes", self.max_body_bytes, 1)
        check_seconds("shutdown_timeout", self.shutdown_timeout)
        check_at_least("data_parallel_size", self.data_parallel_size, 1)
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise OptionError("tool_call_parser", f"must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                                                  f"got {self.tool_call_parser!r}")
        if self.log_level not in LOG_LEVELS:
            raise OptionError("log_level", f"must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")


def check_port(port: object) -> None:
    """A TCP port a server can bind (the router's too)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= MAX_PORT:
        raise OptionError("port", f"must be in 0-{MAX_PORT} (0: any free port), got {port!r}")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The server's own flags; the engine's come from add_engine_args, two defaulting otherwise."""
    p.set_defaults(**SERVE_ENGINE_DEFAULTS)
    d = ServeOptions()
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host, help="bind address (loopback by default)")
    g.add_argument("--port", type=int, default=d.port)
    g.add_argument("--served-model-name", default=None, help="name clients use (default: the model's)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' "
                   "(or set KVSERVE_API_KEY)")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="seconds in-flight requests get to finish on SIGTERM")
    g.add_argument("--log-level", choices=LOG_LEVELS, default=d.log_level,
                   help="info (default) also says where start-up went: reading weights, building the "
                        "model and its kernels, allocating the cache")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=d.data_parallel_size,
                   help="N engine replicas (each its own process and cache) behind one cache-aware router")
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=d.tool_call_parser,
                   help="how tool calls are read from the model's text (auto: by its chat template; "
                   "hermes <tool_call> tags where the template has no tools of its own)")
