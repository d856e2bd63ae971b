"""`jobq why` names the job to retry for a job closed by its failed upstream, and
`jobq retry --root N` re-opens the chain from that root (plain `jobq retry N` is refused,
saying so)."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

import jobq
from helpers import cli


def test_why_names_the_root_and_retry_root_reopens_the_chain(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A fails for good; B and C (a chain on it) close. The bug: `why C` said `jobq retry C`,
    which was refused ("retry that one first"), then B's the same, one level at a time."""
    eng = sa.create_engine(db_url)
    a = jobq.enqueue(eng, "fetch", max_attempts=1)
    b = jobq.enqueue(eng, "t", depends_on=[a])
    c = jobq.enqueue(eng, "t", depends_on=[b])
    lease = jobq.claim(eng, "w", 30)
    assert lease == a
    jobq.fail(eng, a, "boom", worker_id="w", token=lease.token)
    code, out, _ = cli(db_url, "why", str(c), capsys=capsys)
    assert code == 0 and f"retry job {a}, the failed job this one waits on (jobq retry {a})" in out, out
    assert f"jobq retry --root {c}" in out
    code, out, err = cli(db_url, "retry", str(c), capsys=capsys)
    # (errors go through the URL's credential scrubber: a user named "root", as on the MySQL and
    # MariaDB test servers, must not blank "--root")
    assert code != 0 and f"depends on job {b}, which is failed" in err, err
    assert f"re-open the chain from its root: jobq retry --root {c}" in err, err
    code, out, err = cli(db_url, "retry", "--root", str(c), "--json", capsys=capsys)
    assert code == 0, err
    assert json.loads(out) == {"id": c, "reopened": [c, a, b]}
    assert [jobq.get(eng, i).state for i in (a, b, c)] == ["ready", "waiting", "waiting"]  # type: ignore[union-attr]
    eng.dispose()
