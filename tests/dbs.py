"""Which databases a run uses, and how tests reach them (imported by conftest and tests).

Database URLs come from the environment (nox owns the servers, pytest only reads URLs):

    JOBQ_TEST_POSTGRES_URL   e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test
    JOBQ_TEST_MYSQL_URL      e.g. mysql+pymysql://root@127.0.0.1:3307/test
    JOBQ_TEST_MARIADB_URL    e.g. mariadb+pymysql://root@127.0.0.1:3306/test

SQLite always runs, on a file (several connections), never ``:memory:``. Where a URL is unset
and a Docker engine answers, testcontainers starts that server. Otherwise the dialect's tests
skip with the reason, unless ``JOBQ_REQUIRE_DIALECTS`` names it: then they fail.
``JOBQ_TEST_DIALECTS`` (comma list) narrows the run to some dialects.
"""

from __future__ import annotations

import os
import socket

import pytest
import sqlalchemy as sa

import jobq

ALL_DIALECTS = ("sqlite", "postgresql", "mysql", "mariadb")
ENV_URL = {
    "postgresql": "JOBQ_TEST_POSTGRES_URL",
    "mysql": "JOBQ_TEST_MYSQL_URL",
    "mariadb": "JOBQ_TEST_MARIADB_URL",
}
CONTAINER_IMAGES = {"postgresql": "postgres:16", "mysql": "mysql:8.4", "mariadb": "mariadb:11"}


def _csv(name: str) -> list[str]:
    return [x.strip() for x in os.environ.get(name, "").split(",") if x.strip()]


SELECTED = tuple(d for d in ALL_DIALECTS if d in (_csv("JOBQ_TEST_DIALECTS") or ALL_DIALECTS))
REQUIRED = set(_csv("JOBQ_REQUIRE_DIALECTS"))
unknown = REQUIRED - set(ALL_DIALECTS)
if unknown:
    raise RuntimeError(f"JOBQ_REQUIRE_DIALECTS names unknown dialects: {sorted(unknown)}")


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


_containers: list[object] = []


def _container_url(dialect: str) -> str | None:
    if not _docker_answers():
        return None
    try:  # testcontainers >= 4.15 moved its modules under testcontainers.community
        if dialect == "postgresql":
            from testcontainers.community.postgres import PostgresContainer as C  # type: ignore
        else:
            from testcontainers.community.mysql import MySqlContainer as C  # type: ignore
    except ImportError:
        return None
    c = C(CONTAINER_IMAGES[dialect])
    c.start()
    _containers.append(c)
    url = c.get_connection_url()
    if dialect == "postgresql":
        return url.replace("postgresql+psycopg2", "postgresql+psycopg")
    return url.replace("mysql://", "mysql+pymysql://").replace("mysql+mysqldb", "mysql+pymysql")


def stop_containers() -> None:
    for c in _containers:
        c.stop()  # type: ignore[attr-defined]


_resolved: dict[str, str | None] = {}


def server_url(dialect: str) -> str:
    """The URL of a server for ``dialect``, or skip/fail the test as the policy says."""
    if dialect not in _resolved:
        _resolved[dialect] = os.environ.get(ENV_URL[dialect]) or _container_url(dialect)
    url = _resolved[dialect]
    if url is None:
        why = f"{dialect}: set {ENV_URL[dialect]} (no Docker engine answers for testcontainers)"
        if dialect in REQUIRED:
            pytest.fail(f"JOBQ_REQUIRE_DIALECTS requires {why}", pytrace=False)
        pytest.skip(why)
    return url



def wipe(engine: sa.Engine) -> None:
    """Empty jobq's tables (faster than recreating them on MySQL)."""
    with engine.begin() as conn:
        conn.execute(sa.delete(jobq.JobDep.__table__))
        conn.execute(sa.update(jobq.Job.__table__).values(parent_id=None))
        conn.execute(sa.delete(jobq.Job.__table__))
        conn.execute(sa.delete(jobq._slots))  # slots held by an earlier test's abandoned handlers
        conn.execute(sa.delete(jobq._starts))


def only(*dialects: str):
    """Mark a test as needing a capability only these dialects have (say which in the test)."""

    def mark(fn):
        fn.jobq_dialects = dialects
        return fn

    return mark


ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+psycopg_async",
                 "mysql": "mysql+aiomysql", "mariadb": "mariadb+aiomysql"}


def async_url(url: str) -> str:
    """The same database through the async driver jobq's async tests use."""
    u = sa.engine.make_url(url)
    return u.set(drivername=ASYNC_DRIVERS[u.get_backend_name()]).render_as_string(hide_password=False)
