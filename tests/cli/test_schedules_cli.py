"""jobq schedule / jobq schedules: make, show, list, pause, resume and remove a recurring job
from the command line; bad input is one line and exit 2, a missing schedule exit 1."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

import jobq
from helpers import one_line_error


def cli(url: str, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = jobq.main(["--url", url, *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_schedule_commands_make_list_pause_resume_remove(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(db_url, "init", capsys=capsys)[0] == 0
    code, out, _ = cli(db_url, "schedules", capsys=capsys)
    assert code == 0 and out.strip() == "no schedules"
    code, out, _ = cli(db_url, "schedule", "nightly", "--type", "cleanup", "--every", "1d", "--args", '{"keep": 7}',
                       "--group", "ops", capsys=capsys)
    assert code == 0 and out.startswith("schedule nightly: cleanup in group ops, every 24h00m, next ")
    assert out.strip().endswith("never fired, 0 run(s)")
    code, out, _ = cli(db_url, "schedule", "quarter", "--type", "sync", "--cron", "*/15 * * * *", capsys=capsys)
    assert code == 0 and "cron '*/15 * * * *' (UTC)" in out
    code, out, _ = cli(db_url, "schedule", "nightly", "--pause", capsys=capsys)
    assert code == 0 and out.strip().endswith(", PAUSED")
    code, out, _ = cli(db_url, "schedules", "--json", capsys=capsys)
    rows = json.loads(out)
    assert [(r["name"], r["every"], r["cron"], r["paused"], r["args"]) for r in rows] == [
        ("nightly", 86400.0, None, True, {"keep": 7}), ("quarter", None, "*/15 * * * *", False, {})]
    code, out, _ = cli(db_url, "schedule", "nightly", "--resume", capsys=capsys)
    assert code == 0 and "PAUSED" not in out
    code, out, _ = cli(db_url, "schedule", "nightly", "--remove", capsys=capsys)
    assert code == 0 and out.strip() == "schedule nightly: removed"
    code, _, err = cli(db_url, "schedule", "nightly", capsys=capsys)
    assert code == 1 and err.strip() == "jobq: no schedule named 'nightly'"
    assert cli(db_url, "schedule", "nightly", "--remove", capsys=capsys)[0] == 1
    for bad in (["--type", "t", "--every", "0"], ["--type", "t", "--cron", "bad"], ["--every", "5m"],
                ["--type", "t", "--every", "5m", "--cron", "* * * * *"], ["--type", "t"],
                ["--pause", "--resume"], ["--pause", "--type", "t"], ["--type", "t", "--every", "1m", "--args", "[]"]):
        code, _, err = cli(db_url, "schedule", "x", *bad, capsys=capsys)
        assert code == 2 and one_line_error(err), (bad, err)
    engine = sa.create_engine(db_url)
    assert [s.name for s in jobq.schedules(engine)] == ["quarter"]
    engine.dispose()
