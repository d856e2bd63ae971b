"""asyncio: the same functions (jobq.aio) and worker (AsyncWorker) on an AsyncEngine, through
SQLAlchemy's greenlet bridge."""

from __future__ import annotations

import functools
import signal as _os_signal
import threading
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

from .base import ConfigError, _Unwind
from .claiming import claim, claim_batch
from .context import JobContext, WorkerOptions, _check_worker_target, _error_outcome, _Running
from .control import cancel, prune, retry, stats, tick, why
from .drivers import _T, _prepare
from .fastpath import _await_only, _greenlet_spawn
from .jobs import attempts, create_schema, enqueue, get, submit
from .limits import get_group, get_limit, groups, set_group, set_limit
from .outcomes import fail, finalize, heartbeat, reclaim, release
from .validate import _type_name
from .waits import signal
from .worker import _WorkerCore

# Nothing here has SQL or rules of its own. Each async function runs its sync twin, unchanged,
# inside SQLAlchemy's greenlet bridge (greenlet_spawn / run_sync), where every database call the
# twin makes awaits the async driver instead of blocking; transaction retries sleep with
# asyncio.sleep. Needs greenlet (``pip install sqlalchemy[asyncio]``) and an async driver
# (psycopg 3, aiosqlite, aiomysql or asyncmy).

_ASYNC_TWINS = ("attempts", "cancel", "claim", "claim_batch", "create_schema", "enqueue", "fail", "finalize", "get",
                "get_group", "get_limit", "groups", "heartbeat", "prune", "reclaim", "release", "retry", "set_group",
                "set_limit", "signal", "stats", "submit", "tick", "why")


#: The sync function each async twin runs.
_SYNC: dict[str, Callable[..., Any]] = {fn.__name__: fn for fn in (
    attempts, cancel, claim, claim_batch, create_schema, enqueue, fail, finalize, get, get_group, get_limit, groups, heartbeat, prune, reclaim, release, retry, set_group, set_limit, signal, stats, submit, tick, why)}


def _async_twin(fn: Callable[..., _T]) -> Callable[..., Any]:
    async def twin(target: Any, *args: Any, **kwargs: Any) -> _T:
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

        if isinstance(target, AsyncEngine):
            return await _greenlet_spawn(fn, target.sync_engine, *args, **kwargs)  # type: ignore[no-any-return]
        if isinstance(target, (AsyncConnection, AsyncSession)):
            # the caller's transaction, as with a sync Session/Connection
            return await target.run_sync(lambda sync: fn(sync, *args, **kwargs))  # type: ignore[arg-type]
        raise ConfigError(f"jobq.aio.{fn.__name__} needs an AsyncEngine (or AsyncSession/AsyncConnection), "
                          f"got {_type_name(target)}")

    twin.__name__ = twin.__qualname__ = fn.__name__
    twin.__doc__ = (f"``await jobq.aio.{fn.__name__}(...)``: :func:`jobq.{fn.__name__}` on an ``AsyncEngine`` "
                    "(or, where it takes a Session/Connection, an ``AsyncSession``/``AsyncConnection``). Same "
                    f"arguments, result and errors.\n\n{fn.__doc__ or ''}")
    return twin


class AsyncWorker(_WorkerCore):
    """:class:`Worker` for asyncio: handlers are coroutine functions (``async def handler(ctx)``)
    run as tasks on the running event loop, with the same claim, lease, heartbeat, finalize
    and tick semantics, the same loop and the same database code (only the runner differs).

    Takes the Worker's options, except ``executor`` (handlers are tasks) and ``listen``.
    Differences that follow from asyncio: a dispatch that times out, loses its lease, or whose
    job is cancelled has its task cancelled (so unlike a thread it really stops, at its next
    ``await``); handlers must not block the event loop, or heartbeats stall with it. Use
    ``await worker.run()`` / ``await worker.run_until_idle()``; ``stop()`` is thread-safe.

    Raises:
        ConfigError: not an AsyncEngine, a handler that is not ``async def``, or an option
            this worker does not support.
    """

    def __init__(self, engine: Any, handlers: Mapping[str, Callable[[JobContext], Any]], **options: Any) -> None:
        import inspect

        from sqlalchemy.ext.asyncio import AsyncEngine

        if not isinstance(engine, AsyncEngine):
            raise ConfigError(f"AsyncWorker needs an AsyncEngine, got {_type_name(engine)}")
        for key in ("executor", "start_method", "listen"):
            if key in options:
                raise ConfigError(f"AsyncWorker does not take {key}=")
        for name, fn in (handlers.items() if isinstance(handlers, Mapping) else ()):
            if not inspect.iscoroutinefunction(fn):
                raise ConfigError(f"handler for {name!r} must be an async def function")
        _check_worker_target(engine.sync_engine, handlers)
        super().__init__(engine.sync_engine, handlers, WorkerOptions(**options))
        self.async_engine = engine
        self._tasks: dict[tuple[str, int], Any] = {}  # by dispatch (_Running.key)
        self._loop: Any = None  # the event loop this worker runs on
        self._awake: Any = None  # asyncio.Event, made on the running loop

    async def run(self) -> None:
        """Tick until :meth:`stop` (or SIGTERM/SIGINT in the main thread), then stop gracefully.

        Cancelling the task that awaits it stops at once instead: the handler tasks are
        cancelled, their jobs released to ``ready`` (not charged) and results already returned
        written, then :class:`asyncio.CancelledError` is raised again. The release is written
        before the handlers are cancelled; one that ignores its cancellation is waited for at
        most ``shutdown_timeout`` seconds, then abandoned (its job already released, its slot
        counted until it ends or ``lease_ttl`` passes).
        """
        await self._guarded(self._run_steps())

    async def run_until_idle(self, timeout: float | None = None) -> bool:
        """As :meth:`Worker.run_until_idle`; cancelling it stops as cancelling :meth:`run` does."""
        return await self._guarded(self._until_idle_steps(timeout))

    async def tick(self) -> int:
        """As :meth:`Worker.tick`."""
        await self._attach()
        return await self._bridge(self._tick)

    def stop(self) -> None:
        """Ask :meth:`run` to stop claiming and shut down gracefully (thread-safe)."""
        super().stop()
        if self._awake is not None:
            self._loop.call_soon_threadsafe(self._awake.set)

    # -- the task runner -------------------------------------------------------------------

    async def _guarded(self, steps: Generator[Any, Any, _T]) -> _T:
        import asyncio

        done = await self._setup()
        try:
            return await self._drive(steps)
        except asyncio.CancelledError:
            # How an asyncio service stops: no grace, but nothing left running or leased.
            self._stopping.set()
            await self._drive(self._drain_steps(0, unwind=self.options.shutdown_timeout))
            raise
        finally:
            done()

    async def _drive(self, steps: Generator[Any, Any, _T]) -> _T:
        sent: Any = None
        while True:
            try:
                step = steps.send(sent)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            if callable(step):
                sent = await self._shielded(step)
            elif isinstance(step, (int, float)):
                await self._nap(step)
                sent = None
            else:
                sent = await step

    async def _shielded(self, step: Callable[[], _T]) -> _T:
        """Run a step (database work) to its end even if the awaiting task is cancelled, which
        then sees the cancellation after it: a finalize is never cut between its statements
        and its bookkeeping."""
        import asyncio

        work = self._loop.create_task(self._bridge(step))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            while not work.done():
                try:
                    await asyncio.wait([work])
                except asyncio.CancelledError:
                    pass  # cancelled again: still, the step ends first
            raise

    async def _bridge(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await _greenlet_spawn(fn, *args)  # type: ignore[no-any-return]

    async def _nap(self, seconds: float) -> None:
        import asyncio

        try:
            await asyncio.wait_for(self._awake.wait(), seconds)
        except TimeoutError:
            pass
        self._awake.clear()

    async def _attach(self) -> None:
        """Bind to the running event loop and inspect the engine (it may connect: awaited)."""
        import asyncio

        loop = asyncio.get_running_loop()
        if self._awake is None or self._loop is not loop:  # an asyncio.Event belongs to one loop
            self._loop, self._awake = loop, asyncio.Event()
        await self._bridge(_prepare, self.engine)

    async def _setup(self) -> Callable[[], None]:
        await self._attach()
        self._hb_stop = threading.Event()
        hb = self._loop.create_task(self._heartbeats(self._hb_stop))
        restore: list[Callable[[], Any]] = [hb.cancel, self._hb_stop.set]
        if threading.current_thread() is threading.main_thread():
            for sig in (_os_signal.SIGTERM, _os_signal.SIGINT):
                try:
                    self._loop.add_signal_handler(sig, self.stop)
                    restore.append(functools.partial(self._loop.remove_signal_handler, sig))
                except (NotImplementedError, RuntimeError):
                    pass

        def done() -> None:
            for f in restore:
                f()

        return done

    def _unwind_steps(self, wait: float = 5.0) -> Generator[Any, Any, None]:
        import asyncio

        if self._tasks:  # cancelled by the release: let them unwind
            yield asyncio.wait(list(self._tasks.values()), timeout=wait)
            yield asyncio.sleep(0)  # the done callbacks of tasks that ended before the wait (_task_done)
        yield self._persist  # their outcomes free the slots the release held (tasks done already included)

    def _start_all(self, runs: Sequence[_Running]) -> None:
        for run in runs:
            task = self._tasks[run.key] = self._loop.create_task(self._execute_task(run))
            task.add_done_callback(functools.partial(self._task_done, run))

    def _task_done(self, run: _Running, task: Any) -> None:
        # A task cancelled before its first step never ran _execute_task: its outcome, which
        # frees the slot a release holds for it, is queued here instead.
        if task.cancelled() and self._tasks.pop(run.key, None) is not None:
            self._finish(run, "error", "handler task cancelled before it started")

    def _save_checkpoint(self, ctx: JobContext, state: dict[str, Any]) -> Any:
        return self._bridge(self._store_checkpoint, ctx, state)  # awaited by the handler

    async def _execute_task(self, run: _Running) -> None:
        import asyncio

        try:
            handler: Any = self.handlers[run.lease.type]
            value = await _in_bridge(handler(run.ctx))
            kind, payload = self._check_result(value)
        except asyncio.CancelledError:
            kind, payload = "error", f"handler task cancelled ({run.ctx.stop_reason or 'stopped'})"
        except _Unwind as unwind:  # ctx.wait_for/sleep/sleep_until or Snooze: written as a suspension
            kind, payload = "suspend", unwind.intent
        except BaseException as exc:  # noqa: BLE001 - reported like a thread handler's error
            kind, payload = _error_outcome(exc, self._policies.get(run.lease.type))
        self._tasks.pop(run.key, None)
        self._finish(run, kind, payload)

    def _poke(self) -> None:
        super()._poke()
        if self._awake is not None:
            self._awake.set()

    def _stop_handlers(self, runs: Sequence[_Running]) -> None:
        for run in runs:  # written (and fenced) first; then the task really stops
            task = self._tasks.get(run.key)
            if task is not None:
                task.cancel()

    async def _heartbeats(self, stop: threading.Event) -> None:
        import asyncio

        while not stop.is_set():
            await asyncio.sleep(self.heartbeat_interval)
            await self._bridge(self._beat)
            for key, task in list(self._tasks.items()):
                run = self._running.get(key)
                if run is not None and run.ctx.stop_reason in ("lease_lost", "cancelled"):
                    task.cancel()


async def _in_bridge(coro: Any) -> Any:
    """Await ``coro`` with its steps run inside SQLAlchemy's greenlet bridge, so that the
    synchronous jobq calls a handler makes (ctx.enqueue, ctx.submit) await the async driver
    instead of blocking the event loop. The coroutine is driven as a Task drives it: each
    future it yields is waited for (and cancelled with the task), then it is resumed."""
    import asyncio

    async def step(fut: Any) -> None:
        if fut is None:  # a bare yield (asyncio.sleep(0)): give the loop one turn
            await asyncio.sleep(0)
            return
        fut._asyncio_future_blocking = False
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            fut.cancel()
            raise

    def drive() -> Any:
        error: BaseException | None = None
        while True:
            try:
                fut = coro.throw(error) if error is not None else coro.send(None)
            except StopIteration as stop:
                return stop.value
            error = None
            try:
                _await_only(step(fut))
            except BaseException as exc:  # noqa: BLE001 - delivered into the handler, as a Task would
                error = exc

    return await _greenlet_spawn(drive)


class _AioNamespace:
    """``jobq.aio``: every queue function as a coroutine on an ``AsyncEngine`` (``await
    jobq.aio.enqueue(async_engine, "resize", {...})``), plus :class:`AsyncWorker`. Each one
    runs the sync function of the same name through SQLAlchemy's greenlet bridge, so the SQL,
    the locking and the rules are the sync ones, not copies."""

    AsyncWorker = AsyncWorker

    def __init__(self) -> None:
        for name in _ASYNC_TWINS:
            setattr(self, name, _async_twin(_SYNC[name]))

    def __getattr__(self, name: str) -> Any:  # for type checkers: the twins are set in __init__
        raise AttributeError(f"jobq.aio has no {name!r}")


#: The asyncio API: ``await jobq.aio.claim_batch(async_engine, ...)``; see :class:`AsyncWorker`.
aio = _AioNamespace()
