"""Input validation and JSON: job arguments, names, times and limits checked before anything
is written, with one-line errors."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
from collections.abc import Mapping
from typing import Any

from .base import ConfigError, InvalidJob, JobqError

#: Largest encoded args or result, in bytes (below MySQL's default max_allowed_packet).
MAX_JSON_BYTES = 1 << 20
#: Most arrays/objects nested inside one another in args or results, the same on every engine:
#: what the strictest one stores. MariaDB's ``CHECK (json_valid(...))`` refuses 32 nested
#: containers, empty or not and whatever is inside (measured on 10.11: 31 pass); Oracle MySQL
#: allows 100, PostgreSQL and SQLite more. ``{"a": 1}`` has depth 1, a scalar 0.
MAX_JSON_DEPTH = 31
#: Longest type, group or worker name.
MAX_NAME_LENGTH = 200
#: Longest ``run_after`` timedelta (either way) and ``prune`` age: far beyond any real use,
#: short enough that the database's now plus or minus it cannot overflow a datetime.
MAX_TIMEDELTA = _dt.timedelta(days=1000 * 366)

_INT64 = 1 << 63
_INT32 = 1 << 31
#: Largest cap a claim accepts (``max_in_flight``, ``max_concurrency``, a group's cap) and most
#: jobs one claim leases.
_MAX_SLOTS = 100_000
#: Largest fair-share weight (a job's, a stored group policy's, ``jobq group --weight``).
_MAX_WEIGHT = 1_000_000
#: Most starts a rate limit allows per period (``set_group``, ``set_limit``, ``rate_limits``,
#: ``jobq group/limit/worker --rate``).
_MAX_RATE_STARTS = 1_000_000
#: Shortest rate-limit period, in seconds. A claim counts the starts of the window ending at
#: the database's now, and one claim round trip takes milliseconds: a shorter window than
#: this holds no start of another claim, so "1/1e-7s" would read as a limit and be none.
#: Faster rates are written over a longer period (100/1s, not 1/0.01s).
_MIN_RATE_PERIOD = 0.1
#: Longest wait before a retry, in seconds (``fail(delay=...)``, a ``retry_backoff``'s answer).
_MAX_DELAY = MAX_TIMEDELTA.total_seconds()
_MIN_TIME = _dt.datetime(1970, 1, 2)
_MAX_TIME = _dt.datetime(9999, 12, 30)


def _check_json(value: Any, where: str, depth: int = 0) -> Any:
    """Validate and normalise a JSON value (tuples become lists, int subclasses plain ints);
    raise InvalidJob otherwise. ``depth`` counts the containers around ``value``."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not -_INT64 <= value < _INT64:
            raise InvalidJob(f"{where}: integer {value} does not fit in 64 bits")
        return int(value)  # an IntEnum or a ClaimedId is stored as the number it is
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidJob(f"{where}: {value!r} is not valid JSON (NaN and Infinity are rejected)")
        return value
    if isinstance(value, str):
        if "\x00" in value:
            raise InvalidJob(f"{where}: strings may not contain NUL (\\u0000): PostgreSQL jsonb rejects it")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidJob(f"{where}: string holds a lone surrogate, which is not valid UTF-8") from None
        return value
    if isinstance(value, (dict, list, tuple)) and depth >= MAX_JSON_DEPTH:
        raise InvalidJob(f"{where}: more than MAX_JSON_DEPTH={MAX_JSON_DEPTH} arrays/objects nested in one another")
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidJob(f"{where}: object keys must be strings, got {type(k).__name__} {k!r}")
            out[_check_json(k, where, depth + 1)] = _check_json(v, f"{where}.{k}", depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [_check_json(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    raise InvalidJob(f"{where}: {type(value).__name__} is not JSON-serialisable (use str, int, float, bool, None, list, dict)")


def _encode_checked(value: Any, where: str) -> Any:
    value = _check_json(value, where)
    size = len(json.dumps(value, allow_nan=False, separators=(",", ":")).encode("utf-8"))
    if size > MAX_JSON_BYTES:
        raise InvalidJob(f"{where}: {size} bytes encoded, more than MAX_JSON_BYTES={MAX_JSON_BYTES}")
    return value


def _check_name(value: Any, what: str) -> str:
    """Type, group, queue and worker names. Compared exactly on every engine only because
    what MySQL/MariaDB's PAD SPACE collation would equate ('a' = 'a ') is refused everywhere:
    leading/trailing whitespace, and control characters (invisible in logs and the CLI)."""
    if not isinstance(value, str) or not value:
        raise InvalidJob(f"{what} must be a non-empty string, got {value!r}")
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidJob(f"{what} is {len(value)} characters long; the limit is {MAX_NAME_LENGTH}")
    if value != value.strip():
        raise InvalidJob(f"{what} {value!r} starts or ends with whitespace")
    bad = next((ch for ch in value if ch < "\x20" or "\x7f" <= ch <= "\x9f"), None)  # Unicode's Cc
    if bad is not None:
        raise InvalidJob(f"{what} {value!r} holds the control character {bad!r}")
    _check_json(value, what)
    return value


def _check_int(value: Any, what: str, lo: int, hi: int, exc: type[JobqError] = InvalidJob) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise exc(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise exc(f"{what} must be between {lo} and {hi}, got {value}")
    return int(value)


def _check_number(value: Any, what: str, lo: float, hi: float, exc: type[JobqError] = InvalidJob) -> float:
    """A real number (an int or a float, not a bool) in ``lo`` .. ``hi``: NaN, infinities and
    ints too large for a float are refused with ``exc`` instead of an OverflowError later."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise exc(f"{what} must be a number, got {type(value).__name__} {value!r}")
    # An int is compared exactly (math.isfinite(10**400) would raise OverflowError).
    if (isinstance(value, float) and not math.isfinite(value)) or not lo <= value <= hi:
        shown = f"{value!r}" if isinstance(value, float) or abs(value) < 10**30 else f"an integer of {len(str(value))} digits"
        raise exc(f"{what} must be a finite number from {lo:g} to {hi:g}, got {shown}")
    return float(value)


def _check_caps(caps: Any, what: str) -> dict[str, int]:
    """``group_caps``: group -> most jobs in flight, each an int in 0 .. _MAX_SLOTS (ConfigError)."""
    if caps is None:
        return {}
    if not isinstance(caps, Mapping):
        raise ConfigError(f"{what} must be a mapping of group -> int, got {type(caps).__name__}")
    return {_check_name(g, f"{what} group"): _check_int(n, f"{what}[{g!r}]", 0, _MAX_SLOTS, ConfigError)
            for g, n in caps.items()}


def _check_seconds(value: Any, what: str, exc: type[JobqError] = InvalidJob, *, optional: bool = True) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise exc(f"{what} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= 0 or value > 366 * 86400:
        raise exc(f"{what} must be finite, > 0 and at most a year, got {value!r}")
    return float(value)


def _check_timedelta(value: Any, what: str, exc: type[JobqError] = InvalidJob, *, negative: bool = True) -> _dt.timedelta:
    """A timedelta within MAX_TIMEDELTA (and >= 0 unless ``negative``), so that adding it to or
    subtracting it from the database's now cannot overflow."""
    if not isinstance(value, _dt.timedelta):
        raise exc(f"{what} must be a datetime.timedelta, got {value!r}")
    if not (-MAX_TIMEDELTA if negative else _dt.timedelta(0)) <= value <= MAX_TIMEDELTA:
        bound = f"-{MAX_TIMEDELTA.days} .. " if negative else "0 .. "
        raise exc(f"{what} must be within {bound}{MAX_TIMEDELTA.days} days, got {value!r}")
    return value


def _check_age(value: Any, what: str) -> _dt.timedelta:
    """An age such as prune's ``older_than``: a timedelta in 0 .. MAX_TIMEDELTA (ConfigError)."""
    return _check_timedelta(value, what, ConfigError, negative=False)


def _one_line(value: Any) -> str:
    """The first line of ``value``'s text, at most 300 characters (errors in logs and messages)."""
    text = str(value).strip().splitlines()
    return text[0][:300] if text else ""


def _to_db_time(value: _dt.datetime, what: str) -> _dt.datetime:
    """Aware datetime -> naive UTC (how every dialect stores it). Naive input is rejected."""
    if not isinstance(value, _dt.datetime):
        raise InvalidJob(f"{what} must be a timezone-aware datetime or a timedelta, got {value!r}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidJob(f"{what} is a naive datetime; pass an aware one (e.g. tzinfo=datetime.timezone.utc)")
    try:
        out = value.astimezone(_dt.UTC).replace(tzinfo=None)
    except OverflowError:  # e.g. 0001-01-01 at +05:00 is before year 1 in UTC
        out = None
    if out is None or not _MIN_TIME <= out <= _MAX_TIME:
        raise InvalidJob(f"{what} {value.isoformat()} is outside 1970-01-02 .. 9999-12-30 (UTC)")
    return out


def _as_id(value: Any, what: str) -> int:
    """A job id: an int in 1 .. 2**63 - 1 (what a BIGINT holds), returned as a plain int.
    InvalidJob otherwise; get() turns that into None (no such job can exist)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < _INT64:
        raise InvalidJob(f"{what} must be a positive int job id below 2**63, got {value!r}")
    return int(value)


def _dispatch_of(job_id: Any, token: str | None) -> tuple[int, str | None]:
    """(id, token) of the dispatch a seed-level call reports on: an explicit token wins, else
    the one a :class:`ClaimedId` carries (else None: fenced by worker_id alone)."""
    if token is None:
        token = getattr(job_id, "token", None)
    return _as_id(job_id, "job_id"), token


def _type_name(value: Any) -> str:
    return type(value).__name__


def _closed_error(state: str, cause: int, by_container: bool) -> str:
    return f"{'container' if by_container else 'upstream job'} {cause} {'failed' if state == 'failed' else 'was cancelled'}"


# ---- argument types: each refuses bad input with one line, before anything connects

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_MAX_SECONDS = 100 * 366 * 86400  # a century: longer is a typo, and overflows date arithmetic


def _seconds(text: str, what: str, *, unit: bool, zero: bool) -> float:
    """``text`` as seconds: a number with a unit (30s, 15m, 12h, 7d, 2w), or without one
    (seconds) unless ``unit`` is required."""
    t = text.strip()
    factor = 1
    if t and t[-1] in _UNITS:
        factor, t = _UNITS[t[-1]], t[:-1]
    elif unit:
        t = ""
    try:
        value = float(t) * factor
    except ValueError:
        value = math.nan
    example = "30s, 15m, 12h or 7d" if unit else "seconds, or 30s, 15m, 12h, 7d"
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise argparse.ArgumentTypeError(f"{what} must be a {'non-negative' if zero else 'positive'} duration "
                                         f"({example}), got {text!r}")
    if value > _MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{what} must be at most 100 years, got {text!r}")
    return value
