"""What one ctx.checkpoint() costs: the median and 90th percentile wall time of N checkpoints
of a small state (about 100 bytes of JSON) through a Worker's checkpoint path (one short,
fenced UPDATE transaction), per engine.

Run:
    python bench/checkpoint_cost.py --url sqlite:///ck.db --url postgresql+psycopg://postgres@127.0.0.1/db -n 300
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import sqlalchemy as sa

import jobq


def measure(url: str, n: int) -> tuple[float, float]:
    engine = sa.create_engine(url)
    jobq.create_schema(engine)
    jobq.enqueue(engine, "bench_checkpoint")
    lease = jobq.claim_batch(engine, "bench", 600, types=["bench_checkpoint"])[0]
    worker = jobq.Worker(engine, {"bench_checkpoint": lambda ctx: None}, max_concurrency=1)
    ctx = jobq.JobContext(lease)
    ctx._save = worker._save_checkpoint
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        ctx.checkpoint({"next": i, "rows": i * 1000, "cursor": f"partition-{i:06d}", "note": "x" * 40})
        times.append(time.perf_counter() - t0)
    jobq.finalize(engine, lease.id, worker_id="bench", token=lease.token, result={})
    engine.dispose()
    times.sort()
    return statistics.median(times) * 1000, times[int(len(times) * 0.9)] * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", action="append", required=True)
    p.add_argument("-n", type=int, default=300)
    ns = p.parse_args()
    for url in ns.url:
        med, p90 = measure(url, ns.n)
        print(f"{sa.make_url(url).get_backend_name():<10} checkpoint: median {med:.2f} ms, p90 {p90:.2f} ms (n={ns.n})")


if __name__ == "__main__":
    main()
