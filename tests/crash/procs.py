"""Start, watch and kill worker processes; read back their logs."""

from __future__ import annotations

import collections
import pathlib
import subprocess
import sys

from helpers import wait_for

HERE = pathlib.Path(__file__).resolve().parent

#: Lines for the crash summary printed at the end of the run (tests/crash/conftest.py).
SUMMARY: list[str] = []


def start(url: str, logdir: pathlib.Path, *args: str) -> subprocess.Popen:
    with open(logdir / "stderr.log", "a") as err:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, str(HERE / "worker_main.py"), url, str(logdir), *args],
                                stdout=subprocess.DEVNULL, stderr=err)


def lines(logdir: pathlib.Path, prefix: str) -> list[str]:
    out: list[str] = []
    for f in sorted(logdir.glob(f"{prefix}-*.log")):
        out += f.read_text().splitlines()
    return out


def executions(logdir: pathlib.Path) -> collections.Counter[int]:
    return collections.Counter(int(line.split()[0]) for line in lines(logdir, "exec"))


def finalized(logdir: pathlib.Path) -> collections.Counter[int]:
    return collections.Counter(int(line) for line in lines(logdir, "final"))


def events(logdir: pathlib.Path) -> list[tuple[str, int]]:
    return [(a, int(j)) for a, j in (line.split() for line in lines(logdir, "events"))]


def wait_file(path: pathlib.Path, timeout: float = 20.0) -> None:
    """Wait for a marker file a worker process creates (e.g. started-JOB-ATTEMPT)."""
    wait_for(path.exists, timeout=timeout, interval=0.01, what=path.name)
