"""The hot path's statements on the DBAPI cursor (_Direct): compiled once per dialect, run
without Connection.execute's per-call overhead where nothing watches the connection.

This is the one module that uses SQLAlchemy's private or semi-private names: the compiled
statement's internals (construct_expanded_state, post_compile_params, positiontup, bind_names,
the prefetch lists, the ``__[POSTCOMPILE_name]`` marks), ``Connection._autobegin``,
``BindTyping``, and the greenlet bridge of ``sqlalchemy.util`` (_greenlet_spawn, _await_only).
A SQLAlchemy release that changes them must break nothing but the speed-up: the first statement
for an engine's dialect checks, on a probe statement compiled for it, that each name is there
and renders what ``Connection.execute`` would (_fastpath_unsound); if not, every statement on
that dialect goes through ``Connection.execute`` and one warning goes to the "jobq" logger.

``JOBQ_FASTPATH=0`` in the environment (read at import) turns the cursor path off everywhere:
every statement goes through ``Connection.execute``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .base import JobqError, logger
from .engines import _facts

try:
    from sqlalchemy.engine.interfaces import BindTyping
except ImportError:  # a SQLAlchemy without it: _fastpath_unsound says so, nothing runs on the cursor
    BindTyping = None  # type: ignore[assignment,misc]

#: Whether the cursor path may be taken at all: JOBQ_FASTPATH=0 turns it off (read at import).
_FASTPATH = os.environ.get("JOBQ_FASTPATH", "1").strip() != "0"


# ---- SQLAlchemy's greenlet bridge (asyncio engines) --------------------------------------------


async def _greenlet_spawn(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` inside SQLAlchemy's greenlet bridge, where a synchronous call
    on an async engine awaits its driver (sqlalchemy.util.greenlet_spawn)."""
    from sqlalchemy.util import greenlet_spawn

    return await greenlet_spawn(fn, *args, **kwargs)


def _await_only(awaitable: Any) -> Any:
    """Await ``awaitable`` from synchronous code running inside _greenlet_spawn
    (sqlalchemy.util.await_only)."""
    from sqlalchemy.util import await_only

    return await_only(awaitable)

# ---- the hot path's statements on the DBAPI cursor ---------------------------------------------


class _Direct:
    """A prebuilt statement compiled once for one dialect, to run on the DBAPI cursor of the
    caller's connection: ``Connection.execute`` spent 55-75 us of client CPU per statement on a
    cache key, an execution context and a result object around psycopg's 60 (measured on a
    claim's statements), five times a tick. What it did that matters is done here too: bind and
    result processors, the dialect's paramstyle, and errors raised as SQLAlchemy's DBAPIError
    with the connection invalidated on a disconnect (_transaction's retry rules read both)."""

    __slots__ = ("stmt", "sql", "compiled", "binds", "order", "expanding", "int_lists", "literal_order", "columns",
                 "results")

    def __init__(self, stmt: Any, compiled: Any, binds: dict[str, Callable[[Any], Any]], order: tuple[str, ...] | None):
        self.stmt = stmt  # kept alive: the cache is keyed on its id
        self.sql: str = compiled.string
        self.compiled = compiled
        self.binds = binds
        self.order = order  # positional paramstyles: the parameters' order; None: by name
        # Expanding IN lists (MySQL/MariaDB's id lists): rendered per call for the list's
        # length, as Connection.execute renders them (SQLCompiler.construct_expanded_state),
        # or as integer literals (int_lists, below).
        self.expanding = bool(compiled.post_compile_params)
        # The expanding lists that may be rendered as integer literals (d.literal_int_lists):
        # by name, with the placeholder SQLAlchemy leaves in the text for each. Set by
        # _direct_form; empty: every list is expanded by SQLAlchemy.
        self.int_lists: tuple[tuple[str, str], ...] = ()
        # A positional paramstyle's order with the lists written as literals (mysqlclient).
        self.literal_order: tuple[str, ...] | None = None
        # The result columns' types (a text() without .columns() has none: its values come as
        # the driver gives them, as from Connection.execute), and (position, result processor)
        # for each column that converts, resolved on the first execution from the cursor's
        # type codes (as SQLAlchemy does); empty: none converts.
        self.columns = [c.type.dialect_impl(compiled.dialect) for c in getattr(stmt, "selected_columns", ())]
        self.results: list[tuple[int, Callable[[Any], Any]]] | None = None if self.columns else []

    def rows(self, cur: Any) -> list[Any]:
        got = cur.fetchall()
        if self.results is None:
            desc = cur.description or ()
            if len(desc) != len(self.columns):
                raise JobqError(f"{len(desc)} columns where {len(self.columns)} were compiled: {self.sql[:80]}")
            procs = [t.result_processor(self.compiled.dialect, d[1]) for t, d in zip(self.columns, desc, strict=True)]
            self.results = [(i, f) for i, f in enumerate(procs) if f is not None]
        if not self.results:
            return list(got)
        out = []
        for row in got:  # only the columns that convert (MySQL/MariaDB: the lease's timeout, 1 of 9)
            values = list(row)
            for i, f in self.results:
                values[i] = f(values[i])
            out.append(tuple(values))
        return out


_DIRECT: weakref.WeakKeyDictionary[Any, dict[int, _Direct | None]] = weakref.WeakKeyDictionary()
#: Most statements compiled for the cursor per dialect: the hot path's prebuilt ones are a few
#: dozen; anything past this runs through Connection.execute.
_DIRECT_FORMS = 256
#: The forms of a dialect whose SQLAlchemy is not what this module was written for (an empty
#: dict, kept empty: every statement on it runs through Connection.execute).
_OFF: dict[int, _Direct | None] = {}

#: The names of SQLAlchemy's compiled statement (SQLCompiler) this module uses.
_COMPILED_NAMES = ("string", "positional", "positiontup", "bind_names", "post_compile_params",
                   "literal_execute_params", "escaped_bind_names", "insert_prefetch", "update_prefetch",
                   "construct_params", "construct_expanded_state")
#: The expanded state's (construct_expanded_state's) names it uses.
_EXPANDED_NAMES = ("statement", "parameters", "positiontup", "processors")


def _fastpath_unsound(dialect: Any) -> str | None:
    """Why this module's use of SQLAlchemy's private names would not do on ``dialect``, or
    None: each name is there, and a probe statement (a bound value and an expanding list) comes
    out as Connection.execute would send it. Asked once per dialect (_direct_form)."""
    try:
        if BindTyping is None or not hasattr(dialect, "bind_typing"):
            return "no BindTyping"
        if not callable(getattr(Connection, "_autobegin", None)):
            return "no Connection._autobegin"
        t = sa.table("jobq_probe", sa.column("a", sa.Integer), sa.column("b", sa.Integer))
        stmt = sa.select(t.c.a).where(t.c.a == sa.bindparam("x", 2, type_=sa.Integer),
                                      t.c.b.in_(sa.bindparam("ids", [3, 4], expanding=True)))
        compiled = stmt.compile(dialect=dialect)
        missing = [n for n in _COMPILED_NAMES if not hasattr(compiled, n)]
        if missing:
            return "the compiled statement has no " + ", ".join(missing)
        if [b.key for b in compiled.post_compile_params] != ["ids"] or "__[POSTCOMPILE_ids]" not in compiled.string:
            return "an expanding list is not compiled as a POSTCOMPILE mark"
        if sorted(compiled.bind_names.values()) != ["ids", "x"]:
            return "unexpected bind_names"
        state = compiled.construct_expanded_state({"x": 2, "ids": [3, 4]})
        missing = [n for n in _EXPANDED_NAMES if not hasattr(state, n)]
        if missing:
            return "the expanded state has no " + ", ".join(missing)
        # What Connection.execute sends is what the public render_postcompile renders
        rendered = stmt.compile(dialect=dialect, compile_kwargs={"render_postcompile": True})
        if state.statement != rendered.string:
            return "construct_expanded_state renders another statement"
        values = dict(state.parameters)
        sent = [values[k] for k in state.positiontup or ()] if compiled.positional else sorted(values.values())
        if sent != [2, 3, 4]:
            return f"construct_expanded_state sends {sent!r} for [2, 3, 4]"
    except Exception as exc:  # noqa: BLE001 - any surprise means: not this fast path
        return f"{type(exc).__name__}: {exc}"
    return None


def _direct_form(dialect: Any, stmt: Any) -> _Direct | None:
    """``stmt`` compiled for ``dialect``, or None where only Connection.execute runs it right:
    literal binds rendered at execution, bind names that need escaping, a driver that wants
    input sizes, or column defaults computed in Python."""
    forms = _DIRECT.get(dialect)
    if forms is None:
        why = _fastpath_unsound(dialect)
        if why is not None:
            logger.warning("jobq: statements on %s run through Connection.execute: this SQLAlchemy (%s) is not "
                         "what the cursor fast path was written for (%s)", dialect.name, sa.__version__, why)
        forms = _DIRECT[dialect] = {} if why is None else _OFF
    # A form holds its statement, so its id is not reused; at worst a reused id finds None and
    # its statement runs through Connection.execute.
    key = id(stmt)
    if key in forms:
        return forms[key]
    if forms is _OFF or len(forms) >= _DIRECT_FORMS:
        return None  # a statement built per call would grow the cache without bound
    form: _Direct | None = None
    compiled = stmt.compile(dialect=dialect)
    # Python-side column defaults (prefetch) are computed by Connection.execute's execution
    # context: a statement that leaves such a column to its default runs there.
    if (all(b.expanding for b in compiled.post_compile_params) and not compiled.literal_execute_params
            and not compiled.escaped_bind_names and dialect.bind_typing is not BindTyping.SETINPUTSIZES
            and not compiled.insert_prefetch and not compiled.update_prefetch):
        binds = {name: proc for b, name in compiled.bind_names.items()
                 if (proc := b.type.dialect_impl(dialect).bind_processor(dialect)) is not None}
        form = _Direct(stmt, compiled, binds, tuple(compiled.positiontup) if compiled.positional else None)
        lists = compiled.post_compile_params
        if (lists and _facts(dialect).literal_int_lists
                and all(b.type.dialect_impl(dialect).bind_processor(dialect) is None for b in lists)):
            marks = tuple((b.key, f"__[POSTCOMPILE_{b.key}]") for b in lists)
            if all(mark in form.sql for _name, mark in marks):  # else not the text this was written for
                form.int_lists = marks
                if form.order is not None:  # positional (mysqlclient): each list holds one place
                    names = {name for name, _mark in marks}
                    form.literal_order = tuple(k for k in form.order if k not in names)
    forms[key] = form
    return form


def _direct(conn: Connection) -> bool:
    """Whether statements may bypass Connection.execute on ``conn``: not when anything watches
    its statements (cursor-execute listeners, SQLAlchemy's statement log, schema translation),
    nor anywhere with JOBQ_FASTPATH=0."""
    return _FASTPATH and not (conn.dispatch.before_cursor_execute or conn.dispatch.after_cursor_execute
                or conn.engine.logger.isEnabledFor(logging.INFO)
                or "schema_translate_map" in conn.get_execution_options())


_INT_ONLY = {int}  # exactly int: a bool is an int too, and str(True) is no literal for 1


def _int_lists_sql(form: _Direct, params: Mapping[str, Any]) -> str | None:
    """``form``'s SQL with its expanding lists written out as integer literals, exactly as the
    driver would render them; None unless every list is non-empty and holds only ints (an
    empty list, a bool or anything else goes through SQLAlchemy's expansion)."""
    sql = form.sql
    for name, mark in form.int_lists:
        ids = params.get(name)
        # set(map(type, ...)): a C loop; a generator over the ids cost 1 us per 64 on the hot path
        if not ids or not isinstance(ids, (list, tuple)) or set(map(type, ids)) != _INT_ONLY:
            return None
        sql = sql.replace(mark, ", ".join(map(str, ids)))  # as SQLAlchemy joins the placeholders
    return sql


def _statement_args(form: _Direct, params: Mapping[str, Any]) -> tuple[str, Any]:
    """The SQL text and the driver's arguments (a dict, or a tuple for a positional
    paramstyle) that run ``form`` with ``params``, as Connection.execute would send them."""
    sql, order = form.sql, form.order
    literal = _int_lists_sql(form, params) if form.int_lists else None
    if form.expanding and literal is None:
        state = form.compiled.construct_expanded_state(params)
        sql, values, order = state.statement, dict(state.parameters), state.positiontup
        for name, proc in state.processors.items():  # the lists' elements
            values[name] = proc(values[name])
        for name, proc in form.binds.items():
            if name in values:  # not an expanded list
                values[name] = proc(values[name])
    else:  # no lists, or every list written into the SQL as literals
        if literal is not None:
            sql, order = literal, form.literal_order
        values = form.compiled.construct_params(params)
        for name, _mark in form.int_lists:
            del values[name]
        for name, proc in form.binds.items():
            values[name] = proc(values[name])
    return sql, values if order is None else tuple([values[k] for k in order])


def _on_cursor(conn: Connection, form: _Direct, params: Mapping[str, Any], rows: bool) -> Any:
    """Run ``form`` with ``params`` on a cursor of ``conn``'s DBAPI connection, inside its
    transaction (begun here if none is, as Connection.execute begins one): the rows as tuples
    (``rows``), else the row count."""
    sql, args = _statement_args(form, params)
    if not conn.in_transaction():
        # Autobegin with SQLAlchemy's own method (2.0+), as Connection.execute does, and by its
        # rule: not while the transaction is beginning, when SQLite's BEGIN hook runs here. A
        # statement on the caller's Connection (an enqueue) must be inside the transaction
        # its commit() commits.
        conn._autobegin()
    dbapi_conn = conn.connection
    cur = dbapi_conn.cursor()
    try:
        cur.execute(sql, args)
        return form.rows(cur) if rows else cur.rowcount
    except Exception as exc:
        base = conn.dialect.loaded_dbapi.Error
        if not isinstance(exc, base):
            raise
        lost = conn.dialect.is_disconnect(exc, dbapi_conn.dbapi_connection, cur)
        if lost:
            conn.invalidate(exc)
        raise sa.exc.DBAPIError.instance(sql, args, exc, base, connection_invalidated=lost,
                                          dialect=conn.dialect) from exc
    except BaseException:
        conn.invalidate()  # interrupted mid-statement: the connection's state is unknown
        raise
    finally:
        with contextlib.suppress(Exception):
            cur.close()


def _hot_rows(conn: Connection, stmt: Any, params: Mapping[str, Any]) -> list[Any]:
    """``conn.execute(stmt, params).all()`` for a prebuilt hot-path statement, on the DBAPI
    cursor where it can (_Direct); rows are read by position either way."""
    form = _direct_form(conn.dialect, stmt) if _direct(conn) else None
    if form is None:
        return list(conn.execute(stmt, params).all())
    return _on_cursor(conn, form, params, True)  # type: ignore[no-any-return]


def _hot_rowcount(conn: Connection, stmt: Any, params: Mapping[str, Any] | None) -> int:
    """``conn.execute(stmt, params).rowcount``, on the DBAPI cursor where it can (_hot_rows).
    Without ``params`` the statement was built for this call, its values in it: it runs
    through Connection.execute and is not cached."""
    form = None if params is None or not _direct(conn) else _direct_form(conn.dialect, stmt)
    if form is None or params is None:
        return int(conn.execute(stmt, params).rowcount)
    return int(_on_cursor(conn, form, params, False))
