"""``/metrics`` and ``/healthz`` of the dashboard, on every engine: the metrics scraped by a real
Prometheus server (Debian's ``prometheus``) from a real ``jobq serve`` and read back through its
HTTP API; the health check's 200 and each 503 with its one-line reason."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
import jobq_web
from helpers import wait_for
from helpers_web import running_server
from webclient import call

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prometheus_or_skip() -> None:
    if not os.path.exists(PROMETHEUS):
        if os.environ.get("CI"):
            pytest.fail(f"the Prometheus scrape test must run in CI: {PROMETHEUS} is missing (apt-get install prometheus)")
        pytest.skip(f"{PROMETHEUS} is missing (apt-get install prometheus)")


def _query(base: str, promql: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            out = json.load(r)
    except OSError:  # not listening yet
        return []
    assert out["status"] == "success", out
    return out["data"]["result"]  # type: ignore[no-any-return]


def test_prometheus_scrapes_jobq_serve(engine: sa.Engine, db_url: str, tmp_path: Any) -> None:
    """A real Prometheus scrapes ``jobq serve``'s /metrics: jobq_jobs{state="ready"} per group
    comes back as enqueued, and the start counter as claimed. A wrong exposition (a format
    Prometheus refuses, a missing label, a wrong count) shows as a failed target or a value
    that never arrives."""
    _prometheus_or_skip()
    for _ in range(3):
        jobq.enqueue(engine, "scrape", {}, group_key="tenant-a")
    jobq.enqueue(engine, "scrape", {}, group_key="tenant-b")
    with running_server(db_url, "--port", "0") as (base, _):
        target = urllib.parse.urlsplit(base).netloc
        with urllib.request.urlopen(base + "metrics", timeout=30) as r:  # the dashboard's counters start here
            assert r.status == 200
        lease = jobq.claim(engine, "w1", 60)  # counted: after the counters started
        assert lease is not None
        port = _free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                          f"  - job_name: jobq\n    static_configs:\n      - targets: ['{target}']\n")
        prom = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            api = f"http://127.0.0.1:{port}"

            def scraped(promql: str) -> list[dict[str, Any]]:
                assert prom.poll() is None, "prometheus exited"
                return _query(api, promql)

            starts = wait_for(lambda: scraped("sum(jobq_starts_total)"), timeout=60,
                              what="Prometheus's first scrape of jobq serve")
            assert [float(r["value"][1]) for r in starts] == [1.0], starts
            ready = scraped('jobq_jobs{state="ready"}')
            got = {r["metric"]["group"]: float(r["value"][1]) for r in ready}
            # four enqueued, one claimed (fair share picks the group)
            assert got in ({"tenant-a": 2.0, "tenant-b": 1.0}, {"tenant-a": 3.0}), got
            up = _query(api, 'up{job="jobq"}')
            assert [r["value"][1] for r in up] == ["1"], up
        finally:
            prom.terminate()
            try:
                prom.wait(timeout=30)
            finally:
                if prom.stderr is not None:
                    prom.stderr.close()


def test_metrics_page_is_prometheus_text(engine: sa.Engine) -> None:
    """/metrics answers the text format with the live counts; the counters start at the
    dashboard's first scrape and grow by what happened since."""
    app = jobq_web.app(engine)
    jobq.enqueue(engine, "t", {}, group_key="g")
    first = call(app, "/metrics")
    assert first.status == 200 and first.headers["Content-Type"].startswith("text/plain; version="), first
    assert 'jobq_jobs{group="g",state="ready"} 1.0' in first.body, first.body
    assert "jobq_starts_total" in first.body and 'jobq_starts_total{group="g"}' not in first.body
    lease = jobq.claim(engine, "w1", 60)
    assert lease is not None
    jobq.finalize(engine, lease, None, worker_id="w1", token=lease.token)
    second = call(app, "/metrics").body
    assert 'jobq_starts_total{group="g"} 1.0' in second, second
    assert 'jobq_attempts_total{outcome="done",type="t"} 1.0' in second, second
    assert 'jobq_jobs{group="g",state="ready"}' not in second, second


def test_healthz_is_200_with_a_current_schema(engine: sa.Engine) -> None:
    r = call(jobq_web.app(engine), "/healthz")
    assert r.status == 200, r
    assert json.loads(r.body) == {"status": "ok", "schema_version": jobq.SCHEMA_VERSION}


def test_healthz_is_503_with_the_reason_for_an_old_or_new_schema(engine: sa.Engine) -> None:
    """An old schema asks for jobq init, a newer one for a newer jobq: each a 503 and one line."""
    app = jobq_web.app(engine)
    for version, words in ((jobq.SCHEMA_VERSION - 1, "run jobq init"), (jobq.SCHEMA_VERSION + 1, "upgrade jobq")):
        with engine.begin() as conn:
            conn.execute(jobq._Q_SET_SCHEMA_VERSION, {"b_value": str(version)})
        r = call(app, "/healthz")
        assert r.status == 503 and r.body.count("\n") == 1, r
        assert f"schema version {version}" in r.body and words in r.body, r.body
    with engine.begin() as conn:
        conn.execute(jobq._Q_SET_SCHEMA_VERSION, {"b_value": str(jobq.SCHEMA_VERSION)})
    assert call(app, "/healthz").status == 200


def test_healthz_is_503_when_the_database_is_down(tmp_path: Any) -> None:
    """A database that cannot be reached (a SQLite file in a directory that does not exist;
    the same path as a server refusing connections) answers 503 in one line, not a 500."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'missing' / 'q.db'}")
    r = call(jobq_web.app(engine), "/healthz")
    assert r.status == 503 and r.body.startswith("database unreachable") and r.body.count("\n") == 1, r
    engine.dispose()
