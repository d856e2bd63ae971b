"""Tenants sharing an external API with 9 concurrent calls: weighted fair share, a cap, a pause.

What this shows:
    * group_key per tenant, and each tenant's policy stored once with jobq.set_group, where
      every worker reads it (no worker needs group options, and a change needs no restart);
    * weighted fair share of the slots: while "enterprise" (weight 3) and "free-tier" (weight 1)
      both have a backlog, enterprise holds three times the slots of free-tier (6 and 2 of the 8
      that noisy leaves), so 75% of their slot-time, even though free-tier's calls run twice as
      long and all of enterprise's jobs were enqueued first;
    * max_in_flight: "noisy" never holds more than 1 of the 9 slots, however much it enqueues;
    * paused: "suspended" gets no slot until it is resumed, halfway through enterprise's work.

It ends with a verdict line (and exit status 1 if the run did not show it). The share is
measured over the time both tenants had jobs not yet started, and must be within half a slot
of fair share's 6 of 8 (75% +- 6.25%): slots are granted whole, and a freed slot stays empty
until the next claim, which costs the tenant with the shorter calls a little more.

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
    "enterprise": (3, 120, 0.2),
    "free-tier": (1, 30, 0.4),
    "noisy": (1, 20, 0.2),
    "suspended": (1, 10, 0.2),
}
SLOTS = 9
RESUME_AFTER = 60  # enterprise starts before "suspended" is resumed
TOLERANCE = 0.5 / 8  # half a slot of the 8 enterprise and free-tier share

lock = threading.Lock()
runs: dict[str, list[tuple[float, float]]] = {t: [] for t in TENANTS}  # (start, end) per finished call
starts: dict[str, list[float]] = {t: [] for t in TENANTS}
running: dict[str, int] = dict.fromkeys(TENANTS, 0)
peak: dict[str, int] = dict.fromkeys(TENANTS, 0)
halfway = threading.Event()


def call_api(ctx: jobq.JobContext) -> dict:
    tenant = ctx.group_key
    with lock:
        t = time.monotonic()
        starts[tenant].append(t)
        running[tenant] += 1
        peak[tenant] = max(peak[tenant], running[tenant])
        if tenant == "enterprise" and len(starts[tenant]) == RESUME_AFTER:
            halfway.set()
    time.sleep(TENANTS[tenant][2])  # the external call
    with lock:
        running[tenant] -= 1
        runs[tenant].append((t, time.monotonic()))
    return {"tenant": tenant, "status": 200}


def report(stop: threading.Event) -> None:
    while not stop.wait(0.5):
        with lock:
            line = "  ".join(f"{t}={running[t]}" for t in TENANTS)
        print(f"slots in use: {line}", flush=True)


def slot_time(tenant: str, t0: float, t1: float) -> float:
    """Seconds of slot use by ``tenant`` inside [t0, t1]."""
    return sum(max(0.0, min(end, t1) - max(start, t0)) for start, end in runs[tenant])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="database URL (default: a fresh SQLite file)")
    ns = parser.parse_args()
    url = ns.url or f"sqlite:///{os.path.join(tempfile.mkdtemp(prefix='jobq-'), 'tenants.db')}"
    engine = sa.create_engine(url)
    jobq.create_schema(engine)
    for tenant, (weight, _, _) in TENANTS.items():  # the policy, stored once for every worker
        jobq.set_group(engine, tenant, weight=weight)
    jobq.set_group(engine, "noisy", max_in_flight=1)
    jobq.set_group(engine, "suspended", paused=True)
    for policy in jobq.groups(engine):
        print(f"policy: {policy.group_key}: weight {policy.weight}, cap {policy.max_in_flight}, paused {policy.paused}")
    with engine.begin() as conn:  # enqueue in one transaction, enterprise's jobs first
        for tenant, (_, n, _) in TENANTS.items():
            for i in range(n):
                jobq.enqueue(conn, "call_api", {"request": i}, group_key=tenant)

    worker = jobq.Worker(engine, {"call_api": call_api}, max_concurrency=SLOTS, poll_interval=0.01)
    stop = threading.Event()
    threading.Thread(target=report, args=(stop,), daemon=True).start()
    t0 = time.monotonic()
    runner = threading.Thread(target=worker.run_until_idle, kwargs={"timeout": 120})
    runner.start()
    halfway.wait(timeout=120)
    with lock:
        resumed_at = time.monotonic()
        print(f"suspended tenant's starts while paused: {len(starts['suspended'])}; resuming it", flush=True)
    jobq.set_group(engine, "suspended", paused=False)  # every worker sees it at its next claim
    runner.join()
    if len(starts["suspended"]) < TENANTS["suspended"][1]:  # the worker went idle before the resume
        worker.run_until_idle(timeout=120)
    stop.set()

    # both backlogged: until the first of the two started its last job (or the resume changed the mix)
    t1 = min([resumed_at] + [max(starts[t]) for t in ("enterprise", "free-tier") if len(starts[t]) == TENANTS[t][1]])
    ent, free = slot_time("enterprise", t0, t1), slot_time("free-tier", t0, t1)
    share = ent / (ent + free)
    expected = 3 / 4
    paused_starts = sum(1 for s in starts["suspended"] if s < resumed_at)
    done = sum(len(r) for r in runs.values())
    print(f"\nfinished in {time.monotonic() - t0:.1f}s; {done} calls made")
    print(f"both backlogged for {t1 - t0:.2f}s: enterprise {ent:.2f} slot-s, free-tier {free:.2f} slot-s")
    ok = (abs(share - expected) <= TOLERANCE and peak["noisy"] == 1 and paused_starts == 0
          and done == sum(n for _, n, _ in TENANTS.values()))
    print(f"verdict: {'OK' if ok else 'NOT SHOWN'}: while both were backlogged enterprise (weight 3) had "
          f"{share:.1%} of the slot-time it shared with free-tier (weight 1), fair share {expected:.1%} "
          f"+- {TOLERANCE:.2%}; noisy peak {peak['noisy']} (cap 1); suspended started {paused_starts} "
          f"while paused, {len(starts['suspended'])} in all; {done} calls made")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
