"""jobq benchmark, "graph ops" mode: what failing, retrying and cancelling a graph costs, per job,
against submitting it.

Two graphs: a chain of ``--chain`` jobs (5,000 by default), each depending on the one before,
and a fan-out of ``--fanout`` jobs (10,000 by default), all depending on one head. For each,
``--rounds`` times on fresh tables: ``submit`` the graph; claim its head and ``fail`` it for
good (which closes every other job); ``retry`` the head (which re-opens them all); ``cancel``
the head (which closes them all again). It prints the median seconds of each operation and
its ratio to submit's, per job (the same jobs each time, so the ratio of the times). Target:
fail, retry and cancel each within 3x of submit.

Run:
    python bench/graph_ops.py --url postgresql+psycopg://postgres@127.0.0.1/test --chain 5000 --fanout 10000
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

OPS = ("submit", "fail", "retry", "cancel")


def chain(n: int) -> list[dict]:
    return [{"key": "0", "type": "head", "max_attempts": 1}] + [
        {"key": str(i), "type": "t", "depends_on": [str(i - 1)]} for i in range(1, n)]


def fanout(n: int) -> list[dict]:
    return [{"key": "0", "type": "head", "max_attempts": 1}] + [
        {"key": str(i), "type": "t", "depends_on": ["0"]} for i in range(1, n)]


def one_round(eng: sa.Engine, items: list[dict]) -> dict[str, float]:
    """Seconds of each operation on a fresh queue holding nothing but this graph."""
    jobq.Base.metadata.drop_all(eng)
    jobq.create_schema(eng)
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    head = jobq.submit(eng, items)["0"]
    out["submit"] = time.perf_counter() - t0
    lease = jobq.claim(eng, "bench", 60, types=["head"])
    assert lease == head, "the head was not the job claimed"
    t0 = time.perf_counter()
    assert jobq.fail(eng, head, "bench", worker_id="bench", token=lease.token, retry=False) == "failed"
    out["fail"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    reopened = jobq.retry(eng, head)
    out["retry"] = time.perf_counter() - t0
    assert len(reopened) == len(items), f"retry re-opened {len(reopened)} of {len(items)} jobs"
    t0 = time.perf_counter()
    assert jobq.cancel(eng, head) == "cancelled"
    out["cancel"] = time.perf_counter() - t0
    with eng.connect() as conn:
        left = conn.execute(sa.select(sa.func.count()).select_from(jobq.Job).where(jobq.Job.state != "cancelled")).scalar()
    assert left == 0, f"{left} jobs not cancelled"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", action="append", help="a queue's URL; repeat for several engines (default: a SQLite file)")
    ap.add_argument("--chain", type=int, default=5000, help="jobs in the chain (0: skip)")
    ap.add_argument("--fanout", type=int, default=10000, help="jobs in the fan-out, head included (0: skip)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per graph (medians)")
    ns = ap.parse_args()
    urls = ns.url or [f"sqlite:///{tempfile.mkdtemp(prefix='jobq-bench-')}/graph.db"]
    print(f"jobq {jobq.__file__}; medians of {ns.rounds} rounds; ratio = op / submit, per job (target <= 3)")
    for url in urls:
        eng = sa.create_engine(url)
        name = f"{eng.dialect.name} {'.'.join(map(str, eng.dialect.server_version_info or ()))}".strip()
        for label, n, build in (("chain", ns.chain, chain), ("fanout", ns.fanout, fanout)):
            if n < 2:
                continue
            runs = [one_round(eng, build(n)) for _ in range(ns.rounds)]
            med = {op: statistics.median(r[op] for r in runs) for op in OPS}
            cells = "  ".join(f"{op} {med[op]:.3f} s" for op in OPS)
            ratios = "  ".join(f"{op} {med[op] / med['submit']:.1f}x" for op in OPS[1:])
            print(f"{name:<18} {label}{n:<6} {cells}  |  {ratios}", flush=True)
        jobq.Base.metadata.drop_all(eng)
        eng.dispose()


if __name__ == "__main__":
    main()
