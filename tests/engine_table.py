"""The engines the suites run on: one row each. Adding an engine to the tests is one row here
(its class in jobq/engines.py and its driver in jobq/drivers.py are the other half); tests/dbs.py, the
conftest, noxfile.py's per-engine sessions (tests-<short>, races-<short>, crash-<short>), .ci/run's
loops over them and test_layout's list of engine names all read this table.

Plain data and the standard library only: noxfile.py and .ci/run load it without the test
dependencies installed."""

from __future__ import annotations

from typing import NamedTuple


class Engine(NamedTuple):
    #: The nox session suffix: tests-<short>, races-<short>, crash-<short>.
    short: str
    #: The variable that names a server database the suite may wipe (None: an embedded engine,
    #: always tested on a temporary file, ``file_url``).
    env: str | None = None
    #: What a URL looks like, for the "not tested" line.
    url_shape: str = ""
    #: A temporary database file's URL, ``{path}`` filled in (embedded engines).
    file_url: str | None = None
    #: The testcontainers image, its class (module.Class under testcontainers.community) and the
    #: SQLAlchemy driver the container's URL is given.
    image: str | None = None
    container: str | None = None
    container_driver: str | None = None
    #: A query telling whether database ``:n`` exists, for servers without CREATE DATABASE IF
    #: NOT EXISTS (None: the server has it).
    database_exists_sql: str | None = None
    #: The driver jobq's async tests use.
    async_driver: str = ""


ENGINES: dict[str, Engine] = {
    "sqlite": Engine("sqlite", file_url="sqlite:///{path}", async_driver="sqlite+aiosqlite"),
    "postgresql": Engine("postgres", "JOBQ_TEST_POSTGRES_URL", "postgresql+psycopg://user@host/db",
                         image="postgres:16", container="postgres.PostgresContainer",
                         container_driver="postgresql+psycopg",
                         database_exists_sql="SELECT 1 FROM pg_database WHERE datname = :n",
                         async_driver="postgresql+psycopg_async"),
    "mysql": Engine("mysql", "JOBQ_TEST_MYSQL_URL", "mysql+pymysql://user@host:3306/db",
                    image="mysql:8.4", container="mysql.MySqlContainer", container_driver="mysql+pymysql",
                    async_driver="mysql+aiomysql"),
    "mariadb": Engine("mariadb", "JOBQ_TEST_MARIADB_URL", "mariadb+pymysql://user@host:3306/db",
                      image="mariadb:11", container="mysql.MySqlContainer", container_driver="mysql+pymysql",
                      async_driver="mariadb+aiomysql"),
}

if __name__ == "__main__":  # .ci/run: the nox session suffixes, one a line; or with "dialects", all of them
    import sys

    print(",".join(ENGINES) if sys.argv[1:] == ["dialects"] else "\n".join(e.short for e in ENGINES.values()))
