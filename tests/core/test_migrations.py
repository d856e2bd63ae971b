"""The numbered upgrade steps (jobq._MIGRATIONS): each runs once, when the recorded schema
version is below its number, and a database at the current version runs none of them, so a
start inspects nothing beyond the tables create_all checks for."""

from __future__ import annotations

import collections
import contextlib
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
from dbs import needs
from helpers import META, counted, meeting, recorded_version, schema_version

THREADS = 4

#: What only an upgrade step reads or writes: the indexes, columns, keys or DDL of a table
#: (create_all's check for a missing table is one row of pg_class, a PRAGMA table_info or a
#: DESCRIBE per table).
_STEP_SQL = re.compile(
    r"index_list|index_info|index_xinfo|foreign_key_list|sqlite_master|pg_index|pg_opclass|pg_am\b|pg_attribute"
    r"|pg_constraint|SHOW CREATE|information_schema|\bALTER TABLE jobs (ADD|DROP)|\bCREATE INDEX|\bDROP INDEX",
    re.I,
)


def _spied(monkeypatch: pytest.MonkeyPatch, arrive: Any = None) -> collections.Counter[int]:
    """Wrap every step of _MIGRATIONS to count its runs by number (``arrive``, if given, is
    called on entry to the first step)."""
    runs: collections.Counter[int] = collections.Counter()
    lock = threading.Lock()

    def spy(version: int, step: Any) -> Any:
        def run(conn: sa.Connection, d: Any) -> None:
            with lock:
                runs[version] += 1
            if arrive is not None and version == jobq._MIGRATIONS[0][0]:
                arrive()
            step(conn, d)
        return run

    monkeypatch.setattr(jobq, "_MIGRATIONS", tuple((v, spy(v, s), what) for v, s, what in jobq._MIGRATIONS))
    return runs


def _start_statements(engine: sa.Engine) -> list[str]:
    with counted(engine) as seen:
        jobq.create_schema(engine)
    return seen


def _version(engine: sa.Engine) -> str:
    version = schema_version(engine)
    assert version is not None
    return version


def test_the_steps_are_numbered_up_to_the_schema_version() -> None:
    numbers = [v for v, _step, _what in jobq._MIGRATIONS]
    assert numbers == list(range(2, jobq.SCHEMA_VERSION + 1))


def test_a_current_database_runs_no_step_and_reads_no_index_or_column(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a database at SCHEMA_VERSION, create_schema runs no step and sends nothing a step
    sends: only the guard, create_all's one check per table, the jobq_meta read (and on
    PostgreSQL the storage settings). The bug: an upgrade inspected on every start (index
    lists, column lists, foreign keys, the SQLite table's DDL), as the due index, the
    re-keyed indexes and the parent key were."""
    jobq.create_schema(engine)
    runs = _spied(monkeypatch)
    seen = _start_statements(engine)
    assert not runs, runs
    assert [s for s in seen if _STEP_SQL.search(s)] == [], seen
    assert len(seen) <= len(jobq.Base.metadata.tables) + 4, seen
    assert _version(engine) == str(jobq.SCHEMA_VERSION)


def test_broken_a_step_inspected_on_every_start_is_seen(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """BROKEN variant: the due index checked on every start (as it was, without a number of
    its own). The statements of a start on a current database show its catalogue read."""
    jobq.create_schema(engine)
    upgrade = jobq._upgrade

    def every_start(conn: sa.Connection, d: Any, found: int) -> None:
        upgrade(conn, d, found)
        jobq._add_due_index(conn, d)

    monkeypatch.setattr(jobq, "_upgrade", every_start)
    seen = _start_statements(engine)
    assert [s for s in seen if _STEP_SQL.search(s)], seen


def _concurrent_starts(engine: sa.Engine) -> None:
    arrive, errors = meeting(THREADS), []

    def start() -> None:
        try:
            arrive()
            jobq.create_schema(engine)
        except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails on it
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors


def test_each_step_runs_once_across_concurrent_and_repeated_starts(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A database recorded at version 1 (every step's work is present, so each step only looks)
    started by four threads at once, then twice more: each step runs exactly once, in order,
    and the version reads SCHEMA_VERSION. The bugs: a version not recorded after its step
    (every start reruns it), or steps run outside create_schema's serialised transaction
    (concurrent starts each run them): the broken variants below."""
    jobq.create_schema(engine)
    recorded_version(engine, 1)
    runs = _spied(monkeypatch)
    _concurrent_starts(engine)
    jobq.create_schema(engine)
    jobq.create_schema(engine)
    assert runs == {v: 1 for v, _step, _what in jobq._MIGRATIONS}, runs
    assert _version(engine) == str(jobq.SCHEMA_VERSION)


def test_broken_a_version_not_recorded_reruns_its_steps(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """BROKEN variant: the version update writes nothing. Every start reruns every step."""
    jobq.create_schema(engine)
    recorded_version(engine, 1)
    runs = _spied(monkeypatch)
    monkeypatch.setattr(jobq, "_Q_SET_SCHEMA_VERSION", sa.update(META).where(META.c.key == "no such key")
                        .values(value=sa.bindparam("b_value", type_=sa.String(200))))
    jobq.create_schema(engine)
    jobq.create_schema(engine)
    assert set(runs.values()) == {2}, runs
    recorded_version(engine, jobq.SCHEMA_VERSION)


@needs("schema_lock")  # without one, writers are serialised in the process as well
def test_broken_steps_outside_the_guard_run_once_per_start(engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """BROKEN variant: create_schema's transaction without the schema lock. Concurrent starts
    all read version 1 and all run the steps (the first step waits until every start has
    reached it, which the lock would never allow). PostgreSQL's storage settings are left out
    here: their ALTER TABLE takes a table lock of its own, which would serialise the starts."""
    jobq.create_schema(engine)
    recorded_version(engine, 1)
    runs = _spied(monkeypatch, arrive=meeting(THREADS, timeout=60))

    @contextlib.contextmanager
    def unlocked(eng: sa.Engine, d: Any) -> Iterator[sa.Connection]:
        with eng.begin() as conn:
            yield conn

    monkeypatch.setattr(jobq, "_schema_guard", unlocked)
    monkeypatch.setattr(type(jobq._prepare(engine)), "tune_tables", lambda self, conn: None)
    _concurrent_starts(engine)
    assert runs[jobq._MIGRATIONS[0][0]] == THREADS, runs
    recorded_version(engine, jobq.SCHEMA_VERSION)
