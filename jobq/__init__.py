"""jobq: an embeddable, database-backed ready-set job scheduler on SQLAlchemy 2.x.

Jobs live in one relational database (SQLite, PostgreSQL, MySQL 8+ or MariaDB 10.6+) and form a
DAG: a job becomes runnable once every job it depends on is done, and container jobs never run
but roll up from their children. Workers lease runnable jobs with one atomic claim per dialect,
keep the lease alive with heartbeats, and write each result with a fenced, atomic finalize.

Vendoring: copy the generated single file, ``single/jobq.py`` in the repository, into your
project. It imports only the standard library and SQLAlchemy; the database driver (psycopg,
PyMySQL, ...) is your choice.

Layout: the public surface is ``__all__`` below; the modules of this package are internal and
import in one direction, in this order: base (errors, events) -> engines -> schema -> sql ->
fastpath -> drivers -> migrations -> policy -> validate -> claim_sql -> limits -> claiming ->
waits -> outcomes -> jobs -> recurring -> control -> ops -> metrics -> tracing -> context -> worker -> asyncworker -> cli.

Guarantees, in three lines:
  * at-least-once: a job whose worker dies is reclaimed when its lease expires and runs again;
  * never completed twice: a result is written only by the dispatch that still holds the lease;
  * the global concurrency cap holds across every worker sharing the database.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from .asyncworker import AsyncWorker, aio
from .base import (
    EVENT_ACTIONS,
    ConfigError,
    Event,
    InvalidJob,
    JobqError,
    LeaseLost,
    NoRetry,
    Snooze,
    UniqueKeyHeld,
    UnsupportedDatabase,
    WaitTimeout,
)
from .base import __version__ as __version__
from .claiming import CLAIM_WINDOW, ClaimedId, Lease, claim, claim_batch
from .cli import main
from .context import JobContext, RetryPolicy, WorkerOptions
from .control import cancel, prune, retry, stats, tick, why
from .drivers import PG_NOTIFY_CHANNEL, SQLITE_BUSY_TIMEOUT_MS, TX_RETRIES
from .jobs import AttemptInfo, JobInfo, attempts, create_schema, enqueue, get, submit
from .limits import UNLIMITED, GlobalLimit, GroupPolicy, get_group, get_limit, groups, set_group, set_limit
from .metrics import METRICS_BUCKETS, MetricsCollector
from .ops import (
    BULK_ACTIONS,
    RETENTION_BATCH,
    RETENTION_BATCHES,
    RETENTION_INTERVAL,
    AuditEntry,
    BulkResult,
    LogLine,
    RetentionPolicy,
    apply_retention,
    audit_log,
    bulk,
    get_retention,
    logs,
    retention_policies,
    set_retention,
)
from .outcomes import fail, finalize, heartbeat, reclaim, release
from .policy import allocate, backoff, fair_share
from .recurring import ScheduleInfo, pause_schedule, resume_schedule, schedule, schedules, unschedule
from .schema import (
    ATTEMPT_OUTCOMES,
    LOG_FIELDS_BYTES,
    LOG_LINES_PER_JOB,
    LOG_MESSAGE_CHARS,
    SCHEMA_VERSION,
    START_LOG_RETENTION,
    STATES,
    TERMINAL,
    Base,
    Job,
    JobDep,
)
from .sql import ready_set
from .tracing import propagate_trace_context, trace_attempts
from .validate import MAX_JSON_BYTES, MAX_JSON_DEPTH, MAX_NAME_LENGTH
from .waits import signal
from .worker import Worker

__all__ = [
    "ATTEMPT_OUTCOMES",
    "AsyncWorker",
    "AttemptInfo",
    "AuditEntry",
    "BULK_ACTIONS",
    "Base",
    "BulkResult",
    "CLAIM_WINDOW",
    "ClaimedId",
    "ConfigError",
    "EVENT_ACTIONS",
    "Event",
    "GlobalLimit",
    "GroupPolicy",
    "InvalidJob",
    "Job",
    "JobContext",
    "JobDep",
    "JobInfo",
    "JobqError",
    "LOG_FIELDS_BYTES",
    "LOG_LINES_PER_JOB",
    "LOG_MESSAGE_CHARS",
    "Lease",
    "LeaseLost",
    "LogLine",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_NAME_LENGTH",
    "METRICS_BUCKETS",
    "MetricsCollector",
    "NoRetry",
    "PG_NOTIFY_CHANNEL",
    "RETENTION_BATCH",
    "RETENTION_BATCHES",
    "RETENTION_INTERVAL",
    "RetentionPolicy",
    "RetryPolicy",
    "SCHEMA_VERSION",
    "SQLITE_BUSY_TIMEOUT_MS",
    "START_LOG_RETENTION",
    "STATES",
    "ScheduleInfo",
    "Snooze",
    "TERMINAL",
    "TX_RETRIES",
    "UNLIMITED",
    "UniqueKeyHeld",
    "UnsupportedDatabase",
    "WaitTimeout",
    "Worker",
    "WorkerOptions",
    "aio",
    "allocate",
    "apply_retention",
    "attempts",
    "audit_log",
    "backoff",
    "bulk",
    "cancel",
    "claim",
    "claim_batch",
    "create_schema",
    "enqueue",
    "fail",
    "fair_share",
    "finalize",
    "get",
    "get_group",
    "get_limit",
    "get_retention",
    "groups",
    "heartbeat",
    "logs",
    "main",
    "pause_schedule",
    "propagate_trace_context",
    "prune",
    "ready_set",
    "reclaim",
    "release",
    "resume_schedule",
    "retention_policies",
    "retry",
    "schedule",
    "schedules",
    "set_group",
    "set_limit",
    "set_retention",
    "signal",
    "stats",
    "submit",
    "tick",
    "trace_attempts",
    "unschedule",
    "why",
]

# ---- the package as one namespace (the single file is one already; packaging/single_file.py writes it from the modules) ----
from . import (
    asyncworker,
    base,
    claim_sql,
    claiming,
    cli,
    context,
    control,
    drivers,
    engines,
    fastpath,
    jobs,
    limits,
    metrics,
    migrations,
    ops,
    outcomes,
    policy,
    recurring,
    schema,
    sql,
    tracing,
    validate,
    waits,
    worker,
)

#: The modules in import order: each imports only from those before it.
_MODULES: tuple[types.ModuleType, ...] = (base, engines, schema, sql, fastpath, drivers, migrations, policy, validate,
                                          claim_sql, limits, claiming, waits, outcomes, jobs, recurring, control, ops, metrics, tracing, context, worker, asyncworker,
                                          cli)


class _Package(types.ModuleType):
    """``jobq`` read and written as one namespace, as the single file is: ``jobq.TX_RETRIES = 5``
    reaches every module that reads the name, and ``jobq.name`` reads any module's top-level name
    (the seam the test suite and the dashboard use; names outside ``__all__`` are not API)."""

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("__"):
            for module in _MODULES:
                if name in vars(module):
                    return vars(module)[name]
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("__"):
            holders = [module for module in _MODULES if name in vars(module)]
            if name not in vars(self):  # a module's name, first written here: remember it for a del
                _SHADOWED.setdefault(name, [(module, vars(module)[name]) for module in holders])
            for module in holders:
                setattr(module, name, value)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        for module, value in _SHADOWED.pop(name, ()):  # the modules' own value again
            setattr(module, name, value)


#: The modules' values of names written through the package, kept until the name is deleted
#: (how pytest's monkeypatch undoes a write of a name the package itself did not hold).
_SHADOWED: dict[str, list[tuple[types.ModuleType, Any]]] = {}

sys.modules[__name__].__class__ = _Package

# Public names report the package as their home, as the single file does: reprs, pickles and
# documentation read ``jobq.Worker``, whichever module defines it.
for _name in __all__:
    _obj = globals()[_name]
    if str(getattr(_obj, "__module__", "")).startswith(__name__ + "."):
        try:
            _obj.__module__ = __name__
        except (AttributeError, TypeError):
            pass
del _name, _obj
