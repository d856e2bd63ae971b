"""The command line (jobq, python -m jobq): init, enqueue, ls, get, why, stats, cancel, retry,
prune, group, limit, logs, retention, bulk, audit, worker and serve."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from .base import ConfigError, InvalidJob, JobqError, __version__, logger
from .context import _EXECUTORS, JobContext
from .control import _iso, _progress_text, _span, _subtree, _suspension, cancel, prune, retry, stats, why
from .drivers import _missing_database_file, _prepare
from .engines import _scheme_hint
from .jobs import attempts, create_schema, enqueue, get
from .limits import UNLIMITED, GlobalLimit, GroupPolicy, get_group, get_limit, groups, set_group, set_limit
from .ops import (
    BULK_ACTIONS,
    RetentionPolicy,
    apply_retention,
    audit_log,
    bulk,
    get_retention,
    logs,
    retention_policies,
    set_retention,
)
from .recurring import ScheduleInfo, pause_schedule, resume_schedule, schedule, schedules, unschedule
from .schema import _LIVE, LOG_LINES_PER_JOB, SCHEMA_VERSION, STATES, TERMINAL
from .sql import (
    _q_child_ids,
    _q_dependent_ids,
    _q_dependents_of,
    _q_edges_into,
    _q_graph_nodes,
    _q_job_state,
    _q_list_jobs,
    _q_newest_ids,
    _q_running_progress,
    _q_schema_version,
    _q_upstream_ids_of,
)
from .validate import _MAX_RATE_STARTS, _MAX_SLOTS, _MAX_WEIGHT, _MIN_RATE_PERIOD, _one_line, _seconds, _type_name
from .waits import signal
from .worker import Worker

# One rule for exit codes (keep in sync with main's docstring and docs/guides/cli.md): 0 ok, 1 the job
# named by the command's ID does not exist, 2 bad usage or input (options, the URL, --app),
# 3 the database: unreachable, failing, missing, or without jobq's schema, 4 a bug in jobq.
# Every error is one line on stderr, scrubbed of the URL's credentials.

_EXIT_NO_SUCH_JOB, _EXIT_USAGE, _EXIT_DATABASE, _EXIT_INTERNAL = 1, 2, 3, 4


def _cancel_outcome(state: str) -> str:
    """What cancel() returning ``state`` means, in words (the CLI and the dashboard)."""
    if state in _LIVE:
        return "cancel requested; it ends cancelled when its handler returns"
    if state == "held":
        return ("cancel requested; it ends cancelled (never runs) when its spawner's result releases it, "
                "or is deleted with the spawner's other spawns if that handler fails")
    return state


class _CliError(Exception):
    """An error the command reports as one line, with its exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (it prints the whole usage, then the error)."""

    def error(self, message: str) -> Any:
        self.exit(_EXIT_USAGE, f"jobq: {message} (see: {self.prog} --help)\n")


def _load_handlers(spec: str) -> Mapping[str, Callable[[JobContext], Any]]:
    # Handlers come only from the operator's own module: a job row's type is a key into this
    # mapping, never something jobq imports (write access to the table is not code execution).
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--app must look like package.module:handlers, got {spec!r}")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # anything the operator's module raises while it is imported
        raise ConfigError(f"--app {spec}: cannot import {module_name}: {type(exc).__name__}: {_one_line(exc)}") from None
    handlers = getattr(module, attr, None)
    if handlers is None:
        raise ConfigError(f"--app {spec}: module {module_name} has no attribute {attr!r}")
    if not isinstance(handlers, Mapping):
        raise ConfigError(f"--app {spec} is a {_type_name(handlers)}, not a mapping of job type -> handler")
    return handlers


def _duration(text: str) -> _dt.timedelta:
    return _dt.timedelta(seconds=_seconds(text, "a duration", unit=True, zero=True))


def _delay(text: str) -> _dt.timedelta:
    return _dt.timedelta(seconds=_seconds(text, "--delay", unit=False, zero=True))


def _every(text: str) -> _dt.timedelta:
    return _dt.timedelta(seconds=_seconds(text, "--every", unit=False, zero=False))


def _interval(text: str) -> float:
    return _seconds(text, "an interval", unit=False, zero=False)


def _run_after(text: str) -> _dt.datetime:
    t = text.strip()
    try:  # Python 3.10's fromisoformat does not read "Z"
        when = _dt.datetime.fromisoformat(t[:-1] + "+00:00" if t[-1:] in ("Z", "z") else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--run-after must be an ISO 8601 time like 2030-01-31T09:00:00Z, got {text!r}") from None
    if when.tzinfo is None:
        raise argparse.ArgumentTypeError(f"--run-after {text!r} has no time zone: add Z (UTC) or an offset like +02:00")
    try:
        return when.astimezone(_dt.UTC)
    except OverflowError:
        raise argparse.ArgumentTypeError(f"--run-after {text!r} is out of range") from None


def _job_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"a job id is a positive 64-bit integer, got {text!r}")
    return value


def _whole(text: str, most: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= most:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {most}, got {text!r}")
    return value


def _count(text: str) -> int:
    """A cap, a concurrency or a number of rows: the API's bound on caps (_MAX_SLOTS)."""
    return _whole(text, _MAX_SLOTS)


def _weight(text: str) -> int:
    return _whole(text, _MAX_WEIGHT)


def _states(text: str) -> list[str]:
    """``--state``'s value: one state, or several separated by commas (failed,cancelled)."""
    names = [t.strip() for t in text.split(",")]
    bad = [t for t in names if t not in STATES]
    if bad:
        raise argparse.ArgumentTypeError(f"invalid state {bad[0]!r} (choose from {', '.join(STATES)})")
    return names


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 0 to 65535, got {text!r}")
    return int(text)


def _token(text: str) -> str:
    if len(text) < 8:
        raise argparse.ArgumentTypeError("the dashboard token must have at least 8 characters")
    return text


def _limit_or_none(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An option's value, or UNLIMITED for "none" (jobq group --cap none)."""
    def parse_limit(text: str) -> Any:
        return UNLIMITED if text.strip().lower() == "none" else parse(text)
    return parse_limit


def _cap(text: str) -> tuple[str, int]:
    group, eq, n = text.rpartition("=")
    if not eq or not group:
        raise argparse.ArgumentTypeError(f"--cap must look like GROUP=N, got {text!r}")
    return group, _count(n)


def _rate(text: str) -> tuple[str, tuple[int, float]]:
    group, eq, spec = text.rpartition("=")
    n, slash, per = spec.partition("/")
    if not eq or not group or not slash:
        raise argparse.ArgumentTypeError(f"--rate must look like GROUP=N/SECONDS (e.g. tenant-a=10/60 or '*=100/1m'), got {text!r}")
    period = _seconds(per, "--rate's period", unit=False, zero=False)
    if period < _MIN_RATE_PERIOD:
        raise argparse.ArgumentTypeError(f"--rate's period must be at least {_MIN_RATE_PERIOD} seconds (write a "
                                         f"faster rate over a longer period: 100/1s, not 1/0.01s), got {text!r}")
    return group, (_whole(n, _MAX_RATE_STARTS), period)


# ---- credentials: never printed, whatever the URL parser made of them


class _LoginName(str):
    """A piece of the URL's user name. A login is no password: it is blanked only where it
    stands as one (see :func:`_scrub`), so the user "root" leaves "jobq retry --root 7" alone."""


def _url_secrets(raw: str) -> list[str]:
    """Every piece of the URL's credentials that an error message could contain: the raw
    userinfo, its user name and password, their fragments around reserved characters (an
    unescaped ``@`` in a password puts the rest into the host name), decoded and not. Pieces of
    the user name alone come as :class:`_LoginName`."""
    import re
    import urllib.parse

    rest = raw.partition("://")[2]
    at = rest.rfind("@")
    if at <= 0 or rest.startswith("/"):
        return [raw] if raw else []
    userinfo = rest[:at]
    user, _, password = userinfo.partition(":")
    secret = {raw, *((userinfo, password, *re.split(r"[@:/?#\[\]]", password)) if password else ())}
    secret |= {urllib.parse.unquote(s) for s in secret}
    login = {user, *re.split(r"[@:/?#\[\]]", user)}
    login = {*login, *(urllib.parse.unquote(s) for s in login)} - secret
    # A user name that is the dialect's or driver's own name ("postgres://postgres@...") is no
    # secret, and blanking it would blank the error that names the dialect; the password stays.
    public = {part for part in re.split(r"[+]", raw.partition("://")[0].lower()) if part} - secret
    found = [*(s for s in secret if s), *(_LoginName(s) for s in login if s and s.lower() not in public)]
    return sorted(found, key=len, reverse=True)


def _url_hint(raw: str) -> str:
    """The URL a new user most likely meant, for a scheme without a driver SQLAlchemy cannot
    load ("postgres://", "mysql://" without MySQLdb): jobq's extras install psycopg and PyMySQL."""
    meant = _scheme_hint(raw.partition("://")[0].lower())
    if meant is None:
        return ""
    return f" (use {meant[0]}://...: the driver jobq's {meant[1]} extra installs)"


def _scrub(text: str, secrets: Sequence[str]) -> str:
    """``text`` without any of ``secrets``. Pieces shorter than 4 characters only where they
    stand alone (between non-alphanumerics), so a password "ss" does not garble "address". A
    :class:`_LoginName` only where it stands as a login: before an ``@`` (``root@host``,
    ``'root'@'localhost'``), as a URL's ``root:password@``, or quoted whole as drivers name the
    user (``for user "root"``)."""
    import re

    for s in secrets:
        e = re.escape(s)
        if isinstance(s, _LoginName):
            text = re.sub(rf"(?<![\w.%+-]){e}(?=['\"]?@|:[^\s@/'\"]*@)|(?<=[\"']){e}(?=[\"'])", "***", text)
        elif len(s) >= 4:
            text = text.replace(s, "***")
        else:
            text = re.sub(rf"(?<![A-Za-z0-9]){e}(?![A-Za-z0-9])", "***", text)
    return text


class _ScrubbingFormatter(logging.Formatter):
    """The worker's log lines, scrubbed as errors are (a driver error names the host)."""

    def __init__(self, fmt: str, secrets: Sequence[str]) -> None:
        super().__init__(fmt)
        self._secrets = secrets

    def format(self, record: logging.LogRecord) -> str:
        return _scrub(super().format(record), self._secrets)


def _engine_for(raw: str) -> Engine:
    try:
        url = sa.engine.make_url(raw)
    except (sa.exc.ArgumentError, ValueError, TypeError) as exc:
        raise _CliError(f"bad database URL: {_one_line(exc)}", _EXIT_USAGE) from None
    if url.host and "@" in url.host:  # the parser split an unescaped "@" of the credentials
        raise _CliError("bad database URL: write an '@' inside the credentials as %40", _EXIT_USAGE)
    try:
        return sa.create_engine(url, pool_pre_ping=True)
    except ImportError as exc:
        hint = _url_hint(raw) or " (install the database driver this URL names)"
        raise _CliError(f"{_one_line(exc)}{hint}", _EXIT_USAGE) from None
    except (sa.exc.ArgumentError, ValueError, TypeError) as exc:
        raise _CliError(f"bad database URL: {_one_line(exc)}{_url_hint(raw)}", _EXIT_USAGE) from None


# ---- checks before a command touches the database


def _check_database(engine: Engine, command: str) -> None:
    """Every command but ``init`` needs an existing database with jobq's current schema; on
    SQLite, connecting to a mistyped path would create an empty file there."""
    if command == "init":
        return
    path = _missing_database_file(engine)
    if path is not None:
        raise _CliError(f"no SQLite database at {path}: check the path, or create it with `jobq init`", _EXIT_DATABASE)
    _prepare(engine)
    with engine.connect() as conn:
        inspector = sa.inspect(conn)
        if not (inspector.has_table("jobs") and inspector.has_table("jobq_meta")):
            raise _CliError("no jobq schema here: run `jobq init`", _EXIT_DATABASE)
        if command in ("group", "groups") and not inspector.has_table("jobq_groups"):
            raise _CliError("this database has no jobq_groups table yet: run `jobq init`", _EXIT_DATABASE)
        found = conn.execute(_q_schema_version()).scalar()
        conn.rollback()
    version = int(found) if found is not None and str(found).isdigit() else 0
    if version < SCHEMA_VERSION:
        raise _CliError(f"the jobq schema here is version {version}, this jobq needs {SCHEMA_VERSION}: "
                        "run `jobq init` to upgrade it", _EXIT_DATABASE)
    if version > SCHEMA_VERSION:
        raise _CliError(f"the jobq schema here is version {version}, newer than this jobq ({SCHEMA_VERSION}): "
                        "upgrade jobq.py", _EXIT_DATABASE)


def _require_job(engine: Engine, job_id: int) -> str:
    """The job's state, or exit 1: no such job."""
    with engine.connect() as conn:
        state = conn.execute(_q_job_state(job_id)).scalar()
        conn.rollback()
    if state is None:
        raise _CliError(f"no job with id {job_id}", _EXIT_NO_SUCH_JOB)
    return str(state)


# ---- output


def _json_default(value: Any) -> Any:
    if isinstance(value, _dt.datetime):
        return _iso(value, precise=True)
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    return str(value)


def _print_json(value: Any) -> None:
    print(json.dumps(value, default=_json_default, sort_keys=True))


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, _dt.datetime):
        return _iso(value) or ""
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return str(value)


_COLOURS = {"waiting": "#d0d0d0", "ready": "#9ecbff", "leased": "#ffe08a", "running": "#ffd33d",
            "done": "#85e89d", "failed": "#f97583", "cancelled": "#b392f0"}


def _graph_data(conn: Connection, root: int | None, limit: int = 500) -> tuple[list[Any], list[tuple[int, int]]]:
    """The nodes (id, type, state, parent_id, is_container) and edges (upstream, dependent) of
    a job's subtree with its direct upstreams and dependents, or of the newest ``limit`` jobs."""
    if root is None:
        ids = list(conn.execute(_q_newest_ids(limit)).scalars())
    else:
        ids = _subtree(conn, root)
        ups = list(conn.execute(_q_upstream_ids_of(ids[:limit])).scalars())
        downs = list(conn.execute(_q_dependents_of(ids[:limit])).scalars())
        ids = list(dict.fromkeys(ids + ups + downs))[:limit]
    rows = sorted(conn.execute(_q_graph_nodes(ids)).all(), key=lambda r: r.id)
    known = {r.id for r in rows}
    edges = sorted((u, v) for v, u in conn.execute(_q_edges_into(sorted(known))) if u in known)
    return rows, edges


def _graph(rows: Sequence[Any], edges: Sequence[tuple[int, int]], fmt: str) -> str:
    known = {r.id for r in rows}
    kids: dict[int | None, list[Any]] = {}
    for r in rows:
        kids.setdefault(r.parent_id if r.parent_id in known else None, []).append(r)
    lines: list[str] = []
    if fmt == "mermaid":
        lines.append("flowchart TD")

        def emit(parent: int | None, indent: str) -> None:
            for r in sorted(kids.get(parent, []), key=lambda r: r.id):
                label = f'{r.id} {r.type} ({r.state})'.replace('"', "'")
                if r.is_container:
                    lines.append(f'{indent}subgraph c{r.id}["{label}"]')
                    emit(r.id, indent + "  ")
                    lines.append(f"{indent}end")
                    lines.append(f"{indent}class c{r.id} {r.state}")
                else:
                    lines.append(f'{indent}j{r.id}["{label}"]:::{r.state}')

        emit(None, "  ")
        cont = {r.id for r in rows if r.is_container}
        for u, v in edges:
            lines.append(f"  {'c' if u in cont else 'j'}{u} --> {'c' if v in cont else 'j'}{v}")
        lines += [f"  classDef {st} fill:{col}" for st, col in _COLOURS.items()]
    else:
        lines.append("digraph jobq {")
        lines.append('  node [shape=box, style=filled, fontname="sans-serif"];')

        def emit_dot(parent: int | None, indent: str) -> None:
            for r in sorted(kids.get(parent, []), key=lambda r: r.id):
                label = f"{r.id} {r.type}\\n{r.state}".replace('"', "'")
                if r.is_container:
                    lines.append(f'{indent}subgraph cluster_{r.id} {{ label="{label}"; style=filled; fillcolor="{_COLOURS[r.state]}";')
                    lines.append(f'{indent}  j{r.id} [label="{label}", shape=folder, fillcolor="{_COLOURS[r.state]}"];')
                    emit_dot(r.id, indent + "  ")
                    lines.append(f"{indent}}}")
                else:
                    lines.append(f'{indent}j{r.id} [label="{label}", fillcolor="{_COLOURS[r.state]}"];')

        emit_dot(None, "  ")
        lines += [f"  j{u} -> j{v};" for u, v in edges]
        lines.append("}")
    return "\n".join(lines)


def _table(rows: Sequence[Mapping[str, Any]], cols: Sequence[str]) -> str:
    text = [[_text(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(t[i]) for t in text]) for i, c in enumerate(cols)]
    out = ["  ".join(c.upper().ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip()]
    out += ["  ".join(v.ljust(w) for v, w in zip(t, widths, strict=True)).rstrip() for t in text]
    return "\n".join(out)


def _policy_text(p: GroupPolicy) -> str:
    rate = "none" if p.rate_limit is None else f"{p.rate_limit[0]}/{p.rate_limit[1]:g}s"
    weight = "from its jobs" if p.weight is None else p.weight
    cap = "none" if p.max_in_flight is None else p.max_in_flight
    return f"group {p.group_key}: weight {weight}, cap {cap}, rate {rate}{', PAUSED' if p.paused else ''}"


def _limit_text(g: GlobalLimit) -> str:
    cap = "none" if g.max_in_flight is None else g.max_in_flight
    rate = "none" if g.rate_limit is None else f"{g.rate_limit[0]}/{g.rate_limit[1]:g}s"
    return (f"global limit: cap {cap}, rate {rate}"
            + ("" if g.max_in_flight is not None else " (each worker's max_concurrency caps what it runs)"))


#: Groups `jobq status` names per line; past that, the busiest ones and how many more.
_STATUS_GROUPS = 10


def _per_group_text(counts: Mapping[str, int]) -> str:
    """``a: 2, b: 1`` by name, or with thousands of tenants the busiest few and a count."""
    busy = {g: n for g, n in counts.items() if n}
    if len(busy) <= _STATUS_GROUPS:
        return ", ".join(f"{g}: {n}" for g, n in sorted(busy.items())) or "none"
    top = sorted(busy.items(), key=lambda gn: (-gn[1], gn[0]))[:_STATUS_GROUPS]
    return (", ".join(f"{g}: {n}" for g, n in top)
            + f", and {len(busy) - _STATUS_GROUPS:,} more groups (the busiest shown; --json lists all)")


def _suspended_count_text(st: Mapping[str, Any]) -> str:
    """", 2 of them suspended (1 waiting for a signal)": scheduled jobs that hold no slot."""
    n, signal_ = st.get("suspended", 0), st.get("awaiting_signal", 0)
    if not n and not signal_:
        return ""
    return f", {max(n, signal_)} of them suspended" + (f" ({signal_} waiting for a signal)" if signal_ else "")


def _status_text(st: Mapping[str, Any]) -> str:
    window = f"{st['window_seconds'] / 3600:g}h"
    awaiting = _suspended_count_text(st)
    states = "  ".join(f"{k}={v}" + (f" ({st['ready_due']} due, {st['ready_scheduled']} scheduled{awaiting})"
                                      if k == "ready" else "")
                       for k, v in st["states"].items() if k not in TERMINAL)
    finished = "  ".join(f"{k}={st['states'][k]}" for k in TERMINAL)
    due = _per_group_text(st["due_by_group"])
    flight = _per_group_text(st["in_flight"])
    # oldest_ready is the oldest *due* job: its wait is never negative
    age = _span((st["now"] - st["oldest_ready"]).total_seconds()) if st["oldest_ready"] else "-"
    later = str(st["ready_scheduled"])
    if st["next_scheduled"]:
        later += f", the next in {_span((st['next_scheduled'] - st['now']).total_seconds())} (at {_iso(st['next_scheduled'])})"
    lines = [f"jobs now: {states}", f"finished in the last {window}: {finished}", f"due per group: {due}",
             f"in flight per group: {flight}", f"oldest due job waiting: {age}", f"scheduled for later: {later}",
             f"expired leases awaiting reclaim: {st['expired_leases']}"]
    recent = st["recent_failures"]
    lines += ["recent failures:"] + [f"  {r['id']} {r['type']}: {_one_line(r['error'] or '')}" for r in recent] if recent else []
    return "\n".join(lines)


# ---- the command


def _parser() -> argparse.ArgumentParser:
    # --url is accepted before and after the subcommand: the subcommand's copy defaults to
    # "absent", so it overrides the global one only when given.
    common = _Parser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS, help="database URL (default: $JOBQ_URL)")
    parser = _Parser(prog="jobq", description="Operate a jobq queue (URL from --url or $JOBQ_URL).",
                     epilog="exit codes: 0 ok, 1 no such job, 2 bad usage or input, 3 database unreachable, "
                            "failing or without the jobq schema, 4 a bug in jobq")
    parser.add_argument("--url", default=os.environ.get("JOBQ_URL"), help="database URL (default: $JOBQ_URL)")
    parser.add_argument("--version", action="version", version=f"jobq {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def add(name: str, text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=text, description=text, parents=[common])
        p.add_argument("--json", action="store_true", help="print JSON (times as ISO 8601 UTC)")
        return p

    add("init", "create the schema, or upgrade it (idempotent)")
    p = add("enqueue", "add a job; prints its id")
    p.add_argument("type")
    p.add_argument("--args", default="{}", metavar="JSON", help="the job's arguments: a JSON object")
    p.add_argument("--group", default="default", help="fair-share group (default: default)")
    p.add_argument("--weight", type=_weight, default=1, help=f"fair-share weight (1 to {_MAX_WEIGHT}; default: 1)")
    p.add_argument("--depends-on", type=_job_id, action="append", default=[], metavar="ID",
                   help="run only after job ID is done (repeatable)")
    p.add_argument("--after", type=_job_id, action="append", default=[], help=argparse.SUPPRESS)  # deprecated
    p.add_argument("--parent", type=_job_id, metavar="ID", help="the container this job belongs to")
    p.add_argument("--container", action="store_true", help="a container: never runs, rolls up from its children")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--delay", type=_delay, metavar="DURATION", help="not before this long from now (seconds, or 30s, 15m, 2h)")
    when.add_argument("--run-after", type=_run_after, metavar="TIME", help="not before this time (ISO 8601 with a zone, e.g. 2030-01-31T09:00:00Z)")
    p.add_argument("--timeout", type=_interval, metavar="DURATION", help="most one dispatch may run (default: the worker's)")
    p.add_argument("--max-attempts", type=int, default=None, metavar="N",
                   help="dispatches before it fails (default: 3, or the handler's RetryPolicy attempts)")
    p.add_argument("--priority", type=int, default=0, metavar="N", help="claim order within its group, higher first (default: 0)")
    p.add_argument("--unique-key", metavar="KEY", help="while an unfinished job holds KEY, print its id and add nothing")
    p = add("status", "counts per state, due and scheduled ready jobs, in flight per group, expired leases, failures")
    p.add_argument("--watch", type=_interval, metavar="SECONDS", help="refresh in place every SECONDS")
    p = add("ls", "list jobs, newest first (a note on stderr when more match than --limit)")
    p.add_argument("--state", type=_states, action="extend", metavar="STATE[,STATE]",
                   help="only jobs in this state (repeatable, or comma-separated: failed,cancelled)")
    p.add_argument("--type")
    p.add_argument("--group")
    p.add_argument("--since", type=_duration, metavar="DURATION", help="created within, e.g. 1h")
    p.add_argument("--before", type=_job_id, metavar="ID", help="only jobs older than job ID (the next page)")
    p.add_argument("--limit", type=_count, default=50, help=f"most rows (default: 50, at most {_MAX_SLOTS})")
    for name, text in (("show", "every field of a job, its upstreams, dependents and children"),
                       ("why", "why a job is not running right now, in one line"),
                       ("retry", "retry a failed or cancelled job (and re-open what it closed)"),
                       ("cancel", "cancel a job, or a container with its subtree")):
        p = add(name, text)
        p.add_argument("id", type=_job_id)
        if name == "retry":
            p.add_argument("--root", action="store_true",
                           help="first retry the failed or cancelled jobs up its chain that keep it closed")
    p = add("group", "show a group's stored policy, or change it (weight, cap, rate, pause) for every worker")
    p.add_argument("key", metavar="KEY")
    p.add_argument("--weight", type=_weight, help=f"fair-share weight (1 to {_MAX_WEIGHT})")
    p.add_argument("--cap", type=_limit_or_none(_count), metavar="N|none", help="most jobs in flight; none: no cap")
    p.add_argument("--rate", type=_limit_or_none(str), metavar="N/PERIOD|none",
                   help="most N starts per PERIOD (10/1m, 5/30s); none: no rate limit")
    pause = p.add_mutually_exclusive_group()
    pause.add_argument("--pause", dest="paused", action="store_const", const=True, help="claim none of its ready jobs")
    pause.add_argument("--resume", dest="paused", action="store_const", const=False, help="claim them again")
    add("groups", "every group's stored policy")
    p = add("limit", "show the global limits every worker obeys, or change them (cap, rate)")
    p.add_argument("--max-in-flight", type=_limit_or_none(_count), metavar="N|none",
                   help="most jobs in flight across every worker; none: no stored cap")
    p.add_argument("--rate", type=_limit_or_none(str), metavar="N/PERIOD|none",
                   help="most N starts per PERIOD, all groups together (100/1m); none: no rate limit")
    p.add_argument("--clear", action="store_true", help="remove both (each worker's own options still apply)")
    p = add("signal", "send a signal: jobs waiting for KEY in ctx.wait_for run again and read its payload")
    p.add_argument("key", metavar="KEY")
    p.add_argument("--payload", default="null", metavar="JSON", help="what ctx.wait_for returns: any JSON value "
                   "(default: null)")
    _schedule_parsers(add)
    p = add("prune", "delete finished jobs older than a duration, and the signals nobody can still receive")
    p.add_argument("--older-than", type=_duration, required=True, metavar="DURATION", help="e.g. 7d")
    p.add_argument("--state", action="append", choices=TERMINAL, help="default: done (repeatable)")
    p = add("graph", "a job's or container's DAG as Mermaid or Graphviz DOT (--json: nodes and edges)")
    p.add_argument("id", type=_job_id, nargs="?")
    p.add_argument("--all", action="store_true", help="the newest 500 jobs")
    p.add_argument("--format", choices=("mermaid", "dot"), default="mermaid")
    _ops_parsers(add)
    p = sub.add_parser("worker", help="run a worker until SIGTERM", description="run a worker until SIGTERM/SIGINT",
                       parents=[common])
    p.add_argument("--app", required=True, metavar="MODULE:NAME", help="package.module:handlers (your own mapping)")
    p.add_argument("--concurrency", type=_count, default=4, help="the global cap: most jobs in flight across all workers")
    p.add_argument("--local-concurrency", type=_count, metavar="N",
                   help="most jobs this worker runs at once (default: --concurrency)")
    p.add_argument("--lease-ttl", type=_interval, default=30.0, metavar="SECONDS")
    p.add_argument("--heartbeat", type=_interval, metavar="SECONDS", help="default: lease TTL / 3")
    p.add_argument("--poll", type=_interval, default=1.0, metavar="SECONDS", help="seconds between ticks when idle")
    p.add_argument("--listen", action="store_true", help="also wake on NOTIFY (PostgreSQL with psycopg)")
    p.add_argument("--timeout", type=_interval, metavar="SECONDS", help="default most one dispatch may run")
    p.add_argument("--shutdown-timeout", type=_interval, default=30.0, metavar="SECONDS")
    p.add_argument("--cap", type=_cap, action="append", default=[], metavar="GROUP=N",
                   help="most jobs in flight for GROUP (repeatable)")
    p.add_argument("--rate", type=_rate, action="append", default=[], metavar="GROUP=N/SECONDS",
                   help="most N starts per SECONDS for GROUP, '*' for all (repeatable)")
    p.add_argument("--executor", choices=_EXECUTORS, default="thread")
    p.add_argument("--start-method", choices=("fork", "spawn", "forkserver"), help="for --executor process")
    p.add_argument("--worker-id")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    p = sub.add_parser("serve", help="run the web dashboard (jobq_web.py, beside jobq.py)", parents=[common],
                       description="run the web dashboard until SIGINT/SIGTERM: read-only unless given a token")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=_port, default=8080, help="default: 8080 (0: any free port)")
    p.add_argument("--token", type=_token, default=os.environ.get("JOBQ_DASHBOARD_TOKEN") or None,
                   help="allow retry/cancel/pause with this token (default: $JOBQ_DASHBOARD_TOKEN; none: read-only)")
    p.add_argument("--hide-args", action="store_true", help="never show job arguments")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                   help="info (the default) logs one line per request; warning: errors only")
    return parser


def _schedule_parsers(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """``jobq schedule NAME`` (show, make or change, --pause, --resume, --remove) and ``jobq schedules``."""
    p = add("schedule", "show a recurring job; make or change it (--type with --every or --cron); pause, resume, remove")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--type", help="make or change it: the job type each slot enqueues")
    timing = p.add_mutually_exclusive_group()
    timing.add_argument("--every", type=_every, metavar="DURATION", help="one slot per interval (60s, 15m, 1h, 1d)")
    timing.add_argument("--cron", metavar="EXPR", help="slots of a cron expression in UTC ('0 3 * * *'; needs jobq[cron])")
    p.add_argument("--args", default="{}", metavar="JSON", help="the jobs' arguments: a JSON object")
    p.add_argument("--group", default="default", help="fair-share group of its jobs (default: default)")
    p.add_argument("--priority", type=int, default=0, metavar="N", help="its jobs' priority (default: 0)")
    p.add_argument("--max-attempts", type=int, default=None, metavar="N",
                   help="its jobs' dispatches (default: 3, or the handler's RetryPolicy attempts)")
    p.add_argument("--timeout", type=_interval, metavar="DURATION", help="most one dispatch may run")
    p.add_argument("--unique-key", metavar="KEY", help="skip a slot while an earlier slot's job is unfinished")
    act = p.add_mutually_exclusive_group()
    act.add_argument("--pause", dest="action", action="store_const", const="pause", help="enqueue nothing until resumed")
    act.add_argument("--resume", dest="action", action="store_const", const="resume",
                     help="continue from the first slot after now (no catch-up of paused slots)")
    act.add_argument("--remove", dest="action", action="store_const", const="remove", help="delete it (its jobs stay)")
    add("schedules", "every recurring job: its timing, next and last slot, runs, paused")


def _schedule_text(s: ScheduleInfo) -> str:
    timing = f"cron {s.cron!r} (UTC)" if s.cron is not None else f"every {_span(s.every.total_seconds())}" if s.every else "?"
    last = f", last slot {_iso(s.last_run_at)} (job {s.last_job_id})" if s.last_run_at else ", never fired"
    return (f"schedule {s.name}: {s.type} in group {s.group_key}, {timing}, next {_iso(s.next_run_at)}{last}, "
            f"{s.runs} run(s)" + (", PAUSED" if s.paused else ""))


def _schedule_json(s: ScheduleInfo) -> dict[str, Any]:
    return {**dataclasses.asdict(s), "every": None if s.every is None else s.every.total_seconds()}


def _schedule_command(ns: argparse.Namespace, engine: Engine) -> int:
    if ns.command == "schedules":
        found = schedules(engine)
        _print_json([_schedule_json(s) for s in found]) if ns.json else print(
            "\n".join(map(_schedule_text, found)) or "no schedules")
        return 0
    if ns.action is not None and (ns.type or ns.every or ns.cron):
        raise _CliError("--pause, --resume and --remove take no --type, --every or --cron", _EXIT_USAGE)
    if ns.action == "remove":
        gone = unschedule(engine, ns.name)
        _print_json({"name": ns.name, "removed": gone}) if ns.json else print(
            f"schedule {ns.name}: removed" if gone else f"schedule {ns.name}: no such schedule")
        return 0 if gone else _EXIT_NO_SUCH_JOB
    if ns.action is not None:
        info = (pause_schedule if ns.action == "pause" else resume_schedule)(engine, ns.name)
    elif ns.type is not None or ns.every is not None or ns.cron is not None:
        if ns.type is None:
            raise _CliError("making or changing a schedule needs --type", _EXIT_USAGE)
        try:
            args = json.loads(ns.args)
        except ValueError as exc:
            raise _CliError(f"--args is not valid JSON: {_one_line(exc)}", _EXIT_USAGE) from None
        info = schedule(engine, ns.name, ns.type, every=ns.every, cron=ns.cron, args=args, group_key=ns.group,
                        priority=ns.priority, max_attempts=ns.max_attempts, timeout=ns.timeout, unique_key=ns.unique_key)
    else:
        found = [s for s in schedules(engine) if s.name == ns.name]
        if not found:
            raise _CliError(f"no schedule named {ns.name!r}", _EXIT_NO_SUCH_JOB)
        info = found[0]
    _print_json(_schedule_json(info)) if ns.json else print(_schedule_text(info))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The ``jobq`` command for operators. ``jobq --help`` lists the subcommands.

    Exit codes: 0 success, 1 no such job (the ID given to show/why/graph/retry/cancel), 2 bad
    usage or input, 3 the database is unreachable, failing, missing or without the jobq schema,
    4 a bug in jobq. Errors are one line on stderr, never with the URL's credentials. A closed
    output pipe (``jobq ls | head -1``) ends the command quietly.
    """
    try:
        code = _main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away: stop quietly, and keep the interpreter's final flush of
        # stdout from reporting the same broken pipe.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 0


def _main(argv: Sequence[str] | None) -> int:
    try:
        ns = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error (already printed)
        return exc.code if isinstance(exc.code, int) else _EXIT_USAGE
    secrets = _url_secrets(ns.url or "")

    def report(message: str, code: int) -> int:
        print(f"jobq: {_scrub(message, secrets)}", file=sys.stderr)
        return code

    if not ns.url:
        return report("no database: pass --url or set JOBQ_URL", _EXIT_USAGE)
    engine = None
    try:
        engine = _engine_for(ns.url)
        _check_database(engine, ns.command)
        return _run_command(ns, engine, secrets)
    except BrokenPipeError:
        raise
    except _CliError as exc:
        return report(str(exc), exc.code)
    except (InvalidJob, ConfigError, argparse.ArgumentTypeError, OverflowError) as exc:
        return report(_one_line(exc), _EXIT_USAGE)
    except (JobqError, sa.exc.SQLAlchemyError) as exc:  # UnsupportedDatabase, a newer schema, driver errors
        return report(f"database error: {_one_line(getattr(exc, 'orig', None) or exc)}", _EXIT_DATABASE)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        return report(f"internal error (a bug in jobq, please report it): {type(exc).__name__}: {_one_line(exc)}",
                      _EXIT_INTERNAL)
    finally:
        if engine is not None:
            engine.dispose()


def _dashboard() -> Any:
    """The vendorable dashboard module, jobq_web.py: importable, or beside this file."""
    # Run as a script (python jobq.py, the single file), the module is __main__: jobq_web's `import jobq` must
    # find this copy, not load a second one with its own engine hooks.
    sys.modules.setdefault("jobq", sys.modules[main.__module__])
    try:
        return importlib.import_module("jobq_web")
    except ModuleNotFoundError as exc:
        if exc.name != "jobq_web":
            raise
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobq_web.py")
    if not os.path.exists(here):
        raise _CliError(f"serve needs the dashboard module: copy jobq_web.py (from the jobq repository, next to "
                        f"jobq.py) to {here}", _EXIT_USAGE)
    import importlib.util as import_util

    spec = import_util.spec_from_file_location("jobq_web", here)
    module = import_util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["jobq_web"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _ops_parsers(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    # Operations (ops.py): job logs, retention policy, bulk actions and their audit log.
    p = add("logs", "a job's log lines (ctx.log), oldest first")
    p.add_argument("id", type=_job_id)
    p.add_argument("--after", type=lambda t: _whole(t, LOG_LINES_PER_JOB), default=0, metavar="N",
                   help="only lines numbered above N")
    p = add("retention", "show the stored retention policy (how long finished jobs are kept), or set it")
    p.add_argument("--group", metavar="KEY", help="a group's policy, overriding the global one (default: global)")
    for state in TERMINAL:
        p.add_argument(f"--{state}", type=_limit_or_none(_duration), metavar="DURATION|none",
                       help=f"keep {state} jobs this long after they finished (e.g. 7d); none: remove")
    p.add_argument("--apply", action="store_true", help="then delete now all that the policy no longer keeps")
    p = add("bulk", "retry, cancel or prune every job matching a filter, in batches (recorded in the audit log)")
    p.add_argument("action", choices=sorted(BULK_ACTIONS))
    p.add_argument("--state", type=_states, action="extend", metavar="STATE[,STATE]",
                   help="default: failed (retry), waiting,ready (cancel), done (prune)")
    p.add_argument("--type")
    p.add_argument("--group")
    p.add_argument("--since", type=_duration, metavar="DURATION", help="created within, e.g. 1h")
    p.add_argument("--until", type=_duration, metavar="DURATION", help="created more than DURATION ago")
    p.add_argument("--error", metavar="TEXT", help="the job's error contains TEXT (ASCII case ignored)")
    p.add_argument("--dry-run", action="store_true", help="print how many jobs match; change nothing")
    p = add("audit", "the audit log of bulk actions, newest first")
    p.add_argument("--limit", type=_count, default=50, help="most rows (default: 50)")


def _retention_text(p: RetentionPolicy) -> str:
    ages = ", ".join(f"{st} {_span(age.total_seconds())}" if age is not None else f"{st} kept"
                     for st, age in (("done", p.done), ("failed", p.failed), ("cancelled", p.cancelled)))
    if p.group_key is not None:
        ages = ages.replace(" kept", " as global")
    return f"retention {'group ' + p.group_key if p.group_key is not None else 'global'}: {ages}"


def _run_ops(ns: argparse.Namespace, engine: Engine) -> int:
    if ns.command == "logs":
        _require_job(engine, ns.id)
        lines = logs(engine, ns.id, after=ns.after)
        if ns.json:
            _print_json([dataclasses.asdict(line) for line in lines])
        for line in [] if ns.json else lines:
            fields = " " + json.dumps(line.fields, sort_keys=True, ensure_ascii=False) if line.fields else ""
            print(f"{_iso(line.at)} attempt {line.attempt} #{line.seq}: {_text(line.message)}{fields}")
        if not lines and not ns.json:
            print(f"job {ns.id}: no log lines" + (f" after #{ns.after}" if ns.after else ""))
    elif ns.command == "retention":
        ages = {st: getattr(ns, st) for st in TERMINAL}
        if any(v is not None for v in ages.values()):
            policies = [set_retention(engine, ns.group, **ages)]
        else:
            policies = [get_retention(engine, ns.group)] if ns.group else retention_policies(engine) or [get_retention(engine)]
        deleted = apply_retention(engine) if ns.apply else None
        if ns.json:
            _print_json({"policies": [{k: v.total_seconds() if isinstance(v, _dt.timedelta) else v
                                       for k, v in dataclasses.asdict(p).items()} for p in policies], "deleted": deleted})
        else:
            print("\n".join(_retention_text(p) for p in policies) + ("" if deleted is None else f"\ndeleted {deleted} job(s)"))
    elif ns.command == "bulk":
        with engine.connect() as conn:
            now = _prepare(engine).db_now(conn).replace(tzinfo=_dt.UTC)
            conn.rollback()
        r = bulk(engine, ns.action, states=ns.state, type=ns.type, group=ns.group, error=ns.error, dry_run=ns.dry_run,
                 since=None if ns.since is None else now - ns.since, until=None if ns.until is None else now - ns.until,
                 actor=_cli_actor())
        if ns.json:
            _print_json(dataclasses.asdict(r))
        elif r.dry_run:
            print(f"{r.matched} job(s) match: {ns.action} would apply to them (dry run, nothing changed)")
        else:
            print(f"{ns.action}: {r.applied} of {r.matched} matching job(s)" + (f", {r.skipped} skipped" if r.skipped else "")
                  + (f", {r.reopened} re-opened in all" if ns.action == "retry" else ""))
    elif ns.command == "audit":
        entries = [dataclasses.asdict(e) for e in audit_log(engine, limit=ns.limit)]
        if ns.json:
            _print_json(entries)
        else:
            print(_table([{**e, "filter": json.dumps({k: v for k, v in e["filter"].items() if v is not None},
                                                     sort_keys=True)} for e in entries],
                         ["id", "at", "actor", "action", "count", "filter"]))
    return 0


def _cli_actor() -> str:
    """Who runs a bulk action from the command line, for the audit log: cli:user@host."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in this environment
        user = "?"
    return f"cli:{user}@{socket.gethostname()}"[:200]


_OPS_COMMANDS = frozenset({"logs", "retention", "bulk", "audit"})


def _run_command(ns: argparse.Namespace, engine: Engine, secrets: Sequence[str]) -> int:
    cmd = ns.command
    if cmd in _OPS_COMMANDS:
        return _run_ops(ns, engine)
    if cmd == "init":
        create_schema(engine)
        _print_json({"schema_version": SCHEMA_VERSION}) if ns.json else print("schema ready")
    elif cmd == "enqueue":
        try:
            args = json.loads(ns.args)
        except ValueError as exc:
            raise _CliError(f"--args is not valid JSON: {_one_line(exc)}", _EXIT_USAGE) from None
        if not isinstance(args, dict):
            raise _CliError(f"--args must be a JSON object, like '{{\"id\": 7}}', got {_type_name(args)}", _EXIT_USAGE)
        if ns.after:
            print("jobq: --after is deprecated, use --depends-on (the same: wait for that job to be done)", file=sys.stderr)
        when = ns.delay if ns.delay is not None else ns.run_after
        job_id = enqueue(engine, ns.type, args, group_key=ns.group, weight=ns.weight, depends_on=ns.depends_on + ns.after,
                         parent=ns.parent, container=ns.container, run_after=when, max_attempts=ns.max_attempts,
                         timeout=ns.timeout, priority=ns.priority, unique_key=ns.unique_key)
        _print_json({"id": job_id}) if ns.json else print(job_id)
    elif cmd == "status":
        while True:
            st = stats(engine)
            with engine.connect() as conn:  # running jobs that report progress (the first 20)
                running = [dict(r._mapping) for r in conn.execute(_q_running_progress(20))]
                conn.rollback()
            policies = groups(engine) if sa.inspect(engine).has_table("jobq_groups") else []
            glob = get_limit(engine)
            if ns.json:
                out = json.dumps({**st, "progress": running, "group_policy": [dataclasses.asdict(p) for p in policies],
                                  "global_limit": dataclasses.asdict(glob)},
                                 default=_json_default, sort_keys=True)
            else:
                out = _status_text(st) + "".join(
                    f"\n  job {r['id']} ({r['type']}, group {r['group_key']}): {_progress_text(r['progress'])}" for r in running)
                out += f"\n{_limit_text(glob)}" if glob.limits else ""
                out += "".join(f"\n{_policy_text(p)}" for p in policies[:50])
                out += f"\n... and {len(policies) - 50} more stored group policies (jobq groups)" if len(policies) > 50 else ""
            if not ns.watch:
                print(out)
                break
            print("\x1b[2J\x1b[H" + out, flush=True)
            time.sleep(ns.watch)
    elif cmd == "ls":
        with engine.connect() as conn:
            since = _prepare(engine).db_now(conn) - ns.since if ns.since is not None else None
            rows = [dict(r._mapping) for r in conn.execute(_q_list_jobs(
                state=ns.state, type=ns.type, group=ns.group, since=since, before=ns.before, limit=ns.limit + 1))]
            conn.rollback()
        if len(rows) > ns.limit:  # on stderr, so a pipe reading stdout gets only the rows
            rows = rows[:ns.limit]
            more = f", or raise --limit (at most {_MAX_SLOTS})" if ns.limit < _MAX_SLOTS else ""
            print(f"jobq: showing the newest {ns.limit} matching jobs, and more match: the next page is "
                  f"--before {rows[-1]['id']}{more}", file=sys.stderr)
        if ns.json:
            _print_json(rows)
        else:
            print(_table(rows, ["id", "type", "state", "group_key", "attempts", "max_attempts", "run_after",
                                "created_at", "finished_at"]))
    elif cmd == "show":
        info = get(engine, ns.id)
        if info is None:
            raise _CliError(f"no job with id {ns.id}", _EXIT_NO_SUCH_JOB)
        with engine.connect() as conn:
            dependents = list(conn.execute(_q_dependent_ids(ns.id)).scalars())
            children = list(conn.execute(_q_child_ids(ns.id)).scalars())
            conn.rollback()
        data = {**dataclasses.asdict(info), "dependents": dependents, "children": children,
                "suspended": _suspension(engine, ns.id)}
        history = [dataclasses.asdict(a) for a in attempts(engine, ns.id)]
        if ns.json:
            _print_json({**data, "history": history})
        else:
            for k, v in data.items():
                if k == "suspended":  # a suspended job: what it waits for, as why says it
                    v = None if v is None else f"{v['text']}, holding no slot"
                print(f"{k:>17}: {_text(list(v) if isinstance(v, tuple) else v)}")
            print(f"{'history':>17}: " + ("no attempt has ended" if not history else ""))
            for a in history:
                print(f"{'':>19}attempt {a['attempt']} {a['outcome']}: {_iso(a['started_at']) or '-'} .. "
                      f"{_iso(a['finished_at'])} by {a['worker_id'] or '-'}"
                      + (f": {_one_line(a['error'])}" if a["error"] else ""))
    elif cmd == "signal":
        try:
            payload = json.loads(ns.payload)
        except ValueError as exc:
            raise _CliError(f"--payload is not valid JSON: {_one_line(exc)}", _EXIT_USAGE) from None
        sent = signal(engine, ns.key, payload)
        _print_json({"key": ns.key, "sent": sent}) if ns.json else print(
            f"signal {ns.key!r} sent" if sent else f"signal {ns.key!r} was sent before: its first payload stands")
    elif cmd == "why":
        state = _require_job(engine, ns.id)
        line = why(engine, ns.id)
        _print_json({"id": ns.id, "state": state, "why": line}) if ns.json else print(line)
    elif cmd in ("retry", "cancel"):
        _require_job(engine, ns.id)
        try:
            outcome: Any = retry(engine, ns.id, from_root=ns.root) if cmd == "retry" else cancel(engine, ns.id)
        except InvalidJob:
            _require_job(engine, ns.id)  # deleted meanwhile: still "no such job"
            raise
        if cmd == "retry":
            _print_json({"id": ns.id, "reopened": outcome}) if ns.json else print("re-opened: " + " ".join(map(str, outcome)))
        else:
            asked = outcome in _LIVE or outcome == "held"  # the job is not cancelled yet: its end is
            _print_json({"id": ns.id, "state": outcome, "cancel_requested": asked}) if ns.json else print(
                f"job {ns.id}: {_cancel_outcome(outcome)}")
    elif cmd in ("group", "groups"):
        if cmd == "groups":
            policies = groups(engine)
        elif ns.weight is None and ns.cap is None and ns.rate is None and ns.paused is None:
            found = get_group(engine, ns.key)
            if found is None:
                print(f"group {ns.key}: no stored policy (weight from its jobs, no cap, no rate limit)")
                return 0
            policies = [found]
        else:
            policies = [set_group(engine, ns.key, weight=ns.weight, max_in_flight=ns.cap, rate_limit=ns.rate,
                                  paused=ns.paused)]
        if ns.json:
            _print_json([dataclasses.asdict(p) for p in policies] if cmd == "groups" else dataclasses.asdict(policies[0]))
        else:
            for p in policies:
                print(_policy_text(p))
    elif cmd == "limit":
        if ns.clear and (ns.max_in_flight is not None or ns.rate is not None):
            raise _CliError("--clear removes both limits: give it alone", _EXIT_USAGE)
        if ns.clear:
            limit = set_limit(engine, max_in_flight=UNLIMITED, rate_limit=UNLIMITED)
        elif ns.max_in_flight is None and ns.rate is None:
            limit = get_limit(engine)
        else:
            limit = set_limit(engine, max_in_flight=ns.max_in_flight, rate_limit=ns.rate)
        _print_json(dataclasses.asdict(limit)) if ns.json else print(_limit_text(limit))
    elif cmd in ("schedule", "schedules"):
        return _schedule_command(ns, engine)
    elif cmd == "prune":
        n = prune(engine, ns.older_than, states=tuple(ns.state or ("done",)))
        _print_json({"deleted": n}) if ns.json else print(f"deleted {n} job(s)")
    elif cmd == "graph":
        if (ns.id is None) == (not ns.all):
            raise _CliError("graph needs a job id or --all (not both)", _EXIT_USAGE)
        if ns.id is not None:
            _require_job(engine, ns.id)
        with engine.connect() as conn:
            nodes, edges = _graph_data(conn, ns.id)
            conn.rollback()
        text = _graph(nodes, edges, ns.format)
        if ns.json:
            _print_json({"root": ns.id, "format": ns.format, "text": text, "edges": [list(e) for e in edges],
                         "nodes": [{"id": r.id, "type": r.type, "state": r.state, "parent_id": r.parent_id,
                                    "is_container": bool(r.is_container)} for r in nodes]})
        else:
            print(text)
    elif cmd == "serve":
        web = _dashboard()
        handler = logging.StreamHandler()
        handler.setFormatter(_ScrubbingFormatter("%(asctime)s %(levelname)s %(name)s %(message)s",
                                                 [*secrets, *([ns.token] if ns.token else [])]))
        logging.basicConfig(level=getattr(logging, ns.log_level.upper()), handlers=[handler])
        try:
            web.serve(engine, host=ns.host, port=ns.port, token=ns.token, hide_args=ns.hide_args)
        except OSError as exc:  # the address is taken, or not this machine's
            raise _CliError(f"cannot listen on {ns.host}:{ns.port}: {exc.strerror or _one_line(exc)}", _EXIT_USAGE) from None
    elif cmd == "worker":
        handler = logging.StreamHandler()
        handler.setFormatter(_ScrubbingFormatter("%(asctime)s %(levelname)s %(name)s %(message)s", secrets))
        logging.basicConfig(level=getattr(logging, ns.log_level.upper()), handlers=[handler])
        options: dict[str, Any] = {"start_method": ns.start_method} if ns.start_method else {}
        w = Worker(engine, _load_handlers(ns.app), max_concurrency=ns.concurrency,
                   local_concurrency=ns.local_concurrency, lease_ttl=ns.lease_ttl,
                   heartbeat_interval=ns.heartbeat, poll_interval=ns.poll, listen=ns.listen, timeout=ns.timeout,
                   shutdown_timeout=ns.shutdown_timeout, group_caps=dict(ns.cap), rate_limits=dict(ns.rate),
                   executor=ns.executor, worker_id=ns.worker_id, **options)
        logger.info("worker %s started: types %s", w.worker_id, ", ".join(sorted(w.handlers)))
        w.run()
        logger.info("worker %s stopped", w.worker_id)
    return 0
