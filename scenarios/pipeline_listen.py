"""A low-latency pipeline: each stage enqueues the next; on PostgreSQL the worker is woken by
LISTEN/NOTIFY instead of waiting for its next poll.

What this shows:
    * Worker(listen=True): enqueue and released dependents NOTIFY; the worker wakes at once;
    * polling stays on (here every 2 s) so nothing waits forever if a notification is lost;
    * per-hop latency: how long from enqueue to start. On SQLite (no NOTIFY) the same script
      runs with polling only, which shows the difference.

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
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

import jobq

HOPS = 20
enqueued_at: dict[int, float] = {}
latencies: list[float] = []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="database URL (default: a fresh SQLite file)")
    ns = parser.parse_args()
    url = ns.url or f"sqlite:///{os.path.join(tempfile.mkdtemp(prefix='jobq-'), 'pipe.db')}"
    engine = sa.create_engine(url)
    jobq.create_schema(engine)
    listen = engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg"

    def stage(ctx: jobq.JobContext) -> dict:
        latencies.append(time.monotonic() - enqueued_at[ctx.id])
        n = ctx.args["hop"]
        if n + 1 < HOPS:
            enqueued_at[jobq.enqueue(engine, "stage", {"hop": n + 1})] = time.monotonic()
        return {"hop": n}

    poll = 2.0 if listen else 0.2
    worker = jobq.Worker(engine, {"stage": stage}, max_concurrency=2, poll_interval=poll, listen=listen)
    enqueued_at[jobq.enqueue(engine, "stage", {"hop": 0})] = time.monotonic()
    t0 = time.monotonic()
    worker.run_until_idle(timeout=120)
    mode = "LISTEN/NOTIFY" if listen else f"polling every {poll}s"
    print(f"{HOPS} hops in {time.monotonic() - t0:.2f}s with {mode}")
    print(f"enqueue->start per hop: median {statistics.median(latencies) * 1000:.1f} ms, "
          f"max {max(latencies) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
