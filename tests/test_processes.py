"""The tests' process helper: a start that fails says why at once, and a process is stopped with
the children it started, whatever the test did."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.processes import ProcessError, Running, is_running, run, running, stop_group

# a parent that starts a child (in its process group, as a router starts its replicas), says both
# PIDs, and waits; with "ignore", both ignore SIGTERM (an ignored signal stays ignored across exec)
PARENT = """
import os, signal, subprocess, sys, time
if sys.argv[1:] == ["ignore"]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(f"parent {os.getpid()} child {child.pid}", flush=True)
time.sleep(300)
"""


def pids_said(process: Running) -> tuple[int, int]:
    words = process.output().split()
    return int(words[1]), int(words[3])


def has_said_pids(process: Running):
    return lambda: "child" in process.output()


def test_a_process_that_exits_during_start_up_fails_at_once_with_its_output():
    cmd = [sys.executable, "-c", "import sys; print('loading the model'); sys.exit('no model at /no/such')"]
    t0 = time.monotonic()
    with pytest.raises(ProcessError) as failure:
        with running(cmd, ready=lambda: False, timeout_s=120):
            pytest.fail("never ready, so never entered")
    assert time.monotonic() - t0 < 30  # noticed when it exited, not at the deadline
    message = str(failure.value)
    assert "exited with code 1 during start-up" in message
    assert "loading the model" in message and "no model at /no/such" in message  # stdout and stderr


def test_a_process_never_ready_fails_at_the_deadline_with_its_output_and_is_stopped():
    process = Running([sys.executable, "-c", PARENT])
    try:
        process.wait_ready(has_said_pids(process), 60)
        with pytest.raises(ProcessError, match="was not ready within 1 s") as failure:
            process.wait_ready(lambda: False, 1)
        parent, child = (int(w) for w in str(failure.value).split()[-3::2])  # its output ends the message
    finally:
        process.stop()
    assert not is_running(parent) and not is_running(child)


def test_the_child_is_stopped_with_the_process_when_the_body_raises():
    with pytest.raises(RuntimeError, match="the test failed") as failure:
        with running([sys.executable, "-c", PARENT], ready=None) as process:
            process.wait_ready(has_said_pids(process), 60)
            parent, child = pids_said(process)
            assert is_running(parent) and is_running(child)
            raise RuntimeError("the test failed")
    assert not is_running(parent) and not is_running(child)
    assert any(f"parent {parent} child {child}" in note for note in failure.value.__notes__)  # its output
    assert process.output().startswith(f"parent {parent}")  # still readable once stopped


def test_sigterm_ignored_is_followed_by_sigkill_for_the_whole_group():
    process = Running([sys.executable, "-c", PARENT, "ignore"])
    try:
        process.wait_ready(has_said_pids(process), 60)
        parent, child = pids_said(process)
        t0 = time.monotonic()
        stop_group(process.proc, grace_s=0.5)
        assert 0.5 <= time.monotonic() - t0 < 10
        assert process.proc.returncode == -signal.SIGKILL
        assert not is_running(child)
    finally:
        process.stop()


# a test process that starts a server (PARENT) with the helper and then waits
TEST_PROCESS = """
import sys, time
from tests.processes import running
with running([sys.executable, "-c", sys.argv[1]]) as server:
    while "child" not in server.output():
        time.sleep(0.05)
    print(server.output(), flush=True)
    time.sleep(300)
"""


def test_a_test_process_killed_by_sigterm_stops_its_servers_first():
    """SIGTERM runs no finally block, and the server's group is not the test process's (so
    `timeout`'s signal to that group misses it): the helper's handler stops it, then the test
    process dies of the signal all the same."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with running([sys.executable, "-c", TEST_PROCESS, PARENT], env=env) as tester:
        tester.wait_ready(has_said_pids(tester), 60)
        parent, child = pids_said(tester)
        os.kill(tester.pid, signal.SIGTERM)
        assert tester.proc.wait(30) == -signal.SIGTERM
        assert not is_running(parent) and not is_running(child)


def test_run_reports_a_failure_with_its_stderr_and_stops_what_ran_past_its_time():
    with pytest.raises(ProcessError, match="exited with code 2; the last lines of its output:\nbad flag"):
        run([sys.executable, "-c", "import sys; print('bad flag', file=sys.stderr); sys.exit(2)"], check=True)
    done = run([sys.executable, "-c", "print('out')"], check=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, "out\n", "")
    t0 = time.monotonic()
    with pytest.raises(ProcessError, match="ran past 1 s") as failure:
        run([sys.executable, "-c", PARENT], timeout_s=1)
    assert time.monotonic() - t0 < 15
    parent, child = (int(w) for w in str(failure.value).split()[-3::2])
    assert not is_running(parent) and not is_running(child)


def test_is_running_counts_an_exited_process_as_gone():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)  # exited, not yet reaped: a zombie, which os.kill(pid, 0) still finds
    assert not is_running(proc.pid)
    proc.wait()
    assert not is_running(proc.pid)
    assert is_running(1)
