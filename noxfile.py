"""nox sessions: nox owns the database servers, pytest only reads their URLs.

    nox -s demo                 the quick-start scenario on SQLite
    nox -s tests                the suite on every database it can reach (SQLite always)
    nox -s tests-postgres       the suite on one engine (also -sqlite, -mysql, -mariadb)
    nox -s races-postgres       the race suite users run to verify their engine
    nox -s crash-postgres       kill-the-worker and database-fault scenarios
    nox -s fairness             fair-share properties and simulations (no database)
    nox -s lint                 ruff and mypy

Server URLs default to the local services of the development machines and can be set with
JOBQ_TEST_POSTGRES_URL, JOBQ_TEST_MYSQL_URL and JOBQ_TEST_MARIADB_URL.
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["demo", "tests"]

DEFAULT_URLS = {
    "JOBQ_TEST_POSTGRES_URL": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "JOBQ_TEST_MYSQL_URL": "mysql+pymysql://root@127.0.0.1:3307/test",
    "JOBQ_TEST_MARIADB_URL": "mariadb+pymysql://root@127.0.0.1:3306/test",
}
ENGINES = {"sqlite": "sqlite", "postgres": "postgresql", "mysql": "mysql", "mariadb": "mariadb"}
URL_VAR = {"postgres": "JOBQ_TEST_POSTGRES_URL", "mysql": "JOBQ_TEST_MYSQL_URL", "mariadb": "JOBQ_TEST_MARIADB_URL"}
TEST_DEPS = ["-e", ".[test]"]


def _env(dialects: str | None = None) -> dict[str, str]:
    env = {k: os.environ.get(k, v) for k, v in DEFAULT_URLS.items()}
    if dialects:
        env["JOBQ_TEST_DIALECTS"] = dialects
    return env


def _pytest(session: nox.Session, paths: list[str], dialects: str | None = None) -> None:
    session.install(*TEST_DEPS)
    session.run("pytest", *paths, *session.posargs, env=_env(dialects))


@nox.session
def demo(session: nox.Session) -> None:
    """Run the quick-start scenario (a small DAG) on SQLite and show what happened."""
    session.install("SQLAlchemy>=2.0")
    session.run("python", "scenarios/quickstart.py", *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """The conformance suite on every database it can reach (SQLite always)."""
    _pytest(session, ["tests/core", "tests/dag", "tests/cli", "tests/fairness"])


def _engine_sessions(kind: str, paths: list[str], doc: str) -> None:
    # A factory per session: a plain loop would bind every session to the last engine.
    for short, dialect in ENGINES.items():

        def make(short: str = short, dialect: str = dialect) -> None:
            def run(session: nox.Session) -> None:
                _pytest(session, paths, dialect)

            run.__doc__ = doc.format(engine=short)
            nox.session(name=f"{kind}-{short}", default=False)(run)

        make()


_engine_sessions("tests", ["tests/core", "tests/dag", "tests/cli", "tests/fairness"], "The conformance suite on {engine} only.")
def _race_sessions() -> None:
    # Two pytest runs: the xdist race (every worker a claimer on one queue, so --dist each, and
    # `-- -n 8` or JOBQ_RACE_WORKERS sets the workers), then the per-test harness without -n.
    for short, dialect in ENGINES.items():

        def make(short: str = short, dialect: str = dialect) -> None:
            def run(session: nox.Session) -> None:
                session.install(*TEST_DEPS, "pytest-xdist")
                rest, skip = [], False
                for a in session.posargs:  # the harness's own processes are its claimers: no -n for it
                    if not skip and not a.startswith(("-n", "--numprocesses")):
                        rest.append(a)
                    skip = a in ("-n", "--numprocesses")
                workers = os.environ.get("JOBQ_RACE_WORKERS", "4")
                session.run("pytest", "-p", "xdist", "-n", workers, "--dist", "each", "tests/races/xdist",
                            *session.posargs, env=_env(dialect))
                session.run("pytest", "tests/races", "--ignore=tests/races/xdist", *rest, env=_env(dialect))

            run.__doc__ = (f"Race suite on {short}: xdist workers racing on one queue, then no double dispatch, "
                           "caps, broken variants caught.")
            nox.session(name=f"races-{short}", default=False)(run)

        make()


_race_sessions()
_engine_sessions("crash", ["tests/crash"], "Crash suite on {engine}: SIGKILLed workers, zombies, timeouts, database faults.")


@nox.session
def fairness(session: nox.Session) -> None:
    """Fair-share properties (Hypothesis) and tick simulations; no database needed."""
    session.install(*TEST_DEPS)
    session.run("pytest", "tests/fairness", "-m", "not slow", "-k", "not integration", *session.posargs,
                env={"JOBQ_TEST_DIALECTS": "sqlite"})


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """jobq against the raw-SQL ceiling; pass --url to measure a server (default SQLite)."""
    session.install("-e", ".[postgres,mysql]")
    session.run("python", "bench/bench.py", *session.posargs)


@nox.session(default=False)
def lint(session: nox.Session) -> None:
    """ruff check on everything in the repository, mypy on the module."""
    session.install("ruff", "mypy", "SQLAlchemy>=2.0")
    session.run("ruff", "check", "jobq.py", "tests", "bench", "scenarios", "noxfile.py")
    session.run("mypy", "jobq.py")
