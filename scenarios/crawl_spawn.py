"""Crawl: a handler discovers pages and spawns them into its own container, atomically with its result.

What this shows:
    * ctx.enqueue(..., parent=ctx.parent_id): each page job adds the pages it discovers to the
      crawl's container; the container rolls up (and the report after it runs) only when the
      whole site is done, never early, although the DAG grows while it runs,
    * the spawned ids are real: each page returns them in its result,
    * atomicity: the page "/flaky" spawns its links and then fails on attempt 1; those spawns
      are deleted with the failed attempt (never fetched), attempt 2 spawns them again, and
      every page is fetched exactly once,
    * duplicates: every page is spawned with unique_key="page:<url>", so a URL that two pages
      discover while its job is unfinished (held, ready or running) is one job: the second
      ctx.enqueue returns the first one's id. A key is free again once its job is done, so a
      page also skips the pages on its own path (carried in args): the links back up the tree.

It ends with a verdict line (exit status 1 if the run did not show it).

Run:
    python scenarios/crawl_spawn.py                 # SQLite in a temp directory
    python scenarios/crawl_spawn.py --url postgresql+psycopg://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import sys
import tempfile
import threading

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # jobq.py lives one level up

import sqlalchemy as sa

import jobq

# The "web site": page -> links on it (some link back up the tree).
SITE = {
    "/": ["/docs", "/blog", "/flaky"],
    "/docs": ["/docs/install", "/docs/api", "/"],
    "/docs/install": ["/docs"],
    "/docs/api": ["/docs/api/queue", "/docs/api/worker", "/"],
    "/docs/api/queue": [],
    "/docs/api/worker": ["/docs/api"],
    "/blog": ["/blog/1", "/blog/2"],
    "/blog/1": ["/"],
    "/blog/2": [],
    "/flaky": ["/flaky/a", "/flaky/b"],
    "/flaky/a": [],
    "/flaky/b": ["/flaky"],
}

fetched: collections.Counter[str] = collections.Counter()
lock = threading.Lock()


def page(ctx: jobq.JobContext) -> dict:
    url, path = ctx.args["url"], ctx.args["path"]
    links = SITE[url]  # the HTTP request and the parsing would go here
    spawned = {}
    for link in links:
        if link in path or link == url:
            continue  # a link back up this page's own path: already crawled or being crawled
        spawned[link] = ctx.enqueue("page", {"url": link, "path": [*path, url]}, parent=ctx.parent_id,
                                    unique_key=f"page:{link}")
    if url == "/flaky" and ctx.attempt == 1:
        print(f"page {url}: spawned {sorted(spawned.values())}, then failed (attempt 1): they are discarded")
        raise RuntimeError("connection reset while saving the page")
    with lock:
        fetched[url] += 1
    print(f"page {url} (job {ctx.id}, attempt {ctx.attempt}): spawned {spawned or 'nothing'}")
    return {"links": spawned}


def report(ctx: jobq.JobContext) -> dict:
    crawl = jobq.get(ctx_engine, ctx.args["crawl"])
    print(f"report: crawl container {ctx.args['crawl']} is {crawl.state if crawl else '?'}; "
          f"{sum(fetched.values())} page fetches")
    seen_by_report.append(sum(fetched.values()))
    return {"pages": sum(fetched.values())}


ctx_engine: sa.Engine
seen_by_report: list[int] = []  # page fetches the report saw when it ran


def main() -> None:
    global ctx_engine
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="database URL (default: a fresh SQLite file)")
    ns = parser.parse_args()
    url = ns.url or f"sqlite:///{os.path.join(tempfile.mkdtemp(prefix='jobq-'), 'crawl.db')}"
    engine = ctx_engine = sa.create_engine(url)
    jobq.create_schema(engine)

    ids = jobq.submit(engine, [
        {"key": "crawl", "type": "crawl", "container": True},
        {"key": "root", "type": "page", "args": {"url": "/", "path": []}, "parent": "crawl"},
    ])
    ids["report"] = jobq.enqueue(engine, "report", {"crawl": ids["crawl"]}, depends_on=[ids["crawl"]])
    print(f"crawl container {ids['crawl']}, root page job {ids['root']}, report job {ids['report']}")

    worker = jobq.Worker(engine, {"page": page, "report": report}, max_concurrency=3, poll_interval=0.02,
                         retry_backoff=lambda attempt: 0.05)
    worker.run_until_idle(timeout=60)

    crawl = jobq.get(engine, ids["crawl"])
    assert crawl is not None
    with engine.connect() as conn:
        pages = conn.execute(sa.select(sa.func.count()).where(jobq.Job.parent_id == ids["crawl"])).scalar_one()
    print(f"\ncrawl container: {crawl.state}; {pages} page jobs in it; site has {len(SITE)} pages")
    once = sorted(fetched) == sorted(SITE) and set(fetched.values()) == {1}
    print(f"fetched once each: {once}")
    report_state = jobq.get(engine, ids["report"]).state  # type: ignore[union-attr]
    print(f"report: {report_state}")
    ok = once and crawl.state == "done" and report_state == "done" and seen_by_report == [len(SITE)]
    print(f"verdict: {'OK' if ok else 'NOT SHOWN'}: the container rolled up only when all {len(SITE)} pages were "
          f"done (the report saw {seen_by_report[0] if seen_by_report else 'nothing'}); each page fetched once, "
          f"the failed attempt's spawns discarded")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
