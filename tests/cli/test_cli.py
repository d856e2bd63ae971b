"""The jobq command: every subcommand, tables for people, --json for scripts, one rule for exit
codes (0 ok, 1 no such job, 2 bad usage or input, 3 the database, 4 a bug), and one clear line
(no traceback, no part of the URL's credentials) whatever the operator types."""

from __future__ import annotations

import ast
import datetime as dt
import json
import pathlib
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import sqlalchemy as sa

import jobq
from dbs import only
from helpers import JOBQ_CLI, META

ROOT = pathlib.Path(__file__).resolve().parents[2]
UTC = dt.UTC
ISO_S = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"  # to the second, for people
ISO_US = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z"  # to the microsecond, in JSON


def cli(url: str, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = jobq.main(["--url", url, *args])
    out, err = capsys.readouterr()
    return code, out, err


def run(*args: str, cwd: pathlib.Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*JOBQ_CLI, *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd)


def one_line_error(err: str) -> bool:
    return err.startswith("jobq: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_every_subcommand_on_a_small_pipeline(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(db_url, "init", capsys=capsys)[0] == 0
    code, out, _ = cli(db_url, "enqueue", "fetch", "--args", '{"u": 1}', "--group", "t1", capsys=capsys)
    fetch = int(out)
    box = int(cli(db_url, "enqueue", "box", "--container", capsys=capsys)[1])
    kid = int(cli(db_url, "enqueue", "work", "--parent", str(box), "--depends-on", str(fetch), capsys=capsys)[1])
    code, out, _ = cli(db_url, "why", str(kid), capsys=capsys)
    assert code == 0 and f"waiting on 1 upstream job(s): {fetch} (ready)" in out, _
    code, out, _ = cli(db_url, "why", str(fetch), capsys=capsys)
    assert "is ready, due " in out and "no worker is running jobs" in out
    code, out, _ = cli(db_url, "status", capsys=capsys)
    assert "ready=1 (1 due, 0 scheduled)" in out and "waiting=2" in out
    code, out, _ = cli(db_url, "status", "--json", capsys=capsys)
    assert json.loads(out)["states"]["ready"] == 1
    code, out, _ = cli(db_url, "ls", "--state", "waiting", capsys=capsys)
    assert out.splitlines()[0].startswith("ID") and len(out.splitlines()) == 3
    assert {r["id"] for r in json.loads(cli(db_url, "ls", "--json", capsys=capsys)[1])} == {fetch, box, kid}
    code, out, _ = cli(db_url, "show", str(box), "--json", capsys=capsys)
    assert json.loads(out)["children"] == [kid]
    code, out, _ = cli(db_url, "graph", str(box), capsys=capsys)
    assert out.startswith("flowchart TD") and f"subgraph c{box}" in out and f"j{fetch} --> j{kid}" in out
    code, out, _ = cli(db_url, "graph", "--all", "--format", "dot", capsys=capsys)
    assert out.startswith("digraph jobq") and f"cluster_{box}" in out
    assert cli(db_url, "cancel", str(fetch), capsys=capsys)[1].strip() == f"job {fetch}: cancelled"
    code, out, _ = cli(db_url, "why", str(kid), capsys=capsys)
    assert "cancelled: upstream job" in out
    code, out, _ = cli(db_url, "retry", str(fetch), capsys=capsys)
    assert code == 0 and out.split(":")[1].split() == [str(fetch), str(box), str(kid)]
    eng = sa.create_engine(db_url)
    assert jobq.Worker(eng, {"fetch": lambda c: {}, "work": lambda c: {}}, max_concurrency=2,
                       poll_interval=0.02).run_until_idle(timeout=30)
    code, out, _ = cli(db_url, "why", str(box), capsys=capsys)
    assert re.search(rf"is done: finished {ISO_S} after 0 attempt\(s\)$", out.strip()), out
    code, out, _ = cli(db_url, "prune", "--older-than", "0s", capsys=capsys)
    assert out.strip() == "deleted 3 job(s)"
    assert jobq.get(eng, fetch) is None
    eng.dispose()


# ---- item 2: status tells due from scheduled -------------------------------------------------


def test_status_never_prints_a_negative_age(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A job scheduled an hour ahead is not waiting. Today: `oldest ready job waiting: -3600s`."""
    eng = sa.create_engine(db_url)
    later = jobq.get(eng, jobq.enqueue(eng, "t", run_after=dt.timedelta(hours=1)))
    assert later is not None
    _, out, _ = cli(db_url, "status", capsys=capsys)
    assert "ready=1 (0 due, 1 scheduled)" in out and "due per group: none\n" in out
    assert "oldest due job waiting: -\n" in out
    assert re.search(rf"scheduled for later: 1, the next in (59m[0-5]\ds|1h00m) \(at {re.escape(jobq._iso(later.run_after) or '')}\)\n",
                     out), out
    jobq.enqueue(eng, "t", group_key="g")
    _, out, _ = cli(db_url, "status", capsys=capsys)
    assert "ready=2 (1 due, 1 scheduled)" in out and "due per group: g: 1\n" in out
    assert re.search(r"oldest due job waiting: \d+s\n", out), out
    eng.dispose()


def test_status_with_thousands_of_tenants_names_the_busiest_and_counts_the_rest(
        db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 14's tenants: one status line per group list stays readable. Past 10 groups it
    names the 10 with the most due jobs (largest first, ties by name) and how many more there
    are; --json still carries every group."""
    eng = sa.create_engine(db_url)
    jobq.submit(eng, [{"key": str(i), "type": "t", "group_key": f"g{i:04d}"} for i in range(600)]
                + [{"key": f"big{i}", "type": "t", "group_key": "g0599"} for i in range(3)]
                + [{"key": f"mid{i}", "type": "t", "group_key": "g0300"} for i in range(2)])
    _, out, _ = cli(db_url, "status", capsys=capsys)
    line = next(x for x in out.splitlines() if x.startswith("due per group: "))
    assert line == ("due per group: g0599: 4, g0300: 3, g0000: 1, g0001: 1, g0002: 1, g0003: 1, g0004: 1, g0005: 1, "
                    "g0006: 1, g0007: 1, and 590 more groups (the busiest shown; --json lists all)"), line
    _, out, _ = cli(db_url, "status", "--json", capsys=capsys)
    assert len([g for g, n in json.loads(out)["due_by_group"].items() if n]) == 600
    eng.dispose()


# ---- item 4: one rule for exit codes ---------------------------------------------------------


@pytest.mark.parametrize("command", ["show", "why", "graph", "retry", "cancel"])
def test_a_missing_job_exits_1_with_one_line_on_stderr(db_url: str, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """1 means "no such job", for every command that takes an ID, and only that (today retry
    and cancel give 2, and why prints to stdout)."""
    code, out, err = cli(db_url, command, "999", capsys=capsys)
    assert (code, out, err) == (1, "", "jobq: no job with id 999\n")
    code, out, err = cli(db_url, command, "999", "--json", capsys=capsys)
    assert (code, out, err) == (1, "", "jobq: no job with id 999\n")


def test_a_refused_retry_is_bad_input_not_a_missing_job(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    eng = sa.create_engine(db_url)
    jid = jobq.enqueue(eng, "t")
    eng.dispose()
    code, _, err = cli(db_url, "retry", str(jid), capsys=capsys)
    assert code == 2 and one_line_error(err) and "only failed or cancelled" in err


# ---- item 3 and issue 20 item 15: every bad input is one line, exit 2 ------------------------

BAD_INPUT = [
    ["worker", "--app", "goodapp:nosuch"],
    ["worker", "--app", "goodapp:not_a_mapping"],
    ["worker", "--app", "brokensyntax:handlers"],
    ["worker", "--app", "brokenimport:handlers"],
    ["worker", "--app", "raisesatimport:handlers"],
    ["worker", "--app", "no_such_module_here:handlers"],
    ["worker", "--app", "nocolon"],
    ["worker", "--app", "goodapp:handlers", "--cap", "g=0"],
    ["worker", "--app", "goodapp:handlers", "--cap", "=3"],
    ["worker", "--app", "goodapp:handlers", "--rate", "g=5"],
    ["worker", "--app", "goodapp:handlers", "--rate", "g=5/0"],
    ["worker", "--app", "goodapp:handlers", "--concurrency", "0"],
    ["worker", "--app", "goodapp:handlers", "--local-concurrency", "0"],
    ["worker", "--app", "goodapp:handlers", "--concurrency", "2", "--local-concurrency", "3"],
    ["worker", "--app", "goodapp:handlers", "--lease-ttl", "3", "--heartbeat", "2"],
    ["status", "--watch", "-1"],
    ["status", "--watch", "0"],
    ["status", "--watch", "nan"],
    ["status", "--bogus"],
    ["prune", "--older-than", "7"],
    ["prune", "--older-than", "-1d"],
    ["prune", "--older-than", "1e300d"],
    ["prune", "--older-than", "infd"],
    ["ls", "--since", "soon"],
    ["ls", "--limit", "0"],
    ["ls", "--limit", "many"],
    ["show", "abc"],
    ["show", "99999999999999999999"],
    ["cancel", "-3"],
    ["graph"],
    ["graph", "1", "--all"],
    ["enqueue", "t", "--args", "{nope"],
    ["enqueue", "t", "--args", "[1]"],
    ["enqueue", "t", "--delay", "-5"],
    ["enqueue", "t", "--delay", "5", "--run-after", "2030-01-01T00:00:00Z"],
    ["enqueue", "t", "--run-after", "2030-01-01T00:00:00"],
    ["enqueue", "t", "--run-after", "tomorrow"],
    ["enqueue", "t", "--run-after", "0001-01-01T00:00:00+01:00"],
    ["enqueue", "t", "--timeout", "0"],
    ["enqueue", "t", "--max-attempts", "0"],
    ["enqueue", "t", "--depends-on", "424242"],
    ["enqueue", "", "--weight", "1"],
    [],
]


@pytest.fixture
def apps(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """Operator modules for --app: a good one, and modules that fail to import in every way."""
    (tmp_path / "goodapp.py").write_text("handlers = {'hello': lambda ctx: None}\nnot_a_mapping = [1]\n")
    (tmp_path / "brokensyntax.py").write_text("handlers = {\n")
    (tmp_path / "brokenimport.py").write_text("import no_such_dependency_of_the_app\n")
    (tmp_path / "raisesatimport.py").write_text("raise RuntimeError('config file missing')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("goodapp", "brokensyntax", "brokenimport", "raisesatimport"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


@pytest.mark.parametrize("args", BAD_INPUT, ids=lambda a: " ".join(a) or "nothing")
def test_bad_input_is_one_line_and_exit_2(db_url: str, args: list[str], apps: pathlib.Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Today several of these raise (AttributeError, SyntaxError, ValueError, OverflowError)
    out of main() with a traceback."""
    code, out, err = cli(db_url, *args, capsys=capsys)
    assert code == 2 and out == "" and one_line_error(err), err
    if "--args" in args:
        assert "--args" in err


def test_a_malformed_args_names_args(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(db_url, "enqueue", "t", "--args", "{nope", capsys=capsys)
    assert code == 2 and err.startswith("jobq: --args is not valid JSON: Expecting property name")


def test_a_closed_pipe_ends_the_command_quietly(tmp_path: pathlib.Path) -> None:
    """`jobq ls | head -1`: the output (about 0.5 MB) is far more than a pipe holds, so the
    command is still writing when the reader closes its end. Today: a BrokenPipeError
    traceback and exit 1."""
    url = f"sqlite:///{tmp_path / 'q.db'}"
    eng = sa.create_engine(url)
    jobq.create_schema(eng)
    jobq.submit(eng, [{"key": str(i), "type": "t"} for i in range(5000)])
    eng.dispose()
    for fmt in ([], ["--json"]):
        with subprocess.Popen([*JOBQ_CLI, "--url", url, "ls", "--limit", "5000", *fmt],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
            assert p.stdout is not None and p.stderr is not None
            assert p.stdout.read(5)
            p.stdout.close()
            err = p.stderr.read()
            assert p.wait(timeout=60) == 0 and err == ""


# ---- URLs: one line, the right code, never a piece of the credentials -------------------------


@pytest.mark.parametrize("url,code,secrets", [
    # an unescaped "@" in the password: the parser puts "ss" into the host name, which the
    # driver's error then prints (today: `connection to server at "ss@127.0.0.1"`)
    ("postgresql+psycopg://u:pa@ss@127.0.0.1:1/x", 2, ["pa", "ss"]),
    ("mysql+pymysql://u:Xq7pa@Zk9ss@127.0.0.1:1/x", 2, ["Xq7pa", "Zk9ss"]),
    ("postgresql+psycopg://u:s3cret@127.0.0.1:1/nodb", 3, ["s3cret"]),
    ("mysql+pymysql://Zk9user:s3cret@127.0.0.1:1/nodb", 3, ["s3cret", "Zk9user"]),
    ("postgresql+psycopg://u:p%40ss9word@127.0.0.1:1/x", 3, ["p%40ss9word", "p@ss9word", "ss9word"]),
    ("postgresql+psycopg://u:s3cret@127.0.0.1:notaport/db", 2, ["s3cret"]),
    ("nosuchdialect://x", 2, []),
    ("postgresql+nosuchdriver://u:s3cret@h/db", 2, ["s3cret"]),
    ("not a url at all", 2, []),
])
def test_connection_problems_are_one_line_without_the_credentials(url: str, code: int, secrets: list[str]) -> None:
    for args in (["--url", url, "status"], ["status", "--url", url]):
        out = run(*args)
        assert out.returncode == code and one_line_error(out.stderr), out.stderr
        for s in secrets:  # not even as a word of its own
            assert not re.search(rf"(?<![A-Za-z0-9]){re.escape(s)}(?![A-Za-z0-9])", out.stderr), out.stderr
            if len(s) >= 4:
                assert s not in out.stderr, out.stderr


def test_driver_text_is_scrubbed_of_every_piece_of_the_credentials() -> None:
    """Belt and braces behind the refusal above: whatever a driver prints, the pieces of the
    userinfo go, and words that merely contain a short piece stay readable."""
    secrets = jobq._url_secrets("postgresql+psycopg://u:pa@ss@127.0.0.1:1/x")
    text = jobq._scrub('connection to server at "ss@127.0.0.1" failed: password for user "u" (pa) wrong', secrets)
    assert text == 'connection to server at "***@127.0.0.1" failed: password for user "***" (***) wrong'
    long = jobq._url_secrets("mysql+pymysql://admin:Tr0ub4dor&3@db/x")
    assert jobq._scrub("Access denied for user 'admin'@'10.0.0.1' (Tr0ub4dor&3)", long) == \
        "Access denied for user '***'@'10.0.0.1' (***)"


# ---- item 5: --url in both places, --version ---------------------------------------------------


def test_url_before_or_after_the_subcommand_and_version(db_url: str, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    assert jobq.main(["status", "--url", db_url]) == 0
    assert "jobs now:" in capsys.readouterr().out
    # the subcommand's --url wins over the global one and over JOBQ_URL
    monkeypatch.setenv("JOBQ_URL", f"sqlite:///{tmp_path / 'elsewhere.db'}")
    assert jobq.main(["--url", f"sqlite:///{tmp_path / 'nowhere.db'}", "ls", "--url", db_url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert jobq.main(["--version"]) == 0
    assert capsys.readouterr().out == f"jobq {jobq.__version__}\n"
    assert jobq.main(["--help"]) == 0 and "exit codes" in capsys.readouterr().out
    monkeypatch.delenv("JOBQ_URL")
    assert jobq.main(["status"]) == 2
    assert capsys.readouterr().err == "jobq: no database: pass --url or set JOBQ_URL\n"


# ---- item 6: no schema, no file ---------------------------------------------------------------


def test_a_database_without_the_schema_says_run_jobq_init(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Today: `jobq: database error: no such table: jobs` (and a worker would log db_error
    forever)."""
    eng = sa.create_engine(db_url)
    jobq.Base.metadata.drop_all(eng)
    try:
        for args in (["status"], ["ls"], ["show", "1"], ["why", "1"], ["enqueue", "t"], ["prune", "--older-than", "1d"],
                     ["worker", "--app", "x:y"]):
            code, out, err = cli(db_url, *args, capsys=capsys)
            assert (code, out, err) == (3, "", "jobq: no jobq schema here: run `jobq init`\n"), args
    finally:
        assert cli(db_url, "init", capsys=capsys)[0] == 0
        eng.dispose()
    with eng.begin() as conn:  # a schema of an older jobq: init upgrades it
        conn.execute(sa.update(META).where(META.c.key == "schema_version").values(value="1"))
    code, _, err = cli(db_url, "status", capsys=capsys)
    assert code == 3 and err == f"jobq: the jobq schema here is version 1, this jobq needs {jobq.SCHEMA_VERSION}: run `jobq init` to upgrade it\n"
    assert cli(db_url, "init", capsys=capsys)[0] == 0 and cli(db_url, "status", capsys=capsys)[0] == 0
    eng.dispose()


def test_no_command_but_init_creates_a_sqlite_file(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A mistyped path must not leave an empty database (or jobq's lock file) behind."""
    path = tmp_path / "typo.db"
    url = f"sqlite:///{path}"
    for args in (["status"], ["ls"], ["show", "1"], ["why", "1"], ["graph", "1"], ["retry", "1"], ["cancel", "1"],
                 ["prune", "--older-than", "1d"], ["enqueue", "t"], ["worker", "--app", "x:y"]):
        code, out, err = cli(url, *args, capsys=capsys)
        assert (code, out) == (3, "") and err == f"jobq: no SQLite database at {path}: check the path, or create it with `jobq init`\n"
        assert list(tmp_path.iterdir()) == [], args
    sqlite3.connect(path).close()  # an empty file: there, but no schema
    assert cli(url, "status", capsys=capsys)[2] == "jobq: no jobq schema here: run `jobq init`\n"
    assert cli(url, "init", capsys=capsys)[0] == 0 and cli(url, "status", capsys=capsys)[0] == 0


# ---- item 7: enqueue's options ----------------------------------------------------------------


def test_enqueue_options_map_onto_enqueue(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    eng = sa.create_engine(db_url)
    up = int(cli(db_url, "enqueue", "a", capsys=capsys)[1])
    code, out, _ = cli(db_url, "enqueue", "b", "--depends-on", str(up), "--delay", "90", "--timeout", "10m",
                       "--max-attempts", "5", "--group", "g", "--weight", "3", "--json", capsys=capsys)
    b = jobq.get(eng, json.loads(out)["id"])
    assert code == 0 and b is not None
    assert (b.depends_on, b.timeout, b.max_attempts, b.group_key, b.weight) == ((up,), 600.0, 5, "g", 3)
    assert b.run_after - b.created_at == dt.timedelta(seconds=90)
    c = jobq.get(eng, int(cli(db_url, "enqueue", "c", "--delay", "30s", capsys=capsys)[1]))
    assert c is not None and c.run_after - c.created_at == dt.timedelta(seconds=30)
    d = jobq.get(eng, int(cli(db_url, "enqueue", "d", "--run-after", "2030-01-31T10:00:00+01:00", capsys=capsys)[1]))
    assert d is not None and d.run_after == dt.datetime(2030, 1, 31, 9, tzinfo=UTC)
    e = jobq.get(eng, int(cli(db_url, "enqueue", "e", "--run-after", "2030-01-31T09:00:00Z", capsys=capsys)[1]))
    assert e is not None and e.run_after == d.run_after
    # the old name still works, and says it is old
    code, out, err = cli(db_url, "enqueue", "f", "--after", str(up), capsys=capsys)
    f = jobq.get(eng, int(out))
    assert code == 0 and f is not None and f.depends_on == (up,)
    assert err == "jobq: --after is deprecated, use --depends-on (the same: wait for that job to be done)\n"
    eng.dispose()


def _cli_guide() -> str:
    """The command line guide of the docs site, whose first example every new user copies."""
    return (ROOT / "docs" / "guides" / "cli.md").read_text()


def _blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)


def test_the_cli_guide_examples_run_on_a_fresh_database(tmp_path: pathlib.Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Every line of the command line guide's example (docs/guides/cli.md), verbatim, in order, on a database that
    does not exist yet; the ids its comments promise; the status it shows; and the worker line
    with an app of those types. Today `--after 12` fails on a fresh database."""
    section = _cli_guide()
    lines = [shlex.split(line, comments=True) for line in _blocks(section, "sh")[0].splitlines() if line.strip()]
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    worker = [args for args in lines if args[1] == "worker"]
    assert len(worker) == 1 and lines[-1] == worker[0]
    outputs = {}
    for args in lines[:-1]:
        assert args[0] == "jobq"
        code, out, err = cli(url, *args[1:], capsys=capsys)
        assert code == 0 and err == "", (args, err)
        outputs[" ".join(args[1:3])] = out
    ids = [int(out) for key, out in outputs.items() if key.startswith("enqueue")]
    assert ids == [1, 2, 3]  # as the comments say
    status = outputs["status"]
    shown = _blocks(section, "text")[0]
    assert [ln.split(":")[0] for ln in status.splitlines()] == [ln.split(":")[0] for ln in shown.splitlines()]
    assert status.splitlines()[0] == shown.splitlines()[0]
    assert outputs["why 2"].startswith("job 2 (publish, group default) is waiting on 1 upstream job(s): 1 (")
    # the worker line, with an app that has handlers for the example's types
    app = tmp_path / "myproject"
    app.mkdir()
    (app / "__init__.py").write_text("")
    (app / "jobs.py").write_text("handlers = {t: (lambda ctx: {'ok': True}) for t in ('resize', 'publish', 'report')}\n")
    p = subprocess.Popen([*JOBQ_CLI, *worker[0][1:], "--url", url], cwd=tmp_path,
                         stderr=subprocess.PIPE, text=True)
    eng = sa.create_engine(url)
    try:
        deadline = time.monotonic() + 30
        while jobq.get(eng, 1).state != "done":  # type: ignore[union-attr]
            assert time.monotonic() < deadline and p.poll() is None, "the guide's worker did not run job 1"
            time.sleep(0.05)
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        eng.dispose()
    assert p.returncode == 0, err


# ---- item 8: why's wording, times as ISO 8601 UTC, aware JobInfo ------------------------------


def test_why_tells_due_from_scheduled(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Today: "ready, due for 7s" (meaning overdue) and "ready but not due for 28s"."""
    eng = sa.create_engine(db_url)
    due = jobq.enqueue(eng, "t", group_key="g")
    later = jobq.enqueue(eng, "t", run_after=dt.timedelta(minutes=30))
    code, out, _ = cli(db_url, "why", str(due), capsys=capsys)
    assert re.match(rf"job {due} \(t, group g\) is ready, due \d+s ago, waiting for a worker: 0 due job\(s\) ahead", out)
    info = jobq.get(eng, later)
    assert info is not None
    code, out, _ = cli(db_url, "why", str(later), capsys=capsys)
    assert re.fullmatch(rf"job {later} \(t, group default\) is scheduled, runs in (29m[0-5]\ds|30m00s) "
                        rf"\(at {re.escape(jobq._iso(info.run_after) or '')}\)\n", out), out
    (lease,) = jobq.claim_batch(eng, "w", 30, limit=1, types=["t"])
    jobq.fail(eng, lease.id, "ValueError: bad", worker_id="w", token=lease.token, delay=600)
    code, out, _ = cli(db_url, "why", str(lease.id), capsys=capsys)
    assert re.search(rf"is scheduled, runs in (9m[0-5]\ds|10m00s) \(at {ISO_S}\): backing off after attempt 1: ValueError: bad$",
                     out.strip()), out
    eng.dispose()


def test_times_print_as_iso_8601_utc_everywhere(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    eng = sa.create_engine(db_url)
    jid = jobq.enqueue(eng, "t", {"x": 1})
    info = jobq.get(eng, jid)
    assert info is not None
    _, out, _ = cli(db_url, "ls", capsys=capsys)
    header, row = out.splitlines()
    assert header.split() == ["ID", "TYPE", "STATE", "GROUP_KEY", "ATTEMPTS", "MAX_ATTEMPTS", "RUN_AFTER", "CREATED_AT", "FINISHED_AT"]
    assert row.split()[-2:] == [jobq._iso(info.run_after), jobq._iso(info.created_at)]
    assert re.fullmatch(ISO_S, row.split()[-1])
    (listed,) = json.loads(cli(db_url, "ls", "--json", capsys=capsys)[1])
    assert listed["created_at"] == jobq._iso(info.created_at, precise=True) and re.fullmatch(ISO_US, listed["created_at"])
    shown = json.loads(cli(db_url, "show", str(jid), "--json", capsys=capsys)[1])
    assert shown["run_after"] == listed["run_after"] and shown["finished_at"] is None and shown["args"] == {"x": 1}
    _, out, _ = cli(db_url, "show", str(jid), capsys=capsys)
    assert f"created_at: {jobq._iso(info.created_at)}\n" in out and 'args: {"x": 1}\n' in out
    st = json.loads(cli(db_url, "status", "--json", capsys=capsys)[1])
    assert re.fullmatch(ISO_US, st["now"]) and re.fullmatch(ISO_US, st["oldest_ready"])
    eng.dispose()


def test_jobinfo_times_are_aware_utc(engine: sa.Engine) -> None:
    """enqueue refuses naive times, so get() must not hand them out: a JobInfo time goes
    straight back into run_after. Today every JobInfo datetime is naive."""
    jid = jobq.enqueue(engine, "t")
    (lease,) = jobq.claim_batch(engine, "w", 30)
    jobq.heartbeat(engine, lease, 30)
    info = jobq.get(engine, jid)
    assert info is not None
    for name in jobq._JOBINFO_TIMES:
        value = getattr(info, name)
        assert name in ("started_at", "finished_at") or value is not None, name
        assert value is None or (value.tzinfo is not None and value.utcoffset() == dt.timedelta(0)), name
    later = jobq.get(engine, jobq.enqueue(engine, "t", run_after=info.created_at + dt.timedelta(hours=1)))
    assert later is not None and later.run_after == info.created_at + dt.timedelta(hours=1)
    jobq.finalize(engine, jid, {}, worker_id="w", token=lease.token)
    done = jobq.get(engine, jid)
    assert done is not None and done.finished_at is not None and done.finished_at.tzinfo is not None
    assert done.created_at <= done.finished_at


# ---- item 10: --json everywhere, the worker's options ------------------------------------------


def test_every_command_that_prints_takes_json(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Today why, retry, cancel, prune, enqueue, init and graph have no --json."""

    def j(*args: str) -> object:
        code, out, err = cli(db_url, *args, "--json", capsys=capsys)
        assert code == 0 and err == "", (args, err)
        return json.loads(out)

    assert j("init") == {"schema_version": jobq.SCHEMA_VERSION}
    a = j("enqueue", "t")["id"]  # type: ignore[index]
    b = j("enqueue", "t", "--depends-on", str(a))["id"]  # type: ignore[index]
    assert j("why", str(b))["state"] == "waiting"  # type: ignore[index]
    assert j("why", str(b))["why"].startswith(f"job {b} (t, group default) is waiting on 1")  # type: ignore[index]
    graph = j("graph", str(a))
    assert graph["edges"] == [[a, b]] and [n["id"] for n in graph["nodes"]] == [a, b]  # type: ignore[index]
    assert graph["text"].startswith("flowchart TD")  # type: ignore[index]
    assert j("cancel", str(a)) == {"id": a, "state": "cancelled", "cancel_requested": False}
    assert j("retry", str(a)) == {"id": a, "reopened": [a, b]}
    st = j("status")
    assert st["states"]["ready"] == 1 and st["ready_due"] == 1 and st["ready_scheduled"] == 0  # type: ignore[index]
    assert [r["id"] for r in j("ls")] == [b, a]  # type: ignore[union-attr]
    assert j("show", str(b))["depends_on"] == [a]  # type: ignore[index]
    assert j("prune", "--older-than", "1d") == {"deleted": 0}


class _Recorded(jobq.Worker):
    """The Worker the command builds, kept instead of run: the test reads its options."""

    made: list[jobq.Worker] = []

    def run(self) -> None:
        _Recorded.made.append(self)


def test_worker_flags_map_onto_worker_options(db_url: str, apps: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(jobq, "Worker", _Recorded)
    _Recorded.made.clear()
    code, _, err = cli(db_url, "worker", "--app", "goodapp:handlers", "--concurrency", "7", "--local-concurrency", "4",
                       "--lease-ttl", "12",
                       "--heartbeat", "3", "--poll", "0.25", "--timeout", "5m", "--shutdown-timeout", "9",
                       "--cap", "a=2", "--cap", "b=1", "--rate", "a=10/1m", "--rate", "*=100/1", "--worker-id", "cli-w1",
                       "--log-level", "warning", capsys=capsys)
    assert code == 0, err
    (w,) = _Recorded.made
    assert (w.max_concurrency, w.local_concurrency, w.lease_ttl, w.heartbeat_interval, w.poll_interval, w.timeout,
            w.shutdown_timeout) == (7, 4, 12.0, 3.0, 0.25, 300.0, 9.0)
    assert w.group_caps == {"a": 2, "b": 1} and w.rate_limits == {"a": (10, 60.0), "*": (100, 1.0)}
    assert (w.worker_id, w.listen, w.executor, sorted(w.handlers)) == ("cli-w1", False, "thread", ["hello"])
    code, _, err = cli(db_url, "worker", "--app", "goodapp:handlers", "--listen", capsys=capsys)
    if db_url.startswith("postgresql+psycopg"):
        assert code == 0 and _Recorded.made[-1].listen
    else:
        assert code == 2 and err == "jobq: listen=True needs PostgreSQL with the psycopg (3) driver\n"


@only("sqlite", "postgresql")  # no dialect code of its own: the Worker is covered everywhere else
def test_worker_command_runs_the_operators_handlers_and_stops_on_sigterm(db_url: str, tmp_path: pathlib.Path) -> None:
    (tmp_path / "myapp.py").write_text("handlers = {'hello': lambda ctx: {'greeting': 'hi ' + ctx.args['name']}}\n")
    eng = sa.create_engine(db_url)
    jid = jobq.enqueue(eng, "hello", {"name": "ops"})
    p = subprocess.Popen([*JOBQ_CLI, "worker", "--url", db_url, "--app", "myapp:handlers",
                          "--concurrency", "2", "--poll", "0.05", "--log-level", "debug", "--worker-id", "cli-w1"],
                         cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while jobq.get(eng, jid).state != "done":  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the worker did not run the job"
            time.sleep(0.05)
    finally:
        p.terminate()
        try:
            _, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()  # leave no process behind for the next test
            p.communicate()
            raise
    assert p.returncode == 0
    assert jobq.get(eng, jid).result == {"greeting": "hi ops"}  # type: ignore[union-attr]
    assert "worker cli-w1 started: types hello" in err and "worker cli-w1 stopped" in err
    assert f"DEBUG jobq claimed job={jid} type=hello" in err  # --log-level debug
    eng.dispose()


# ---- issue 13: the command line, get, why and stats run only named builders ---------------------

_SQL_CALLS = {"select", "update", "insert", "delete", "text", "union_all", "exists"}


def test_the_command_line_get_why_and_stats_build_no_sql_inline() -> None:
    """Every statement they run is a `_q_*` builder of the SQL module, none written inline."""
    checked, inline = [], []
    for path in sorted((ROOT / "jobq").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            name = getattr(node, "name", "")
            if name in ("get", "why", "stats") or (path.name == "cli.py" and isinstance(node, ast.FunctionDef | ast.ClassDef)):
                checked.append(name)
                for sub in ast.walk(node):
                    if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in _SQL_CALLS
                            and isinstance(sub.func.value, ast.Name) and sub.func.value.id == "sa"):
                        inline.append(f"{path.name}:{name}:{sub.lineno} sa.{sub.func.attr}")
    assert {"get", "why", "stats", "main", "_run_command", "_graph_data"} <= set(checked)
    assert inline == []


def test_group_and_groups_store_and_show_policy_and_why_names_it(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """jobq group KEY sets what it is given (--cap/--rate none remove a limit); jobq groups
    lists; why says a due job of a paused or capped group is held by its group's policy; bad
    values are one line and exit 2, nothing stored."""
    assert cli(db_url, "init", capsys=capsys)[0] == 0
    code, out, _ = cli(db_url, "group", "t1", capsys=capsys)
    assert code == 0 and "no stored policy" in out
    code, out, _ = cli(db_url, "group", "t1", "--weight", "3", "--cap", "2", "--rate", "10/1m", "--pause", capsys=capsys)
    assert code == 0 and out.strip() == "group t1: weight 3, cap 2, rate 10/60s, PAUSED"
    job = int(cli(db_url, "enqueue", "t", "--group", "t1", capsys=capsys)[1])
    code, out, _ = cli(db_url, "why", str(job), capsys=capsys)
    assert "not claimed: its group is paused (resume it with: jobq group t1 --resume)" in out
    code, out, _ = cli(db_url, "group", "t1", "--resume", "--cap", "none", capsys=capsys)
    assert out.strip() == "group t1: weight 3, cap none, rate 10/60s"
    code, out, _ = cli(db_url, "groups", "--json", capsys=capsys)
    assert [(g["group_key"], g["weight"], g["max_in_flight"], g["rate_limit"], g["paused"]) for g in json.loads(out)] == [
        ("t1", 3, None, [10, 60.0], False)]
    code, out, _ = cli(db_url, "status", capsys=capsys)
    assert "group t1: weight 3, cap none, rate 10/60s" in out
    for bad in (["--rate", "10"], ["--cap", "0"], ["--pause", "--resume"], ["--weight", "x"]):
        code, _, err = cli(db_url, "group", "t1", *bad, capsys=capsys)
        assert code == 2 and one_line_error(err), (bad, err)
    assert cli(db_url, "group", "t1", capsys=capsys)[1].strip() == "group t1: weight 3, cap none, rate 10/60s"


# ---- issue 39 item 11: a URL without a loadable driver says which one to write ---------------------------


@pytest.mark.parametrize("url,blocked,meant", [
    ("postgres://postgres@127.0.0.1/db", None, "postgresql+psycopg://"),
    ("mysql://root@127.0.0.1/db", "MySQLdb", "mysql+pymysql://"),
    ("mariadb://root@127.0.0.1/db", "MySQLdb", "mariadb+pymysql://"),
])
def test_a_url_without_a_driver_suggests_the_one_jobq_installs(url: str, blocked: str | None, meant: str) -> None:
    """Old code: `Can't load plugin: sqlalchemy.dialects:***` (the user name "postgres" was
    scrubbed as a credential although it is the dialect's name) and `No module named 'MySQLdb'`
    with no word of the PyMySQL driver the mysql extra installs. ``blocked`` is a driver made
    unimportable in the child, as on a machine with only jobq's extras."""
    code = (f"import sys; sys.modules[{blocked!r}] = None; " if blocked else "import sys; ") + \
        f"sys.path.insert(0, {str(ROOT)!r}); import jobq; sys.exit(jobq.main(['--url', {url!r}, 'status']))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and one_line_error(p.stderr), p.stderr
    assert meant in p.stderr and "***" not in p.stderr, p.stderr
    if url.startswith("postgres://"):
        assert "sqlalchemy.dialects:postgres" in p.stderr, p.stderr


def test_the_password_is_scrubbed_when_the_user_name_is_the_dialects() -> None:
    secrets = jobq._url_secrets("postgres://postgres:hunter2@127.0.0.1/db")
    assert "postgres" not in secrets and "hunter2" in secrets
    secrets = jobq._url_secrets("postgres://postgres:postgres@127.0.0.1/db")  # a password is always scrubbed
    assert "postgres" in secrets


def test_cancel_of_a_running_job_says_cancel_requested_everywhere(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 39 item 13. Old code printed `job N: running` (read as "nothing happened") and its
    JSON had no cancel_requested. Correct: the text says the cancel is requested and when it
    applies, --json says cancel_requested true, and show and why show the request."""
    cli(db_url, "init", capsys=capsys)
    engine = sa.create_engine(db_url)
    try:
        jid = jobq.enqueue(engine, "t")
        lease = jobq.claim_batch(engine, "w", 300)[0]
        code, out, err = cli(db_url, "cancel", str(jid), capsys=capsys)
        assert code == 0 and out.strip() == f"job {jid}: cancel requested; it ends cancelled when its handler returns", err
        code, out, _ = cli(db_url, "cancel", str(jid), "--json", capsys=capsys)
        assert code == 0 and json.loads(out) == {"id": jid, "state": "leased", "cancel_requested": True}
        code, out, _ = cli(db_url, "show", str(jid), capsys=capsys)
        assert re.search(r"cancel_requested: True", out), out
        assert json.loads(cli(db_url, "show", str(jid), "--json", capsys=capsys)[1])["cancel_requested"] is True
        code, out, _ = cli(db_url, "why", str(jid), capsys=capsys)
        assert "cancel requested" in out, out
        assert jobq.fail(engine, jid, "stopped", worker_id="w", token=lease.token) == "cancelled"
        code, out, _ = cli(db_url, "cancel", str(jid), "--json", capsys=capsys)
        assert json.loads(out) == {"id": jid, "state": "cancelled", "cancel_requested": False}
    finally:
        engine.dispose()


# ---- issue 39: a user named "root" is blanked only where it stands as the login ----------------------------


@pytest.mark.parametrize("url", ["mysql+pymysql://root@127.0.0.1:3307/db", "mariadb+pymysql://root@127.0.0.1:3306/db",
                                 "mysql+pymysql://root:hunter2@127.0.0.1:3307/db"])
def test_a_login_named_root_is_blanked_only_as_the_login(url: str) -> None:
    """Old code blanked "root" everywhere: `jobq retry --*** 7`, `from its ***`. The login is
    still blanked where a message names it as one, and a password everywhere."""
    secrets = jobq._url_secrets(url)
    advice = "retry that one first, or re-open the chain from its root: jobq retry --root 7 (root/rooted)"
    assert jobq._scrub(advice, secrets) == advice
    assert jobq._scrub("(1045, \"Access denied for user 'root'@'localhost' (using password: YES)\")", secrets) == \
        "(1045, \"Access denied for user '***'@'localhost' (using password: YES)\")"
    assert jobq._scrub('password authentication failed for user "root"', secrets) == \
        'password authentication failed for user "***"'
    shown = url.replace(":hunter2", ":***")  # SQLAlchemy's own rendering of the URL
    assert "root" not in jobq._scrub(f"engine {shown} and {shown.partition('://')[2]}", secrets)
    assert jobq._scrub("the password hunter2 and hunter2hunter2 again", secrets).count("hunter2") == \
        (0 if "hunter2" in url else 3)
