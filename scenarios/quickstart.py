"""Quick start: a small DAG run to completion by one worker.

What this shows:
    * enqueue with dependencies and a container (a job that never runs; it rolls up),
    * a Worker with a global cap running handlers in dependency order,
    * a failing job retried, and what `jobq.get` tells you afterwards.

It ends with a verdict line (exit status 1 if the run did not show it).

Run:
    python scenarios/quickstart.py                      # SQLite file in a temp directory
    python scenarios/quickstart.py --url postgresql+psycopg://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # jobq.py lives one level up

import sqlalchemy as sa

import jobq

started = time.monotonic()
lock = threading.Lock()
log: list[str] = []


def say(msg: str) -> None:
    with lock:
        line = f"[{time.monotonic() - started:5.2f}s] {msg}"
        log.append(line)
        print(line, flush=True)


def fetch(ctx: jobq.JobContext) -> dict:
    say(f"fetch      job {ctx.id}: downloading {ctx.args['source']}")
    time.sleep(0.2)
    return {"rows": 100 * len(ctx.args["source"])}


def transform(ctx: jobq.JobContext) -> dict:
    if ctx.args.get("flaky") and ctx.attempt == 1:
        say(f"transform  job {ctx.id}: attempt {ctx.attempt} fails (it will be retried)")
        raise ConnectionError("upstream API hiccup")
    say(f"transform  job {ctx.id}: part {ctx.args['part']} (attempt {ctx.attempt})")
    time.sleep(0.1)
    return {"part": ctx.args["part"], "ok": True}


def load(ctx: jobq.JobContext) -> dict:
    say(f"load       job {ctx.id}: writing the report")
    return {"report": "report.csv"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="database URL (default: a fresh SQLite file)")
    ns = parser.parse_args()
    url = ns.url or f"sqlite:///{os.path.join(tempfile.mkdtemp(prefix='jobq-'), 'quickstart.db')}"
    engine = sa.create_engine(url)
    jobq.create_schema(engine)

    fetch_id = jobq.enqueue(engine, "fetch", {"source": "s3://bucket/day.csv"})
    parts = jobq.enqueue(engine, "parts", container=True)  # rolls up when its children finish
    kids = [
        jobq.enqueue(engine, "transform", {"part": p, "flaky": p == 2}, parent=parts, depends_on=[fetch_id])
        for p in (1, 2, 3)
    ]
    load_id = jobq.enqueue(engine, "load", depends_on=[parts])
    print(f"enqueued: fetch={fetch_id}, container={parts} with children {kids}, load={load_id}")

    worker = jobq.Worker(
        engine,
        {"fetch": fetch, "transform": transform, "load": load},
        max_concurrency=2,  # the global cap: at most 2 jobs in flight across all workers
        poll_interval=0.05,
        retry_backoff=lambda attempt: 0.2,
    )
    worker.run_until_idle(timeout=60)

    print("\njob  type       state  attempts  result")
    for jid in [fetch_id, parts, *kids, load_id]:
        info = jobq.get(engine, jid)
        assert info is not None
        print(f"{jid:<4} {info.type:<10} {info.state:<6} {info.attempts:<9} {info.result}")
    infos = {jid: jobq.get(engine, jid) for jid in [fetch_id, parts, *kids, load_id]}
    order = [line.split("] ", 1)[1].split()[0] for line in log if "fails" not in line]  # handler names, in start order
    in_order = order[0] == "fetch" and order[-1] == "load" and order.count("transform") == len(kids)
    retried = infos[kids[1]].attempts == 2  # type: ignore[union-attr]
    ok = in_order and retried and all(i is not None and i.state == "done" for i in infos.values())
    print(f"\nverdict: {'OK' if ok else 'NOT SHOWN'}: fetch ran first, the three parts after it, load after the "
          f"container rolled up; part 2 failed once and was retried: {'all done' if ok else 'NOT all done'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
