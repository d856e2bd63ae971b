"""Tenants sharing a rate-limited external API: weighted fair share, a per-tenant cap, a rate limit.

What this shows:
    * group_key per tenant, and each tenant's policy stored once with jobq.set_group, where
      every worker reads it (no worker needs group options, and a change needs no restart):
      "enterprise" (weight 3) gets three times the slots of "free-tier" (weight 1) while both
      have a backlog, even though free-tier jobs run longer;
    * max_in_flight: "noisy" may never hold more than 1 of the 8 slots, however much it enqueues;
      a paused tenant ("suspended") gets none until it is resumed, halfway through the run;
    * rate_limits (a worker option): all tenants together start at most 60 calls per second;
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
    "suspended": (1, 10, 0.05),
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
    for tenant, (weight, _, _) in TENANTS.items():  # the policy, stored once for every worker
        jobq.set_group(engine, tenant, weight=weight)
    jobq.set_group(engine, "noisy", max_in_flight=1)  # never more than one of the 8 slots
    jobq.set_group(engine, "suspended", paused=True)
    for policy in jobq.groups(engine):
        print(f"policy: {policy.group_key}: weight {policy.weight}, cap {policy.max_in_flight}, paused {policy.paused}")
    with engine.begin() as conn:  # enqueue in one transaction
        for tenant, (_, n, _) in TENANTS.items():
            for i in range(n):
                jobq.enqueue(conn, "call_api", {"request": i}, group_key=tenant)

    worker = jobq.Worker(
        engine,
        {"call_api": call_api},
        max_concurrency=8,  # 8 concurrent calls allowed by the API, across all workers
        rate_limits={"*": (60, 1.0)},  # and at most 60 calls start per second
        poll_interval=0.01,
    )
    stop = threading.Event()
    threading.Thread(target=report, args=(stop,), daemon=True).start()
    t0 = time.monotonic()
    runner = threading.Thread(target=worker.run_until_idle, kwargs={"timeout": 120})
    runner.start()
    while busy["enterprise"] < 0.5 * 150 * 0.05 and runner.is_alive():  # halfway through enterprise's work
        time.sleep(0.05)
    with lock:
        print(f"suspended tenant's slot-time while paused: {busy['suspended']:.2f}s; resuming it", flush=True)
    jobq.set_group(engine, "suspended", paused=False)  # every worker sees it at its next claim
    runner.join()
    if busy["suspended"] == 0.0:  # the worker went idle before the resume: run the rest
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
