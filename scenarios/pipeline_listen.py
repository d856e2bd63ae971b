"""A low-latency pipeline: requests arrive from outside the worker, each runs three stages
(each stage enqueues the next); on PostgreSQL an idle worker is woken by LISTEN/NOTIFY instead
of waiting for its next poll.

What this shows:
    * a stage enqueued by a running job starts at once on every engine: the worker claims
      again as soon as a job finishes, no poll involved;
    * a request enqueued from outside while the worker is idle: with Worker(listen=True) on
      PostgreSQL (psycopg 3) the NOTIFY wakes the worker, which starts it within milliseconds
      although it polls only once a second; the verdict requires every such wait to be under
      half the poll interval (a worker that polled would wait about 0.75 s here);
    * on engines without LISTEN/NOTIFY the same script falls back to polling: each outside
      request waits for the worker's next poll (here each arrives 0.25 s into a 1 s wait).
      Polling stays on with LISTEN too, so nothing waits forever if a notification is lost.

It ends with a verdict line (exit status 1 if the run did not show it).

Run:
    python scenarios/pipeline_listen.py --url postgresql+psycopg://postgres@127.0.0.1/test
    python scenarios/pipeline_listen.py                    # SQLite: polling only
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

import jobq

REQUESTS = 6
STAGES = 3
POLL = 1.0
enqueued_at: dict[int, float] = {}
outside: list[float] = []  # enqueue -> start of a request's first stage (enqueued by the producer)
inside: list[float] = []  # enqueue -> start of a later stage (enqueued by the running stage before it)
finished = threading.Event()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="database URL (default: a fresh SQLite file)")
    ns = parser.parse_args()
    url = ns.url or f"sqlite:///{os.path.join(tempfile.mkdtemp(prefix='jobq-'), 'pipe.db')}"
    engine = sa.create_engine(url)
    jobq.create_schema(engine)
    listen = engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg"

    def stage(ctx: jobq.JobContext) -> dict:
        n = ctx.args["stage"]
        (outside if n == 0 else inside).append(time.monotonic() - enqueued_at[ctx.id])
        if n + 1 < STAGES:
            enqueued_at[jobq.enqueue(engine, "stage", {"request": ctx.args["request"], "stage": n + 1})] = time.monotonic()
        else:
            finished.set()
        return {"stage": n}

    worker = jobq.Worker(engine, {"stage": stage}, max_concurrency=2, poll_interval=POLL, listen=listen)
    runner = threading.Thread(target=worker.run)
    runner.start()
    for request in range(REQUESTS):  # one at a time, each while the worker is idle
        time.sleep(0.25)  # the worker has gone back to waiting for its next poll (or a NOTIFY)
        finished.clear()
        enqueued_at[jobq.enqueue(engine, "stage", {"request": request, "stage": 0})] = time.monotonic()
        finished.wait(timeout=30)
    worker.stop()
    runner.join()

    done = sum(1 for jid in enqueued_at if (info := jobq.get(engine, jid)) is not None and info.state == "done")
    ms = {k: (statistics.median(v) * 1000, max(v) * 1000) for k, v in (("outside", outside), ("inside", inside))}
    print(f"{REQUESTS} requests of {STAGES} stages: {done} jobs done")
    print(f"enqueued from outside, worker idle: median {ms['outside'][0]:.1f} ms, max {ms['outside'][1]:.1f} ms")
    print(f"enqueued by the stage before:       median {ms['inside'][0]:.1f} ms, max {ms['inside'][1]:.1f} ms")
    complete = done == REQUESTS * STAGES
    if listen:
        ok = complete and max(outside) < POLL / 2
        print(f"verdict: {'OK' if ok else 'NOT SHOWN'}: LISTEN/NOTIFY woke the idle worker: outside requests "
              f"started after at most {ms['outside'][1]:.1f} ms with a {POLL:.0f} s poll interval")
    else:
        ok = complete
        print(f"verdict: {'OK' if ok else 'NOT SHOWN'}: no LISTEN/NOTIFY on {engine.dialect.name}, polling "
              f"every {POLL:.0f} s: outside requests waited for the next poll (median {ms['outside'][0]:.0f} ms); "
              f"all {done} jobs done")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
