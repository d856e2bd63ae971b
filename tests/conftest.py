"""Shared fixtures: one engine-agnostic suite, run against every selected database (see dbs.py)."""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if os.environ.get("JOBQ_TEST_SINGLE_FILE"):  # the generated single/jobq.py instead of the package
    sys.path.insert(0, str(ROOT / "single"))
sys.path.insert(0, str(ROOT / "tests"))

import jobq  # noqa: E402
from dbs import (  # noqa: E402
    NOT_TESTED,
    REQUIRED,
    TESTED,
    file_url,
    not_tested_reason,
    reachable,
    server_url,
    stop_containers,
    wipe,
)

try:  # Hypothesis profiles: deterministic in CI, heavier for soak runs (HYPOTHESIS_PROFILE=soak)
    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", derandomize=True, max_examples=300, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("dev", max_examples=300, deadline=None)
    settings.register_profile("soak", max_examples=20_000, deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
except ImportError:  # pragma: no cover - hypothesis is in the test extra
    pass


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "dialect" in metafunc.fixturenames:
        wanted = getattr(metafunc.function, "jobq_dialects", None)
        params = [d for d in TESTED if wanted is None or d in wanted] or [_NOT_SELECTED]
        metafunc.parametrize("dialect", params, ids=params, scope="session")


_NOT_SELECTED = "not-selected"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A test for a capability only some engines have is deselected, not skipped, in a run that
    # selected none of them: a skip would read as "a database was missing". Engines with no
    # server are not parametrized at all (dbs.TESTED); the run says so once per engine.
    drop = [i for i in items if getattr(getattr(i, "callspec", None), "params", {}).get("dialect") == _NOT_SELECTED]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [i for i in items if i not in drop]


def pytest_sessionstart(session: pytest.Session) -> None:
    # One clear error up front instead of every test of the engine failing the same way.
    missing = [d for d in TESTED if d in REQUIRED and not reachable(d)]
    if missing:
        raise pytest.UsageError("JOBQ_REQUIRE_DIALECTS requires "
                                + "; ".join(not_tested_reason(d) for d in missing))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    stop_containers()


_schema_ready: set[str] = set()


@pytest.fixture
def db_url(dialect: str, tmp_path: pathlib.Path) -> Iterator[str]:
    """A URL to an empty jobq schema on ``dialect`` (a fresh file for SQLite)."""
    url = file_url(dialect, str(tmp_path / "jobq.db"))
    if url:  # an embedded engine: a fresh file
        eng = sa.create_engine(url)
        jobq.create_schema(eng)
        eng.dispose()
        yield url
        return
    url = server_url(dialect)
    eng = sa.create_engine(url)
    if url not in _schema_ready:
        jobq.Base.metadata.drop_all(eng)
        jobq.create_schema(eng)
        _schema_ready.add(url)
    wipe(eng)
    eng.dispose()
    yield url


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    """An Engine on an empty jobq schema."""
    eng = sa.create_engine(db_url, pool_pre_ping=True)
    yield eng
    eng.dispose()


_durations: dict[str, float] = {}
_report: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    # Runs in the process that ran the test (an xdist worker): what the summary needs travels
    # to the controller in user_properties, which xdist serialises with the report.
    from helpers import REPORT

    outcome = yield
    report = outcome.get_result()
    params = getattr(item, "callspec", None)
    d = params.params.get("dialect") if params else None
    report.user_properties.append(("jobq-dialect", d if isinstance(d, str) else "no database"))
    while REPORT:
        report.user_properties.append(("jobq-report", REPORT.pop(0)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    props = dict(p for p in report.user_properties if p[0] == "jobq-dialect")
    key = props.get("jobq-dialect")
    if key is not None:
        _durations[key] = _durations.get(key, 0.0) + report.duration
    _report.extend(v for k, v in report.user_properties if k == "jobq-report")


def pytest_report_header(config: pytest.Config) -> list[str]:
    # Under xdist, each worker tests a server on its own <named database>_gwN (see dbs.py).
    return [f"jobq engines tested: {', '.join(TESTED) or 'none'}"]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _report:
        terminalreporter.write_sep("-", "measured")
        for line in _report:
            terminalreporter.write_line(line)
    if _durations:
        terminalreporter.write_sep("-", "time per dialect")
        for d, secs in sorted(_durations.items()):
            terminalreporter.write_line(f"{d:<12} {secs:7.1f}s")
    if NOT_TESTED:
        terminalreporter.write_sep("-", "engines not tested")
        for line in NOT_TESTED:
            terminalreporter.write_line(line, yellow=True)
