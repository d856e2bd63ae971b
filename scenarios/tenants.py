"""Tenants sharing a rate-limited external API: weighted fair share, a per-tenant cap, a rate limit.

What this shows:
    * group_key per tenant and weights: "enterprise" (weight 3) gets three times the slots of
      "free-tier" (weight 1) while both have a backlog, even though free-tier jobs run longer;
    * group_caps: "noisy" may never hold more than 1 of the 8 slots, however much it enqueues;
    * rate_limits: all tenants together start at most 60 calls per second (the API's quota);
    * per-tenant shares of slot-time printed as the run goes (the final figures include the
      tail after a tenant's backlog ran out).

Run:
    python scenarios/tenants.py                       # SQLite file in a temp directory
    python scenarios/tenants.py --url postgresql+psycopg://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

import jobq

TENANTS = {  # tenant: (weight, jobs, seconds per call)
    "enterprise": (3, 150, 0.05),
    "free-tier": (1, 40, 0.15),
    "noisy": (1, 60, 0.05),
}
lock = threading.Lock()
busy: dict[str, float] = dict.fromkeys(TENANTS, 0.0)  # slot-seconds used per tenant


def call_api(ctx: jobq.JobContext) -> dict:
    seconds = TENANTS[ctx.group_key][2]
    time.sleep(seconds)  # the external call
    with lock:
        busy[ctx.group_key] += seconds
    return {"tenant": ctx.group_key, "status": 200}


def report(stop: threading.Event) -> None:
    while not stop.wait(0.5):
        with lock:
            total = sum(busy.values()) or 1.0
            line = "  ".join(f"{t}={busy[t] / total:5.1%}" for t in TENANTS)
        print(f"slot-time so far: {line}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="database URL (default: a fresh SQLite file)")
    ns = parser.parse_args()
    url = ns.url or f"sqlite:///{os.path.join(tempfile.mkdtemp(prefix='jobq-'), 'tenants.db')}"
    engine = sa.create_engine(url)
    jobq.create_schema(engine)
    with engine.begin() as conn:  # enqueue in one transaction
        for tenant, (weight, n, _) in TENANTS.items():
            for i in range(n):
                jobq.enqueue(conn, "call_api", {"request": i}, group_key=tenant, weight=weight)

    worker = jobq.Worker(
        engine,
        {"call_api": call_api},
        max_concurrency=8,  # 8 concurrent calls allowed by the API, across all workers
        group_caps={"noisy": 1},  # one tenant may never hold more than one of them
        rate_limits={"*": (60, 1.0)},  # and at most 60 calls start per second
        poll_interval=0.01,
    )
    stop = threading.Event()
    threading.Thread(target=report, args=(stop,), daemon=True).start()
    t0 = time.monotonic()
    worker.run_until_idle(timeout=120)
    stop.set()
    with lock:
        total = sum(busy.values())
        print(f"\nfinished in {time.monotonic() - t0:.1f}s; final slot-time shares:")
        for tenant, (weight, n, _) in TENANTS.items():
            print(f"  {tenant:<11} weight {weight}  jobs {n:>3}  share {busy[tenant] / total:6.1%}")
    print(f"states: {jobq.stats(engine)['states']}")


if __name__ == "__main__":
    main()
