"""OpenTelemetry traces on every engine, with the SDK's in-memory exporter: each attempt's span
is a child of the span that enqueued the job (its W3C context stored with the job and restored
in the worker), carries the job's id, type, group, attempt and outcome, for the thread Worker
and the AsyncWorker; with propagation off nothing is stored and no span has a parent."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from sqlalchemy.ext.asyncio import create_async_engine

import jobq
from dbs import async_url
from helpers import FAST


@pytest.fixture
def traced() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    jobq.propagate_trace_context()
    try:
        yield provider, exporter
    finally:
        jobq.propagate_trace_context(False)


def _handlers() -> dict[str, Any]:
    def flaky(ctx: jobq.JobContext) -> None:
        if ctx.attempt == 1:
            raise RuntimeError("first try fails")

    return {"ok": lambda ctx: None, "flaky": flaky}


def _check(engine: sa.Engine, exporter: InMemorySpanExporter, ok: int, flaky: int, enqueue_span: Any) -> None:
    attempts = sorted((s for s in exporter.get_finished_spans() if s.name.startswith("jobq ")),
                      key=lambda s: (s.attributes["jobq.job_id"], s.attributes["jobq.attempt"]))
    got = [(s.attributes["jobq.job_id"], s.attributes["jobq.type"], s.attributes["jobq.group"],
            s.attributes["jobq.attempt"], s.attributes["jobq.outcome"]) for s in attempts]
    assert got == [(ok, "ok", "g", 1, "done"), (flaky, "flaky", "g", 1, "retried"), (flaky, "flaky", "g", 2, "done")], got
    ctx = enqueue_span.get_span_context()
    for s in attempts:
        assert s.parent is not None and s.parent.span_id == ctx.span_id, s
        assert s.context.trace_id == ctx.trace_id, s
    assert attempts[0].status.status_code is not StatusCode.ERROR


def test_an_attempts_span_is_a_child_of_the_enqueuing_span(engine: sa.Engine, traced: Any) -> None:
    """Two jobs enqueued inside a span, one failing once: three attempt spans, each a child of
    that span in its trace, with the outcome of its attempt. A bug shows as a root span (the
    context not stored or not restored), a wrong outcome, or a span per event."""
    provider, exporter = traced
    tracer = provider.get_tracer("app")
    with tracer.start_as_current_span("request") as enqueue_span:
        ok = jobq.enqueue(engine, "ok", {}, group_key="g")
        flaky = jobq.enqueue(engine, "flaky", {}, group_key="g", max_attempts=2)
    w = jobq.Worker(engine, _handlers(), max_concurrency=2,
                    on_event=jobq.trace_attempts(engine, tracer_provider=provider), **FAST)
    assert w.run_until_idle(timeout=60)
    _check(engine, exporter, ok, flaky, enqueue_span)


def test_the_async_worker_makes_the_same_spans(engine: sa.Engine, db_url: str, traced: Any) -> None:
    provider, exporter = traced
    tracer = provider.get_tracer("app")
    with tracer.start_as_current_span("request") as enqueue_span:
        ok = jobq.enqueue(engine, "ok", {}, group_key="g")
        flaky = jobq.enqueue(engine, "flaky", {}, group_key="g", max_attempts=2)

    async def ok_(ctx: jobq.JobContext) -> None:
        return None

    async def flaky_(ctx: jobq.JobContext) -> None:
        if ctx.attempt == 1:
            raise RuntimeError("first try fails")

    async def main() -> bool:
        eng = create_async_engine(async_url(db_url))
        try:
            w = jobq.AsyncWorker(eng, {"ok": ok_, "flaky": flaky_}, max_concurrency=2, poll_interval=0.05, retry_backoff=lambda n: 0.0,
                                 on_event=jobq.trace_attempts(engine, tracer_provider=provider))
            return await w.run_until_idle(timeout=60)
        finally:
            await eng.dispose()

    assert asyncio.run(main())
    _check(engine, exporter, ok, flaky, enqueue_span)


def test_without_propagation_nothing_is_stored(engine: sa.Engine) -> None:
    """Off (the default): no trace context is written, even inside a span, and the attempt's
    span is a root."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("app").start_as_current_span("request"):
        job = jobq.enqueue(engine, "ok", {})
    with engine.connect() as conn:
        assert conn.execute(jobq._q_trace_parent(job)).scalar() is None
    w = jobq.Worker(engine, _handlers(), max_concurrency=1, on_event=jobq.trace_attempts(engine, tracer_provider=provider),
                    **FAST)
    assert w.run_until_idle(timeout=60)
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "jobq ok"]
    assert span.parent is None and span.attributes["jobq.outcome"] == "done"
