"""Regenerate the dashboard screenshots in docs/ (shown on the docs site's Dashboard page, docs/guides/dashboard.md).

What this does: fills a fresh SQLite queue with a small, realistic picture (an ETL DAG with a
container, three tenants sharing the slots, an hour of finished jobs, a failure with its
traceback), serves it with jobq_web, and has headless chromium photograph the overview, the
container's job page, the groups page and the per-type page.

Run:  python docs/screenshots.py            (needs chromium, chromium-driver and selenium)
"""

from __future__ import annotations

import argparse
import datetime as dt
import pathlib
import sys
import tempfile
import threading

import sqlalchemy as sa

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jobq  # noqa: E402
import jobq_web  # noqa: E402


def seed(engine: sa.Engine) -> int:
    """The demo queue; returns the id of the container whose page is photographed."""
    jobq.create_schema(engine)
    now = dt.datetime.now(dt.UTC)
    # an hour of history: finished jobs every few minutes, a few failures
    for i in range(72):
        at = now - dt.timedelta(minutes=60 - i * 0.8)
        group = ("tenant-a", "tenant-b", "tenant-c")[i % 3]
        job = jobq.enqueue(engine, ("resize", "thumbnail", "index")[i % 3], {"n": i}, group_key=group, max_attempts=1,
                           run_after=at - dt.timedelta(seconds=5))
        lease = jobq.claim_batch(engine, "web-1:4711", 30, now=at - dt.timedelta(seconds=1))[0]
        assert lease.id == job
        if i % 11 == 5:
            jobq.fail(engine, job, "Traceback (most recent call last):\n  File \"app/jobs.py\", line 42, in resize\n"
                      "OSError: image truncated", worker_id="web-1:4711", token=lease.token, now=at)
        else:
            jobq.finalize(engine, job, {"ok": True}, worker_id="web-1:4711", token=lease.token, now=at)
    # the ETL DAG: extract (done) -> transform (a container of three parts) -> load -> report
    ids = jobq.submit(engine, [
        {"key": "extract", "type": "extract", "args": {"day": "2026-12-01"}, "group_key": "etl"},
        {"key": "transform", "type": "transform", "container": True, "depends_on": ["extract"], "group_key": "etl"},
        *({"key": f"part-{i}", "type": "transform-part", "parent": "transform", "args": {"part": i}, "group_key": "etl"}
          for i in (1, 2, 3)),
        {"key": "load", "type": "load", "depends_on": ["transform"], "group_key": "etl"},
        {"key": "report", "type": "report", "depends_on": ["load"], "group_key": "etl"},
    ])
    lease = jobq.claim_batch(engine, "etl-worker:88", 60, types=["extract"])[0]
    jobq.finalize(engine, lease.id, {"rows": 120_000}, worker_id="etl-worker:88", token=lease.token)
    for _ in range(2):
        lease = jobq.claim_batch(engine, "etl-worker:88", 60, types=["transform-part"])[0]
    jobq.finalize(engine, lease.id, {"rows": 40_000}, worker_id="etl-worker:88", token=lease.token)
    jobq.claim_batch(engine, "etl-worker:88", 60, types=["transform-part"])
    # tenants: a backlog each, some in flight
    for group, n, w in (("tenant-a", 40, 3), ("tenant-b", 12, 1), ("tenant-c", 5, 1)):
        for i in range(n):
            jobq.enqueue(engine, "resize", {"image": f"{group}/{i}.png"}, group_key=group, weight=w)
    jobq.claim_batch(engine, "web-1:4711", 30, limit=4, types=["resize"])
    jobq.claim_batch(engine, "web-2:5120", 30, limit=3, types=["resize"])
    # stored policy, shown in the groups' rows: a weight, a cap and a rate, and a paused tenant
    jobq.set_group(engine, "tenant-a", weight=3, max_in_flight=4, rate_limit="120/1m")
    jobq.set_group(engine, "tenant-b", max_in_flight=2)
    jobq.set_group(engine, "tenant-c", paused=True)
    jobq.set_limit(engine, max_in_flight=16)
    jobq.enqueue(engine, "send-digest", {"to": "ops@example.com"}, run_after=dt.timedelta(minutes=20))
    return ids["transform"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "docs"), help="where the PNGs go (default: docs/)")
    ns = ap.parse_args()
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    with tempfile.TemporaryDirectory() as tmp:
        engine = sa.create_engine(f"sqlite:///{tmp}/demo.db")
        box = seed(engine)
        httpd = make_server("127.0.0.1", 0, jobq_web.app(engine, token="demo-token-123"), handler_class=Quiet)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{httpd.server_port}"
        opts = webdriver.ChromeOptions()
        opts.binary_location = "/usr/bin/chromium"
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--hide-scrollbars",
                    "--window-size=1280,900", "--force-device-scale-factor=1"):
            opts.add_argument(arg)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
        try:
            for name, path in (("overview", "/"), ("job", f"/jobs/{box}"), ("groups", "/groups"), ("types", "/types")):
                driver.set_window_size(1280, 900)
                driver.get(base + path)
                height = driver.execute_script("return document.documentElement.scrollHeight")
                driver.set_window_size(1280, min(max(int(height) + 20, 400), 2400))
                target = pathlib.Path(ns.out) / f"dashboard-{name}.png"
                driver.save_screenshot(str(target))
                print(f"wrote {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}")
        finally:
            driver.quit()
            httpd.shutdown()
            engine.dispose()


if __name__ == "__main__":
    main()
