"""A worker process on one cluster host (run inside its network namespace by infra.start_worker).

    python worker_main.py URL LOGDIR --host NAME [--cap N] [--group-caps JSON] [--ttl S]
                          [--listen] [--broken unfenced|cap_outside_claim]

Every attempt is logged outside the database, one JSON object a line, in LOGDIR/hist-HOST-PID.jsonl
(no other process writes that file; CLOCK_MONOTONIC is one clock for every namespace here):
    {"ev": "start",  "job": id, "run": r, "attempt": n, "t": s}   the handler begins (claim committed)
    {"ev": "finish", "job": id, "run": r, "t": s, "result": {...}}   the handler returns
    {"ev": "done",   "job": id, "run": r, "t": s}   the completion committed (the worker's word)
(run: PID.N, one per handler call; the result carries it, so the stored result names its run)
    {"ev": "stopped", "job": id, "run": r, "reason": why}   a cooperative handler was told to stop
    {"ev": "lease_lost" | "reclaimed" | "db_error", ...}  worker events
The handler "work" waits for the file args["gate"] + "-HOST" if a gate is given (the test opens each
host's gate), else sleeps args["sleep"]; with args["coop"] it also stops when the worker tells it to.

--broken selects a deliberately broken worker the history checker must catch:
    unfenced            claims with jobq, never heartbeats, and writes `done` with a plain UPDATE
                        by id (no lease token), so a result finished after its lease was lost lands
    cap_outside_claim   jobq's Worker, but the global cap is counted in a transaction of its own
                        before the claim (the claim itself is not capped by it)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import sqlalchemy as sa  # noqa: E402

import jobq  # noqa: E402

jobs = jobq.Job.__table__


class History:
    def __init__(self, path: pathlib.Path) -> None:
        self.f = open(path, "a")  # noqa: SIM115 - open for the life of the process
        self.lock = threading.Lock()

    def log(self, **rec: object) -> None:
        rec.setdefault("t", time.monotonic())
        line = json.dumps(rec)
        with self.lock:
            self.f.write(line + "\n")
            self.f.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("logdir", type=pathlib.Path)
    p.add_argument("--host", required=True)
    p.add_argument("--cap", type=int, default=4)
    p.add_argument("--group-caps", default="{}")
    p.add_argument("--ttl", type=float, default=3.0)
    p.add_argument("--poll", type=float, default=0.05)
    p.add_argument("--listen", action="store_true")
    p.add_argument("--broken", default="")
    p.add_argument("--types", default="work", help="comma-separated job types this worker runs (all: the work handler)")
    p.add_argument("--plain-url", action="store_true", help="drop the URL's network timeouts (libpq defaults)")
    ns = p.parse_args()
    pid = os.getpid()
    hist = History(ns.logdir / f"hist-{ns.host}-{pid}.jsonl")
    run_of: dict[int, str] = {}  # job -> the run this process last started it as
    seq = iter(range(1, 1 << 62))
    seq_lock = threading.Lock()

    def work(ctx: jobq.JobContext) -> dict:
        # A run id per handler call: after an asynchronous failover the same attempt number
        # can be handed out twice (the first claim was lost with the old primary).
        with seq_lock:
            run = f"{pid}.{next(seq)}"
        run_of[ctx.id] = run
        hist.log(ev="start", job=ctx.id, attempt=ctx.attempt, run=run, host=ns.host, pid=pid)
        gate = ctx.args.get("gate")
        if ctx.args.get("coop"):  # a cooperative handler: stops when told, or when its gate opens
            while not os.path.exists(f"{gate}-{ns.host}") and not ctx.wait(0.05):
                pass
            if ctx.stop_requested:
                hist.log(ev="stopped", job=ctx.id, run=run, host=ns.host, pid=pid, reason=ctx.stop_reason)
        elif gate:
            while not os.path.exists(f"{gate}-{ns.host}"):  # the test opens the gate; a partition cannot stop this
                time.sleep(0.02)
        else:
            time.sleep(float(ctx.args.get("sleep", 0.02)))
        result = {"v": int(ctx.args.get("i", 0)) * 7, "host": ns.host, "run": run, "attempt": ctx.attempt}
        hist.log(ev="finish", job=ctx.id, attempt=ctx.attempt, run=run, host=ns.host, pid=pid, result=result)
        return result

    def checkpoint(point: str, job_ids=()) -> None:  # type: ignore[no-untyped-def]
        if point == "finalized":
            t = time.monotonic()
            for j in job_ids:
                hist.log(ev="done", job=j, run=run_of.get(j), host=ns.host, pid=pid, t=t)

    def on_event(ev: jobq.Event) -> None:
        if ev.action in ("lease_lost", "reclaimed", "db_error"):
            hist.log(ev=ev.action, job=ev.job_id, run=run_of.get(ev.job_id), host=ns.host, pid=pid, error=ev.error)

    jobq._checkpoint = checkpoint  # the test entry point's replacement for the no-op
    url = sa.engine.make_url(ns.url)
    if ns.plain_url:
        url = url.set(query={})
    engine = sa.create_engine(url, pool_pre_ping=True, pool_size=ns.cap + 4)
    group_caps = {str(k): int(v) for k, v in json.loads(ns.group_caps).items()}
    hist.log(ev="ready", host=ns.host, pid=pid)

    if ns.broken == "unfenced":
        wid = f"broken-{ns.host}-{pid}"
        while True:
            try:
                leases = jobq.claim_batch(engine, wid, ns.ttl, limit=1, max_in_flight=ns.cap)
            except Exception:  # noqa: BLE001 - a partitioned host keeps trying
                time.sleep(ns.poll)
                continue
            if not leases:
                time.sleep(ns.poll)
                continue
            lease = leases[0]
            info = jobq.get(engine, lease.id)
            assert info is not None
            result = work(jobq.JobContext(lease))
            while True:  # write the result whatever happened meanwhile: no token in the WHERE
                try:
                    with engine.begin() as conn:
                        n = conn.execute(sa.update(jobs).where(jobs.c.id == lease.id).values(
                            state="done", result=result, in_flight=False, lease_owner=None)).rowcount
                    break
                except Exception:  # noqa: BLE001
                    time.sleep(ns.poll)
            if n:
                hist.log(ev="done", job=lease.id, run=run_of.get(lease.id), host=ns.host, pid=pid)

    if ns.broken == "cap_outside_claim":
        real = jobq._lease_rows

        def lease_rows(conn, d, *, max_in_flight, group_caps, limit, **kw):  # type: ignore[no-untyped-def]
            with engine.begin() as other:  # BROKEN: a separate transaction, not under the claim lock
                used = other.execute(sa.select(sa.func.count()).where(jobs.c.in_flight == sa.true())).scalar_one()
            time.sleep(0.02)  # the round trip between the count and the claim, as across hosts
            free = limit if max_in_flight is None else min(limit, max_in_flight - used)
            if free <= 0:
                return []
            return real(conn, d, max_in_flight=None, group_caps=group_caps, limit=free, **kw)

        jobq._lease_rows = lease_rows

    worker = jobq.Worker(
        engine, {t: work for t in ns.types.split(",")}, max_concurrency=ns.cap, group_caps=group_caps or None, lease_ttl=ns.ttl,
        poll_interval=ns.poll, retry_backoff=lambda a: 0.0, shutdown_timeout=5.0, listen=ns.listen,
        on_event=on_event, worker_id=f"{ns.host}-{pid}",
    )
    worker.run()


if __name__ == "__main__":
    main()
