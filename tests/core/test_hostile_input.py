"""Bad input that used to crash (OverflowError, DataError, a server's CHECK) instead of being
refused with jobq's own error, and names the engines used to compare differently (issue 20,
items 9, 11 and 13). Correct is the same on every engine: InvalidJob/ConfigError naming the
rule, nothing written; a bug shows as another exception type, as a write, or as a result a
worker could never store."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
from dbs import needs
from helpers import snapshot, state, wait_for

UTC = dt.UTC
FAST = dict(poll_interval=0.02, lease_ttl=5.0, retry_backoff=lambda attempt: 0.0)


def nest(n: int, shape: str) -> Any:
    """A JSON value with exactly ``n`` arrays/objects nested in one another (the outermost
    one a dict, so it can be a job's args)."""
    inner: Any = {"scalar": 1, "empty-list": [], "empty-dict": {}, "string": "[[{{"}[shape]
    containers = n - (shape in ("empty-list", "empty-dict"))
    for i in range(containers - 1):
        inner = [inner] if i % 2 else {"k": inner, "sibling": 7}
    return {"top": inner} if containers else {}


SHAPES = ["scalar", "empty-list", "empty-dict", "string"]


# ---- item 9: JSON depth, as the strictest engine counts it --------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_json_at_max_depth_round_trips_on_every_engine(engine: sa.Engine, shape: str) -> None:
    value = nest(jobq.MAX_JSON_DEPTH, shape)
    jid = jobq.enqueue(engine, "t", value)
    assert jobq.get(engine, jid).args == value  # type: ignore[union-attr]


#: Values whose text form a decoder could get wrong: the claim reads args and checkpoints as
#: text and decodes them itself (_LEASE_COLS), with a shortcut for exactly "{}".
AWKWARD = [
    {},
    {"{}": "{}", "": [], "e": {}},
    {"emoji": "\U0001f600 \u00e9\u4e2d", "ctl": "\t\n\r\x1f", "quote": "\"'\\"},
    {"big": 2**63 - 1, "neg": -(2**63), "float": 1.5e-300, "tiny": 5e-324, "bool": [True, False, None]},
    {"nested": [[[{"a": [{}]}]]], "str": "[[{{", "spaces": "  {}  "},
]


@pytest.mark.parametrize("value", AWKWARD, ids=range(len(AWKWARD)))
def test_awkward_args_and_checkpoints_reach_the_handler_unchanged(engine: sa.Engine, value: dict) -> None:
    """What enqueue stored is what the claim hands over, as args and as the next attempt's
    checkpoint (ctx.state), on every engine; at the depth limit too."""
    seen: list[tuple[Any, Any]] = []

    def handler(ctx: jobq.JobContext) -> None:
        seen.append((ctx.args, ctx.state))
        if ctx.attempt == 1:
            ctx.checkpoint(value)
            raise RuntimeError("again, from the checkpoint")

    jobq.enqueue(engine, "t", value, max_attempts=2)
    jobq.enqueue(engine, "t", nest(jobq.MAX_JSON_DEPTH, "empty-dict"), max_attempts=1)
    assert jobq.Worker(engine, {"t": handler}, max_concurrency=1, **FAST).run_until_idle(timeout=60)
    assert (value, None) in seen and (value, value) in seen, seen
    assert (nest(jobq.MAX_JSON_DEPTH, "empty-dict"), None) in seen


@pytest.mark.parametrize("shape", SHAPES)
def test_json_one_level_deeper_is_refused_on_every_engine(engine: sa.Engine, shape: str) -> None:
    """Old code let 32 containers through: MariaDB's CHECK then raised OperationalError 4025,
    and the other engines stored what MariaDB cannot (not the same behaviour everywhere)."""
    before = snapshot(engine)
    with pytest.raises(jobq.InvalidJob, match="MAX_JSON_DEPTH=31"):
        jobq.enqueue(engine, "t", nest(jobq.MAX_JSON_DEPTH + 1, shape))
    with pytest.raises(jobq.InvalidJob, match="MAX_JSON_DEPTH"):
        jobq.submit(engine, [{"key": "a", "type": "t", "args": nest(jobq.MAX_JSON_DEPTH + 1, shape)}])
    assert snapshot(engine) == before


@needs("json_max_depth")  # the engine whose JSON_VALID sets MAX_JSON_DEPTH
def test_max_json_depth_is_exactly_what_the_strictest_engine_stores(engine: sa.Engine) -> None:
    """The limit is measured, not guessed: MariaDB's CHECK (json_valid(args)) accepts
    MAX_JSON_DEPTH nested containers and refuses one more, in every shape. Written past
    jobq's validation, straight into the column."""
    jid = jobq.enqueue(engine, "t")
    for shape in SHAPES:
        for n, stored in ((jobq.MAX_JSON_DEPTH, True), (jobq.MAX_JSON_DEPTH + 1, False)):
            doc = jobq.json.dumps(nest(n, shape))
            try:
                with engine.begin() as conn:
                    conn.execute(sa.text("UPDATE jobs SET args = :a WHERE id = :i"), {"a": doc, "i": jid})
                ok = True
            except sa.exc.DBAPIError:
                ok = False
            assert ok is stored, f"{n} containers ({shape}): stored={ok}"


def test_a_result_too_deep_to_store_fails_its_job_not_the_worker(engine: sa.Engine) -> None:
    """A handler returning MAX_JSON_DEPTH + 1 containers: that job ends failed naming the
    limit, and the worker goes on to run the next job. Old code: stored on three engines (done),
    and on MariaDB the finalize failed on every tick while nothing else was claimed."""
    deep = jobq.enqueue(engine, "deep", max_attempts=3)
    after = jobq.enqueue(engine, "plain")
    handlers = {"deep": lambda ctx: nest(jobq.MAX_JSON_DEPTH + 1, "scalar"), "plain": lambda ctx: {"ok": True}}
    w = jobq.Worker(engine, handlers, max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=60)
    info = jobq.get(engine, deep)
    assert info is not None and info.state == "failed" and info.attempts == 1, (info.state, info.attempts)
    assert "MAX_JSON_DEPTH" in (info.error or "")
    assert info.result is None
    assert state(engine, after) == "done"


def test_a_result_at_max_depth_is_stored(engine: sa.Engine) -> None:
    value = nest(jobq.MAX_JSON_DEPTH, "empty-dict")
    jid = jobq.enqueue(engine, "t")
    w = jobq.Worker(engine, {"t": lambda ctx: value}, max_concurrency=1, **FAST)
    assert w.run_until_idle(timeout=60)
    assert jobq.get(engine, jid).result == value  # type: ignore[union-attr]


# ---- item 11: out-of-range input ------------------------------------------------------------------


BIG_IDS = [2**63, 2**63 + 1, 2**64, 10**30]

OUT_OF_RANGE = [
    pytest.param(dict(run_after=dt.datetime(1, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=5)))), "outside", id="aware-before-year-1-in-utc"),
    pytest.param(dict(run_after=dt.datetime.min.replace(tzinfo=dt.timezone(dt.timedelta(hours=23, minutes=59)))), "outside", id="aware-min"),
    pytest.param(dict(run_after=dt.datetime(9999, 12, 31, 23, tzinfo=dt.timezone(-dt.timedelta(hours=5)))), "outside", id="aware-after-9999-in-utc"),
    pytest.param(dict(run_after=dt.datetime.max.replace(tzinfo=dt.timezone(-dt.timedelta(hours=23, minutes=59)))), "outside", id="aware-max"),
    pytest.param(dict(run_after=dt.timedelta.max), "run_after must be within", id="timedelta-max"),
    pytest.param(dict(run_after=dt.timedelta.min), "run_after must be within", id="timedelta-min"),
    pytest.param(dict(run_after=dt.timedelta(days=999_999_999)), "run_after must be within", id="timedelta-huge"),
    pytest.param(dict(run_after=-dt.timedelta(days=999_999_999)), "run_after must be within", id="timedelta-huge-negative"),
    pytest.param(dict(run_after=jobq.MAX_TIMEDELTA + dt.timedelta(microseconds=1)), "run_after must be within", id="timedelta-just-over"),
    *[pytest.param(dict(depends_on=[i]), "below 2\\*\\*63", id=f"dep-{i}") for i in BIG_IDS],
    *[pytest.param(dict(parent=i), "below 2\\*\\*63", id=f"parent-{i}") for i in BIG_IDS],
    pytest.param(dict(depends_on=[0]), "positive int", id="dep-zero"),
    pytest.param(dict(parent=-1), "positive int", id="parent-negative"),
]


@pytest.mark.parametrize("kwargs,message", OUT_OF_RANGE)
def test_out_of_range_input_is_refused_by_enqueue_and_submit(engine: sa.Engine, kwargs: dict, message: str) -> None:
    """Old code: OverflowError (datetimes, timedeltas; ids on SQLite), DataError "bigint out
    of range" (PostgreSQL), or an unknown-id InvalidJob that hid the real problem."""
    box = jobq.enqueue(engine, "box", container=True)
    jobq.enqueue(engine, "kid", parent=box)  # an open container and some rows to keep
    before = snapshot(engine)
    with pytest.raises(jobq.InvalidJob, match=message):
        jobq.enqueue(engine, "t", **kwargs)
    with pytest.raises(jobq.InvalidJob, match=message):
        jobq.submit(engine, [{"key": "a", "type": "t", **kwargs}])
    assert snapshot(engine) == before


def test_run_after_at_the_timedelta_bounds_is_stored(engine: sa.Engine) -> None:
    past = jobq.enqueue(engine, "t", run_after=-jobq.MAX_TIMEDELTA)
    future = jobq.enqueue(engine, "t", run_after=jobq.MAX_TIMEDELTA)
    info = jobq.get(engine, future)
    assert info is not None and info.run_after - info.created_at == jobq.MAX_TIMEDELTA
    assert jobq.claim(engine, "w", 30) == past  # due long ago
    assert jobq.claim(engine, "w", 30) is None  # not due for a thousand years


def test_the_largest_id_is_a_valid_reference(engine: sa.Engine) -> None:
    """2**63 - 1 fits a BIGINT: it is looked up (and not found), not refused as out of range."""
    with pytest.raises(jobq.InvalidJob, match=f"no job with id {2**63 - 1}"):
        jobq.enqueue(engine, "t", depends_on=[2**63 - 1])


@pytest.mark.parametrize("age", [dt.timedelta(days=999_999_999), dt.timedelta.max, dt.timedelta(seconds=-1)])
def test_prune_refuses_an_age_out_of_range(engine: sa.Engine, age: dt.timedelta) -> None:
    jobq.enqueue(engine, "t")
    before = snapshot(engine)
    try:
        jobq.prune(engine, older_than=age)
    except jobq.ConfigError as exc:
        assert "older_than must be within" in str(exc)
    else:
        raise AssertionError("prune accepted an age out of range")
    assert snapshot(engine) == before


def test_the_age_validator_prune_needs() -> None:
    assert jobq._check_age(jobq.MAX_TIMEDELTA, "older_than") == jobq.MAX_TIMEDELTA
    assert jobq._check_age(dt.timedelta(0), "older_than") == dt.timedelta(0)
    for bad in (dt.timedelta(days=999_999_999), dt.timedelta(seconds=-1), 3600, None):
        with pytest.raises(jobq.ConfigError, match="older_than must be"):
            jobq._check_age(bad, "older_than")


@pytest.mark.parametrize("job_id", BIG_IDS)
def test_get_and_cancel_of_an_id_that_cannot_exist(engine: sa.Engine, job_id: int) -> None:
    assert jobq.get(engine, job_id) is None
    with pytest.raises(jobq.InvalidJob):
        jobq.cancel(engine, job_id)


def test_seed_level_calls_refuse_an_id_out_of_range(engine: sa.Engine) -> None:
    for job_id in BIG_IDS + [0, -5]:
        with pytest.raises(jobq.InvalidJob, match="job_id must be a positive int"):
            jobq.finalize(engine, job_id, {}, worker_id="w")
        with pytest.raises(jobq.InvalidJob, match="job_id must be a positive int"):
            jobq.fail(engine, job_id, "x", worker_id="w")
        with pytest.raises(jobq.InvalidJob, match="job_id must be a positive int"):
            jobq.release(engine, job_id, worker_id="w")


# ---- item 13: names MySQL/MariaDB's PAD SPACE would equate ------------------------------------------


BAD_NAMES = ["resize ", " resize", "resize\t", "\nresize", "resize\u00a0", "\u3000resize", "res\x01ize",
             "resize\x7f", "resize\x85", "a\u0085b"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_names_with_edge_whitespace_or_control_characters_are_refused_everywhere(engine: sa.Engine, name: str) -> None:
    """On MySQL/MariaDB (PAD SPACE) 'resize' = 'resize ': a worker for "resize" would claim
    "resize " and fail it with a KeyError, and caps of group "a" counted group "a ". Refused
    on every engine so every engine behaves the same; old code stored them."""
    jobq.enqueue(engine, "resize", group_key="a")
    before = snapshot(engine)
    with pytest.raises(jobq.InvalidJob, match="whitespace|control character"):
        jobq.enqueue(engine, name)
    with pytest.raises(jobq.InvalidJob, match="whitespace|control character"):
        jobq.enqueue(engine, "resize", group_key=name)
    with pytest.raises(jobq.InvalidJob, match="whitespace|control character"):
        jobq.submit(engine, [{"key": "k", "type": name}])
    with pytest.raises(jobq.JobqError, match="whitespace|control character"):
        jobq.claim(engine, "w", 30, types=[name])
    with pytest.raises(jobq.JobqError, match="whitespace|control character"):
        jobq.claim(engine, name, 30)
    with pytest.raises(jobq.JobqError, match="whitespace|control character"):
        jobq.Worker(engine, {name: lambda ctx: None}, max_concurrency=1)
    with pytest.raises(jobq.JobqError, match="whitespace|control character"):
        jobq.Worker(engine, {"resize": lambda ctx: None}, max_concurrency=1, worker_id=name)
    with pytest.raises(jobq.JobqError, match="whitespace|control character"):
        jobq.Worker(engine, {"resize": lambda ctx: None}, max_concurrency=1, rate_limits={name: (1, 1.0)})
    assert snapshot(engine) == before


GOOD_NAMES = ["🚀", "tenant-😀", "👩\u200d💻 deploy", "☕", "☕\ufe0f", "日本語", "café", "cafe\u0301", "resize image", "a"]


def test_emoji_and_other_unicode_names_round_trip_and_match_exactly(engine: sa.Engine) -> None:
    """Every name comes back as written, and a claim for one type takes only that type: names
    that differ only by a variation selector, a combining accent or a ZWJ stay distinct."""
    ids = {name: jobq.enqueue(engine, name, {"name": name}, group_key=name) for name in GOOD_NAMES}
    for name, jid in ids.items():
        info = jobq.get(engine, jid)
        assert info is not None and (info.type, info.group_key, info.args) == (name, name, {"name": name})
    for name, jid in ids.items():
        assert jobq.claim(engine, "w", 30, types=[name]) == jid, name
        assert jobq.claim(engine, "w", 30, types=[name]) is None, name
    submitted = jobq.submit(engine, [{"key": n, "type": n, "group_key": n} for n in GOOD_NAMES])
    assert {jobq.get(engine, j).type for j in submitted.values()} == set(GOOD_NAMES)  # type: ignore[union-attr]


# ---- issue 39 item 9: the seed-level API's numbers ----------------------------------------------------


NAN, INF = float("nan"), float("inf")

#: (call, what it is given, the error it must raise, the rule named in the message). Old code:
#: a NaN cap was no cap (leased past it), "2" a TypeError, a negative TTL an expired lease,
#: NaN/1e300 a ValueError/OverflowError, NUL in a worker id stored (SQLite/MySQL) or a driver
#: DataError (PostgreSQL).
BAD_CLAIMS = [
    pytest.param("claim_batch", dict(max_in_flight=NAN), jobq.ConfigError, "max_in_flight must be an int", id="cap-nan"),
    pytest.param("claim_batch", dict(max_in_flight=INF), jobq.ConfigError, "max_in_flight must be an int", id="cap-inf"),
    pytest.param("claim_batch", dict(max_in_flight="2"), jobq.ConfigError, "max_in_flight must be an int", id="cap-str"),
    pytest.param("claim_batch", dict(max_in_flight=10**400), jobq.ConfigError, "max_in_flight must be between", id="cap-huge"),
    pytest.param("claim_batch", dict(group_caps={"default": NAN}), jobq.ConfigError, "group_caps", id="group-cap-nan"),
    pytest.param("claim_batch", dict(group_caps={"default": "2"}), jobq.ConfigError, "group_caps", id="group-cap-str"),
    pytest.param("claim_batch", dict(group_caps={"default": -1}), jobq.ConfigError, "group_caps", id="group-cap-negative"),
    pytest.param("claim_batch", dict(group_caps=[("default", 1)]), jobq.ConfigError, "group_caps must be a mapping",
                 id="group-caps-list"),
    pytest.param("tick", dict(lease_ttl=-1), jobq.ConfigError, "lease_ttl must be finite, > 0", id="ttl-negative"),
    pytest.param("tick", dict(lease_ttl=0), jobq.ConfigError, "lease_ttl must be finite, > 0", id="ttl-zero"),
    pytest.param("tick", dict(lease_ttl=NAN), jobq.ConfigError, "lease_ttl must be finite", id="ttl-nan"),
    pytest.param("tick", dict(lease_ttl=INF), jobq.ConfigError, "lease_ttl must be finite", id="ttl-inf"),
    pytest.param("tick", dict(lease_ttl=1e300), jobq.ConfigError, "at most a year", id="ttl-1e300"),
    pytest.param("tick", dict(lease_ttl="30"), jobq.ConfigError, "lease_ttl must be a number", id="ttl-str"),
    pytest.param("tick", dict(worker_id="w\x00"), jobq.InvalidJob, "control character", id="worker-nul"),
    pytest.param("tick", dict(worker_id="w\x1b[2J"), jobq.InvalidJob, "control character", id="worker-escape"),
    pytest.param("tick", dict(max_concurrency=NAN), jobq.ConfigError, "max_concurrency must be an int", id="tick-cap-nan"),
    pytest.param("tick", dict(max_concurrency=-1), jobq.ConfigError, "max_concurrency must be between", id="tick-cap-negative"),
    pytest.param("tick", dict(group_caps={"default": NAN}), jobq.ConfigError, "group_caps", id="tick-group-cap-nan"),
    pytest.param("tick", dict(group_caps={"default": "2"}), jobq.ConfigError, "group_caps", id="tick-group-cap-str"),
    pytest.param("tick", dict(limit=NAN), jobq.ConfigError, "limit must be an int", id="tick-limit-nan"),
]


@pytest.mark.parametrize("call,bad,error,message", BAD_CLAIMS)
def test_a_claim_refuses_a_bad_number_or_worker_id_before_it_leases(
        engine: sa.Engine, call: str, bad: dict, error: type[Exception], message: str) -> None:
    """Correct: the claim raises ``error`` naming the rule and leases nothing. A bug shows as a
    lease (past a NaN cap, or already expired), or as TypeError/ValueError/OverflowError or a
    driver error instead of jobq's own."""
    for _ in range(3):
        jobq.enqueue(engine, "t")
    before = snapshot(engine)
    with pytest.raises(error, match=message):
        if call == "claim_batch":
            jobq.claim_batch(engine, "w", 30, limit=3, **{"max_in_flight": 1, **bad})
        else:
            args = {"worker_id": "w", "max_concurrency": 1, "lease_ttl": 30.0, **bad}
            jobq.tick(engine, args.pop("worker_id"), None, **args)
    assert snapshot(engine) == before


@pytest.mark.parametrize("delay", [INF, -INF, NAN, -1, 1e300, 10**400, "5", None],
                         ids=["inf", "-inf", "nan", "-1", "1e300", "10**400", "str", "None"])
def test_fail_refuses_a_delay_that_is_not_a_finite_number_of_seconds(engine: sa.Engine, delay: Any) -> None:
    """Old code: OverflowError (inf, 1e300), a ValueError (NaN) or a TypeError ("5"), and a
    negative delay was silently 0. The lease is still held afterwards: fail it properly."""
    jid = jobq.enqueue(engine, "t")
    lease = jobq.claim_batch(engine, "w", 30)[0]
    before = snapshot(engine)
    with pytest.raises(jobq.ConfigError, match="delay must be"):
        jobq.fail(engine, jid, "boom", worker_id="w", token=lease.token, delay=delay)
    assert snapshot(engine) == before
    assert jobq.fail(engine, jid, "boom", worker_id="w", token=lease.token, delay=jobq._MAX_DELAY) == "ready"


@pytest.mark.parametrize("done,total", [(10**400, None), (1, 10**400), (-(10**400), None), (NAN, None), (1, INF),
                                        (True, None), ("3", None)],
                         ids=["done-10**400", "total-10**400", "done--10**400", "nan", "inf", "bool", "str"])
def test_progress_refuses_numbers_no_engine_stores_with_invalid_job(engine: sa.Engine, done: Any, total: Any) -> None:
    """Old code: ``ctx.progress(10**400)`` raised OverflowError out of the handler (NaN,
    infinity, bools and strings were already InvalidJob: kept so they stay so)."""
    seen: list[BaseException | None] = []

    def handler(ctx: jobq.JobContext) -> None:
        try:
            ctx.progress(done, total)
        except Exception as exc:  # noqa: BLE001 - the test is which one
            seen.append(exc)
        else:
            seen.append(None)
        ctx.progress(1, 2, "fine")

    jid = jobq.enqueue(engine, "t")
    assert jobq.Worker(engine, {"t": handler}, max_concurrency=1, **FAST).run_until_idle(timeout=60)
    assert len(seen) == 1 and isinstance(seen[0], jobq.InvalidJob), seen
    assert "progress" in str(seen[0]) and state(engine, jid) == "done"


def first_attempt_recorded(engine: sa.Engine, answer: Any) -> jobq.JobInfo:
    """Run one failing attempt of a job with two attempts under a worker whose retry_backoff
    answers ``answer``; return the job once that failure is written."""
    jid = jobq.enqueue(engine, "t", max_attempts=2)

    def handler(ctx: jobq.JobContext) -> None:
        raise RuntimeError("try later")

    w = jobq.Worker(engine, {"t": handler}, max_concurrency=1, **{**FAST, "retry_backoff": lambda attempt: answer})

    def recorded() -> jobq.JobInfo | None:
        w.tick()
        info = jobq.get(engine, jid)
        return info if info is not None and info.error and w.in_flight == 0 else None

    return wait_for(recorded, timeout=30, what="the failed attempt to be written")  # type: ignore[no-any-return]


@pytest.mark.parametrize("answer", [INF, 1e300, 10**400], ids=["inf", "1e300", "10**400"])
def test_a_retry_backoff_beyond_any_date_waits_the_longest_delay(engine: sa.Engine, answer: Any) -> None:
    """``retry_backoff`` answering infinity (or more seconds than a datetime holds) made the
    worker's write raise OverflowError: the failure was never recorded and the job stayed
    leased. Correct: it is back to ready, due after the longest delay jobq stores."""
    info = first_attempt_recorded(engine, answer)
    assert info.state == "ready" and info.attempts == 1 and "try later" in (info.error or "")
    assert info.run_after - info.updated_at > dt.timedelta(days=999 * 366), info


@pytest.mark.parametrize("answer", [NAN, "5", None], ids=repr)
def test_a_retry_backoff_that_is_no_number_falls_back_to_the_default(engine: sa.Engine, answer: Any) -> None:
    """No number at all: jobq.backoff's delay (and a warning). Old code: NaN raised ValueError
    and "5"/None TypeError out of the worker's tick, so the failure was never written."""
    info = first_attempt_recorded(engine, answer)
    assert info.state == "ready" and info.attempts == 1 and "try later" in (info.error or "")
    assert dt.timedelta(0) < info.run_after - info.updated_at <= dt.timedelta(seconds=jobq.backoff(1, jitter=0) * 2)


def test_a_negative_retry_backoff_retries_at_once(engine: sa.Engine) -> None:
    """The retry is written with the attempt's failure and claimed in the same tick (as on the
    old code: kept so that holding answers to the bounds keeps a negative one at 0)."""
    info = first_attempt_recorded(engine, -5.0)
    assert info.state == "failed" and info.attempts == 2, info
