"""A real worker process for the crash tests, with jobq's checkpoint replaced by a kill switch.

    python worker_main.py URL LOGDIR [--kill-at POINT --kill-nth N] [--until-idle SECONDS]

Handlers append to per-process logs in LOGDIR (flushed and fsynced before they return), so the
test can count executions and finalize commits after the process is gone:
    exec-PID.log    one line per handler start: "job attempt"
    steps-PID.log   one line per step of the "steps" handler: "job attempt step"
    final-PID.log   one line per job whose finalize committed (the "finalized" checkpoint)
    events-PID.log  one line per worker event: "action job"
    started-JOB-ATTEMPT  a marker file created when a handler starts
    returning-JOB-ATTEMPT  created just before a "work" handler with args.gate returns
    (the "waiter" handler checkpoints once, then waits for the signal args.key)
    handler-JOB-ATTEMPT  the pid of the "forever" handler's process, written when it starts

--no-death-watch starts handler processes (--executor process) without jobq's watch on their
worker: the broken variant of tests/crash/test_orphan_handler.py.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import sqlalchemy as sa  # noqa: E402

import jobq  # noqa: E402


def append(path: pathlib.Path, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def forever(ctx: jobq.JobContext) -> None:
    """Writes its process's pid to LOGDIR/handler-JOB-ATTEMPT (LOGDIR is args.logdir), then
    runs until killed, ignoring stop_requested like a hung call. Module-level: the spawn and
    forkserver start methods pickle the handler by reference."""
    marker = pathlib.Path(ctx.args["logdir"]) / f"handler-{ctx.id}-{ctx.attempt}"
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(str(os.getpid()))
    tmp.rename(marker)  # whole or absent
    while True:
        time.sleep(0.05)


def no_death_watch(lifeline: object) -> None:
    """BROKEN: the handler process does not watch its worker (replaces jobq._die_with_worker)."""


def suspend_keeps_lease(conn: sa.Connection, d: object, o: object, now: object) -> tuple[int, str, str]:
    """BROKEN: the suspension is reported written, but the job keeps its lease (replaces
    jobq._write_suspension): it can only come back through a reclaim, charged."""
    return 1, "ready", "suspended"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("logdir", type=pathlib.Path)
    p.add_argument("--kill-at", default="")
    p.add_argument("--kill-nth", type=int, default=1)
    p.add_argument("--until-idle", type=float, default=0.0)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--ttl", type=float, default=1.0)
    p.add_argument("--shutdown-timeout", type=float, default=5.0)
    p.add_argument("--executor", default="thread")
    p.add_argument("--start-method", default="fork")
    p.add_argument("--no-death-watch", action="store_true", help="BROKEN: handler processes outlive the worker")
    p.add_argument("--suspend-keeps-lease", action="store_true",
                   help="BROKEN: a suspension records the wait but leaves the job leased (tests/crash/test_suspend_kill.py)")
    p.add_argument("--no-pre-ping", action="store_true", help="let dead pooled connections surface as errors")
    ns = p.parse_args()
    pid = os.getpid()
    logs = ns.logdir
    seen = {"n": 0}

    def checkpoint(point: str, job_ids=()) -> None:
        if point == "finalized":
            for j in job_ids:
                append(logs / f"final-{pid}.log", str(j))
        if point == ns.kill_at and job_ids:
            seen["n"] += 1
            if seen["n"] >= ns.kill_nth:
                append(logs / f"killed-{pid}.log", f"{point} {list(job_ids)}")
                os.kill(pid, signal.SIGKILL)

    jobq._checkpoint = checkpoint  # the test entry point's replacement for the no-op
    if ns.no_death_watch:
        jobq._die_with_worker = no_death_watch  # type: ignore[assignment]
    if ns.suspend_keeps_lease:
        jobq._write_suspension = suspend_keeps_lease  # type: ignore[assignment]

    def work(ctx: jobq.JobContext) -> dict:
        append(logs / f"exec-{pid}.log", f"{ctx.id} {ctx.attempt}")
        (logs / f"started-{ctx.id}-{ctx.attempt}").touch()
        sleep = float(ctx.args.get("sleep", 0.02))
        if ctx.args.get("gate"):
            # Runs until the test creates the file args.gate, ignoring stop_requested like a
            # hung call; marks returning-JOB-ATTEMPT just before it returns.
            while not os.path.exists(ctx.args["gate"]):
                time.sleep(0.01)
            (logs / f"returning-{ctx.id}-{ctx.attempt}").touch()
        elif ctx.args.get("cooperative"):
            ctx.wait(sleep)
        else:
            time.sleep(sleep)
        return {"pid": pid, "attempt": ctx.attempt}

    def spawner(ctx: jobq.JobContext) -> dict:
        # Spawns args["n"] work jobs (the last also waits on this job), then, on attempt 1 only,
        # marks spawned-JOB-ATTEMPT and sleeps args["hold"] seconds (a kill window).
        append(logs / f"exec-{pid}.log", f"{ctx.id} {ctx.attempt}")
        n = int(ctx.args.get("n", 3))
        items = [{"key": str(i), "type": "work", "args": {"sleep": 0.01, "attempt": ctx.attempt}} for i in range(n)]
        items[-1]["depends_on"] = [ctx.id, *(str(i) for i in range(n - 1))]
        ids = ctx.submit(items)
        (logs / f"spawned-{ctx.id}-{ctx.attempt}").touch()
        if ctx.attempt == 1:
            time.sleep(float(ctx.args.get("hold", 0)))
        return {"pid": pid, "attempt": ctx.attempt, "spawned": sorted(ids.values())}

    def poison(ctx: jobq.JobContext) -> None:
        append(logs / f"exec-{pid}.log", f"{ctx.id} {ctx.attempt}")
        os.kill(pid, signal.SIGKILL)

    def steps(ctx: jobq.JobContext) -> dict:
        # A long job in steps that checkpoints after each one; attempt 1 SIGKILLs the whole
        # worker (from the handler's own process too, with --executor process) after step
        # args.kill_after was checkpointed.
        start = (ctx.state or {}).get("next", 0)
        append(logs / f"exec-{pid}.log", f"{ctx.id} {ctx.attempt}")
        for i in range(start, ctx.args["n"]):
            append(logs / f"steps-{pid}.log", f"{ctx.id} {ctx.attempt} {i}")
            ctx.progress(i + 1, ctx.args["n"])
            ctx.checkpoint({"next": i + 1})
            if ctx.attempt == 1 and i == ctx.args["kill_after"]:
                os.kill(pid, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
        return {"resumed_from": start}

    def waiter(ctx: jobq.JobContext) -> dict:
        # Checkpoints once, then waits for the signal args.key without holding a slot.
        append(logs / f"exec-{pid}.log", f"{ctx.id} {ctx.attempt}")
        if ctx.state is None:
            ctx.checkpoint({"prepared": ctx.attempt})
        got = ctx.wait_for(ctx.args["key"])
        return {"got": got, "state": ctx.state, "attempt": ctx.attempt}

    connect_args = {"application_name": "jobq-crash-worker"} if ns.url.startswith("postgresql") else {}
    engine = sa.create_engine(ns.url, pool_pre_ping=not ns.no_pre_ping, connect_args=connect_args)
    worker = jobq.Worker(
        engine, {"work": work, "poison": poison, "steps": steps, "spawner": spawner, "forever": forever,
                 "waiter": waiter},
        max_concurrency=ns.concurrency, lease_ttl=ns.ttl, poll_interval=0.02, retry_backoff=lambda a: 0.0,
        shutdown_timeout=ns.shutdown_timeout, executor=ns.executor, start_method=ns.start_method,
        on_event=lambda ev: append(logs / f"events-{pid}.log", f"{ev.action} {ev.job_id}"),
    )
    append(logs / f"ready-{pid}.log", worker.worker_id)
    if ns.until_idle:
        sys.exit(0 if worker.run_until_idle(timeout=ns.until_idle) else 3)
    worker.run()


if __name__ == "__main__":
    main()
