"""jobq benchmark, "ab" mode: the working tree's jobq against a git revision's, alternating.

Loads jobq as it is in the working tree (the package, jobq/) and as it was at ``--rev`` (its
single file: ``single/jobq.py``, or ``jobq.py`` before the package, by ``git show``) side by
side in one process, and alternates their drains of the same no-op jobs (one ``Worker``,
``--concurrency`` slots, ``run_until_idle``), the order flipping each round, so the machine's
drift falls on both alike. Prints each side's median jobs/s and client CPU per job (this
process's user + system time over the drain, seeding excluded) and new/old. What one change
bought, where bench.py's drains compare contenders.

With ``--procs N`` each drain is N worker processes instead (spawned, each loading its side's
single file, the working tree's single/jobq.py being generated from its package; ``--concurrency`` slots each under a cap of N times that, as bench.py's drains), for a
change that acts across workers (the claim lock's hold, say); client CPU is then the workers'.
On a machine that drifts by a third between runs, only such paired runs separate a 10% change
from noise.

Run:
    python bench/ab.py --url postgresql+psycopg://postgres@127.0.0.1/test --rev HEAD~1
    python bench/ab.py --url ... --rev HEAD~1 --procs 2
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from types import ModuleType

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import sqlalchemy as sa
import throughput as T  # its process harness: start signal, drain CPU, failed processes

import bench as B  # imports the working tree's jobq

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load(name: str, path: pathlib.Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _drain(jobq: ModuleType, url: str, n: int, conc: int) -> tuple[float, float]:
    """(jobs/s, client CPU µs per job) of one drain of ``n`` fresh no-op jobs."""
    eng = sa.create_engine(url)
    jobq.Base.metadata.drop_all(eng)
    jobq.create_schema(eng)
    B.seed(eng, n, table=jobq.Job.__table__)
    eng.dispose()
    gc.collect()
    eng = sa.create_engine(url)
    w = jobq.Worker(eng, {"noop": B._noop}, max_concurrency=conc, poll_interval=0.05, lease_ttl=60)
    c0, t0 = B._cpu(), time.perf_counter()
    if not w.run_until_idle(timeout=600):
        raise RuntimeError("the drain did not finish")
    elapsed, cpu = time.perf_counter() - t0, B._cpu() - c0
    with eng.connect() as conn:
        done = conn.execute(sa.text("SELECT count(*) FROM jobs WHERE state = 'done'")).scalar()
    eng.dispose()
    if done != n:
        raise RuntimeError(f"{done} of {n} jobs done")
    return n / elapsed, cpu / n * 1e6


def _enqueue(jobq: ModuleType, url: str, n: int, conc: int) -> tuple[float, float]:
    """(enqueues/s, client CPU µs per enqueue) of ``n`` single enqueues, one transaction each."""
    eng = sa.create_engine(url)
    jobq.Base.metadata.drop_all(eng)
    jobq.create_schema(eng)
    gc.collect()
    c0, t0 = B._cpu(), time.perf_counter()
    for i in range(n):
        jobq.enqueue(eng, "noop", {"i": i})
    elapsed, cpu = time.perf_counter() - t0, B._cpu() - c0
    eng.dispose()
    return n / elapsed, cpu / n * 1e6


def _claim(jobq: ModuleType, url: str, n: int, conc: int) -> tuple[float, float]:
    """(jobs/s, client CPU µs per job) of claiming ``n`` seeded jobs ``conc`` at a time with
    claim_batch, each batch finalized (the claim and the finish without a worker's loop)."""
    eng = sa.create_engine(url)
    jobq.Base.metadata.drop_all(eng)
    jobq.create_schema(eng)
    B.seed(eng, n, table=jobq.Job.__table__)
    gc.collect()
    c0, t0, got = B._cpu(), time.perf_counter(), 0
    while got < n:
        leases = jobq.claim_batch(eng, "ab", 60, limit=conc)
        if not leases:
            raise RuntimeError(f"{got} of {n} jobs claimed")
        for lease in leases:
            jobq.finalize(eng, lease.id, None, worker_id="ab", token=lease.token)
        got += len(leases)
    elapsed, cpu = time.perf_counter() - t0, B._cpu() - c0
    eng.dispose()
    return n / elapsed, cpu / n * 1e6


_OPS = {"drain": _drain, "enqueue": _enqueue, "claim": _claim}


def _setup_side(path: str, url: str, conc: int, cap: int) -> Callable[[], None]:
    """One worker process of a ``--procs`` drain, on the jobq.py at ``path``: its Worker, made
    before the start signal (throughput._run_procs), and the drain to run after it."""
    jobq = _load("jobq_side", pathlib.Path(path))
    w = jobq.Worker(sa.create_engine(url), {"noop": B._noop}, max_concurrency=cap, local_concurrency=conc,
                    poll_interval=0.05, lease_ttl=60)

    def drain() -> None:
        if not w.run_until_idle(timeout=600):
            raise RuntimeError("the drain did not finish")

    return drain


def _drain_procs(jobq: ModuleType, path: str, url: str, n: int, conc: int, procs: int) -> tuple[float, float]:
    """(jobs/s, client CPU µs per job) of one drain by ``procs`` worker processes, ``conc``
    slots each under a cap of ``conc * procs`` (as bench.py's drains), on the jobq.py at
    ``path`` (``jobq``: the same module, loaded here, which makes the schema)."""
    eng = sa.create_engine(url)
    jobq.Base.metadata.drop_all(eng)
    jobq.create_schema(eng)
    B.seed(eng, n, table=jobq.Job.__table__)
    eng.dispose()
    elapsed, cpu = T._run_procs(_setup_side, (path, url, conc, conc * procs), procs)
    return n / elapsed, cpu / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="sqlite:////dev/shm/jobq_ab.db")
    ap.add_argument("--rev", default="HEAD", help="the git revision whose jobq is 'old'")
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--op", choices=sorted(_OPS), default="drain",
                    help="drain: a Worker's run_until_idle; enqueue: single enqueues; claim: claim_batch + finalize")
    ap.add_argument("--procs", type=int, default=0,
                    help="worker processes (each --concurrency slots, as bench.py's drains); 0: one Worker in this process")
    args = ap.parse_args()
    for old in ("single/jobq.py", "jobq.py"):  # jobq.py: a revision from before the package
        shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.rev}:{old}"], capture_output=True, text=True)
        if shown.returncode == 0:
            source = shown.stdout
            break
    else:
        raise SystemExit(f"{args.rev} has neither single/jobq.py nor jobq.py")
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "jobq_old.py"
        path.write_text(source)
        sides = {"old": _load("jobq_old", path), "new": B.jobq}
        paths = {"old": str(path), "new": str(ROOT / "single" / "jobq.py")}
        got: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
        for i in range(args.rounds):
            for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
                got[name].append(
                    _drain_procs(sides[name], paths[name], args.url, args.jobs, args.concurrency, args.procs)
                    if args.procs else _OPS[args.op](sides[name], args.url, args.jobs, args.concurrency))
                rate, cpu = got[name][-1]
                print(f"  round {i + 1} {name}: {rate:,.0f} jobs/s, {cpu:.1f} µs CPU/job", flush=True)
    med = {k: (statistics.median(r for r, _ in v), statistics.median(c for _, c in v)) for k, v in got.items()}
    shape = f"{args.procs} processes x {args.concurrency} slots" if args.procs else f"{args.concurrency} slots"
    print(f"{args.rev} → working tree, {args.op}, {args.jobs:,} jobs, {shape}, medians of {args.rounds}:")
    for k in ("old", "new"):
        print(f"  {k}: {med[k][0]:,.0f} jobs/s, {med[k][1]:.1f} µs CPU/job")
    print(f"  new/old: {med['new'][0] / med['old'][0]:.2f}x jobs/s, {med['new'][1] / med['old'][1]:.2f}x CPU/job")


if __name__ == "__main__":
    main()
