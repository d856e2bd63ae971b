"""Group policy (set_group, get_group, groups) and the global limits (set_limit, get_limit):
what every claim obeys, stored in the database."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import functools
import json
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import orm
from sqlalchemy.engine import Connection, Engine

from .base import ConfigError, JobqError, _chunks
from .claim_sql import _q_lock_claim, _q_lock_policy
from .drivers import _T, _Dialect, _engine_of, _prepare, _target_connection, _transaction
from .migrations import _Q_SEED_META
from .schema import _CLAIM_LOCK_KEY, _GLOBAL_LIMITS_KEY, START_LOG_RETENTION
from .sql import (
    _Q_ALL_GROUP_POLICIES,
    _Q_GLOBAL_LIMITS,
    _Q_INSERT_GROUP,
    _Q_SET_CLAIM_LOCK_VALUE,
    _Q_SET_GLOBAL_LIMITS,
    _Q_UPDATE_GROUP,
    _q_group_policies,
)
from .validate import (
    _MAX_RATE_STARTS,
    _MAX_SLOTS,
    _MAX_WEIGHT,
    _MIN_RATE_PERIOD,
    _check_int,
    _check_name,
    _check_seconds,
    _seconds,
)

# ---- group policy: what claims obey, stored with set_group ------------------------------------


class _Unlimited:
    """The type of :data:`UNLIMITED`."""

    def __repr__(self) -> str:
        return "jobq.UNLIMITED"


#: Pass as ``max_in_flight`` or ``rate_limit`` to :func:`set_group` or :func:`set_limit` to
#: remove that limit.
UNLIMITED: Any = _Unlimited()


@dataclasses.dataclass(frozen=True)
class GroupPolicy:
    """A group's stored policy (:func:`set_group`); None means "not set".

    Attributes:
        group_key: the group.
        weight: its fair-share weight (None: the largest weight among its next runnable jobs).
        max_in_flight: most of its jobs leased or running at once, across every worker.
        rate_limit: (starts, per_seconds): most job starts in any window of that length.
        paused: its ready jobs are not claimed (its running jobs finish).
        updated_at: when it was last set (aware UTC, the database's clock).
    """

    group_key: str
    weight: int | None
    max_in_flight: int | None
    rate_limit: tuple[int, float] | None
    paused: bool
    updated_at: _dt.datetime

    @property
    def limits(self) -> bool:
        """Whether it holds claims back at all (cap, rate or pause): such groups make every
        claim take the claim lock."""
        return self.paused or self.max_in_flight is not None or self.rate_limit is not None


def _policy_of(row: Any) -> GroupPolicy:
    rate = None if row.rate_n is None else (int(row.rate_n), float(row.rate_period))
    return GroupPolicy(group_key=row.group_key, weight=row.weight, max_in_flight=row.max_in_flight, rate_limit=rate,
                       paused=bool(row.paused), updated_at=row.updated_at.replace(tzinfo=_dt.UTC))


def _policy_counts(value: str | None) -> tuple[int, int]:
    """The claim_lock row's value: (stored policy rows, rows that limit); "" before any."""
    if not value:
        return 0, 0
    rows, _, limited = value.partition(" ")
    return int(rows), int(limited or 0)


def _check_rate_spec(value: Any, what: str) -> tuple[int, float]:
    """A rate limit as (starts, per_seconds) or the text "N/PERIOD" (10/1m, 5/30s, 100/1h)."""
    if isinstance(value, str):
        text = value
        count, slash, per = text.partition("/")
        try:  # _seconds: the command line's duration parser (a forward reach at run time only)
            if not slash:
                raise ValueError(text)
            value = (int(count), _seconds(per, what, unit=False, zero=False))
        except (ValueError, argparse.ArgumentTypeError):
            raise ConfigError(f"{what} must look like N/PERIOD (10/1m, 5/30s), got {text!r}") from None
    return _check_rate_pair(value, what, "(starts, per_seconds) or 'N/PERIOD'")


def _check_rate_pair(value: Any, what: str, forms: str) -> tuple[int, float]:
    """A rate limit as (starts, per_seconds): the checks stored policy (_check_rate_spec) and a
    Worker's rate_limits (_check_rate_limits) share; ``forms`` names what ``what`` accepts."""
    if not isinstance(value, tuple) or len(value) != 2:
        raise ConfigError(f"{what} must be {forms}, got {value!r}")
    n = _check_int(value[0], f"{what} starts", 1, _MAX_RATE_STARTS, ConfigError)
    period = _check_seconds(value[1], f"{what} period", ConfigError, optional=False)
    assert period is not None
    if period < _MIN_RATE_PERIOD:
        raise ConfigError(f"{what} period must be at least {_MIN_RATE_PERIOD} seconds (write a faster rate "
                          f"over a longer period: 100/1s, not 1/0.01s), got {value[1]!r}")
    if period > START_LOG_RETENTION.total_seconds():
        raise ConfigError(f"{what} period is longer than START_LOG_RETENTION")
    return n, float(period)


def set_group(
    target: Engine | Connection | orm.Session,
    group_key: str,
    *,
    weight: int | None = None,
    max_in_flight: Any = None,
    rate_limit: Any = None,
    paused: bool | None = None,
) -> GroupPolicy:
    """Store a group's fair-share policy in the database, where every claim reads it.

    Options left as None keep their stored value; a group never set has none. Takes effect at
    the next claim that starts after the change commits, on every worker: the change is made
    under the claim lock, and claims read it under the same lock, so a lowered cap is never
    overspent by a later claim (jobs already running finish).

    Args:
        target: an Engine (jobq commits its own transaction) or a Connection/Session (written
            in the caller's transaction, in effect once the caller commits).
        group_key: the group (a tenant, customer, API key).
        weight: fair-share weight (int >= 1); it replaces the per-job weights of this group.
        max_in_flight: most jobs of this group leased or running at once (int >= 1), or
            :data:`UNLIMITED`. A worker's ``group_caps`` may be stricter: the smaller cap wins.
        rate_limit: (starts, per_seconds) or "N/PERIOD" ("10/1m"): most starts in any window,
            or :data:`UNLIMITED`. A worker's ``rate_limits`` apply as well.
        paused: True: its ready jobs are not claimed; False: resume.

    Returns:
        The group's policy as stored.

    Raises:
        ConfigError: a bad value; nothing is written.
    """
    key = _check_name(group_key, "group_key")
    new: dict[str, Any] = {}
    if weight is not None:
        new["weight"] = _check_int(weight, "weight", 1, _MAX_WEIGHT, ConfigError)
    if max_in_flight is UNLIMITED:
        new["max_in_flight"] = None
    elif max_in_flight is not None:
        new["max_in_flight"] = _check_int(max_in_flight, "max_in_flight", 1, _MAX_SLOTS, ConfigError)
    if rate_limit is UNLIMITED:
        new["rate_n"] = new["rate_period"] = None
    elif rate_limit is not None:
        new["rate_n"], new["rate_period"] = _check_rate_spec(rate_limit, "rate_limit")
    if paused is not None:
        if not isinstance(paused, bool):
            raise ConfigError(f"paused must be True or False, got {paused!r}")
        new["paused"] = paused

    def run(conn: Connection, d: _Dialect) -> GroupPolicy:
        lock = conn.execute(_q_lock_policy(d)).first()  # serialised with every claim that obeys policy
        if lock is None:
            raise JobqError("jobq_meta has no claim_lock row: run jobq.create_schema(engine)")
        rows, limited = _policy_counts(lock.value)
        old = conn.execute(_q_group_policies([key])).first()
        now = d.db_now(conn)
        if old is None:
            values: dict[str, Any] = {"weight": None, "max_in_flight": None, "rate_n": None, "rate_period": None,
                                      "paused": False}
            values.update(new, group_key=key, updated_at=now)
            conn.execute(_Q_INSERT_GROUP, values)
            rows += 1
        else:
            values = {k: getattr(old, k) for k in ("weight", "max_in_flight", "rate_n", "rate_period", "paused")}
            values.update(new, updated_at=now)
            conn.execute(_Q_UPDATE_GROUP, {**values, "b_key": key})
            limited -= _policy_of(old).limits
            values["group_key"] = key
        rate = None if values["rate_n"] is None else (int(values["rate_n"]), float(values["rate_period"]))
        policy = GroupPolicy(group_key=key, weight=values["weight"], max_in_flight=values["max_in_flight"],
                             rate_limit=rate, paused=bool(values["paused"]), updated_at=now.replace(tzinfo=_dt.UTC))
        limited += policy.limits
        conn.execute(_Q_SET_CLAIM_LOCK_VALUE, {"b_value": f"{rows} {limited}"})
        return policy

    if isinstance(target, Engine):
        return _transaction(target, run)
    return run(_target_connection(target), _prepare(_engine_of(target)))  # type: ignore[arg-type]


def get_group(engine: Engine | Connection | orm.Session, group_key: str) -> GroupPolicy | None:
    """A group's stored policy, or None when :func:`set_group` never stored one.

    Args:
        engine: an Engine, or a Connection/Session to read in the caller's transaction.
        group_key: the group.
    """
    key = _check_name(group_key, "group_key")
    rows = _read(engine, lambda conn: conn.execute(_q_group_policies([key])).all())
    return _policy_of(rows[0]) if rows else None


def groups(engine: Engine | Connection | orm.Session) -> list[GroupPolicy]:
    """Every stored group policy, by group key.

    Args:
        engine: an Engine, or a Connection/Session to read in the caller's transaction.
    """
    return [_policy_of(r) for r in _read(engine, lambda conn: conn.execute(_Q_ALL_GROUP_POLICIES).all())]


# ---- the global limits: what every claim on the database obeys together, stored with set_limit


@dataclasses.dataclass(frozen=True)
class GlobalLimit:
    """The database's global limits (:func:`set_limit`); None means "not set".

    Attributes:
        max_in_flight: most jobs leased or running at once, across every worker and group. A
            worker's ``max_concurrency`` applies as well: the smaller cap wins.
        rate_limit: (starts, per_seconds): most job starts, all groups together, in any window
            of that length. A worker's ``rate_limits["*"]`` applies as well.
        updated_at: when it was last set (aware UTC, the database's clock); None if never.
    """

    max_in_flight: int | None
    rate_limit: tuple[int, float] | None
    updated_at: _dt.datetime | None

    @property
    def limits(self) -> bool:
        """Whether it holds claims back at all (a cap or a rate): then every claim takes the
        claim lock."""
        return self.max_in_flight is not None or self.rate_limit is not None


_NO_GLOBAL_LIMIT = GlobalLimit(max_in_flight=None, rate_limit=None, updated_at=None)


@functools.lru_cache(maxsize=16)
def _global_limit_of(value: str) -> GlobalLimit:
    """The global_limits row's value (JSON; "" before the first set_limit), parsed once per
    distinct value: every claim reads it."""
    if not value:
        return _NO_GLOBAL_LIMIT
    try:
        data = json.loads(value)
        cap, rate = data["max_in_flight"], data["rate_limit"]
        return GlobalLimit(max_in_flight=None if cap is None else int(cap),
                           rate_limit=None if rate is None else (int(rate[0]), float(rate[1])),
                           updated_at=_dt.datetime.fromisoformat(data["updated_at"]).replace(tzinfo=_dt.UTC))
    except (ValueError, TypeError, KeyError, IndexError):
        raise JobqError(f"jobq_meta's global_limits row is not jobq's: {value!r} "
                        "(store the limits again with jobq.set_limit or `jobq limit`)") from None


def set_limit(
    target: Engine | Connection | orm.Session,
    *,
    max_in_flight: Any = None,
    rate_limit: Any = None,
) -> GlobalLimit:
    """Store the global limits in the database, where every claim of every worker reads them.

    Options left as None keep their stored value; :data:`UNLIMITED` removes one. Takes effect
    at the next claim that starts after the change commits, on every worker: the change is
    made under the claim lock, and claims read it under the same lock, so a lowered cap is
    never overspent by a later claim (jobs already running finish). A worker's own
    ``max_concurrency`` (and ``rate_limits["*"]``) apply as well: the stricter limit wins.

    Args:
        target: an Engine (jobq commits its own transaction) or a Connection/Session (written
            in the caller's transaction, in effect once the caller commits).
        max_in_flight: most jobs leased or running at once across every worker (int >= 1),
            or :data:`UNLIMITED`.
        rate_limit: (starts, per_seconds) or "N/PERIOD" ("100/1m"): most job starts, all
            groups together, in any window of that length, or :data:`UNLIMITED`.

    Returns:
        The global limits as stored.

    Raises:
        ConfigError: a bad value; nothing is written.
    """
    new: dict[str, Any] = {}
    if max_in_flight is UNLIMITED:
        new["max_in_flight"] = None
    elif max_in_flight is not None:
        new["max_in_flight"] = _check_int(max_in_flight, "max_in_flight", 1, _MAX_SLOTS, ConfigError)
    if rate_limit is UNLIMITED:
        new["rate_limit"] = None
    elif rate_limit is not None:
        new["rate_limit"] = _check_rate_spec(rate_limit, "rate_limit")

    def run(conn: Connection, d: _Dialect) -> GlobalLimit:
        # Both rows, locked in key order as every claim locks them.
        rows = conn.execute(_q_lock_claim(d)).all()
        _claim_meta(rows)  # the claim_lock row is there
        old = _global_limit_of(rows[1].value) if len(rows) > 1 else None
        now = d.db_now(conn)
        values: dict[str, Any] = {"max_in_flight": None, "rate_limit": None}
        if old is not None:
            values.update(max_in_flight=old.max_in_flight, rate_limit=old.rate_limit)
        values.update(new)
        text = json.dumps({**values, "updated_at": now.isoformat()})
        if old is None:  # a database whose create_schema predates the row
            conn.execute(_Q_SEED_META, [{"key": _GLOBAL_LIMITS_KEY, "value": text}])
        else:
            conn.execute(_Q_SET_GLOBAL_LIMITS, {"b_value": text})
        return _global_limit_of(text)

    if isinstance(target, Engine):
        return _transaction(target, run)
    return run(_target_connection(target), _prepare(_engine_of(target)))  # type: ignore[arg-type]


def get_limit(target: Engine | Connection | orm.Session) -> GlobalLimit:
    """The database's global limits as :func:`set_limit` stored them (all None if never set).

    Args:
        target: an Engine, or a Connection/Session to read in the caller's transaction.
    """
    value = _read(target, lambda conn: conn.execute(_Q_GLOBAL_LIMITS).scalar())
    return _global_limit_of(value or "")


def _read(target: Engine | Connection | orm.Session, fn: Callable[[Connection], _T]) -> _T:
    if isinstance(target, Engine):
        _prepare(target)
        with target.connect() as conn:
            try:
                return fn(conn)
            finally:
                conn.rollback()
    return fn(_target_connection(target))  # type: ignore[arg-type]


def _group_policies(conn: Connection, keys: Sequence[str]) -> dict[str, GroupPolicy]:
    """The stored policies of these groups (the claim's read, in its transaction)."""
    out: dict[str, GroupPolicy] = {}
    for chunk in _chunks(list(keys), 500):
        out.update({r.group_key: _policy_of(r) for r in conn.execute(_q_group_policies(chunk))})
    return out


def _claim_meta(rows: Sequence[Any]) -> tuple[tuple[int, int], GlobalLimit]:
    """The claim_lock and global_limits rows (key, value, pin settings...), in key order: the
    stored policy counts and the global limits (none where the row is missing or empty)."""
    if not rows or rows[0][0] != _CLAIM_LOCK_KEY:
        raise JobqError("jobq_meta has no claim_lock row: run jobq.create_schema(engine)")
    return _policy_counts(rows[0][1]), (_global_limit_of(rows[1][1]) if len(rows) > 1 else _NO_GLOBAL_LIMIT)
