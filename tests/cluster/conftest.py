"""The cluster suite's fixtures: worker hosts (network namespaces) for the whole run, a fresh
PostgreSQL instance (or primary and standby) per test, and the summary line at the end.
The MariaDB backend (test_cluster_mariadb.py) has hosts of its own (``maria_hosts``: jqm-*,
instances under $TMPDIR/jobq-cluster-mariadb), so the two suites can run at the same time.

Everything is removed at the end, also after a failure or a run killed half-way (the next run
removes what an earlier one left: namespaces jqc-h*, bridge jqc-br0, instances under
$TMPDIR/jobq-cluster)."""

from __future__ import annotations

import pathlib
import subprocess
from collections.abc import Iterator

import pytest
from checker import TALLY
from infra import Hosts, preflight, remove_hosts, remove_instances, stop_workers


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TALLY.jobs:
        terminalreporter.write_sep("=", "cluster summary")
        for n in TALLY.notes:
            terminalreporter.write_line(n)
        terminalreporter.write_line(TALLY.line())


@pytest.fixture(scope="session")
def hosts() -> Iterator[Hosts]:
    preflight()
    remove_hosts()
    remove_instances()
    h = Hosts(TALLY.hosts)
    try:
        h.up()
        yield h
    finally:
        h.down()
        remove_instances()


@pytest.fixture(scope="session")
def maria_hosts() -> Iterator[Hosts]:
    import maria_infra  # only the MariaDB suite needs it

    maria_infra.preflight()
    remove_hosts(maria_infra.TAG)
    maria_infra.remove_instances()
    h = Hosts(TALLY.hosts, maria_infra.TAG, maria_infra.NET)
    try:
        h.up()
        yield h
    finally:
        h.down()
        maria_infra.remove_instances()


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    """Worker processes a test starts: killed at its end, whatever happened."""
    started: list[subprocess.Popen] = []
    yield started
    stop_workers(started)


@pytest.fixture
def logdir(tmp_path: pathlib.Path) -> pathlib.Path:
    d = tmp_path / "hist"
    d.mkdir()
    return d
