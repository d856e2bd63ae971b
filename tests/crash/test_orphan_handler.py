"""SIGKILL a worker while its handler runs in a process of its own (executor="process"), as the
OOM killer would: the handler's process must end with it.

Correct: once the worker is dead, its handler process is gone too (the kernel's parent-death
signal on Linux, and everywhere a lifeline pipe whose write end only the worker held), for the
fork, spawn and forkserver start methods. A bug shows the handler process still running after
its worker died: unfenced, without its timeout, and, once the lease expires, alongside the
rerun of its own job (two handlers of one job under a cap of 1). The broken variant starts
handler processes without the watch (the worker entry point's --no-death-watch), and the same
check must catch the orphan.
"""

from __future__ import annotations

import os
import pathlib
import signal

import pytest
import sqlalchemy as sa

import jobq
from helpers import wait_for
from procs import SUMMARY, start, wait_file

START_METHODS = ["fork", "spawn", "forkserver"]
#: How long a dead worker's handler process may take to notice: a bound for a loaded machine,
#: not a measurement (the correct watch ends it within milliseconds).
GONE_WITHIN = 5.0


def _alive(pid: int) -> bool:
    # A zombie has ended (it waits for a parent, here the host's reaper, to collect it).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _orphan_check(engine: sa.Engine, db_url: str, tmp_path: pathlib.Path, method: str, *broken: str) -> int:
    """Start a worker whose handler runs forever in its own process, SIGKILL the worker, and
    assert that the handler's process is gone within GONE_WITHIN. Returns the handler's pid."""
    jid = jobq.enqueue(engine, "forever", {"logdir": str(tmp_path)}, max_attempts=5)
    p = start(db_url, tmp_path, "--executor", "process", "--start-method", method, "--concurrency", "1",
              "--ttl", "30", *broken)
    marker = tmp_path / f"handler-{jid}-1"
    child = 0
    try:
        wait_file(marker, timeout=60)
        child = int(marker.read_text())
        assert child != p.pid and _alive(child), "the handler should run in a process of its own"
        p.send_signal(signal.SIGKILL)
        assert p.wait(30) == -signal.SIGKILL, (tmp_path / "stderr.log").read_text()[-2000:]
        wait_for(lambda: not _alive(child), timeout=GONE_WITHIN, interval=0.01,
                 what=f"the handler process {child} to end with its SIGKILLed worker ({method})")
        return child
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)  # the orphan of a failing run: never left behind


@pytest.mark.parametrize("method", START_METHODS)
def test_a_handler_process_ends_with_its_sigkilled_worker(
        engine: sa.Engine, db_url: str, tmp_path: pathlib.Path, method: str) -> None:
    """Correct: the handler's process is gone soon after its worker is SIGKILLed. A bug: it
    keeps running (the check times out)."""
    _orphan_check(engine, db_url, tmp_path, method)
    SUMMARY.append(f"{engine.dialect.name:<10} SIGKILLed worker ({method}): its handler process ended with it")


@pytest.mark.parametrize("method", START_METHODS)
def test_the_orphan_check_catches_a_handler_process_without_a_death_watch(
        engine: sa.Engine, db_url: str, tmp_path: pathlib.Path, method: str) -> None:
    """The broken variant: handler processes started without jobq's watch on their worker
    outlive it, and the check above must say so."""
    with pytest.raises(AssertionError, match="to end with its SIGKILLed worker"):
        _orphan_check(engine, db_url, tmp_path, method, "--no-death-watch")
    SUMMARY.append(f"{engine.dialect.name:<10} SIGKILLed worker ({method}), no death watch: orphan caught")
