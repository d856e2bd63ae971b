"""nox sessions: nox owns the database servers, pytest only reads their URLs.

    nox -s demo                 the quick-start scenario on SQLite
    nox -s tests                the suite on every database it can reach (SQLite always)
    nox -s tests-postgres       the suite on one engine (also -sqlite, -mysql, -mariadb)
    nox -s races-postgres       the race suite users run to verify their engine
    nox -s crash-postgres       kill-the-worker and database-fault scenarios
    nox -s fairness             fair-share properties and simulations (no database; not in `tests`)
    nox -s cluster-postgres     worker hosts (network namespaces), partitions, a failover (root)
    nox -s cluster-mariadb      the same on MariaDB: a replica, HAProxy, semi-sync and async failovers (root)
    nox -s lint                 ruff and mypy
    nox -s package              build the wheel and check it installed (license, py.typed, -m jobq)
    nox -s floors               the suite on SQLite and PostgreSQL with the lowest versions jobq declares
    nox -s single               single/jobq.py in sync with the package, and the SQLite suite run on it

No session invents a server: an engine is tested only when JOBQ_TEST_POSTGRES_URL,
JOBQ_TEST_MYSQL_URL or JOBQ_TEST_MARIADB_URL names a database the suite may wipe (see
tests/dbs.py); otherwise the run ends with one line per engine saying how to enable it.

The conformance suite (tests, tests-<engine>) runs under pytest-xdist: JOBQ_TEST_WORKERS sets
the number of workers (default 2; 0 runs serially), and `-n N` after `--` overrides it. Each
worker uses its own database on each server, derived from the named one (<name>_gw0, ...).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import tomllib

import nox
from packaging.requirements import Requirement

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["demo", "tests"]


def _engine_table() -> dict:
    # The tests' table of engines (plain data): one row there is one more set of per-engine sessions.
    spec = importlib.util.spec_from_file_location("engine_table", pathlib.Path(__file__).parent / "tests" / "engine_table.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ENGINES


#: nox's engine name (tests-<short>) -> the dialect the suite calls it, and its URL variable.
_TABLE = _engine_table()
ENGINES = {e.short: dialect for dialect, e in _TABLE.items()}
URL_VAR = {e.short: e.env for e in _TABLE.values() if e.env}
TEST_DEPS = ["-e", ".[test]"]


# The fair-share properties and tick simulations need no database and take most of a run on a
# machine without servers: they run in `fairness` (which CI runs), so the README's `tests` stays
# about a minute there. Their Worker-level checks against the databases stay here.
CONFORMANCE = ["tests/core", "tests/dag", "tests/cli", "tests/docs", "tests/fairness/test_integration.py",
               "tests/fairness/test_integration_at_scale.py", "tests/web"]

# Sessions that re-run the conformance suite only to prove another installation of the same code
# (floors: the lowest versions; tests-mysqlclient: the C driver; tests-nofastpath: every statement
# through Connection.execute; single: the generated file) leave out what `tests` already runs on
# every engine and what that installation cannot change:
# - the documentation's blocks, the scenario scripts and the benchmark's drain: subprocesses
#   calling the API the suite calls directly (under `single` they even import the checkout's
#   package, not the single file);
# - the checks of scale: a thousand-deep nest of containers, a 2,000-job fan-out and fan-in, a
#   walk beside 20,000 jobs, 5,000 fair-share groups. They prove the work per job stays bounded
#   (no recursion per level, no read of the whole table), which is the statements' shape, not the
#   versions, the driver, the execution path or the layout; they were half of the PostgreSQL
#   tests' time in a run of `tests` (300 s of 613 s on the shared machine).
# Every other module of tests/core, tests/dag, tests/cli and tests/web runs, so every module of
# jobq and the dashboard is exercised on each engine the session proves.
REPEATED = ["tests/docs", "tests/cli/test_scenarios.py", "tests/cli/test_bench.py",
            "tests/fairness/test_integration_at_scale.py"]
SCALE_CHECKS = ["tests/dag/test_adversarial_dag.py::test_a_thousand_deep_nest_of_containers_opens_and_rolls_up",
                "tests/dag/test_dag.py::test_submit_a_large_fan_out_and_fan_in",
                "tests/dag/test_graph_ops_statements.py::test_the_walk_reads_each_jobs_edges_even_before_job_deps_is_analysed"]
INSTALLATION_CHECK = [*(f"--ignore={p}" for p in REPEATED), *(f"--deselect={t}" for t in SCALE_CHECKS)]


def _installation_check(paths: list[str]) -> list[str]:
    """pytest's arguments for ``paths`` less INSTALLATION_CHECK: a path named on the command line
    is collected whatever --ignore says, so REPEATED's are dropped from ``paths`` too."""
    return [p for p in paths if p not in REPEATED] + INSTALLATION_CHECK


def _env(dialects: str | None = None) -> dict[str, str]:
    # The server URLs pass through from the caller's environment, untouched.
    # A session for one engine (tests-postgres, ...) without that engine fails, rather than
    # passing with nothing run.
    env = {}
    if dialects:
        env["JOBQ_TEST_DIALECTS"] = dialects
        env["JOBQ_REQUIRE_DIALECTS"] = os.environ.get("JOBQ_REQUIRE_DIALECTS") or dialects
    return env


def _workers(session: nox.Session) -> list[str]:
    """xdist's -n for the conformance suite, unless the caller passed their own."""
    if any(a.startswith(("-n", "--numprocesses", "--dist")) or a == "no:xdist" for a in session.posargs):
        return []
    n = os.environ.get("JOBQ_TEST_WORKERS", "2")
    return [] if n == "0" else ["-n", n]


def _pytest(session: nox.Session, paths: list[str], dialects: str | None = None, parallel: bool = False) -> None:
    session.install(*TEST_DEPS)
    session.run("pytest", *paths, *(_workers(session) if parallel else []), *session.posargs, env=_env(dialects))


@nox.session
def demo(session: nox.Session) -> None:
    """Run the quick-start scenario (a small DAG) on SQLite and show what happened."""
    session.install("SQLAlchemy>=2.0")
    session.run("python", "scenarios/quickstart.py", *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """The conformance suite, in parallel, on SQLite and every server named by JOBQ_TEST_*_URL."""
    _pytest(session, CONFORMANCE, parallel=True)


def _engine_sessions(kind: str, paths: list[str], doc: str, parallel: bool = False) -> None:
    # A factory per session: a plain loop would bind every session to the last engine.
    for short, dialect in ENGINES.items():

        def make(short: str = short, dialect: str = dialect) -> None:
            def run(session: nox.Session) -> None:
                _pytest(session, paths, dialect, parallel)

            run.__doc__ = doc.format(engine=short)
            nox.session(name=f"{kind}-{short}", default=False)(run)

        make()


_engine_sessions("tests", CONFORMANCE, "The conformance suite on {engine} only, in parallel.", parallel=True)


@nox.session(name="tests-nofastpath", default=False)
def tests_nofastpath(session: nox.Session) -> None:
    """The conformance suite (less INSTALLATION_CHECK's repeats) on PostgreSQL with JOBQ_FASTPATH=0:
    every statement through Connection.execute, as on a SQLAlchemy the cursor fast path does not recognise."""
    session.install(*TEST_DEPS)
    env = {**_env("postgresql"), "JOBQ_FASTPATH": "0"}
    session.run("pytest", *_installation_check(CONFORMANCE), *_workers(session), *session.posargs, env=env)


@nox.session(name="tests-mysqlclient", default=False)
def tests_mysqlclient(session: nox.Session) -> None:
    """The MySQL and MariaDB suites through mysqlclient (MySQLdb, the C driver) instead of
    PyMySQL: the servers JOBQ_TEST_MYSQL_URL and JOBQ_TEST_MARIADB_URL name, their driver swapped."""
    session.install("-e", ".[test,mysqlclient]")
    env = _env("mysql,mariadb")
    for var in (URL_VAR["mysql"], URL_VAR["mariadb"]):
        url = os.environ.get(var)
        if not url:
            session.error(f"{var} names no server: this session runs only against real servers")
        scheme, sep, rest = url.partition("://")
        env[var] = f"{scheme.split('+')[0]}+mysqldb{sep}{rest}"
    session.run("pytest", *_installation_check(["tests/core", "tests/dag", "tests/cli"]), *_workers(session),
                *session.posargs, env=env)


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


@nox.session(name="cluster-postgres", default=False)
def cluster_postgres(session: nox.Session) -> None:
    """Cluster suite: 3 worker hosts as network namespaces, partitions, a PostgreSQL failover (root; own servers)."""
    # It makes its own PostgreSQL primary and standby (ports 55432/55433) and namespaces, and
    # removes them; it needs root, iproute2, nftables and PostgreSQL 15's binaries, and fails
    # (never skips) without them. The shared servers named by JOBQ_TEST_*_URL are not used.
    session.install(*TEST_DEPS)
    session.run("pytest", "tests/cluster/test_cluster.py", *session.posargs, env={"JOBQ_TEST_DIALECTS": "sqlite"})


@nox.session(name="cluster-mariadb", default=False)
def cluster_mariadb(session: nox.Session) -> None:
    """Cluster suite on MariaDB: 3 worker hosts, HAProxy, partitions, a semi-sync and an async failover (root)."""
    # Its own MariaDB primary and replica (Debian's mariadbd, ports 53306/53307), HAProxy on port
    # 53300 and namespaces jqm-* of their own (it runs beside cluster-postgres), all removed at
    # the end; it needs root, iproute2, nftables, mariadb-server and haproxy, and fails (never
    # skips) without them. The system MariaDB on 3306 is not used.
    session.install(*TEST_DEPS)
    session.run("pytest", "tests/cluster/test_cluster_mariadb.py", *session.posargs,
                env={"JOBQ_TEST_DIALECTS": "sqlite"})


@nox.session
def fairness(session: nox.Session) -> None:
    """Fair-share properties (Hypothesis) and tick simulations; no database needed."""
    session.install(*TEST_DEPS)
    session.run("pytest", "tests/fairness", "-m", "not slow", "-k", "not integration", *session.posargs,
                env={"JOBQ_TEST_DIALECTS": "sqlite"})


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """jobq beside a DBAPI ceiling and its peers (PGQueuer, huey, Procrastinate); --url names the database."""
    # mysqlclient only when a URL names it: it builds from source (client headers, pkg-config).
    extras = "postgres,mysql,bench" + (",mysqlclient" if any("+mysqldb" in a for a in session.posargs) else "")
    session.install("-e", f".[{extras}]")
    session.run("python", "bench/bench.py", *session.posargs)


PACKAGE_CHECK = """\
import importlib.metadata, subprocess, sys
import sqlalchemy as sa
import jobq

job_id: int = jobq.enqueue(sa.create_engine("sqlite://"), "t") if len(sys.argv) > 9 else 0
meta = importlib.metadata.metadata("jobq")
assert meta["License"] == "MIT" and "License :: OSI Approved :: MIT License" in (meta.get_all("Classifier") or []), meta
assert jobq.__file__.endswith("jobq/__init__.py"), jobq.__file__
subprocess.run([sys.executable, "-m", "jobq", "--help"], check=True, capture_output=True)
print("installed wheel: license", meta["License"], "| typed | python -m jobq works")
"""


@nox.session(default=False)
def package(session: nox.Session) -> None:
    """Build the wheel, install it in a scratch venv: license field, py.typed for mypy, -m jobq."""
    session.install("mypy")
    tmp = pathlib.Path(session.create_tmp())
    shutil.rmtree(tmp / "dist", ignore_errors=True)
    session.run("python", "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"), ".")
    session.run("python", "-m", "venv", "--clear", str(tmp / "venv"))
    py = str(tmp / "venv" / "bin" / "python")
    session.run(py, "-m", "pip", "install", "-q", *map(str, (tmp / "dist").glob("jobq-*.whl")), external=True)
    check = tmp / "check_installed.py"
    check.write_text(PACKAGE_CHECK)
    # mypy reads the scratch venv's site-packages: an untyped jobq is an import-untyped error.
    session.run("mypy", "--python-executable", py, "--no-incremental", str(check))
    session.run(py, str(check), external=True, env={"PYTHONPATH": ""})


# The conformance suite but its fair-share runs (policy over the same claim statements, about a
# minute of its five on two loaded cores) and what INSTALLATION_CHECK leaves to `tests`; with
# MariaDB, the sync and async drivers' part.
FLOORS_SUITE = [p for p in CONFORMANCE if not p.startswith("tests/fairness/")]
FLOORS_MARIADB = ["tests/core/test_async.py", "tests/core/test_lifecycle.py"]
# The extras whose drivers a user installs with jobq: their floors (and SQLAlchemy's) are what
# `floors` installs. mysqlclient is left out: it builds from source against the client headers.
FLOOR_EXTRAS = ("postgres", "mysql", "asyncio")


def _floor_pins() -> list[str]:
    """`name[extras]==X` for every `>=X` that pyproject declares for jobq and FLOOR_EXTRAS."""
    project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for e in FLOOR_EXTRAS for r in project["optional-dependencies"][e]]
    floors: dict[str, tuple[str, str, set[str]]] = {}  # SQLAlchemy comes twice, with and without [asyncio]
    for req in map(Requirement, reqs):
        if req.name == project["name"]:
            continue
        floor = [s.version for s in req.specifier if s.operator == ">="]
        if len(floor) != 1:
            raise ValueError(f"pyproject: {req} declares no single >= floor")
        name, seen, extras = floors.setdefault(req.name.lower(), (req.name, floor[0], set()))
        if seen != floor[0]:
            raise ValueError(f"pyproject: {name} declares two floors, {seen} and {floor[0]}")
        extras |= req.extras
    return sorted(f"{name}{'[' + ','.join(sorted(ex)) + ']' if ex else ''}=={v}" for name, v, ex in floors.values())


CHECK_FLOORS = """\
import importlib.metadata, sys
from packaging.version import Version
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    got = importlib.metadata.version(name.split("[")[0])
    assert Version(got) == Version(version), f"{name} {got} is installed, not its floor {version}"
print("floors installed:", *sys.argv[1:])
"""


@nox.session(default=False)
def floors(session: nox.Session) -> None:
    """The conformance suite (less INSTALLATION_CHECK's repeats) on SQLite and PostgreSQL with the lowest
    versions pyproject declares (SQLAlchemy, psycopg, aiosqlite, ...); PyMySQL and aiomysql on MariaDB
    when JOBQ_TEST_MARIADB_URL names it."""
    # Its own virtualenv: the floors pinned exactly, the test tools at their newest.
    pins = _floor_pins()
    session.install("-e", ".[test]", *pins)
    session.run("python", "-c", CHECK_FLOORS, *pins)
    dialects = "sqlite,postgresql"
    env = {"JOBQ_TEST_DIALECTS": dialects, "JOBQ_REQUIRE_DIALECTS": dialects}
    session.run("pytest", *_installation_check(FLOORS_SUITE), *_workers(session), *session.posargs, env=env)
    if os.environ.get(URL_VAR["mariadb"]):  # PyMySQL and aiomysql: a small part of the suite
        env = {"JOBQ_TEST_DIALECTS": "mariadb", "JOBQ_REQUIRE_DIALECTS": "mariadb"}
        session.run("pytest", *FLOORS_MARIADB, *session.posargs, env=env)
    else:
        session.run("python", "-c", "import pymysql, aiomysql, jobq")
        session.log(f"PyMySQL and aiomysql only imported: {URL_VAR['mariadb']} names no MariaDB server")


@nox.session(default=False)
def single(session: nox.Session) -> None:
    """The generated single file: in sync with jobq/ (else regenerate it), then the SQLite
    conformance suite (less INSTALLATION_CHECK's repeats) run against it instead of the package."""
    session.run("python", "packaging/single_file.py", "--check")
    session.install(*TEST_DEPS)
    # The checks of scale measure the claim's cost, not the layout, and the doc blocks and
    # scenarios import the package: INSTALLATION_CHECK leaves them to `tests`.
    session.run("pytest", *_installation_check(CONFORMANCE), *_workers(session), *session.posargs,
                env={**_env("sqlite"), "JOBQ_TEST_SINGLE_FILE": "1"})


@nox.session(default=False)
def lint(session: nox.Session) -> None:
    """ruff check on everything in the repository, mypy on the package, the dashboard and the scenarios."""
    session.install("ruff", "mypy", "SQLAlchemy>=2.0")
    session.run("ruff", "check", "jobq", "jobq_web.py", "packaging", "tests", "bench", "scenarios", "docs", "noxfile.py")
    session.run("mypy", "jobq", "jobq_web.py", "packaging/single_file.py", "scenarios")


DOCS_DEPS = ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings-python>=1.10"]


@nox.session(default=False)
def docs(session: nox.Session) -> None:
    """Build the documentation site with `mkdocs build --strict` (a broken link, anchor or API
    reference fails), then open it in headless chromium (tests/site)."""
    session.install("-e", ".[test]", *DOCS_DEPS)
    session.run("mkdocs", "build", "--strict", *session.posargs)  # into site/ (git-ignored)
    # The built site in headless chromium: title, navigation, a highlighted example, the references.
    session.run("pytest", "tests/site", env={"JOBQ_TEST_DIALECTS": "sqlite"})
