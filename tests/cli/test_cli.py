"""The jobq command: every subcommand, tables for people, --json for scripts, exit codes, and
one clear line (no traceback, no password) when the database or the input is wrong."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import sqlalchemy as sa

import jobq
from dbs import only

ROOT = pathlib.Path(__file__).resolve().parents[2]


def cli(url: str, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = jobq.main(["--url", url, *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_every_subcommand_on_a_small_pipeline(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(db_url, "init", capsys=capsys)[0] == 0
    code, out, _ = cli(db_url, "enqueue", "fetch", "--args", '{"u": 1}', "--group", "t1", capsys=capsys)
    fetch = int(out)
    box = int(cli(db_url, "enqueue", "box", "--container", capsys=capsys)[1])
    kid = int(cli(db_url, "enqueue", "work", "--parent", str(box), "--after", str(fetch), capsys=capsys)[1])
    code, out, _ = cli(db_url, "why", str(kid), capsys=capsys)
    assert code == 0 and f"waiting on 1 upstream job(s): {fetch} (ready)" in out
    code, out, _ = cli(db_url, "why", str(fetch), capsys=capsys)
    assert "is ready" in out and "no worker is running jobs" in out
    code, out, _ = cli(db_url, "status", capsys=capsys)
    assert "ready=1" in out and "waiting=2" in out
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
    assert "is done" in out
    code, out, _ = cli(db_url, "prune", "--older-than", "0s", capsys=capsys)
    assert out.strip() == "deleted 3 job(s)"
    assert jobq.get(eng, fetch) is None
    eng.dispose()


def test_unknown_ids_and_bad_input_exit_with_one_line(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(db_url, "show", "999", capsys=capsys)[0] == 1
    assert cli(db_url, "graph", "999", capsys=capsys)[0] == 1
    code, out, _ = cli(db_url, "why", "999", capsys=capsys)
    assert code == 1 and "no such job" in out
    code, _, err = cli(db_url, "enqueue", "t", "--args", "[1]", capsys=capsys)
    assert code == 2 and err.startswith("jobq: args must be a JSON object") and len(err.splitlines()) == 1
    code, _, err = cli(db_url, "enqueue", "t", "--args", "{nope", capsys=capsys)
    assert code == 2 and len(err.splitlines()) == 1
    eng = sa.create_engine(db_url)
    code, _, err = cli(db_url, "retry", str(jobq.enqueue(eng, "t")), capsys=capsys)
    eng.dispose()
    assert code == 2 and "only failed or cancelled" in err


@pytest.mark.parametrize("url,code,needle", [
    ("postgresql+psycopg://u:s3cret@127.0.0.1:1/nodb", 3, "jobq: database error"),
    ("nosuchdialect://x", 2, "jobq:"),
    ("postgresql+nosuchdriver://u:s3cret@h/db", 2, "jobq:"),
])
def test_connection_problems_are_one_line_without_the_password(url: str, code: int, needle: str) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "jobq.py"), "--url", url, "status"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == code, out.stderr
    assert out.stderr.startswith(needle) and len(out.stderr.strip().splitlines()) == 1
    assert "s3cret" not in out.stderr and "Traceback" not in out.stderr


@only("sqlite", "postgresql")  # no dialect code of its own: the Worker is covered everywhere else
def test_worker_command_runs_the_operators_handlers_and_stops_on_sigterm(db_url: str, tmp_path: pathlib.Path) -> None:
    (tmp_path / "myapp.py").write_text("handlers = {'hello': lambda ctx: {'greeting': 'hi ' + ctx.args['name']}}\n")
    eng = sa.create_engine(db_url)
    jid = jobq.enqueue(eng, "hello", {"name": "ops"})
    p = subprocess.Popen([sys.executable, str(ROOT / "jobq.py"), "--url", db_url, "worker", "--app", "myapp:handlers",
                          "--concurrency", "2"], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        deadline = __import__("time").monotonic() + 30
        while jobq.get(eng, jid).state != "done":  # type: ignore[union-attr]
            assert __import__("time").monotonic() < deadline, "the worker did not run the job"
            __import__("time").sleep(0.05)
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    assert p.returncode == 0
    assert jobq.get(eng, jid).result == {"greeting": "hi ops"}  # type: ignore[union-attr]
    assert "started: types hello" in err and "stopped" in err
    eng.dispose()
