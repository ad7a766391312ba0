"""Server and router settings are checked before anything starts, each refused in one line naming
its flag; and a server stopped with SIGTERM exits within its grace, whatever a client has sent."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from kvserve.cli import main
from kvserve.config import OptionError
from kvserve.server.args import ServeOptions
from kvserve.server.router import RouterOptions, RoutingPolicy
from tests.conftest import STORIES_DIR
from tests.processes import healthy, running
from tests.server.conftest import free_port


@pytest.fixture
def nothing_starts(monkeypatch):
    """A command that gets past its checks fails the test at once, instead of loading a model or
    serving forever."""
    def started(*args, **kwargs):
        raise AssertionError("got past the settings' checks")
    monkeypatch.setattr("kvserve.engine.llm_engine.LLMEngine.from_options", started)
    monkeypatch.setattr("kvserve.server.app._GracefulServer", started)
    monkeypatch.setattr("kvserve.server.replicas.serve_replicas", started)


def refused(capsys, args: list[str]) -> str:
    code = main(args)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kvserve: error: "), (args, code, err)
    return lines[0]


def test_serve_settings_that_cannot_work_are_refused_before_the_model_loads(capsys, nothing_starts):
    for args, says in (
            (["--port", "70000"], "--port must be in 0-65535 (0: any free port), got 70000"),
            (["--port", "-1"], "--port must be in 0-65535 (0: any free port), got -1"),
            (["--max-body-bytes", "0"], "--max-body-bytes must be an integer >= 1, got 0"),
            (["--max-body-bytes", "-1"], "--max-body-bytes must be an integer >= 1, got -1"),
            (["--max-waiting", "-1"], "--max-waiting must be an integer >= 1, got -1"),
            (["--max-waiting", "0"], "--max-waiting must be an integer >= 1, got 0"),
            (["--shutdown-timeout", "-5"], "--shutdown-timeout must be a number of seconds >= 0, got -5.0"),
            (["--shutdown-timeout", "nan"], "--shutdown-timeout must be a number of seconds >= 0, got nan"),
            (["--log-stats-interval", "-1"], "--log-stats-interval must be a number of seconds >= 0, got -1.0"),
            (["--data-parallel-size", "0"], "--data-parallel-size must be an integer >= 1, got 0"),
            # an engine option too, refused here rather than in each replica
            (["-dp", "2", "--num-blocks", "0"], "--num-blocks must be an integer >= 1, got 0")):
        line = refused(capsys, ["serve", "--model", str(STORIES_DIR), *args])
        assert line == f"kvserve: error: {says}", args


def test_router_settings_that_cannot_work_are_refused_before_it_starts(capsys, nothing_starts):
    for args, says in (
            (["--port", "70000"], "--port must be in 0-65535"),
            (["--max-body-bytes", "0"], "--max-body-bytes must be an integer >= 1, got 0"),
            (["--shutdown-timeout", "-1"], "--shutdown-timeout must be a number of seconds >= 0"),
            (["--overlap-weight", "-1"], "--overlap-weight must be a number >= 0, got -1.0"),
            (["--overlap-weight", "inf"], "--overlap-weight must be a number >= 0, got inf")):
        line = refused(capsys, ["router", "--replica", "http://127.0.0.1:9", *args])
        assert line.startswith(f"kvserve: error: {says}"), args
    for url in ("localhost:8000", "ftp://a", "http://a:99999"):
        line = refused(capsys, ["router", "--replica", "http://127.0.0.1:9", "--replica", url])
        assert line == f"kvserve: error: --replica must be a server's URL, as http://HOST:PORT, got {url!r}"


def test_the_options_dataclasses_check_what_they_are_given():
    """As the command line, so whoever builds them in Python (serve -dp builds its replicas')."""
    assert ServeOptions(port=0).port == 0  # any free port
    with pytest.raises(OptionError, match=r"port must be in 0-65535") as e:
        ServeOptions(port=65536)
    assert e.value.option == "port" and e.value.as_flag.startswith("--port ")
    with pytest.raises(OptionError, match="tool_call_parser must be one of auto, hermes, llama3_json"):
        ServeOptions(tool_call_parser="xml")
    with pytest.raises(OptionError, match="port"):
        RouterOptions(port=True)
    with pytest.raises(OptionError, match="overlap_weight"):
        RoutingPolicy(overlap_weight=float("nan"))


# ---- shutdown ----
GRACE_S = 1.0
MARGIN_S = 2.0  # start-up of the shutdown, the interpreter's exit, a loaded 2-core machine
LONG_PROMPT = "Once upon a time there was a cat. " * 100_000  # 3.4 MB: about 10 s of tokenizing on one core


def test_sigterm_exits_within_the_grace_while_a_prompt_is_still_tokenizing():
    """The engine has no request (the prompt has not reached it), so nothing should hold the
    process past its grace. Before, the prompt's tokenizing thread was one of asyncio's default
    executor, which the event loop's close waits for: a 1 MB prompt (within the default
    --max-body-bytes) kept `--shutdown-timeout 1` alive 3.4-4 s, this one 10 s."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    exe = os.path.join(os.path.dirname(sys.executable), "kvserve")
    command = [exe, "serve", "--model", str(STORIES_DIR), "--port", str(port), "--shutdown-timeout", str(GRACE_S),
               "--max-body-bytes", str(4 << 20)]
    with running(command, ready=healthy(url), timeout_s=120) as server:
        body = json.dumps({"prompt": LONG_PROMPT, "max_tokens": 1}).encode()
        with contextlib.closing(socket.create_connection(("127.0.0.1", port))) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            time.sleep(1.0)  # read, parsed, and being tokenized
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            try:
                code = server.proc.wait(GRACE_S + MARGIN_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running {GRACE_S + MARGIN_S:.0f} s after SIGTERM with "
                            f"--shutdown-timeout {GRACE_S}")
            exited_after = time.monotonic() - t0
    assert code == 0 and exited_after < GRACE_S + MARGIN_S
