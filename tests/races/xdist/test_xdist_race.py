"""The xdist race: every pytest-xdist worker is a claimer process on ONE shared queue.

Run it with every worker taking part (``--dist each``; ``nox -s races-<engine>`` does)::

    pytest -p xdist -n 4 --dist each tests/races/xdist

One worker seeds the queue (elected by an exclusive create of a file in the directory the
workers share); all of them wait on a file barrier, then run T threads each that claim with a
global cap, group caps and a group's rate limit, hold the lease briefly, finalize it, and log
every claim (job, token, claimer, asked/answered/released times) to their own file. A sampler
thread on each worker counts in-flight rows per group in the database the whole time. When
every worker has finished (a second barrier), each one checks the union of the logs and the
database: no job claimed twice, none lost, every claim the database counted is in a log, the
caps never exceeded (sampled in the database and seen in the logs), no rate window overspent.

``JOBQ_RACE_VARIANT`` swaps in a deliberately broken claim from ``tests/races/variants.py``
(e.g. ``read_then_update``); the race must then fail with duplicates, which
``tests/races/test_xdist_catches.py`` checks in a subprocess.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import threading
import time
from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
from dbs import named_url
from harness import CLOCK_MARGIN, ROUNDS, SUMMARY, max_overlap
from helpers import most_surely_in_window

jobs = jobq.Job.__table__

WORKER = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = int(os.environ.get("JOBQ_RACE_THREADS", "4"))
VARIANT = os.environ.get("JOBQ_RACE_VARIANT", "correct")
N_JOBS = int(os.environ.get("JOBQ_RACE_JOBS", str(10_000 * ROUNDS)))  # the contended claims

CAP = 32  # max_in_flight across every worker: below what 16 claimers asking for up to 8 jobs want
BATCH = 16  # each claim asks for 1..BATCH jobs: claims under a cap serialise, so batches carry the volume
GROUP_CAPS = {"g0": 2, "g1": 3}
# At most 20 claims of group "rated" in any 2 s: a window several times longer than a claim
# waits for the claim lock under load, or no claim's whole span would fit inside one.
RATED, RATE = "rated", (20, 2.0)
N_RATED = 100  # >= 8 s of the rated group's claims, running alongside the rest
SHARES = {"g0": 0.10, "g1": 0.15, "g2": 0.35, "g3": 0.40}  # of the jobs not in the rated group
TTL = 600.0  # no lease may expire during the race: every second claim would be a double dispatch
START_DEADLINE = 120.0  # seconds for every worker to reach the start barrier
SEED_DEADLINE = 900.0  # a hang guard for seeding: Oracle MySQL inserts one row at a time (no RETURNING)
RUN_DEADLINE = 1800.0 * ROUNDS  # a hang guard, not a timed check: a loaded 2-core box took 8+ min


def _shared_dir(factory: pytest.TempPathFactory) -> pathlib.Path:
    """A directory every worker of this run sees: the parent of the workers' base temps."""
    base = factory.getbasetemp()
    root = base.parent if "PYTEST_XDIST_WORKER" in os.environ else base
    d = root / f"xrace-{os.environ.get('PYTEST_XDIST_TESTRUNUID', 'solo')}"
    d.mkdir(exist_ok=True)
    return d


def _write_atomic(path: pathlib.Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + f".{WORKER}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # readers see the whole file or none


def _wait_files(d: pathlib.Path, pattern: str, n: int, deadline: float, what: str) -> list[pathlib.Path]:
    """The file barrier: poll until ``n`` files match; fail naming who is missing."""
    end = time.monotonic() + deadline
    while True:
        found = sorted(d.glob(pattern))
        errs = {p.name: e for p in {*found, *d.glob("*.done")} if (e := json.loads(p.read_text()).get("error"))}
        if errs:
            raise AssertionError(f"{what}: failed on another worker: {errs}")
        if len(found) >= n:
            return found
        if time.monotonic() > end:
            raise AssertionError(
                f"{what}: only {len(found)} of {n} xdist workers arrived within {deadline:.0f}s "
                f"({[p.stem for p in found]}); every worker must run this test: use --dist each")
        time.sleep(0.002)


def _url(dialect: str, shared: pathlib.Path) -> str:
    if dialect == "sqlite":
        return f"sqlite:///{shared / 'race.db'}"  # one file, reached by every worker process
    return named_url(dialect)


def _seed(url: str, dialect: str) -> dict[str, Any]:
    """A fresh schema and the queue: N_JOBS jobs in groups g0..g3 plus N_RATED rate-limited."""
    eng = sa.create_engine(url)
    if dialect != "sqlite":
        jobq.Base.metadata.drop_all(eng)
    jobq.create_schema(eng)
    groups: list[str] = []
    for g, share in SHARES.items():
        groups += [g] * int((N_JOBS - N_RATED) * share)
    groups += ["g3"] * (N_JOBS - N_RATED - len(groups)) + [RATED] * N_RATED
    random.Random(7).shuffle(groups)
    ids: list[int] = []
    for start in range(0, len(groups), 1000):  # batched inserts; seeding is not what is measured
        chunk = groups[start:start + 1000]
        keys = jobq.submit(eng, [{"key": str(i), "type": "race", "group_key": g} for i, g in enumerate(chunk)])
        ids += keys.values()
    eng.dispose()
    return {"jobs": len(ids)}


def _claim_fn(variant: str):
    if variant == "correct":
        def correct(engine: sa.Engine, wid: str, limit: int) -> list[tuple[int, str]]:
            leases = jobq.claim_batch(engine, wid, TTL, limit=limit, max_in_flight=CAP, group_caps=GROUP_CAPS,
                                      rate_limits={RATED: RATE})
            return [(l.id, l.token) for l in leases]

        return correct
    from variants import VARIANTS  # the broken claims of the per-test harness

    broken = VARIANTS[variant]

    def rerun_on_deadlock(engine: sa.Engine, wid: str, limit: int) -> list[tuple[int, str]]:
        # A broken claim has no transaction retry of its own: on MySQL its read-then-update
        # deadlocks (1213) now and then. Rerun it, as jobq reruns its own, so the race fails for
        # what the variant breaks (duplicates), not for an error jobq would have retried.
        d = jobq._prepare(engine)
        for attempt in range(20):
            try:
                return broken(engine, wid, limit, CAP)
            except sa.exc.DBAPIError as exc:
                if attempt == 19 or not d.retryable(exc):
                    raise
        raise AssertionError("unreachable")

    return rerun_on_deadlock


def _sample(engine: sa.Engine, stop: threading.Event, out: dict[str, Any]) -> None:
    """In-flight rows per group, counted by one statement (one snapshot) over and over."""
    q = sa.select(jobs.c.group_key, sa.func.count()).where(jobs.c.in_flight == sa.true()).group_by(jobs.c.group_key)
    peaks: Counter[str] = Counter()
    total = samples = 0
    with engine.connect() as conn:
        while not stop.is_set():
            counts = dict(conn.execute(q).all())
            conn.rollback()  # end the read's transaction: the next sample sees a new snapshot
            samples += 1
            total = max(total, sum(counts.values()))
            for g, n in counts.items():
                peaks[g] = max(peaks[g], n)
            stop.wait(0.01)
    out.update(total=total, groups=dict(peaks), samples=samples)


def _finalize(engine: sa.Engine, wid: str, got: list[tuple[int, str]]) -> list[str | None]:
    """Finalize a claim's jobs as jobq's Worker does: one transaction, each row fenced by its
    lease token (finalize() is the same write for one job). None where the lease was lost."""
    result = jobq._encode_checked({"by": wid}, "result")
    outs = [jobq._Outcome(job_id, wid, token, "done", result=result) for job_id, token in got]
    return jobq._transaction(engine, lambda conn, d: jobq._apply_outcomes(conn, d, outs, d.db_now(conn)))


class _Claimers:
    """This worker's THREADS claimer threads and its sampler, on one engine."""

    def __init__(self, url: str, variant: str) -> None:
        self.claim = _claim_fn(variant)
        self.variant = variant
        self.engine = sa.create_engine(url, pool_size=THREADS + 2, max_overflow=4)
        jobq.create_schema(self.engine)  # prepares the engine; the schema exists
        self.records: list[dict[str, Any]] = []
        self.sampled: dict[str, Any] = {}
        self.errors: list[BaseException] = []
        self.calls = Counter[str]()  # claim calls: "leased" something, came back "empty"
        self.lock = threading.Lock()
        self.go, self.stop = threading.Event(), threading.Event()
        self.threads = [threading.Thread(target=self._claimer, args=(i,)) for i in range(THREADS)]
        for t in self.threads:
            t.start()  # each waits for `go`

    def run(self) -> float:
        """Release the claimers together; return when all are done (the seconds it took)."""
        t0 = time.monotonic()
        sampler = threading.Thread(target=_sample, args=(self.engine, self.stop, self.sampled))
        sampler.start()
        self.go.set()
        for t in self.threads:
            t.join()
        self.stop.set()
        sampler.join()
        self.engine.dispose()
        if self.errors:
            raise self.errors[0]
        return time.monotonic() - t0

    def _ready_left(self) -> int:
        with self.engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).where(jobs.c.state == "ready")).scalar_one()

    def _claimer(self, tid: int) -> None:
        wid = f"{WORKER}t{tid}"
        rnd = random.Random(f"{WORKER}/{tid}")
        self.go.wait()
        try:
            while True:
                t_ask = time.monotonic()
                try:
                    got = self.claim(self.engine, wid, rnd.randint(1, BATCH))
                except sa.exc.OperationalError:
                    if self.variant == "correct":  # broken variants may surface lock errors; jobq's claim must not
                        raise
                    got = []
                t_claim = time.monotonic()
                self.calls["leased" if got else "empty"] += 1
                if not got:
                    if self._ready_left() == 0:
                        return
                    time.sleep(0.002)  # capped, rate-limited or raced away: ask again
                    continue
                time.sleep(rnd.uniform(0, 0.002))  # hold the leases briefly
                t_release = time.monotonic()
                written = _finalize(self.engine, wid, got)
                with self.lock:
                    self.records += [{"job": job_id, "wid": wid, "token": token, "ta": t_ask, "t0": t_claim,
                                      "t1": t_release, "ok": w == "done"} for (job_id, token), w in zip(got, written, strict=True)]
        except BaseException as e:  # re-raised by run(), after the other claimers finish
            self.errors.append(e)


@pytest.mark.timeout(RUN_DEADLINE + SEED_DEADLINE + 2 * START_DEADLINE)
def test_claimers_on_every_xdist_worker_share_one_queue(dialect: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every xdist worker x THREADS claimers drain N_JOBS (10,000 x JOBQ_RACE_ROUNDS) from one
    queue under max_in_flight=32, group caps g0<=2 and g1<=3, and 20 claims per 2 s of group
    "rated". Correct: every job claimed exactly once and done, every claim the database counted
    (attempts) in a worker's log, no sample of the database ever above a cap, no two logs'
    claim-to-release intervals overlapping beyond a cap, no 2 s window holding more than 20
    rated claims whose whole asked-to-answered span lies inside it. A claim that is not atomic
    shows as a job in two claimers' logs; a cap outside the claim's lock as a sample over the cap."""
    shared = _shared_dir(tmp_path_factory) / dialect
    shared.mkdir(exist_ok=True)
    url = _url(dialect, shared)
    me = {"worker": WORKER}
    phases = {"start": time.monotonic()}
    try:
        try:  # the seeder: whoever creates this file first
            fd = os.open(shared / "seed.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.close(fd)
            seeder = True
        except FileExistsError:
            seeder = False
        if seeder:
            try:
                _write_atomic(shared / "seeded.json", _seed(url, dialect))
            except BaseException as e:
                _write_atomic(shared / "seeded.json", {"error": repr(e)})
                raise
        _wait_files(shared, "seeded.json", 1, SEED_DEADLINE, "seeding")
        phases["seeded"] = time.monotonic()
        claimers = _Claimers(url, VARIANT)
        _write_atomic(shared / f"{WORKER}.arrived", me)
        _wait_files(shared, "*.arrived", WORKERS, START_DEADLINE, "start barrier")
        phases["started"] = time.monotonic()
        seconds = claimers.run()
        phases["ran"] = time.monotonic()
        _write_atomic(shared / f"{WORKER}.log.json",
                      {"records": claimers.records, "sampled": claimers.sampled, "seconds": seconds,
                       "calls": claimers.calls, "phases": phases})
        _write_atomic(shared / f"{WORKER}.done", me)
    except BaseException as e:
        _write_atomic(shared / f"{WORKER}.done", {**me, "error": repr(e)})
        raise
    _wait_files(shared, "*.done", WORKERS, RUN_DEADLINE, "finish barrier")
    _check(url, shared, dialect)


def _check(url: str, shared: pathlib.Path, dialect: str) -> None:
    """The final check over every worker's log and the database (every worker runs it)."""
    logs = [json.loads(p.read_text()) for p in sorted(shared.glob("*.log.json"))]
    assert len(logs) == WORKERS, f"{len(logs)} logs for {WORKERS} workers"
    records = [r for lg in logs for r in lg["records"]]
    eng = sa.create_engine(url)
    with eng.connect() as conn:
        rows = conn.execute(sa.select(jobs.c.id, jobs.c.group_key, jobs.c.state, jobs.c.attempts)).all()
    eng.dispose()
    group = {r.id: r.group_key for r in rows}
    claims = Counter(r["job"] for r in records)
    oks = Counter(r["job"] for r in records if r["ok"])
    by_group: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        by_group.setdefault(group[r["job"]], []).append((r["t0"], r["t1"]))
    db_peak = max(lg["sampled"]["total"] for lg in logs)
    db_groups = {g: max(lg["sampled"]["groups"].get(g, 0) for lg in logs) for g in GROUP_CAPS}
    rated = sorted((r["ta"], r["t0"]) for r in records if group[r["job"]] == RATED)
    n_rate, period = RATE
    most = most_surely_in_window(rated, period - CLOCK_MARGIN)
    res = {
        "variant": VARIANT, "workers": WORKERS, "threads": THREADS, "jobs": len(rows), "claims": len(records),
        "duplicates": sum(1 for n in claims.values() if n > 1),
        "lost": sum(1 for r in rows if r.state != "done"),
        "double_done": sum(1 for n in oks.values() if n > 1),
        "unlogged": sum(r.attempts for r in rows) - len(records),  # claims the database counted, no log holds
        "overlap": max_overlap([(r["t0"], r["t1"]) for r in records]),
        "db_peak": db_peak, "db_groups": db_groups,
        "group_overlap": {g: max_overlap(by_group.get(g, [])) for g in GROUP_CAPS},
        "rate_most": most, "rated": len(rated),
        "samples": sum(lg["sampled"]["samples"] for lg in logs),
        "calls": sum(lg["calls"].get("leased", 0) for lg in logs), "empty_calls": sum(lg["calls"].get("empty", 0) for lg in logs),
        "seconds": max(lg["seconds"] for lg in logs),
        "phases": [{k: round(v - lg["phases"]["start"], 1) for k, v in lg["phases"].items()} for lg in logs],
    }
    if WORKER == "gw0":  # one copy of the figures: the summary table and the broken-variant test read it
        _write_atomic(shared / "result.json", res)
        _summary(dialect, res)
    bad = {k: res[k] for k in ("duplicates", "lost", "double_done", "unlogged") if res[k]}
    if res["claims"] != res["jobs"]:
        bad["claims"] = f"{res['claims']} for {res['jobs']} jobs"
    if max(res["overlap"], db_peak) > CAP:
        bad["cap"] = f"logs {res['overlap']}, database {db_peak} > {CAP}"
    for g, cap in GROUP_CAPS.items():
        if max(db_groups[g], res["group_overlap"][g]) > cap:
            bad[f"cap {g}"] = f"logs {res['group_overlap'][g]}, database {db_groups[g]} > {cap}"
    if most > n_rate:
        bad["rate"] = f"{most} claims of {RATED} inside one {period}s window > {n_rate}"
    assert not bad, f"the xdist race ({VARIANT}) broke: {bad}"
    # Contention was real, and the rate limit did limit: the rated claims span what it implies.
    assert res["overlap"] >= 2 and db_peak >= 2, res
    span = max(a for _, a in rated) - min(b for b, _ in rated)
    assert span >= (N_RATED / n_rate - 1) * period - CLOCK_MARGIN, span


def _summary(dialect: str, res: dict[str, Any]) -> None:
    who = f"{res['workers']}x{res['threads']}"
    name = "xdist race" if res["variant"] == "correct" else f"BROKEN xdist {res['variant']}"
    SUMMARY.append({"engine": dialect, "check": f"{name}: dispatch, cap", "claimers": who, "claims": res["claims"],
                    "dups": res["duplicates"], "lost": res["lost"], "overlap": f"{res['overlap']}/{CAP}",
                    "secs": f"{res['seconds']:.1f}"})
    SUMMARY.append({"engine": dialect, "check": "  cap sampled in the database", "claimers": who,
                    "claims": res["samples"], "overlap": f"{res['db_peak']}/{CAP}"})
    for g, cap in GROUP_CAPS.items():
        SUMMARY.append({"engine": dialect, "check": f"  group {g}: database/logs", "claimers": who,
                        "overlap": f"{res['db_groups'][g]}/{res['group_overlap'][g]}/{cap}"})
    SUMMARY.append({"engine": dialect, "check": f"  rate: most {RATED} in {RATE[1]}s", "claimers": who,
                    "claims": res["rated"], "overlap": f"{res['rate_most']}/{RATE[0]}"})
