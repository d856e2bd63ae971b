"""A job closed by its failed upstream: `why` names the job to retry (the root of its chain),
and `retry(..., from_root=True)` re-opens the chain from that root in one call. Without them a
user told "jobq retry N" was refused ("retry that one first") one level at a time up a chain."""

from __future__ import annotations

import itertools

import pytest
import sqlalchemy as sa

import jobq
from helpers import counted

_types = itertools.count()


def failed(engine: sa.Engine, job_id: int | None = None) -> int:
    """A job (``job_id``, or a new one) that ran once and failed for good. Each has its own
    type, so the claim takes it and not a job re-opened earlier."""
    if job_id is None:
        job_id = jobq.enqueue(engine, f"root{next(_types)}", max_attempts=1)
    type_ = jobq.get(engine, job_id).type  # type: ignore[union-attr]
    lease = jobq.claim(engine, "w", 30, types=[type_])
    assert lease == job_id
    assert jobq.fail(engine, job_id, "boom", worker_id="w", token=lease.token, retry=False) == "failed"
    return job_id


def states(engine: sa.Engine, *ids: int) -> list[str]:
    return [jobq.get(engine, i).state for i in ids]  # type: ignore[union-attr]


def closed_chain_costs(engine: sa.Engine, n: int) -> tuple[int, int]:
    """Statements of why and of retry(from_root=True) for the tail of a chain of ``n`` jobs
    closed by its failed head (checking that why names the head and the retry re-opens all)."""
    head_type = f"chainhead{next(_types)}"
    ids = jobq.submit(engine, [{"key": "0", "type": head_type, "max_attempts": 1}] + [
        {"key": str(i), "type": "t", "depends_on": [str(i - 1)]} for i in range(1, n)])
    head, tail = ids["0"], ids[str(n - 1)]
    failed(engine, head)
    with counted(engine) as why_sql:
        line = jobq.why(engine, tail)
    assert f"retry job {head}, the failed job" in line, line
    with counted(engine) as retry_sql:
        reopened = jobq.retry(engine, tail, from_root=True)
    assert reopened[0] == tail and sorted(reopened) == sorted(ids.values())
    return len(why_sql), len(retry_sql)


def test_finding_the_root_costs_statements_independent_of_the_chains_length(engine: sa.Engine) -> None:
    """why and retry(from_root=True) of the tail of a 30-job and of a 120-job closed chain send
    the same number of statements: one recursive read walks up to the root. A walk of a level
    at a time (as before) shows as about 180 more statements for the longer chain."""
    small, large = closed_chain_costs(engine, 30), closed_chain_costs(engine, 120)
    assert large == small, f"(why, retry --root) statements: {small} for 30 jobs, {large} for 120"


def test_why_names_the_root_of_a_closed_chain_and_retry_from_root_reopens_it(engine: sa.Engine) -> None:
    """A fails; B (on A) and C (on B) close. why(C) names A, not C: retrying C is refused, since
    its upstream B is failed too. retry(C, from_root=True) re-opens A, B and C, C first in the
    answer, and the chain runs again (A ready, B and C waiting on it)."""
    a = failed(engine)
    b = jobq.enqueue(engine, "t", depends_on=[a])
    c = jobq.enqueue(engine, "t", depends_on=[b])
    assert states(engine, a, b, c) == ["failed"] * 3
    line = jobq.why(engine, c)
    assert f"retry job {a}, the failed job this one waits on (jobq retry {a})" in line, line
    assert f"jobq retry --root {c}" in line and f"jobq retry {c})" not in line, line
    assert jobq.why(engine, a).endswith(f"(retry it with: jobq retry {a})")  # the root itself: as before
    with pytest.raises(jobq.InvalidJob, match=f"depends on job {b}, which is failed.*jobq retry --root {c}"):
        jobq.retry(engine, c)
    assert states(engine, a, b, c) == ["failed"] * 3
    assert jobq.retry(engine, c, from_root=True) == [c, a, b]
    assert states(engine, a, b, c) == ["ready", "waiting", "waiting"]


def test_retry_from_root_reopens_every_root_a_job_waits_on(engine: sa.Engine) -> None:
    """D depends on X and Y, both failed (D names only X as its closer). why names both;
    from_root re-opens both, then D. Retrying X alone would leave D closed by Y."""
    x, y = failed(engine), failed(engine)
    d = jobq.enqueue(engine, "t", depends_on=[x, y])
    line = jobq.why(engine, d)
    assert f"retry jobs {x} (failed), {y} (failed), the failed or cancelled jobs this one waits on" in line, line
    assert sorted(jobq.retry(engine, d, from_root=True)) == sorted([d, x, y])
    assert states(engine, x, y, d) == ["ready", "ready", "waiting"]


def test_retry_from_root_reopens_a_child_closed_with_its_container(engine: sa.Engine) -> None:
    """A container waits on U, which fails: the container and its child close. The child's root
    is U (the container is closed by it too); from_root re-opens U, the container and the child."""
    u = jobq.enqueue(engine, f"root{next(_types)}")
    box = jobq.enqueue(engine, "box", container=True, depends_on=[u])
    kid = jobq.enqueue(engine, "t", parent=box)
    failed(engine, u)
    assert states(engine, box, kid)[1] in ("failed", "cancelled")
    assert f"retry job {u}, the failed job" in jobq.why(engine, kid)
    with pytest.raises(jobq.InvalidJob, match=f"inside container {box}.*depends on job {u}"):
        jobq.retry(engine, kid)
    got = jobq.retry(engine, kid, from_root=True)
    assert got[0] == kid and sorted(got) == sorted([u, box, kid])
    assert states(engine, u, box, kid) == ["ready", "waiting", "waiting"]


def test_retry_from_root_of_a_root_is_a_plain_retry(engine: sa.Engine) -> None:
    """A job that nothing else keeps closed is its own root: from_root changes nothing. A
    from_root that is not a bool is a ConfigError, and a job that is not closed is refused as
    before."""
    a = failed(engine)
    b = jobq.enqueue(engine, "t", depends_on=[a])
    with pytest.raises(jobq.ConfigError, match="from_root must be True or False"):
        jobq.retry(engine, b, from_root="yes")  # type: ignore[arg-type]
    assert jobq.retry(engine, a, from_root=True) == [a, b]
    with pytest.raises(jobq.InvalidJob, match="only failed or cancelled jobs can be retried"):
        jobq.retry(engine, b, from_root=True)
