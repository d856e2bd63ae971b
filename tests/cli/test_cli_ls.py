"""`jobq ls`: every --state given is listed (repeatable, or comma-separated), and a list cut at
--limit says so on stderr, naming the next page, while stdout holds only the rows."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

import jobq
from helpers import cli, one_line_error


def listed(out: str) -> set[int]:
    return {int(line.split()[0]) for line in out.splitlines()[1:]}


def test_ls_lists_every_state_it_is_given(db_url: str, engine: sa.Engine, capsys: pytest.CaptureFixture[str]) -> None:
    """The bug: `jobq ls --state failed --state cancelled` listed only the cancelled jobs (the
    last --state replaced the others), without a word."""
    failed = jobq.enqueue(engine, "t", max_attempts=1)
    lease = jobq.claim(engine, "w", 30)
    assert lease == failed
    jobq.fail(engine, failed, "boom", worker_id="w", token=lease.token)
    done = jobq.enqueue(engine, "t")
    lease = jobq.claim(engine, "w", 30)
    assert lease == done
    jobq.finalize(engine, done, {}, worker_id="w", token=lease.token)
    cancelled = jobq.enqueue(engine, "t")
    assert jobq.cancel(engine, cancelled) == "cancelled"
    jobq.enqueue(engine, "t")  # ready: listed by none of these

    for args in (["--state", "failed", "--state", "cancelled"], ["--state", "failed,cancelled"],
                 ["--state", "cancelled, failed"], ["--state", "failed", "--state", "cancelled,failed"]):
        code, out, err = cli(db_url, "ls", *args, capsys=capsys)
        assert code == 0 and err == "" and listed(out) == {failed, cancelled}, (args, out, err)
        code, out, err = cli(db_url, "ls", *args, "--json", capsys=capsys)
        assert code == 0 and err == "", err
        assert sorted((r["id"], r["state"]) for r in json.loads(out)) == [(failed, "failed"), (cancelled, "cancelled")]
    code, out, _ = cli(db_url, "ls", "--state", "done", capsys=capsys)  # a single state, as before
    assert code == 0 and listed(out) == {done}
    for bad in ("nope", "failed,", "failed,nope"):
        code, out, err = cli(db_url, "ls", "--state", bad, capsys=capsys)
        assert code == 2 and out == "" and one_line_error(err) and "invalid state" in err, (bad, err)


def test_ls_says_on_stderr_when_more_jobs_match_than_it_shows(db_url: str, engine: sa.Engine,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The bug: `ls` stopped at 50 rows (its default --limit) without a word. Now one line on
    stderr names the next page (--before ID) and --limit; stdout, text or JSON, holds only the
    rows, so a pipe reads clean data. A list that fits says nothing."""
    ids = [jobq.enqueue(engine, "t") for _ in range(51)]
    code, out, err = cli(db_url, "ls", capsys=capsys)
    assert code == 0 and listed(out) == set(ids[1:]), err
    assert one_line_error(err) and f"--before {ids[1]}" in err and "--limit" in err, err
    code, out, err = cli(db_url, "ls", "--json", "--limit", "20", capsys=capsys)
    assert [r["id"] for r in json.loads(out)] == ids[-1:-21:-1]
    assert one_line_error(err) and f"--before {ids[-20]}" in err, err
    code, out, err = cli(db_url, "ls", "--json", "--limit", "20", "--before", str(ids[-20]), capsys=capsys)
    assert [r["id"] for r in json.loads(out)] == ids[-21:-41:-1] and f"--before {ids[-40]}" in err, err
    code, out, err = cli(db_url, "ls", "--json", "--limit", "20", "--before", str(ids[-40]), capsys=capsys)
    assert [r["id"] for r in json.loads(out)] == ids[-41::-1] and err == "", err  # the last page: 11 rows
    code, out, err = cli(db_url, "ls", "--limit", "51", capsys=capsys)
    assert len(listed(out)) == 51 and err == "", err  # exactly the limit: nothing more to say
