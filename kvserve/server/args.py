"""Arguments of `kvserve serve`."""

from __future__ import annotations

import argparse


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None, help="name clients use (default: the model's)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' "
                   "(or set KVSERVE_API_KEY)")
    g.add_argument("--max-waiting", type=int, default=256, help="queue bound; beyond it, 503")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20)
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM")
    g.add_argument("--log-stats-interval", type=float, default=10.0)
