"""jobq benchmark, "groups" mode: how a claim's cost grows with the groups holding ready work.

Each group holds 2 ready jobs; one ``claim_batch(limit=64, max_in_flight=64)`` is timed, its
leases released untimed, three times (``--repeats``); the median is reported per group count.
Three claims run untimed first (``--warmup``): right after the bulk load the server is still
flushing it (on MySQL the first claims took up to twice as long as the tenth).

Run:
    python bench/groups.py --url postgresql+psycopg://postgres@127.0.0.1/test --groups 1,100,1000,10000
    python bench/bench.py --url ... --only groups          # the same rows inside bench.py's table
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

import jobq

GROUP_COUNTS = (1, 100, 1_000, 10_000, 100_000)


def _seed_groups(eng: sa.Engine, n_groups: int, per_group: int = 2) -> None:
    now = jobq._utcnow() - jobq._dt.timedelta(seconds=5)
    base = dict(type="noop", args={}, state="ready", is_container=False, parent_id=None, weight=1, run_after=now,
                created_at=now, updated_at=now, attempts=0, max_attempts=3, in_flight=False, cancel_requested=False,
                pending_deps=0, pending_children=0, failed_children=0)
    rows = [dict(base, group_key=f"tenant-{g:06d}") for g in range(n_groups) for _ in range(per_group)]
    with eng.begin() as conn:
        for i in range(0, len(rows), 5000):
            conn.execute(sa.insert(jobq.Job.__table__), rows[i:i + 5000])


def claim_time(url: str, n_groups: int, repeats: int = 3, per_group: int = 2, warmup: int = 3) -> float:
    """Median seconds of one claim_batch(limit=64, max_in_flight=64) over ``n_groups`` groups
    of ``per_group`` ready jobs each, after ``warmup`` untimed claims."""
    eng = sa.create_engine(url)
    jobq.Base.metadata.drop_all(eng)
    jobq.create_schema(eng)
    _seed_groups(eng, n_groups, per_group)
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        leases = jobq.claim_batch(eng, "bench", 60, limit=64, max_in_flight=64)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        assert leases, "nothing claimed"
        for lease in leases:
            jobq.release(eng, lease.id, worker_id="bench", token=lease.token)
    eng.dispose()
    return statistics.median(times)


def groups_rows(url: str, counts: tuple[int, ...] = GROUP_COUNTS, repeats: int = 3,
                warmup: int = 3) -> list[tuple[str, str]]:
    """bench.py's rows: claim time per number of groups with ready work."""
    out = []
    for n in counts:
        secs = claim_time(url, n, repeats, warmup=warmup)
        out.append((f"claim_batch(limit=64, max_in_flight=64), {n:,} groups x 2 ready jobs (median of {repeats})",
                    f"{secs * 1000:.1f} ms"))
        print(out[-1], flush=True)
        if n == 1:
            # The same 64 slots as the rows of 32 groups and more: one group's claim above fills
            # only 2, so the ratio to it counts per-slot work (64 rows leased, logged) as well.
            secs = claim_time(url, 1, repeats, per_group=128, warmup=warmup)
            out.append((f"claim_batch(limit=64, max_in_flight=64), 1 group x 128 ready jobs, 64 slots filled "
                        f"(median of {repeats})", f"{secs * 1000:.1f} ms"))
            print(out[-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url")
    ap.add_argument("--groups", default=",".join(map(str, GROUP_COUNTS)))
    ap.add_argument("--repeats", type=int, default=3, help="claims timed per group count (the median is shown)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed claims first, after the bulk load")
    ns = ap.parse_args()
    url = ns.url or f"sqlite:///{tempfile.mkdtemp(prefix='jobq-bench-')}/bench.db"
    groups_rows(url, tuple(int(x) for x in ns.groups.split(",")), ns.repeats, ns.warmup)


if __name__ == "__main__":
    main()
