"""Async: an asyncio service that enqueues from its own transaction and runs coroutine handlers.

What this shows:
    * jobq.aio.enqueue inside the caller's AsyncSession: the job exists only if the service's
      own write commits (one is rolled back, and no job appears),
    * an AsyncWorker running `async def` handlers as tasks under a global cap of 3,
    * a stuck coroutine really stopped by its timeout (its task is cancelled) and retried,
    * the same queue functions as the sync API (`await jobq.aio.stats(...)`).

It ends with a verdict line (exit status 1 if the run did not show it).

Run (needs jobq's asyncio extra, `pip install 'jobq[asyncio]'`; without it the script says so in one
line and exits 2):
    python scenarios/async_crawl.py                     # SQLite (aiosqlite) in a temp directory
    python scenarios/async_crawl.py --url postgresql+psycopg://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # jobq.py lives one level up

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

import jobq

started = time.monotonic()
live = peak = 0
cancelled: list[str] = []  # stop reasons of cancelled tasks


def say(msg: str) -> None:
    print(f"[{time.monotonic() - started:5.2f}s] {msg}", flush=True)


async def crawl(ctx: jobq.JobContext) -> dict:
    global live, peak
    live += 1
    peak = max(peak, live)
    try:
        if ctx.args["url"].endswith("/slow") and ctx.attempt == 1:
            say(f"crawl job {ctx.id}: {ctx.args['url']} hangs (attempt 1; its timeout will cancel it)")
            await asyncio.sleep(60)
        await asyncio.sleep(0.1)  # the HTTP request would go here
        say(f"crawl job {ctx.id}: {ctx.args['url']} fetched (attempt {ctx.attempt})")
        return {"bytes": 1000 + ctx.id}
    except asyncio.CancelledError:
        say(f"crawl job {ctx.id}: task cancelled ({ctx.stop_reason})")
        cancelled.append(str(ctx.stop_reason))
        raise
    finally:
        live -= 1


async def main(url: str) -> bool:
    engine = create_async_engine(url)
    await jobq.aio.create_schema(engine)
    async with engine.begin() as conn:  # the service's own table, next to jobq's
        await conn.execute(sa.text("CREATE TABLE IF NOT EXISTS pages (url VARCHAR(200))"))

    ids = []
    for page in ["a", "b", "c", "d", "e", "slow", "rolled-back"]:
        async with AsyncSession(engine) as session:
            target = f"https://example.com/{page}"
            await session.execute(sa.text("INSERT INTO pages (url) VALUES (:u)"), {"u": target})
            jid = await jobq.aio.enqueue(session, "crawl", {"url": target}, timeout=1.0 if page == "slow" else None)
            if page == "rolled-back":
                await session.rollback()  # the business write fails: the job goes with it
                say(f"enqueued job {jid} in a transaction that rolled back")
                gone = jid
            else:
                await session.commit()
                ids.append(jid)
                if page == "slow":
                    slow_id = jid
    say(f"enqueued {len(ids)} jobs; job {gone} exists: {await jobq.aio.get(engine, gone) is not None}")

    worker = jobq.AsyncWorker(engine, {"crawl": crawl}, max_concurrency=3, poll_interval=0.05,
                              retry_backoff=lambda attempt: 0.1)
    await worker.run_until_idle(timeout=60)

    infos = []
    for jid in ids:
        info = await jobq.aio.get(engine, jid)
        assert info is not None
        infos.append(info)
        say(f"job {jid}: {info.state}, attempts={info.attempts}, result={info.result}")
    done = sum(1 for i in infos if i.state == "done")
    say(f"peak concurrency {peak} (cap 3); done={done}")
    slow = infos[ids.index(slow_id)]
    exists = await jobq.aio.get(engine, gone) is not None
    await engine.dispose()
    ok = (not exists and done == len(ids) and peak == 3 and cancelled == ["timed_out"] and slow.attempts == 2)
    print(f"verdict: {'OK' if ok else 'NOT SHOWN'}: the rolled-back job does not exist; {done} of {len(ids)} jobs "
          f"done; peak {peak} tasks (cap 3); the stuck task was cancelled ({', '.join(cancelled) or 'never'}) "
          f"and done on attempt {slow.attempts}")
    return ok


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="database URL (default: a fresh SQLite file through aiosqlite)")
    ns = parser.parse_args()
    url = ns.url or f"sqlite+aiosqlite:///{os.path.join(tempfile.mkdtemp(prefix='jobq-'), 'async.db')}"
    u = sa.engine.make_url(url)  # a sync URL works too: use the async driver for its database
    async_driver = {"sqlite": "aiosqlite", "mysql": "aiomysql", "mariadb": "aiomysql", "postgresql": "psycopg"}
    url = u.set(drivername=f"{u.get_backend_name()}+{async_driver[u.get_backend_name()]}").render_as_string(hide_password=False)
    try:  # SQLAlchemy's asyncio bridge and the async driver for this database
        import greenlet  # noqa: F401
        __import__(async_driver[u.get_backend_name()])
    except ImportError as exc:
        print(f"async_crawl.py needs jobq's asyncio extra ({exc.name} is missing): pip install 'jobq[asyncio]'",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if asyncio.run(main(url)) else 1)
