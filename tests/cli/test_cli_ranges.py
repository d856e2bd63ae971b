"""The command line accepts exactly the ranges the API does (it reads the API's bounds, so the
two cannot drift apart again), and a rate limit's period has a floor everywhere a rate is given."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

import jobq
from dbs import async_url
from helpers import cli, one_line_error


def parses(argv: list[str]) -> bool:
    """Whether the command line's parser takes ``argv`` (the worker's options are checked there)."""
    try:
        jobq._parser().parse_args(argv)
    except SystemExit:
        return False
    return True


def api_takes(call: Callable[[int], Any], n: int) -> bool:
    try:
        call(n)
    except jobq.ConfigError:
        return False
    except jobq.InvalidJob:
        return False
    return True


def test_the_cli_and_the_api_accept_the_same_weights_caps_and_rates(db_url: str, engine: sa.Engine,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """At each bound and one past it, the command and the API it calls agree. The bug: `jobq
    group --weight` stopped at 100,000 while set_group and enqueue take 10**6, and `jobq worker
    --rate` at 100,000 starts while rate_limits take 10**6."""
    w, slots, starts = jobq._MAX_WEIGHT, jobq._MAX_SLOTS, jobq._MAX_RATE_STARTS
    cases: list[tuple[str, int, Callable[[int], list[str]], Callable[[int], Any]]] = [
        ("group --weight", w, lambda n: ["group", "g", "--weight", str(n)], lambda n: jobq.set_group(engine, "g", weight=n)),
        ("enqueue --weight", w, lambda n: ["enqueue", "t", "--weight", str(n)], lambda n: jobq.enqueue(engine, "t", weight=n)),
        ("group --cap", slots, lambda n: ["group", "g", "--cap", str(n)],
         lambda n: jobq.set_group(engine, "g", max_in_flight=n)),
        ("group --rate", starts, lambda n: ["group", "g", "--rate", f"{n}/60"],
         lambda n: jobq.set_group(engine, "g", rate_limit=(n, 60))),
        ("limit --max-in-flight", slots, lambda n: ["limit", "--max-in-flight", str(n)],
         lambda n: jobq.set_limit(engine, max_in_flight=n)),
        ("limit --rate", starts, lambda n: ["limit", "--rate", f"{n}/60"], lambda n: jobq.set_limit(engine, rate_limit=(n, 60))),
    ]
    for name, most, argv, api in cases:
        for n in (most, most + 1):
            code, _, err = cli(db_url, *argv(n), capsys=capsys)
            assert (code == 0) == api_takes(api, n) == (n == most), (name, n, err)
            assert code == 0 or (code == 2 and one_line_error(err)), (name, n, err)
    assert jobq.get_group(engine, "g").weight == w  # type: ignore[union-attr]
    worker = ["worker", "--app", "m:h"]
    for name, most, argv, api in [
        ("worker --rate", starts, lambda n: [*worker, "--rate", f"g={n}/60"],
         lambda n: jobq.WorkerOptions(max_concurrency=1, rate_limits={"g": (n, 60)})),
        ("worker --cap", slots, lambda n: [*worker, "--cap", f"g={n}"],
         lambda n: jobq.WorkerOptions(max_concurrency=1, group_caps={"g": n})),
        ("worker --concurrency", slots, lambda n: [*worker, "--concurrency", str(n)],
         lambda n: jobq.WorkerOptions(max_concurrency=n)),
    ]:
        for n in (most, most + 1):
            assert parses(argv(n)) == api_takes(api, n) == (n == most), (name, n)
    capsys.readouterr()


TOO_SHORT = jobq._MIN_RATE_PERIOD / 2
HANDLERS = {"t": lambda ctx: None}


async def _noop(ctx: jobq.JobContext) -> None:
    return None


def async_worker(db_url: str, rate_limits: dict[str, Any]) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    eng = create_async_engine(async_url(db_url))
    try:
        jobq.AsyncWorker(eng, {"t": _noop}, max_concurrency=1, rate_limits=rate_limits)
    finally:
        asyncio.run(eng.dispose())


def test_a_rate_period_below_the_floor_is_refused_everywhere_a_rate_is_given(
        db_url: str, engine: sa.Engine, capsys: pytest.CaptureFixture[str]) -> None:
    """`1/1e-7s` read as a rate limit and was none: a window shorter than a claim round trip
    holds no other claim's start. Refused by set_group, set_limit, a Worker's, AsyncWorker's and
    a claim's rate_limits, and each --rate of the command line, with ConfigError or one line;
    nothing is stored. The floor itself is accepted."""
    for spec in [(1, 1e-7), (1_000_000, TOO_SHORT), "1/1e-7s", f"1/{TOO_SHORT}"]:
        with pytest.raises(jobq.ConfigError, match="at least"):
            jobq.set_group(engine, "g", rate_limit=spec)
        with pytest.raises(jobq.ConfigError, match="at least"):
            jobq.set_limit(engine, rate_limit=spec)
    assert jobq.groups(engine) == [] and jobq.get_limit(engine).rate_limit is None
    bad = {"g": (1, 1e-7)}
    for make in (lambda: jobq.Worker(engine, HANDLERS, max_concurrency=1, rate_limits=bad),
                 lambda: async_worker(db_url, bad),
                 lambda: jobq.WorkerOptions(max_concurrency=1, rate_limits=bad),
                 lambda: jobq.claim_batch(engine, "w", 30, rate_limits=bad),
                 lambda: jobq.tick(engine, "w", None, max_concurrency=1, lease_ttl=30, rate_limits=bad)):
        with pytest.raises(jobq.ConfigError, match="at least"):
            make()
    for argv in (["group", "g", "--rate", "1/1e-7s"], ["limit", "--rate", "1/1e-7s"],
                 ["worker", "--app", "m:h", "--rate", "g=1/1e-7"]):
        code, _, err = cli(db_url, *argv, capsys=capsys)
        assert code == 2 and one_line_error(err) and "at least" in err, (argv, err)
    assert jobq.groups(engine) == [] and jobq.get_limit(engine).rate_limit is None

    floor = jobq._MIN_RATE_PERIOD
    assert jobq.set_group(engine, "g", rate_limit=(1, floor)).rate_limit == (1, floor)
    assert jobq.set_limit(engine, rate_limit=f"5/{floor}").rate_limit == (5, floor)
    assert jobq.WorkerOptions(max_concurrency=1, rate_limits={"g": (1, floor)}).rate_limits == {"g": (1, floor)}
    assert parses(["worker", "--app", "m:h", "--rate", f"g=1/{floor}"])
