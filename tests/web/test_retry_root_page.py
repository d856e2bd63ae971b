"""The job page of a job closed by its failed upstream: it names the root to retry and offers
a Retry of that root and a Retry from the root, not a Retry of the job itself (which the
queue refuses while its upstream is failed)."""

from __future__ import annotations

import sqlalchemy as sa

import jobq
import jobq_web
from webclient import call

TOKEN = "s3cret-dashboard-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


def test_a_closed_job_offers_its_root_and_a_retry_from_the_root(engine: sa.Engine) -> None:
    a = jobq.enqueue(engine, "fetch", max_attempts=1)
    b = jobq.enqueue(engine, "t", depends_on=[a])
    c = jobq.enqueue(engine, "t", depends_on=[b])
    lease = jobq.claim(engine, "w", 30)
    assert lease == a
    jobq.fail(engine, a, "boom", worker_id="w", token=lease.token)
    app = jobq_web.app(engine, token=TOKEN)

    page = call(app, f"/jobs/{c}", headers=BEARER)
    assert page.status == 200, page.body
    assert f"retry job {a}, the failed job this one waits on" in page.body
    assert f'action="/jobs/{a}/retry"' in page.body and f'action="/jobs/{c}/retry?root=1"' in page.body
    assert f'action="/jobs/{c}/retry"' not in page.body  # the refused retry is not offered
    detail = call(app, f"/api/jobs/{c}").json()
    assert detail["retry_roots"] == [a] and f"jobq retry --root {c}" in detail["why"]
    assert call(app, f"/api/jobs/{a}").json()["retry_roots"] == []  # the root itself: a plain Retry
    assert f'action="/jobs/{a}/retry"' in call(app, f"/jobs/{a}", headers=BEARER).body

    r = call(app, f"/jobs/{c}/retry", "POST", headers=BEARER)
    # (errors are scrubbed of the URL's credentials: a user named "root" must not blank "--root")
    assert r.status == 409 and f"re-open the chain from its root: jobq retry --root {c}" in r.json()["error"], r.body
    r = call(app, f"/jobs/{c}/retry?root=1", "POST", headers=BEARER)
    assert r.status == 200 and r.json()["result"] == [c, a, b], r.body
    assert [jobq.get(engine, i).state for i in (a, b, c)] == ["ready", "waiting", "waiting"]  # type: ignore[union-attr]
