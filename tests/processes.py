"""Processes a test starts, stopped with everything they started however the test ends.

`running(cmd, ready=...)` starts a command as the leader of a session of its own, its output
going to a file; waits for `ready()` while watching the process, so one that exits during
start-up fails at once; and on leaving stops the whole process group: SIGTERM, then SIGKILL
after a bounded wait. A router's replica servers, a tensor-parallel engine's workers and
multiprocessing's helpers are in that group, so they go with it. A start that fails says why:
the message ends with the last lines the process wrote.

`run(cmd)` is `subprocess.run` for a command that should finish by itself, with the same
guarantee when it does not (a timeout, or the test interrupted).

In a group of its own, a server is out of reach of a signal to pytest's group (a terminal's
Ctrl-C, `timeout`'s SIGTERM). Ctrl-C unwinds pytest, so the finally blocks stop it; a SIGTERM
runs none, so the first start sets a handler that stops the live groups, and pytest then dies
of the signal as before.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import shlex
import signal
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

TAIL_LINES = 40
STOP_GRACE_S = 10.0  # a SIGTERM's time to finish a graceful shutdown before SIGKILL
KILL_WAIT_S = 5.0  # a SIGKILLed process's time to be reaped
POLL_S = 0.1

Ready = Callable[[], bool]

_live_groups: dict[int, subprocess.Popen[Any]] = {}  # leader pid -> leader, until stopped
_live_logs: set[Path] = set()  # Running's output files, until stopped
_handler_pid: Optional[int] = None  # the process that set the SIGTERM handler (a fork inherits it)


class ProcessError(RuntimeError):
    """A process that exited during start-up, was not ready in time, or failed; the message
    ends with its own output."""


def is_running(pid: int) -> bool:
    """Whether pid is a process that has not exited. A zombie has exited: where PID 1 does not
    reap orphans (some containers), a killed child stays one, and `os.kill(pid, 0)` still
    succeeds on it."""
    try:
        return _stat(pid)[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: ask the kernel, zombies included
        return _signal(pid, 0, os.kill)


def group_members(pgid: int) -> list[int]:
    """The processes of group pgid that have not exited (from /proc; without it, [pgid] while
    anything in the group, zombies included, is there)."""
    if not os.path.exists("/proc/self/stat"):
        return [pgid] if _signal(pgid, 0, os.killpg) else []
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            state, _, group = _stat(int(name))[:3]
        except OSError:  # it exited while we looked
            continue
        if state != "Z" and int(group) == pgid:
            members.append(int(name))
    return members


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the parenthesised name: state, ppid, pgrp, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def stop_group(proc: subprocess.Popen[Any], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to proc's process group (proc leads it: start_new_session=True); once all of it has
    exited or grace_s has passed, SIGKILL to whatever is left, and a bounded wait for that."""
    stop_groups([proc], grace_s)


def stop_groups(leaders: Sequence[subprocess.Popen[Any]], grace_s: float = STOP_GRACE_S) -> None:
    """stop_group for several groups at once, the grace shared."""
    for proc in leaders:
        _signal(proc.pid, signal.SIGTERM, os.killpg)
    deadline = time.monotonic() + grace_s
    for proc in leaders:
        _wait_group(proc, deadline - time.monotonic())
    for proc in leaders:
        _signal(proc.pid, signal.SIGKILL, os.killpg)  # children the leader left behind, or the leader
    deadline = time.monotonic() + KILL_WAIT_S
    for proc in leaders:
        _wait_group(proc, deadline - time.monotonic())  # past it, stuck in the kernel: nothing to do
        _live_groups.pop(proc.pid, None)


def _start_group(cmd: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
    """Popen as the leader of a new session, remembered until stop_groups."""
    _stop_live_groups_on_sigterm()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True, **popen)
    _live_groups[proc.pid] = proc
    return proc


def _stop_live_groups_on_sigterm() -> None:
    """Once, where SIGTERM would simply end this process: stop the live groups first (and at a
    normal exit, any a test left)."""
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set a handler
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # installed already, or someone else's
    global _handler_pid
    _handler_pid = os.getpid()
    signal.signal(signal.SIGTERM, _on_sigterm)
    atexit.register(_stop_live_groups)


def _stop_live_groups(grace_s: float = STOP_GRACE_S) -> None:
    if os.getpid() != _handler_pid:  # a forked child: the groups are its parent's
        return
    stop_groups(list(_live_groups.values()), grace_s)
    for path in list(_live_logs):
        path.unlink(missing_ok=True)


def _on_sigterm(signum: int, frame: Any) -> None:
    _stop_live_groups(KILL_WAIT_S)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)  # die of it, as without this handler


def _wait_group(proc: subprocess.Popen[Any], timeout_s: float) -> None:
    """Until proc is reaped and nothing else of its group is running, or timeout_s."""
    deadline = time.monotonic() + timeout_s
    while (proc.poll() is None or group_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(POLL_S / 2)


def _signal(target: int, sig: int, send: Callable[[int, int], None]) -> bool:
    """Send sig with os.kill or os.killpg; False if there was nothing to send it to."""
    try:
        send(target, sig)
    except ProcessLookupError:
        return False
    return True


def stop_children(children: Sequence[multiprocessing.process.BaseProcess],
                  grace_s: float = STOP_GRACE_S) -> None:
    """Terminate, then kill, multiprocessing children (started from this process, so in pytest's
    own process group: they cannot be stopped by group)."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
            child.join(KILL_WAIT_S)


def tail(text: str, num_lines: int = TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-num_lines:])


def describe(cmd: Sequence[str], what: str, output: str) -> str:
    """`<command> <what>; the last lines of its output:` and those lines."""
    shown = shlex.join(cmd)
    shown = shown if len(shown) <= 200 else shown[:200] + " ..."
    lines = tail(output)
    return f"{shown} {what}; " + (f"the last lines of its output:\n{lines}" if lines else "it wrote nothing")


class Running:
    """A started process, leading its own process group, with its stdout and stderr in a file."""

    def __init__(self, cmd: Sequence[str], env: Optional[dict[str, str]] = None) -> None:
        self.cmd = [str(c) for c in cmd]
        fd, name = tempfile.mkstemp(prefix="kvserve-test-", suffix=".log")
        self._log_path: Optional[Path] = Path(name)
        self._final_output = ""
        _live_logs.add(self._log_path)
        try:
            self.proc = _start_group(self.cmd, stdout=fd, stderr=subprocess.STDOUT, env=env)
        except BaseException:
            self._log_path.unlink()
            _live_logs.discard(self._log_path)
            raise
        finally:
            os.close(fd)  # the child holds its own copy

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        """Everything it has written so far (after stop(), everything it wrote)."""
        if self._log_path is None:
            return self._final_output
        return self._log_path.read_text(errors="replace")

    def describe(self, what: str) -> str:
        return describe(self.cmd, what, self.output())

    def check_alive(self) -> None:
        """Raise, with its output, if it has exited (for use while it should be starting)."""
        code = self.proc.poll()
        if code is not None:
            raise ProcessError(self.describe(f"exited with code {code} during start-up"))

    def wait_ready(self, ready: Ready, timeout_s: float) -> None:
        wait_ready([(self, ready)], timeout_s)

    def stop(self) -> None:
        """Stop it and everything in its group (idempotent); its output stays readable."""
        stop_group(self.proc)
        if self._log_path is not None:
            self._final_output = self.output()
            self._log_path.unlink(missing_ok=True)
            _live_logs.discard(self._log_path)
            self._log_path = None


def wait_ready(checks: Sequence[tuple[Running, Ready]], timeout_s: float) -> None:
    """Until every check has passed. Each round polls every process first, so one that exits
    fails at once, not at the deadline; one not ready at the deadline fails then. Either way
    the message ends with that process's own output."""
    deadline = time.monotonic() + timeout_s
    pending = list(checks)
    while pending:
        for process, _ in checks:
            process.check_alive()
        process, ready = pending[0]
        if ready():
            pending.pop(0)
        elif time.monotonic() > deadline:
            raise ProcessError(process.describe(f"was not ready within {timeout_s:.0f} s"))
        else:
            time.sleep(POLL_S)


def healthy(url: str) -> Ready:
    """A readiness check: `url`/health answers 200."""
    import httpx

    def check() -> bool:
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False
    return check


@contextmanager
def running(cmd: Sequence[str], ready: Optional[Ready] = None, timeout_s: float = 120.0,
            env: Optional[dict[str, str]] = None) -> Iterator[Running]:
    """The process, started and (given `ready`) ready; stopped with its group on leaving, however
    the block ends. An error in the block gets the process's last lines as a note."""
    process = Running(cmd, env)
    try:
        if ready is not None:
            process.wait_ready(ready, timeout_s)
        yield process
    except Exception as e:
        if not isinstance(e, ProcessError):
            code = process.proc.poll()
            e.add_note(process.describe("was running" if code is None else f"had exited with code {code}"))
        raise
    finally:
        process.stop()


def run(cmd: Sequence[str], timeout_s: float = 600.0, check: bool = False,
        env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(cmd, capture_output=True, text=True)` in a session of its own. Past
    timeout_s, or when the test is interrupted, its whole group is stopped and (on a timeout)
    the error ends with its output. With check, a non-zero exit fails with the end of its
    stderr. What it leaves running when it exits by itself (`ray start` starts daemons) is its
    own business."""
    cmd = [str(c) for c in cmd]
    proc = _start_group(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        out, err = _remaining_output(proc)
        raise ProcessError(describe(cmd, f"ran past {timeout_s:.0f} s", err + out)) from None
    except BaseException:
        stop_group(proc)
        raise
    _live_groups.pop(proc.pid, None)  # it exited by itself: what it left running is meant to be
    if check and proc.returncode != 0:
        raise ProcessError(describe(cmd, f"exited with code {proc.returncode}", err or out))
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _remaining_output(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """What a stopped process had written; nothing if a process outside its group (one that
    left it with setsid) still holds the pipes."""
    try:
        out, err = proc.communicate(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        return "", ""
    return out or "", err or ""
