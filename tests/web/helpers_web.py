"""Run `jobq serve` as a real process for the dashboard tests."""

from __future__ import annotations

import contextlib
import pathlib
import signal
import subprocess
from collections.abc import Iterator

from helpers import JOBQ_CLI

ROOT = pathlib.Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def running_server(url: str, *argv: str, log: list[str] | None = None) -> Iterator[tuple[str, str]]:
    """`python jobq.py --url URL serve ARGV`: yields (its base URL, what it printed before
    listening), then stops it with SIGINT (as Ctrl-C) and checks it exited cleanly; ``log``, if
    given, receives the lines it wrote to stderr after listening (its request log)."""
    proc = subprocess.Popen([*JOBQ_CLI, "--url", url, "serve", *argv],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the server prints its URL once it listens; a crash ends the loop
            lines.append(line)
            if line.startswith("jobq dashboard on "):
                break
        else:
            raise AssertionError("jobq serve exited before listening: " + "".join(lines))
        base = lines[-1].split()[3]
        yield base, "".join(lines)
    finally:
        proc.send_signal(signal.SIGINT)
        try:  # read what it writes while it stops: a full pipe would block it
            rest = proc.communicate(timeout=30)[1] or ""
            code = proc.returncode
            if log is not None:
                log.extend(rest.splitlines())
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        finally:
            if proc.stderr is not None:
                proc.stderr.close()
    assert code in (0, 130), (code, "".join(lines))
