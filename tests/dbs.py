"""Which databases a run uses, and how tests reach them (imported by conftest and tests).

The suite writes only to databases it was given. SQLite always runs, on temporary files
(several connections, never ``:memory:``). A server engine is tested only when its variable
names a database, and the suite then **drops and recreates jobq's tables in exactly that
database** (``jobs``, ``job_deps``, ``jobq_meta``, ``jobq_slots``, ``jobq_starts``,
``jobq_attempts``), so name one
of its own, never an application's:

    JOBQ_TEST_POSTGRES_URL   e.g. postgresql+psycopg://postgres@127.0.0.1:5432/jobq_test
    JOBQ_TEST_MYSQL_URL      e.g. mysql+pymysql://root@127.0.0.1:3307/jobq_test
    JOBQ_TEST_MARIADB_URL    e.g. mariadb+pymysql://root@127.0.0.1:3306/jobq_test

Under pytest-xdist (``pytest -n 4``, as ``nox -s tests`` runs) each worker gets a database of
its own, derived from the named one: ``jobq_test_gw0``, ``jobq_test_gw1``, ... on the same
server, created when missing (so the user in the URL needs the right to create databases).
:func:`named_url` is the named database itself, for suites whose xdist workers must share one
queue.

Where a variable is unset and a Docker engine answers, testcontainers starts a throwaway server
(one per pytest process). Otherwise that engine is not tested: its tests are deselected and the
run ends with one line saying how to enable it, unless ``JOBQ_REQUIRE_DIALECTS`` names it: then
its tests fail. ``JOBQ_TEST_DIALECTS`` (comma list) narrows the run to some dialects.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import tempfile

import pytest
import sqlalchemy as sa
from engine_table import ENGINES

import jobq

#: Every engine the suites know, in their order (one row each in engine_table.ENGINES).
ALL_DIALECTS = tuple(ENGINES)
#: The servers' URL variables (an embedded engine has none: it always runs, on a temporary file).
ENV_URL = {d: e.env for d, e in ENGINES.items() if e.env}


def _csv(name: str) -> list[str]:
    return [x.strip() for x in os.environ.get(name, "").split(",") if x.strip()]


SELECTED = tuple(d for d in ALL_DIALECTS if d in (_csv("JOBQ_TEST_DIALECTS") or ALL_DIALECTS))
REQUIRED = set(_csv("JOBQ_REQUIRE_DIALECTS"))
unknown = REQUIRED - set(ALL_DIALECTS)
if unknown:
    raise RuntimeError(f"JOBQ_REQUIRE_DIALECTS names unknown dialects: {sorted(unknown)}")


@functools.cache
def _docker_answers() -> bool:
    sock_path = "/var/run/docker.sock"
    if not os.path.exists(sock_path):
        return False
    try:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(1)
        s.connect(sock_path)
        s.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
        ok = b"OK" in s.recv(256)
        s.close()
        return ok
    except OSError:
        return False


def _testcontainers_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("testcontainers.community") is not None
    except ImportError:
        return False


def reachable(dialect: str) -> bool:
    """Decided without connecting: a URL was given, or testcontainers can start a server."""
    if dialect not in ENV_URL or os.environ.get(ENV_URL[dialect]):
        return True
    return _docker_answers() and _testcontainers_installed()


def not_tested_reason(dialect: str) -> str:
    return (f"{dialect}: not tested: set {ENV_URL[dialect]}={ENGINES[dialect].url_shape} "
            "(a database the suite may wipe)")


#: The dialects whose tests are generated: selected, and reachable or required (a required
#: dialect with no server fails its tests rather than vanishing).
TESTED = tuple(d for d in SELECTED if d in REQUIRED or reachable(d))
#: One line per selected engine that is not tested, printed at the end of the run.
NOT_TESTED = [not_tested_reason(d) for d in SELECTED if d not in TESTED]


_containers: list[object] = []


def _container_url(dialect: str) -> str | None:
    e = ENGINES[dialect]
    if not _docker_answers() or not (e.image and e.container and e.container_driver):
        return None
    import importlib

    module, _, cls = e.container.rpartition(".")
    try:  # testcontainers >= 4.15 moved its modules under testcontainers.community
        C = getattr(importlib.import_module(f"testcontainers.community.{module}"), cls)
    except ImportError:
        return None
    c = C(e.image)
    c.start()
    _containers.append(c)
    url = sa.engine.make_url(c.get_connection_url()).set(drivername=e.container_driver)
    return url.render_as_string(hide_password=False)


def stop_containers() -> None:
    for c in _containers:
        c.stop()  # type: ignore[attr-defined]


_resolved: dict[str, tuple[str, bool] | None] = {}


def _named(dialect: str) -> tuple[str, bool] | None:
    """(URL, whether it came from a container), or None when no server was given."""
    if dialect not in _resolved:
        url = os.environ.get(ENV_URL[dialect])
        if url:
            _resolved[dialect] = (url, False)
        else:
            c = _container_url(dialect)
            _resolved[dialect] = (c, True) if c else None
    return _resolved[dialect]


def named_url(dialect: str) -> str:
    """The database named for ``dialect`` (shared by every xdist worker), or skip/fail the test."""
    got = _named(dialect)
    if got is None:
        why = not_tested_reason(dialect)
        if dialect in REQUIRED:
            pytest.fail(f"JOBQ_REQUIRE_DIALECTS requires {why}", pytrace=False)
        pytest.skip(why)
    return got[0]


def server_url(dialect: str) -> str:
    """The database this pytest process tests ``dialect`` on: the named one, or under xdist
    the worker's own ``<named>_gwN`` (a container is already this process's own)."""
    url = named_url(dialect)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    got = _named(dialect)
    if not worker or (got is not None and got[1]):
        return url
    return worker_database(url, worker)


@functools.cache
def worker_database(url: str, worker: str) -> str:
    """``url`` with its database renamed ``<database>_<worker>``, created on the server if missing."""
    import filelock

    u = sa.engine.make_url(url)
    if not u.database:
        raise RuntimeError(f"{u.render_as_string()} names no database to derive {worker}'s from")
    name = f"{u.database}_{worker}"
    # Two runs on one server (or one run's workers) may race to create it: serialise per name.
    key = hashlib.sha1(u.set(database=name).render_as_string().encode()).hexdigest()[:16]
    with filelock.FileLock(os.path.join(tempfile.gettempdir(), f"jobq-test-db-{key}.lock"), timeout=60):
        eng = sa.create_engine(url, isolation_level="AUTOCOMMIT")  # CREATE DATABASE refuses a transaction
        try:
            quoted = eng.dialect.identifier_preparer.quote(name)
            with eng.connect() as conn:
                exists_sql = ENGINES[dialect_of(url)].database_exists_sql
                if exists_sql is None:
                    conn.exec_driver_sql(f"CREATE DATABASE IF NOT EXISTS {quoted}")
                elif not conn.execute(sa.text(exists_sql), {"n": name}).first():
                    conn.exec_driver_sql(f"CREATE DATABASE {quoted}")
        finally:
            eng.dispose()
    return u.set(database=name).render_as_string(hide_password=False)


def wipe(engine: sa.Engine) -> None:
    """Empty jobq's tables (faster than recreating them on MySQL)."""
    tables = jobq.Base.metadata.tables  # by the public Base, not jobq's private names
    meta = tables["jobq_meta"]
    with engine.begin() as conn:
        conn.execute(sa.delete(jobq.JobDep.__table__))
        conn.execute(sa.update(jobq.Job.__table__).values(parent_id=None))
        conn.execute(sa.delete(jobq.Job.__table__))
        conn.execute(sa.delete(tables["jobq_slots"]))  # slots held by an earlier test's abandoned handlers
        conn.execute(sa.delete(tables["jobq_starts"]))
        conn.execute(sa.delete(tables["jobq_attempts"]))
        conn.execute(sa.delete(tables["jobq_groups"]))  # stored group policy (set_group), and its counts
        conn.execute(sa.delete(tables["jobq_waits"]))  # what handlers waited for, and the signals
        conn.execute(sa.delete(tables["jobq_signals"]))
        conn.execute(sa.delete(tables["jobq_schedules"]))  # recurring jobs (jobq.schedule)
        for name in ("jobq_logs", "jobq_retention", "jobq_audit"):  # ctx.log, retention policy, bulk actions
            conn.execute(sa.delete(tables[name]))
        conn.execute(sa.update(meta).where(meta.c.key == "retention_due").values(value=""))
        conn.execute(sa.update(meta).where(meta.c.key == "claim_lock").values(value=""))
        conn.execute(sa.update(meta).where(meta.c.key == "global_limits").values(value=""))  # set_limit


def only(*dialects: str):
    """Mark a test as about these engines' own behaviour (an error code, a planner's trap, a
    driver's types), not a capability: say why on the same line (test_layout checks it). A
    capability question is :func:`needs`."""

    def mark(fn):
        fn.jobq_dialects = dialects
        return fn

    return mark


def facts(dialect: str) -> jobq._Dialect:
    """What jobq's driver knows about ``dialect``: SQLite's facts at the SQLite this Python links
    (the version the package sees), a server's at the oldest version jobq supports."""
    if dialect == "sqlite":
        import sqlite3

        return jobq._capabilities(dialect, sqlite3.sqlite_version_info)
    return jobq._capabilities(dialect, jobq._MIN_VERSIONS[dialect])


def needs(*caps: str, no: str | tuple[str, ...] = ()):
    """Mark a test as asking a capability question: it runs on the engines whose driver has every
    fact in ``caps`` (``row_locks``, ``partial_indexes``, ...) and none in ``no``, decided from
    the same facts the package branches on (:func:`facts`). Parametrised as :func:`only` is."""
    nos = (no,) if isinstance(no, str) else no
    for cap in (*caps, *nos):
        if not hasattr(facts("sqlite"), cap):
            raise AttributeError(f"needs({cap!r}): the drivers have no such fact")
    dialects = tuple(d for d in ALL_DIALECTS if all(getattr(facts(d), c) for c in caps)
                     and not any(getattr(facts(d), c) for c in nos))

    def mark(fn):
        fn.jobq_dialects = dialects
        fn.jobq_needs = (caps, nos)
        return fn

    return mark


def dialect_of(url: str) -> str:
    """The row of ENGINES a URL's scheme names (mysql+pymysql:// is "mysql" even on MariaDB)."""
    return sa.engine.make_url(url).get_backend_name()


def file_url(dialect: str, path: str) -> str | None:
    """An embedded engine's URL for a database file at ``path`` (None for a server)."""
    template = ENGINES[dialect].file_url
    return template.format(path=path) if template else None


def async_url(url: str) -> str:
    """The same database through the async driver jobq's async tests use."""
    u = sa.engine.make_url(url)
    return u.set(drivername=ENGINES[dialect_of(url)].async_driver).render_as_string(hide_password=False)
