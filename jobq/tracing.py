"""OpenTelemetry traces: the enqueuing span's context stored with each job, and a span per
attempt made from the worker's events as its child. opentelemetry is imported only by the two
functions here (the ``jobq[otel]`` extra)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Engine

from .base import _TRACE_CONTEXT, Event
from .drivers import _transaction
from .sql import _q_trace_parent

#: Events that end an attempt, and the outcome its span records.
_ENDS = {"finished": "done", "failed": "failed", "retried": "retried", "cancelled": "cancelled",
         "timed_out": "timeout", "released": "released", "lease_lost": "lease_lost", "suspended": "suspended",
         "snoozed": "snoozed", "db_error": "db_error"}


def propagate_trace_context(enabled: bool = True) -> None:
    """Store the current OpenTelemetry span's context (its W3C ``traceparent``) with every job
    this process enqueues or submits from now on, so that each attempt's span
    (:func:`trace_attempts`) is a child of the span that enqueued the job. Off by default:
    until this is called jobq neither imports OpenTelemetry nor writes the column.

    Args:
        enabled: False turns propagation off again.

    Raises:
        ImportError: opentelemetry-api is not installed (``pip install jobq[otel]``).
    """
    _TRACE_CONTEXT.clear()
    if not enabled:
        return
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    w3c = TraceContextTextMapPropagator()

    def current() -> str | None:
        carrier: dict[str, str] = {}
        w3c.inject(carrier)
        return carrier.get("traceparent")

    _TRACE_CONTEXT.append(current)


def trace_attempts(engine: Engine, *, on_event: Callable[[Event], None] | None = None,
                   tracer_provider: Any = None) -> Callable[[Event], None]:
    """An ``on_event`` callback for :class:`Worker` or :class:`AsyncWorker` that makes one
    OpenTelemetry span per attempt: started when the worker starts the job, ended when the
    attempt ends, a child of the span that enqueued the job when its context was stored
    (:func:`propagate_trace_context`), else a root. Attributes: ``jobq.job_id``, ``jobq.type``,
    ``jobq.group``, ``jobq.attempt``, ``jobq.worker_id`` and ``jobq.outcome`` (done, failed,
    retried, cancelled, timeout, released, lease_lost, suspended, snoozed, db_error); a
    failure sets the span's status to error with its one-line summary.

    Each start reads the job's stored context by primary key (one short read, on ``engine``:
    a synchronous Engine on the same database, also for an AsyncWorker). The handler runs
    outside the span's context: spans it makes are not its children.

    Args:
        engine: the queue's (synchronous) Engine.
        on_event: another callback to pass every event on to.
        tracer_provider: the TracerProvider to use (default: OpenTelemetry's global one).

    Raises:
        ImportError: opentelemetry-api is not installed (``pip install jobq[otel]``).
    """
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer("jobq")
    w3c = TraceContextTextMapPropagator()
    spans: dict[tuple[int, int], Any] = {}
    lock = threading.Lock()

    def hook(ev: Event) -> None:
        if ev.action == "started":
            parent = _transaction(engine, lambda conn, d: conn.execute(_q_trace_parent(ev.job_id)).scalar())
            span = tracer.start_span(f"jobq {ev.type}", context=w3c.extract({"traceparent": parent}) if parent else None,
                                     kind=trace.SpanKind.CONSUMER, attributes={
                                         "jobq.job_id": ev.job_id, "jobq.type": ev.type, "jobq.group": ev.group,
                                         "jobq.attempt": ev.attempt, "jobq.worker_id": ev.worker_id})
            with lock:
                spans[(ev.job_id, ev.attempt)] = span
        elif ev.action in _ENDS and ev.job_id:
            with lock:
                span = spans.pop((ev.job_id, ev.attempt), None)
            if span is not None:
                span.set_attribute("jobq.outcome", _ENDS[ev.action])
                if ev.error is not None and ev.action not in ("retried", "cancelled", "released"):
                    span.set_status(trace.StatusCode.ERROR, ev.error)
                span.end()
        if on_event is not None:
            on_event(ev)

    return hook
