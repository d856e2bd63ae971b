"""``jobq signal KEY [--payload JSON]`` and what ``jobq why``, ``jobq show`` and ``jobq status`` say of
suspended jobs (issue 42)."""

from __future__ import annotations

import datetime as dt
import json

import pytest
import sqlalchemy as sa

import jobq
from helpers import FAST, cli, one_line_error, state


def test_signal_from_the_command_line_wakes_the_waiting_job(db_url: str, engine: sa.Engine,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """why names the signal and the timeout; `jobq signal` sends it (a second time: says so);
    the job runs again and reads the payload."""
    job = jobq.enqueue(engine, "t", {})
    w = jobq.Worker(engine, {"t": lambda ctx: {"got": ctx.wait_for("invoice-9", timeout=3600)}},
                    max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=30) and state(engine, job) == "ready"
    code, out, _ = cli(db_url, "why", str(job), capsys=capsys)
    assert code == 0 and "is waiting for signal 'invoice-9' since" in out and "timeout at" in out, out
    code, out, _ = cli(db_url, "status", capsys=capsys)
    assert code == 0 and "ready=1 (0 due, 1 scheduled, 1 of them suspended (1 waiting for a signal))" in out, out
    code, out, _ = cli(db_url, "show", str(job), capsys=capsys)
    line = next(x for x in out.splitlines() if x.strip().startswith("suspended:"))
    assert "waiting for signal 'invoice-9' since" in line and "(timeout at" in line and "holding no slot" in line, out
    code, out, _ = cli(db_url, "show", str(job), "--json", capsys=capsys)
    shown = json.loads(out)["suspended"]
    assert (shown["kind"], shown["key"]) == ("signal", "invoice-9") and shown["timeout_at"], shown
    code, out, _ = cli(db_url, "signal", "invoice-9", "--payload", '{"paid": 12.5}', capsys=capsys)
    assert (code, out.strip()) == (0, "signal 'invoice-9' sent")
    code, out, _ = cli(db_url, "signal", "invoice-9", "--json", capsys=capsys)
    assert code == 0 and json.loads(out) == {"key": "invoice-9", "sent": False}
    assert w.run_until_idle(timeout=30)
    info = jobq.get(engine, job)
    assert info is not None and info.result == {"got": {"paid": 12.5}}, info


def test_why_says_sleeping_and_snoozed(db_url: str, engine: sa.Engine, capsys: pytest.CaptureFixture[str]) -> None:
    sleeper = jobq.enqueue(engine, "s", {})
    snoozer = jobq.enqueue(engine, "z", {})
    handlers = {"s": lambda ctx: ctx.sleep(3600), "z": lambda ctx: (_ for _ in ()).throw(jobq.Snooze(600))}
    assert jobq.Worker(engine, handlers, max_concurrency=2, **FAST).run_until_idle(timeout=30)
    assert "is sleeping until" in cli(db_url, "why", str(sleeper), capsys=capsys)[1]
    assert "is snoozed until" in cli(db_url, "why", str(snoozer), capsys=capsys)[1]
    shown = cli(db_url, "show", str(sleeper), capsys=capsys)[1]
    assert any(x.strip().startswith("suspended: sleeping until") for x in shown.splitlines()), shown
    assert "2 scheduled, 2 of them suspended)" in cli(db_url, "status", capsys=capsys)[1]
    plain = jobq.enqueue(engine, "later", {}, run_after=dt.timedelta(hours=1))  # scheduled, not suspended
    assert "3 scheduled, 2 of them suspended)" in cli(db_url, "status", capsys=capsys)[1]
    assert json.loads(cli(db_url, "show", str(plain), "--json", capsys=capsys)[1])["suspended"] is None


def test_bad_signal_input_is_one_line_and_exit_2(db_url: str, engine: sa.Engine, capsys: pytest.CaptureFixture[str]) -> None:
    for args in (("signal", "k", "--payload", "{nope"), ("signal", " k"), ("signal", "k", "--payload", "NaN")):
        code, _, err = cli(db_url, *args, capsys=capsys)
        assert code == 2 and one_line_error(err), (args, err)
