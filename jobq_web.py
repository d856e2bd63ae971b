"""jobq_web: the jobq dashboard, a WSGI app in one vendorable file beside ``jobq.py``.

It answers what operators ask of a queue: what is stuck, why, and who is using the slots.
Standard library and jobq only; every style, script and picture is served by the app itself,
so it works behind a firewall, and the read-only pages work with JavaScript off.

Run it:  ``jobq --url URL serve [--host 127.0.0.1] [--port 8080] [--token T] [--hide-args]``
Mount it: ``jobq_web.app(engine, token=...)`` is a WSGI callable for any WSGI server or
framework (see docs/guides/dashboard.md).

Pages (each with a JSON twin under ``/api``): ``/`` overview, ``/jobs`` list with filters and
paging, ``/jobs/<id>`` one job (why it is not running, its DAG neighbourhood as SVG), and
``/groups``, ``/types`` (per job type: runtime and failure rate over the last hour and day),
``/schedules`` (recurring jobs); ``/metrics`` (Prometheus) and ``/healthz`` (200, or 503 with the reason). Actions (POST ``/jobs/<id>/retry``, ``/jobs/<id>/cancel``,
``/groups/pause?group=<name>``, ``/groups/resume?group=<name>``, or ``/groups/<name>/pause``;
``/groups/policy?group=<name>`` with ``weight``, ``cap``, ``rate``; ``/schedules/pause?name=<name>``,
``/schedules/resume?name=<name>``; each change of a group or schedule in the audit log)
need the token (a session cookie from ``/login``, or ``Authorization: Bearer <token>``) and,
with the cookie, a CSRF field; without a token the dashboard is read-only. A GET of an
action's address offers the action as a button (where signing in after a refused one leads).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import hmac
import html
import importlib
import json
import logging
import re
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

if TYPE_CHECKING or not __package__:
    import jobq
else:  # vendored inside a package: the jobq.py next to this file
    jobq = importlib.import_module(f"{__package__}.jobq")

#: jobq's internals the dashboard shares with the command line (its builders and formatting):
#: the package reads any module's name as ``jobq._name``, as the single file has them at top level.
_jq: Any = jobq

__all__ = ["Dashboard", "app", "serve"]

logger = logging.getLogger("jobq.web")
#: One line per request served by :func:`serve` (INFO): client, method, path, status and
#: milliseconds, with the same as ``extra`` keys; route or silence it by this name.
access_logger = logging.getLogger("jobq.web.access")

#: Rows per page of /jobs (``?limit=`` may ask for up to 500).
PAGE_SIZE = 50
#: Groups per page of /groups, and how many the overview lists before linking to that page.
GROUPS_PAGE = 100
OVERVIEW_GROUPS = 20
_MAX_PAGE = 500
#: A job list counts the jobs its filters match up to this many ("10000+" beyond).
_COUNT_CAP = 10_000
#: The overview's chart: finished jobs over the last hour, in 12 spans of 5 minutes.
_CHART_STEP = _dt.timedelta(minutes=5)
_CHART_SPANS = 12
#: The per-type page's windows (name, length), and the most finished jobs it reads for them: the
#: newest first, so a window with more finishes is summarised from its newest ones (and says so).
TYPE_WINDOWS = (("1h", _dt.timedelta(hours=1)), ("24h", _dt.timedelta(hours=24)))
TYPE_SAMPLE = 10_000
#: Jobs shown in a job's DAG picture at most.
_GRAPH_LIMIT = 60
_SESSION_COOKIE = "jobq_session"


# =============================================================================================
# Errors a request can meet: each answers a clear page or JSON body, never a traceback
# =============================================================================================


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_REASONS = {200: "OK", 303: "See Other", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
            404: "Not Found", 405: "Method Not Allowed", 409: "Conflict", 500: "Internal Server Error",
            501: "Not Implemented", 503: "Service Unavailable"}


# =============================================================================================
# What the pages show: data, read through jobq's public API and its read builders
# =============================================================================================
# Each of the functions marked "seam" stands in for an API that jobq may not have yet; it is
# the one place to rewire when it does.


def _db_now(engine: sa.Engine) -> _dt.datetime:
    d = _jq._prepare(engine)
    with engine.connect() as conn:
        now: _dt.datetime = d.db_now(conn)
        conn.rollback()
    return now


def _group_policies(engine: sa.Engine) -> dict[str, dict[str, Any]]:
    """Each group's stored policy (jobq.groups: weight, cap, rate, paused), by group."""
    return {g.group_key: dataclasses.asdict(g) for g in jobq.groups(engine)}


def _plain(value: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return dict(value)
    return dict(getattr(value, "_mapping", {}))


def _group_rows(engine: sa.Engine, st: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Seam: one row per group that has ready, in-flight or recently started work, by name:
    weight (stored, else the largest among its due jobs), ready and due jobs, in flight, cap,
    rate and paused (stored policy), starts in the last hour, and served share versus weight
    share over the groups with work. A fixed number of statements whatever the number of
    groups; the pages show a slice of these rows (group_page, the overview)."""
    now = st["now"]
    policies = _group_policies(engine)
    names = set(st["ready_by_group"]) | set(st["in_flight"]) | set(policies)
    with engine.connect() as conn:
        starts = {g: int(n) for g, n in conn.execute(_jq._q_starts_by_group(now - _dt.timedelta(hours=1)))}
        names |= set(starts)
        weights = {g: int(w or 1) for g, w in conn.execute(_jq._q_due_weights(now))}
        conn.rollback()
    rows = []
    for g in sorted(names):
        pol = policies.get(g, {})
        rate = pol.get("rate_limit")
        rows.append({
            "group": g, "weight": pol.get("weight") or weights.get(g), "ready": st["ready_by_group"].get(g, 0),
            "due": st["due_by_group"].get(g, 0), "in_flight": st["in_flight"].get(g, 0), "cap": pol.get("max_in_flight"),
            "rate": f"{rate[0]}/{rate[1]:g}s" if rate else None, "paused": pol.get("paused"),
            "starts_last_hour": starts.get(g, 0),
        })
    busy = [r for r in rows if r["due"] or r["in_flight"]]
    total_w = sum(r["weight"] or 1 for r in busy)
    total_starts = sum(r["starts_last_hour"] for r in rows)
    for r in rows:
        r["weight_share"] = round((r["weight"] or 1) / total_w, 3) if r in busy and total_w else None
        r["served_share"] = round(r["starts_last_hour"] / total_starts, 3) if total_starts else None
    return rows


def _global_limit(engine: sa.Engine) -> dict[str, Any]:
    """The stored global limits every worker obeys (jobq.get_limit: cap, rate, updated_at)."""
    return dataclasses.asdict(jobq.get_limit(engine))


def overview(engine: sa.Engine) -> dict[str, Any]:
    """The overview's data: stats() (indexes only), per-group rows, the stored global limits,
    who holds the slots, and finished jobs per 5 minutes over the last hour."""
    st = jobq.stats(engine)
    now = st["now"]
    since = now - _CHART_STEP * _CHART_SPANS
    chart = {s: [0] * _CHART_SPANS for s in jobq.TERMINAL}
    with engine.connect() as conn:
        for state, *counts in conn.execute(_jq._q_finished_buckets(since, _CHART_STEP, _CHART_SPANS)):
            chart[state] = [int(c or 0) for c in counts]  # MySQL sums to a Decimal
        holders = [{"worker": o, "group": g, "in_flight": int(n)} for o, g, n in conn.execute(_jq._q_holders())]
        conn.rollback()
    st = dict(st)
    st["groups"] = _group_rows(engine, st)
    st["global_limit"] = _global_limit(engine)
    st["holders"] = sorted(holders, key=lambda h: (str(h["worker"]), h["group"]))
    st["chart"] = {"since": since, "step_seconds": _CHART_STEP.total_seconds(), "finished": chart}
    return st


def job_list(engine: sa.Engine, *, state: str | None, type: str | None, group: str | None,
             since: _dt.datetime | None, until: _dt.datetime | None, before: int | None, limit: int,
             after: int | None = None) -> dict[str, Any]:
    """One page of jobs, newest first: those below the id ``before``, or the ``limit`` jobs just
    above the id ``after``, or the newest; with ``next_before`` (the ``before`` of the older page,
    or None) and ``newer_after`` (the ``after`` of the newer page, or None)."""
    _jq._prepare(engine)
    with engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(_jq._q_list_jobs(
            state=state, type=type, group=group, since=since, until=until, before=before, after=after,
            limit=limit + 1))]
        conn.rollback()
    more = len(rows) > limit
    rows = rows[:limit]
    if after is not None:  # read upwards from ``after``: the page's newest is last
        rows.reverse()
        return {"jobs": rows, "next_before": rows[-1]["id"] if rows else None,
                "newer_after": rows[0]["id"] if more and rows else None}
    return {"jobs": rows, "next_before": rows[-1]["id"] if more and rows else None,
            "newer_after": rows[0]["id"] if before is not None and rows else None}


def _list_details(engine: sa.Engine, d: dict[str, Any], filters: Mapping[str, Any]) -> dict[str, Any]:
    """A job list page's extras, in three statements whatever the page size: each row's
    priority, last error, last start and progress, the database time (for "3m ago") and the
    number of jobs matching the filters (``total``, counted to ``_COUNT_CAP``; ``total_capped``
    says it is at least that many)."""
    ids = [r["id"] for r in d["jobs"]]
    with engine.connect() as conn:
        extra = {r.id: r._mapping for r in conn.execute(_jq._q_list_details(ids))} if ids else {}
        total = int(conn.execute(_jq._q_count_listed(
            state=filters.get("state"), type=filters.get("type"), group=filters.get("group"),
            since=filters.get("since"), until=filters.get("until"), cap=_COUNT_CAP)).scalar_one())
        conn.rollback()
    for r in d["jobs"]:
        r.update({k: v for k, v in extra.get(r["id"], {}).items() if k != "id"})
    return d | {"now": _db_now(engine), "total": min(total, _COUNT_CAP), "total_capped": total > _COUNT_CAP}


def _retry_roots(conn: sa.Connection, job_id: int, state: str) -> list[int]:
    """The failed or cancelled jobs that keep a closed job closed (retry them, or retry it from
    its root); empty when retrying the job itself is what to do."""
    return [r for r in _jq._retry_roots(conn, job_id) if r != job_id] if state in _jq._BAD else []


def job_detail(engine: sa.Engine, job_id: int, *, hide_args: bool) -> dict[str, Any] | None:
    """Everything the job page shows, or None if there is no such job."""
    info = jobq.get(engine, job_id)
    if info is None:
        return None
    line = jobq.why(engine, job_id)
    with engine.connect() as conn:
        dependents = list(conn.execute(_jq._q_dependent_ids(job_id)).scalars())
        children = list(conn.execute(_jq._q_child_ids(job_id)).scalars())
        nodes, edges = _jq._graph_data(conn, job_id, limit=_GRAPH_LIMIT)
        roots = _retry_roots(conn, job_id, info.state)
        if info.parent_id is not None and all(n.id != info.parent_id for n in nodes):
            nodes = sorted([*nodes, *conn.execute(_jq._q_graph_nodes([info.parent_id]))], key=lambda r: r.id)
        conn.rollback()
    data = dataclasses.asdict(info)
    data["depends_on"] = list(info.depends_on)
    if hide_args:
        data["args"] = None
    data.update(args_hidden=hide_args, why=line, dependents=dependents, children=children, retry_roots=roots,
                suspended=_jq._suspension(engine, job_id), now=_db_now(engine),
                attempt_history=[_plain(a) for a in jobq.attempts(engine, job_id)],
                log=[_plain(line) for line in jobq.logs(engine, job_id)],
                graph={"nodes": [{"id": n.id, "type": n.type, "state": n.state, "parent_id": n.parent_id,
                                  "is_container": bool(n.is_container)} for n in nodes],
                       "edges": [list(e) for e in edges]})
    return data


def _nearest_rank(sorted_values: Sequence[float], percent: int) -> float | None:
    """The ``percent`` percentile (1-100) of ascending values by nearest rank (the value at
    rank ceil(percent/100 * n)); None if empty."""
    if not sorted_values:
        return None
    return sorted_values[max(1, -(-percent * len(sorted_values) // 100)) - 1]


def type_page(engine: sa.Engine) -> dict[str, Any]:
    """The per-type page: for each job type, its ready and running (leased or running) jobs now,
    and per window of :data:`TYPE_WINDOWS`, the jobs that finished in it (done, failed,
    cancelled), the failure rate (failed over done and failed; None without either) and the
    median and 95th percentile of how long their last attempt ran (seconds, jobs that started).

    Two reads: the live rows by type (the ready and in-flight indexes) and the newest
    :data:`TYPE_SAMPLE` jobs finished in the longest window (ix_jobs_finished, newest first).
    A window with more finishes than that is summarised from its newest ones: its entry in
    ``windows`` has ``complete`` false and ``covers_since``, the oldest finish read."""
    now = _db_now(engine)
    longest = max(w for _, w in TYPE_WINDOWS)
    with engine.connect() as conn:
        live = conn.execute(_jq._q_live_by_type()).all()
        rows = conn.execute(_jq._q_type_finishes(now - longest, TYPE_SAMPLE + 1)).all()
        conn.rollback()
    capped = len(rows) > TYPE_SAMPLE
    rows = rows[:TYPE_SAMPLE]
    oldest = rows[-1].finished_at if rows else None
    types: dict[str, dict[str, Any]] = {}

    def entry(name: str) -> dict[str, Any]:
        return types.setdefault(name, {"type": name, "ready": 0, "running": 0})

    for type_, state, n in live:
        entry(type_)["ready" if state == "ready" else "running"] += int(n)
    windows = []
    for label, length in TYPE_WINDOWS:
        since = now - length
        complete = not capped or (oldest is not None and oldest < since)
        windows.append({"name": label, "seconds": length.total_seconds(), "since": since, "complete": complete,
                        "covers_since": None if complete else oldest})
        per: dict[str, dict[str, Any]] = {}
        for r in rows:
            if r.finished_at < since:
                break  # newest first: the rest are older
            w = per.setdefault(r.type, {"done": 0, "failed": 0, "cancelled": 0, "runs": []})
            w[r.state] += 1
            if r.started_at is not None:
                w["runs"].append(max(0.0, (r.finished_at - r.started_at).total_seconds()))
        for type_, w in per.items():
            runs = sorted(w.pop("runs"))
            judged = w["done"] + w["failed"]
            entry(type_)[label] = w | {
                "finished": w["done"] + w["failed"] + w["cancelled"],
                "failure_rate": round(w["failed"] / judged, 4) if judged else None,
                "runtime_p50": _nearest_rank(runs, 50), "runtime_p95": _nearest_rank(runs, 95)}
    empty = {"done": 0, "failed": 0, "cancelled": 0, "finished": 0, "failure_rate": None, "runtime_p50": None,
             "runtime_p95": None}
    out = [t | {label: t.get(label, empty) for label, _ in TYPE_WINDOWS} for _, t in sorted(types.items())]
    return {"now": now, "windows": windows, "sample": TYPE_SAMPLE, "types": out}


def group_page(engine: sa.Engine, *, after: str | None = None, limit: int | None = None) -> dict[str, Any]:
    """The groups page: the rows of the groups named after ``after``, at most ``limit`` of them
    (None: all), with ``groups_total``, ``next_after`` (the ``after`` of the next page, or
    None) and ``global_limit`` (the stored limits over all groups). ``policy_stored`` is always
    true since schema 4 (kept for scripts that read it)."""
    st = jobq.stats(engine)
    rows = _group_rows(engine, st)
    total = len(rows)
    if after is not None:
        rows = [r for r in rows if r["group"] > after]
    more = limit is not None and len(rows) > limit
    rows = rows[:limit] if limit is not None else rows
    return {"groups": rows, "policy_stored": True, "now": st["now"], "groups_total": total,
            "next_after": rows[-1]["group"] if more and rows else None, "global_limit": _global_limit(engine)}


# =============================================================================================
# Rendering: every value through _e (HTML-escaped), no inline script or style (the CSP forbids them)
# =============================================================================================


def _e(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, _dt.datetime):
        return html.escape(_jq._iso(value) or "")
    return html.escape(str(value), quote=True)


def _json_text(value: Any) -> str:
    return json.dumps(value, default=_jq._json_default, sort_keys=True, indent=2)


def _state(state: str) -> str:
    return f'<span class="state s-{_e(state)}">{_e(state)}</span>'


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], cls: str = "") -> str:
    """A table of already-escaped cells."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body or _empty(len(headers))}</tbody></table>'


def _empty(n: int) -> str:
    return f'<tr><td colspan="{n}" class="muted">none</td></tr>'


def _num(value: Any) -> str:
    return "-" if value is None else _e(value)


def _share(value: Any) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def _utc(value: _dt.datetime) -> _dt.datetime:
    return value.replace(tzinfo=_dt.UTC) if value.tzinfo is None else value.astimezone(_dt.UTC)


def _duration(seconds: float) -> str:
    """A duration for people: tenths of a second below 10 s ("2.4s"), else as the CLI does."""
    return f"{seconds:.1f}s" if seconds < 10 else _jq._span(seconds)


def _ago(value: _dt.datetime | None, now: _dt.datetime | None) -> str:
    """A time as "3m05s ago" (or "in 5m00s"), its absolute UTC time in the title; "-" if None."""
    if value is None:
        return "-"
    iso = _e(value)
    if now is None:
        return f'<time datetime="{iso}">{iso}</time>'
    secs = (_utc(now) - _utc(value)).total_seconds()
    rel = f"{_duration(secs)} ago" if secs >= 0 else f"in {_duration(-secs)}"
    return f'<time datetime="{iso}" title="{iso}">{rel}</time>'


def _took(start: _dt.datetime | None, end: _dt.datetime | None) -> str:
    """How long from ``start`` to ``end`` ("-" when either is missing)."""
    return "-" if start is None or end is None else _duration(max(0.0, (_utc(end) - _utc(start)).total_seconds()))


def _amount(v: float) -> str:
    return f"{int(v):,}" if float(v).is_integer() else f"{v:,.2f}"


def _progress(p: Any) -> str:
    """A job's last ctx.progress as a bar with its numbers and note: "231 / 1,000 (23%) · note"."""
    if p is None:
        return "-"
    if not isinstance(p, Mapping):
        return _e(_json_text(p))
    done: Any = p.get("done")
    total: Any = p.get("total")
    note = p.get("message")

    def number(x: Any) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool) and x == x and abs(x) != float("inf")

    if not number(done):
        return _e(_json_text(dict(p)))
    if number(total) and total > 0:
        frac = min(max(done / total, 0.0), 1.0)
        out = (f'<progress class="bar" value="{min(max(done, 0), total)!r}" max="{total!r}">{frac:.0%}</progress> '
               f"{_amount(done)} / {_amount(total)} ({frac:.0%})")
    else:
        out = f"{_amount(done)} done"
    return out + (f" &middot; {_e(note)}" if note else "")


def _paused(value: Any) -> str:
    return "paused" if value else "active"


def _error_cell(error: str | None, width: int = 80) -> str:
    """A job's last error for a table: its first line, cut to ``width`` characters, the whole
    text in the title (a browser shows it on hover)."""
    if not error:
        return ""
    first = _headline(error)
    short = first if len(first) <= width and first == error.strip() else first[:width].rstrip() + "…"
    return f'<span class="err" title="{_e(error)}">{_e(short)}</span>'


def _headline(error: str) -> str:
    """The line that says what went wrong: the first (a worker writes "Type: message" there),
    or a bare traceback's last."""
    lines = [ln.strip() for ln in error.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    return lines[-1] if lines[0].startswith("Traceback (most recent call last)") else lines[0]


#: The attempts table's columns: heading, then the cell from one attempt (a dict) and the job page's ``now``.
_ATTEMPT_COLUMNS: tuple[tuple[str, Callable[[Mapping[str, Any], _dt.datetime | None], str]], ...] = (
    ("#", lambda a, now: _num(a.get("attempt"))),
    ("outcome", lambda a, now: _state(a["outcome"]) if a.get("outcome") else "-"),
    ("worker", lambda a, now: _e(a.get("worker_id")) or "-"),
    ("started", lambda a, now: _ago(a.get("started_at"), now)),
    ("finished", lambda a, now: _ago(a.get("finished_at"), now)),
    ("ran", lambda a, now: _took(a.get("started_at"), a.get("finished_at"))),
    ("error", lambda a, now: _attempt_error(a.get("error"))),
)


def _attempt_error(error: str | None) -> str:
    """An attempt's error in full (the traceback keeps its lines), folded under its first line."""
    if not error:
        return ""
    return f'<details class="tb"><summary>{_e(_headline(error)[:120])}</summary><pre>{_e(error)}</pre></details>'


def _attempts_table(history: Sequence[Mapping[str, Any]], now: _dt.datetime | None) -> str:
    return _table([h for h, _ in _ATTEMPT_COLUMNS], ([cell(a, now) for _, cell in _ATTEMPT_COLUMNS] for a in history),
                  "attempts")


def _chart_svg(chart: Mapping[str, Any]) -> str:
    """Finished jobs per span as stacked bars (done, failed, cancelled), with the counts."""
    fin = chart["finished"]
    n = len(fin["done"])
    totals = [sum(fin[s][i] for s in jobq.TERMINAL) for i in range(n)]
    top = max(totals + [1])
    w, h, bar = 24 * n + 40, 110, 18
    parts = [f'<svg class="chart" role="img" viewBox="0 0 {w} {h + 30}" width="{w}" height="{h + 30}" '
             f'xmlns="http://www.w3.org/2000/svg"><title>jobs finished per 5 minutes, last hour</title>',
             f'<line x1="30" y1="{h}" x2="{w}" y2="{h}" stroke="#888"/>',
             f'<text x="0" y="12" class="axis">{top}</text><text x="0" y="{h}" class="axis">0</text>']
    for i in range(n):
        x, y = 34 + 24 * i, float(h)
        for s in jobq.TERMINAL:
            v = fin[s][i]
            if v:
                bh = max(1.0, (h - 10) * v / top)
                y -= bh
                parts.append(f'<rect x="{x}" y="{y:.1f}" width="{bar}" height="{bh:.1f}" fill="{_jq._COLOURS[s]}">'
                             f'<title>{_e(s)}: {v}</title></rect>')
        label = f"-{(n - i) * 5}m" if (n - i) % 3 == 0 else ""
        parts.append(f'<text x="{x}" y="{h + 14}" class="axis">{label}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _dag_svg(nodes: Sequence[Mapping[str, Any]], edges: Sequence[Sequence[int]], focus: int, base: str) -> str:
    """The neighbourhood as an SVG: one column per depth (upstreams left, dependents right,
    a container left of its children), boxes coloured by state, each a link to its page."""
    ids = {n["id"] for n in nodes}
    preds: dict[int, list[int]] = {i: [] for i in ids}
    for u, v in edges:
        preds[v].append(u)
    for n in nodes:
        if n["parent_id"] in ids:
            preds[n["id"]].append(n["parent_id"])
    depth: dict[int, int] = {}

    def level(i: int, seen: frozenset[int]) -> int:
        if i not in depth:
            depth[i] = 1 + max((level(p, seen | {i}) for p in preds[i] if p not in seen), default=-1)
        return depth[i]

    for i in sorted(ids):
        level(i, frozenset())
    columns: dict[int, list[Mapping[str, Any]]] = {}
    for n in sorted(nodes, key=lambda n: n["id"]):
        columns.setdefault(depth[n["id"]], []).append(n)
    bw, bh, gx, gy = 170, 44, 60, 16
    pos = {n["id"]: (20 + c * (bw + gx), 20 + r * (bh + gy)) for c, col in columns.items() for r, n in enumerate(col)}
    width = 40 + max(columns, default=0) * (bw + gx) + bw
    height = 40 + max((len(c) for c in columns.values()), default=1) * (bh + gy) - gy
    out = [f'<svg class="dag" role="img" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'xmlns="http://www.w3.org/2000/svg"><title>job {focus} and its neighbourhood</title>',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
           'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#555"/></marker></defs>']
    for u, v in edges:
        (x1, y1), (x2, y2) = pos[u], pos[v]
        out.append(f'<line class="edge" x1="{x1 + bw}" y1="{y1 + bh / 2}" x2="{x2}" y2="{y2 + bh / 2}" '
                   'stroke="#555" marker-end="url(#arrow)"/>')
    for n in nodes:
        if n["parent_id"] in ids:
            (x1, y1), (x2, y2) = pos[n["parent_id"]], pos[n["id"]]
            out.append(f'<line class="contains" x1="{x1 + bw}" y1="{y1 + bh / 2}" x2="{x2}" y2="{y2 + bh / 2}" '
                       'stroke="#999" stroke-dasharray="4 3"/>')
    for n in nodes:
        x, y = pos[n["id"]]
        label = str(n["type"])
        label = label if len(label) <= 18 else label[:17] + "\u2026"
        kind = "container" if n["is_container"] else "job"
        stroke = ' stroke="#000" stroke-width="3"' if n["id"] == focus else ' stroke="#666"'
        dash = ' stroke-dasharray="6 3"' if n["is_container"] else ""
        out.append(f'<a href="{_e(base)}/jobs/{n["id"]}" class="node" data-state="{_e(n["state"])}">'
                   f'<title>{kind} {n["id"]} {_e(n["type"])}: {_e(n["state"])}</title>'
                   f'<rect x="{x}" y="{y}" width="{bw}" height="{bh}" rx="6" fill="{_jq._COLOURS.get(n["state"], "#eee")}"'
                   f'{stroke}{dash}/>'
                   f'<text x="{x + 8}" y="{y + 18}" class="n1">{n["id"]} {_e(label)}</text>'
                   f'<text x="{x + 8}" y="{y + 35}" class="n2">{_e(n["state"])}</text></a>')
    out.append("</svg>")
    return "".join(out)


_CSS = """
:root { font-family: system-ui, sans-serif; color: #1f2328; background: #fafafa; }
body { margin: 0; }
header { background: #24292f; color: #fff; padding: .6rem 1.2rem; display: flex; gap: 1.4rem; align-items: baseline; }
header a { color: #fff; text-decoration: none; } header a.here { text-decoration: underline; }
header .brand { font-weight: 700; } header .right { margin-left: auto; font-size: .85rem; color: #ccc; }
main { padding: 1rem 1.2rem; max-width: 1200px; }
h1 { font-size: 1.3rem; margin: .2rem 0 .8rem; } h2 { font-size: 1.05rem; margin: 1.4rem 0 .5rem; }
table { border-collapse: collapse; background: #fff; font-size: .9rem; }
th, td { border: 1px solid #d0d7de; padding: .25rem .55rem; text-align: left; vertical-align: top; }
th { background: #f0f3f6; }
td.n, th.n { text-align: right; }
.cards { display: flex; flex-wrap: wrap; gap: .6rem; }
.card { background: #fff; border: 1px solid #d0d7de; border-radius: 6px; padding: .5rem .8rem; min-width: 6.5rem; }
a.card { color: inherit; text-decoration: none; } a.card:hover { border-color: #0969da; }
.card .v { font-size: 1.5rem; font-weight: 600; } .card .k { font-size: .8rem; color: #57606a; }
.state { padding: .05rem .45rem; border-radius: 1rem; font-size: .85rem; border: 1px solid #0002; }
.s-waiting { background: #d0d0d0; } .s-ready { background: #9ecbff; } .s-leased { background: #ffe08a; }
.s-running { background: #ffd33d; } .s-done { background: #85e89d; } .s-failed { background: #f97583; }
.s-cancelled { background: #b392f0; }
.why { background: #fff8c5; border: 1px solid #d4a72c; padding: .6rem .8rem; border-radius: 6px; }
pre { background: #fff; border: 1px solid #d0d7de; padding: .5rem; overflow: auto; max-height: 24rem; font-size: .85rem; }
.muted { color: #57606a; } .error { background: #ffebe9; border: 1px solid #ff8182; padding: .6rem .8rem; border-radius: 6px; }
.flash { background: #dafbe1; border: 1px solid #4ac26b; padding: .5rem .8rem; border-radius: 6px; }
form.inline { display: inline; } button { font: inherit; padding: .2rem .7rem; cursor: pointer; }
form.filters { display: flex; flex-wrap: wrap; gap: .6rem; align-items: end; margin-bottom: .8rem; }
form.filters label { display: flex; flex-direction: column; font-size: .8rem; color: #57606a; }
svg text.axis { font-size: 10px; fill: #57606a; } svg text.n1 { font-size: 12px; font-weight: 600; }
svg text.n2 { font-size: 11px; } svg a.node:hover rect { stroke: #0969da; stroke-width: 3; }
.dagbox { overflow: auto; background: #fff; border: 1px solid #d0d7de; padding: .3rem; }
dl.fields { display: grid; grid-template-columns: max-content 1fr; gap: .15rem 1rem; margin: 0; font-size: .9rem; }
dl.fields dt { color: #57606a; } dl.fields dd { margin: 0; }
progress.bar { width: 10rem; vertical-align: middle; } details.tb pre { max-width: 60rem; white-space: pre; }
details.tb summary { cursor: pointer; } span.err { color: #cf222e; }
"""

# Live refresh: every 5 s, fetch this same page and swap in its <main>; paused while the
# operator is typing in a form, and by the checkbox (remembered for the tab). Without JavaScript
# the pages are static.
_JS = """
(function () {
  var box = document.getElementById('live');
  if (!box) return;
  var on = box.querySelector('input');
  try { on.checked = sessionStorage.getItem('jobq-live') !== 'off'; } catch (e) {}
  on.addEventListener('change', function () {
    try { sessionStorage.setItem('jobq-live', on.checked ? 'on' : 'off'); } catch (e) {}
  });
  box.hidden = false;
  function busy() { var a = document.activeElement; return !on.checked || (a && a.form); }
  setInterval(function () {
    if (busy()) return;
    fetch(location.href, {headers: {'X-Requested-With': 'jobq-live'}, credentials: 'same-origin'})
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (text) {
        if (!text) return;
        var doc = new DOMParser().parseFromString(text, 'text/html');
        var fresh = doc.querySelector('main'), old = document.querySelector('main');
        if (fresh && old && !busy()) { old.replaceWith(fresh); }
      }).catch(function () {});
  }, 5000);
})();
"""

_SECURITY_HEADERS = [
    ("Content-Security-Policy", "default-src 'none'; style-src 'self'; script-src 'self'; img-src 'self'; "
                                "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "same-origin"),
    ("X-Frame-Options", "DENY"),
    ("Cache-Control", "no-store"),
]


# =============================================================================================
# The WSGI application
# =============================================================================================


#: C0 and C1 control characters and DEL: never in a header, a name or a filter.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def _wsgi_text(value: Any) -> str:
    """A WSGI string as the text it spells: PEP 3333 hands over a request's bytes read as
    latin-1 (PATH_INFO already percent-decoded), and URLs carry UTF-8. A string that is not
    such bytes (a server that decoded it already) is taken as it is."""
    text = str(value or "")
    try:
        return text.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return text


class _Request:
    def __init__(self, environ: Mapping[str, Any]) -> None:
        self.environ = environ
        self.method = str(environ.get("REQUEST_METHOD", "GET")).upper()
        self.path = _wsgi_text(environ.get("PATH_INFO")) or "/"
        self.base = urllib.parse.quote(_wsgi_text(environ.get("SCRIPT_NAME")).rstrip("/"))
        self.pairs = urllib.parse.parse_qsl(_wsgi_text(environ.get("QUERY_STRING")))
        self.query: dict[str, list[str]] = {}
        for k, v in self.pairs:
            self.query.setdefault(k, []).append(v)
        self._form: dict[str, list[str]] | None = None

    @property
    def here(self) -> str:
        """This address (path and query, without the flash message) as a path on this site."""
        query = urllib.parse.urlencode([(k, v) for k, v in self.pairs if k != "done"])
        return urllib.parse.quote(self.path) + (f"?{query}" if query else "")

    def arg(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[-1].strip() or None if values else None

    def form(self) -> dict[str, list[str]]:
        if self._form is None:
            n = min(_ascii_int(str(self.environ.get("CONTENT_LENGTH") or "").strip()) or 0, 64 * 1024)
            body = self.environ["wsgi.input"].read(n) if n > 0 else b""
            self._form = urllib.parse.parse_qs(body.decode("utf-8", "replace"))
        return self._form

    def cookie(self, name: str) -> str | None:
        for part in _wsgi_text(self.environ.get("HTTP_COOKIE")).split(";"):
            k, _, v = part.strip().partition("=")
            if k == name:
                return v
        return None

    @property
    def wants_json(self) -> bool:
        return self.path.startswith("/api/") or "application/json" in str(self.environ.get("HTTP_ACCEPT", "")) \
            or self.environ.get("HTTP_AUTHORIZATION") is not None


_Response = tuple[int, list[tuple[str, str]], bytes]


class Dashboard:
    """The dashboard as a WSGI application: ``Dashboard(engine, token=...)(environ, start_response)``.

    Args:
        engine: the queue's SQLAlchemy Engine (its URL is never shown).
        token: allow actions (retry, cancel, pause/resume) to requests that prove they know it;
            None (the default) makes the dashboard read-only.
        hide_args: never show job arguments (pages and JSON).
        title: the name shown in the page header.
    """

    def __init__(self, engine: sa.Engine, *, token: str | None = None, hide_args: bool = False,
                 title: str = "jobq") -> None:
        if token is not None and (not isinstance(token, str) or len(token) < 8):
            raise ValueError("the dashboard token must be a string of at least 8 characters")
        self.engine = engine
        self.token = token
        self.hide_args = hide_args
        self.title = title
        self._secrets = _jq._url_secrets(engine.url.render_as_string(hide_password=False))
        self._collector: Any = None  # /metrics: made at the first scrape

    # ---- auth: a session cookie (HMAC of the token) plus a CSRF field, or a bearer token

    def _mac(self, purpose: str) -> str:
        assert self.token is not None
        return hmac.new(self.token.encode(), f"jobq-web {purpose}".encode(), hashlib.sha256).hexdigest()

    def _session_ok(self, req: _Request) -> bool:
        value = req.cookie(_SESSION_COOKIE)
        return self.token is not None and value is not None and _same_secret(value, self._mac("session"))

    def _bearer_ok(self, req: _Request) -> bool:
        auth = _wsgi_text(req.environ.get("HTTP_AUTHORIZATION"))
        scheme, _, value = auth.partition(" ")
        return self.token is not None and scheme.lower() == "bearer" and _same_secret(value.strip(), self.token)

    def _csrf(self) -> str:
        return self._mac("csrf")

    def _same_origin(self, req: _Request) -> bool:
        origin = req.environ.get("HTTP_ORIGIN") or req.environ.get("HTTP_REFERER")
        if not origin or origin == "null":
            return origin is None
        host = req.environ.get("HTTP_HOST") or req.environ.get("SERVER_NAME", "")
        try:
            return urllib.parse.urlsplit(str(origin)).netloc == host
        except ValueError:  # not a URL ("http://["): not this site
            return False

    def _authorize(self, req: _Request) -> None:
        """Raise 401/403 unless the request may act: 403 on a read-only dashboard, 401 without
        a credential or with a wrong one (saying which), 403 without a valid CSRF field or from
        another origin (cookie sessions)."""
        if self.token is None:
            raise _HttpError(403, "this dashboard is read-only: start it with --token (or JOBQ_DASHBOARD_TOKEN) to allow actions")
        if self._bearer_ok(req):
            return
        auth = _wsgi_text(req.environ.get("HTTP_AUTHORIZATION"))
        if auth:
            if auth.partition(" ")[0].lower() != "bearer":
                raise _HttpError(401, "the Authorization header must be 'Bearer <token>'")
            raise _HttpError(401, "wrong token: the bearer token is not this dashboard's")
        if not self._session_ok(req):
            if req.cookie(_SESSION_COOKIE):
                raise _HttpError(401, "the session is not valid for this dashboard (was its token changed?): sign in again")
            raise _HttpError(401, "sign in with the dashboard token first (or send Authorization: Bearer <token>)")
        field = (req.form().get("csrf") or [""])[-1]
        if not _same_secret(field, self._csrf()) or not self._same_origin(req):
            raise _HttpError(403, "the request failed its CSRF check: reload the page and try again")

    # ---- WSGI

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        req = _Request(environ)
        try:
            status, headers, body = self._respond(req)
        except Exception:  # a bug while drawing the error page itself: a line of plain text
            logger.error("jobq dashboard: internal error on %s %r", req.method, req.path, exc_info=True)
            status, headers, body = 500, [("Content-Type", "text/plain; charset=utf-8")], b"internal error: please report it\n"
        start_response(f"{status} {_REASONS.get(status, 'Error')}", [
            (k, _header_value(v)) for k, v in headers + _SECURITY_HEADERS + [("Content-Length", str(len(body)))]])
        return [b"" if req.method == "HEAD" else body]

    def _respond(self, req: _Request) -> _Response:
        try:
            status, headers, body = self._route(req)
        except _HttpError as exc:
            status, headers, body = self._error(req, exc.status, exc.message)
        except (sa.exc.SQLAlchemyError, jobq.JobqError, OSError) as exc:
            logger.warning("jobq dashboard: database error on %s %r: %s: %s", req.method, req.path,
                           type(exc).__name__, self._scrub(_jq._one_line(getattr(exc, "orig", None) or exc)))
            status, headers, body = self._error(
                req, 503, f"the database did not answer ({type(exc).__name__}); the server log has the details")
        except Exception as exc:  # a bug: one line to the page, the traceback to the log only
            logger.error("jobq dashboard: internal error on %s %r", req.method, req.path, exc_info=True)
            status, headers, body = self._error(req, 500, f"internal error ({type(exc).__name__}): please report it")
        return status, headers, body

    def _scrub(self, text: str) -> str:
        return _jq._scrub(text, self._secrets)

    def _route(self, req: _Request) -> _Response:
        parts = [p for p in req.path.split("/") if p]
        api = bool(parts) and parts[0] == "api"
        if api:
            parts = parts[1:]
        post = req.method == "POST"
        if req.method not in ("GET", "HEAD", "POST"):
            raise _HttpError(405, f"method {req.method} is not allowed here")
        if not api and parts[:1] == ["static"] and len(parts) == 2 and not post:
            return self._static(parts[1])
        if not api and parts in (["login"], ["logout"]):
            return self._login(req, parts[0])
        if not api and parts in (["metrics"], ["healthz"]) and not post:
            return self._metrics() if parts == ["metrics"] else _healthz(self.engine)
        job_action = len(parts) == 3 and parts[0] == "jobs" and parts[2] in ("retry", "cancel")
        group_action = len(parts) >= 2 and parts[0] == "groups" and parts[-1] in ("pause", "resume", "policy")
        if parts == ["signals", "send"]:  # a signal: ?key=K (&job=ID, the page to return to)
            return self._signal_action(req) if post else self._offer_signal(req)
        if parts == ["jobs", "bulk-retry"]:
            return self._bulk_retry(req, post)
        if parts in (["schedules", "pause"], ["schedules", "resume"]):
            if post:
                return self._schedule_action(req, parts[1])
            if req.wants_json or self.token is None:
                raise _HttpError(405, "actions are POST requests")
            return self._offer_schedule_action(req, parts[1])
        if post:
            if job_action:
                return self._job_action(req, _job_id(parts[1]), parts[2])
            if group_action and parts[-1] == "policy":
                return self._group_policy_action(req, _group_name(req, parts))
            if group_action:
                return self._group_action(req, _group_name(req, parts), parts[-1])
            raise _HttpError(405 if self._known_get(parts, api) else 404, f"no action at {req.path}")
        if (job_action or group_action) and (req.wants_json or self.token is None):
            raise _HttpError(405, "actions are POST requests")
        if job_action:  # where signing in after a refused action leads: the action offered again
            return self._offer_job_action(req, _job_id(parts[1]), parts[2])
        if group_action and parts[-1] == "policy":
            return self._offer_group_policy(req, _group_name(req, parts))
        if group_action:
            return self._offer_group_action(req, _group_name(req, parts), parts[-1])
        if parts in ([], ["overview"]) and (api or not parts):
            data = overview(self.engine)
            return self._json(data) if api else self._page(req, "Overview", self._overview_html(req, data), "/")
        if parts == ["jobs"]:
            data = self._list(req)
            return self._json(data) if api else self._page(req, "Jobs", self._jobs_html(req, data), "/jobs")
        if len(parts) == 2 and parts[0] == "jobs":
            job_id = _job_id(parts[1])
            detail = job_detail(self.engine, job_id, hide_args=self.hide_args)
            if detail is None:
                raise _HttpError(404, f"no job with id {job_id}")
            return self._json(detail) if api else self._page(req, f"Job {job_id}", self._job_html(req, detail), "/jobs")
        if parts == ["audit"]:
            entries = [_plain(e) for e in jobq.audit_log(self.engine, limit=_int_arg(req, "limit", PAGE_SIZE, 1, _MAX_PAGE))]
            return self._json({"audit": entries}) if api else self._page(req, "Audit log", _audit_html(entries), "/audit")
        if parts == ["groups"]:
            after = _name_arg(req, "after")
            # The JSON twin lists every group unless asked for a page (as before paging existed).
            data = group_page(self.engine, after=after,
                              limit=_int_arg(req, "limit", None if api else GROUPS_PAGE, 1, _MAX_PAGE))
            return self._json(data) if api else self._page(req, "Groups", self._groups_html(req, data), "/groups")
        if parts == ["types"]:
            data = type_page(self.engine)
            return self._json(data) if api else self._page(req, "Types", _types_html(req, data), "/types")
        if parts == ["schedules"]:
            data = schedule_list(self.engine, hide_args=self.hide_args)
            button = (lambda name, action: self._schedule_button(req, name, action)) if self.token else None
            return self._json(data) if api else self._page(req, "Schedules", _schedules_html(req, data, button),
                                                           "/schedules")
        raise _HttpError(404, f"no page at {req.path}")

    @staticmethod
    def _known_get(parts: list[str], api: bool) -> bool:
        return parts in ([], ["jobs"], ["groups"], ["types"], ["schedules"], ["audit"]) or (len(parts) == 2 and parts[0] == "jobs")

    # ---- handlers

    def _list(self, req: _Request) -> dict[str, Any]:
        state = req.arg("state")
        if state is not None and state not in jobq.STATES:
            raise _HttpError(400, f"state must be one of {', '.join(jobq.STATES)}, got {state!r}")
        limit = _int_arg(req, "limit", PAGE_SIZE, 1, _MAX_PAGE)
        before = _int_arg(req, "before", None, 1, 2**63 - 1)
        after = _int_arg(req, "after", None, 0, 2**63 - 1) if before is None else None
        now = _db_now(self.engine) if req.arg("since") or req.arg("until") else None
        since = _time_arg(req, "since", now)
        until = _time_arg(req, "until", now)
        type_, group = _name_arg(req, "type"), _name_arg(req, "group")
        data = job_list(self.engine, state=state, type=type_, group=group, since=since,
                        until=until, before=before, limit=limit, after=after)
        data = _list_details(self.engine, data, {"state": state, "type": type_, "group": group,
                                                 "since": since, "until": until})
        data["filters"] = {"state": state, "type": type_, "group": group,
                           "since": req.arg("since"), "until": req.arg("until"), "limit": limit, "before": before,
                           "after": after}
        return data

    def _job_action(self, req: _Request, job_id: int, action: str) -> _Response:
        self._authorize(req)
        if jobq.get(self.engine, job_id) is None:
            raise _HttpError(404, f"no job with id {job_id}")
        try:
            outcome: Any = (jobq.retry(self.engine, job_id, from_root=req.arg("root") == "1") if action == "retry"
                            else jobq.cancel(self.engine, job_id))
        except jobq.InvalidJob as exc:
            raise _HttpError(409, _jq._one_line(exc)) from None
        if action == "retry":
            message = f"re-opened {', '.join(map(str, outcome))}"
        elif outcome in (*_jq._LIVE, "held"):  # asked to stop, or cancelled at its release: not cancelled yet
            message = f"job {job_id}: {_jq._cancel_outcome(outcome)}"
        elif outcome in ("done", "failed"):
            raise _HttpError(409, f"job {job_id} is {outcome} already: there is nothing to cancel")
        else:
            message = f"job {job_id}: {outcome}"
        logger.info("jobq dashboard: %s job %d: %s", action, job_id, message)
        if req.wants_json:
            return self._json({"id": job_id, "action": action, "result": outcome, "message": message})
        return _redirect(f"{req.base}/jobs/{job_id}?{urllib.parse.urlencode({'done': message})}")

    # ---- suspended jobs (jobq.signal): what one waits for, and the signal's form

    def _suspended_html(self, req: _Request, job_id: int, s: Mapping[str, Any] | None) -> str:
        """A suspended job's wait, and (with the token) a form that sends the signal it waits for."""
        if s is None:
            return ""
        out = f'<p id="suspended">suspended: {_e(s["text"])}, holding no slot</p>'
        return out + (self._signal_form(req, s["key"], job_id) if s["kind"] == "signal" and self.token else "")

    def _signal_form(self, req: _Request, key: str, job_id: int | None) -> str:
        # The key travels in the query, as a group's name does: any character round-trips.
        csrf = f'<input type="hidden" name="csrf" value="{self._csrf()}">' if self._session_ok(req) else ""
        query = _e(urllib.parse.urlencode({"key": key, **({"job": job_id} if job_id is not None else {})}))
        return (f'<form method="post" action="{_e(req.base)}/signals/send?{query}">{csrf}'
                '<label>payload (JSON) <input name="payload" id="payload" value="null"></label> '
                f'<button type="submit" id="send-signal">Send signal {_e(key)}</button></form>')

    def _signal_args(self, req: _Request) -> tuple[str, int | None]:
        key = _name_arg(req, "key")
        if not key:
            raise _HttpError(400, "name the signal: /signals/send?key=KEY")
        job = req.arg("job")
        return key, None if job is None else _job_id(job)

    def _signal_action(self, req: _Request) -> _Response:
        self._authorize(req)
        key, job = self._signal_args(req)
        raw = ((req.form().get("payload") or [""])[-1]).strip()
        try:
            sent = jobq.signal(self.engine, key, json.loads(raw) if raw else None)
        except ValueError as exc:  # bad JSON, or jobq.InvalidJob (a bad key or payload)
            raise _HttpError(400, f"payload must be JSON: {_jq._one_line(exc)}" if not isinstance(exc, jobq.JobqError)
                             else _jq._one_line(exc)) from None
        message = f"signal {key!r} " + ("sent" if sent else "was sent before: its first payload stands")
        logger.info("jobq dashboard: signal %r: %s", key, message)
        if req.wants_json:
            return self._json({"key": key, "sent": sent, "message": message})
        back = f"/jobs/{job}" if job is not None else "/"
        return _redirect(f"{req.base}{back}?{urllib.parse.urlencode({'done': message})}")

    def _offer_signal(self, req: _Request) -> _Response:
        """The page at the signal action's address (a GET): its form; signing in after a refused
        signal lands here."""
        if req.wants_json or self.token is None:
            raise _HttpError(405, "actions are POST requests")
        key, job = self._signal_args(req)
        body = f"<h1>Send signal {_e(key)}</h1>{self._signal_form(req, key, job)}"
        return self._page(req, f"Send signal {key}", body, "")

    def _group_action(self, req: _Request, group: str, action: str) -> _Response:
        self._authorize(req)
        self._set_group(group, f"group_{action}", {}, paused=action == "pause")
        message = f"group {group}: {action}d"
        if req.wants_json:
            return self._json({"group": group, "action": action, "message": message})
        return _redirect(f"{req.base}/groups?{urllib.parse.urlencode({'done': message})}")

    def _set_group(self, group: str, action: str, details: Mapping[str, Any], **change: Any) -> Any:
        """jobq.set_group(group, **change) and its audit entry (``action``, the group and
        ``details``) in one transaction: both or neither. A bad name or value is a 400."""
        def run(conn: sa.Connection, d: Any) -> Any:
            policy = jobq.set_group(conn, group, **change)
            _jq._record_audit(conn, d, "dashboard", action, {"group": policy.group_key, **details}, 1)
            return policy

        try:
            return _jq._transaction(self.engine, run)
        except (jobq.InvalidJob, jobq.ConfigError) as exc:
            raise _HttpError(400, _jq._one_line(exc)) from None

    def _group_policy_action(self, req: _Request, group: str) -> _Response:
        """``POST /groups/policy?group=NAME`` with ``weight``, ``cap``, ``rate`` (form fields;
        empty keeps the stored value, ``none`` removes a cap or rate): jobq.set_group, audited."""
        self._authorize(req)
        change, details = _policy_change(req.form())
        policy = self._set_group(group, "group_policy", details, **change)
        message = f"group {group}: {_policy_text(_plain(policy))}"
        logger.info("jobq dashboard: %s", message)
        if req.wants_json:
            return self._json({"group": group, "action": "policy", "policy": _plain(policy), "message": message})
        return _redirect(f"{req.base}/groups?{urllib.parse.urlencode({'done': message})}")

    def _offer_group_policy(self, req: _Request, group: str) -> _Response:
        """The page at the policy action's address (a GET): the group's stored policy and the
        form that changes it (prefilled with the stored values)."""
        try:
            policy = jobq.get_group(self.engine, group)
        except jobq.InvalidJob as exc:
            raise _HttpError(400, _jq._one_line(exc)) from None
        p = _plain(policy) if policy is not None else {"weight": None, "max_in_flight": None, "rate_limit": None}
        rate = p["rate_limit"]
        csrf = f'<input type="hidden" name="csrf" value="{self._csrf()}">' if self._session_ok(req) else ""
        query = _e(urllib.parse.urlencode({"group": group}))
        b = _e(req.base)
        body = (f"<h1>Policy of group {_e(group)}</h1>"
                f'<p id="group-policy">stored: {_e(_policy_text(p)) if policy is not None else "nothing (defaults)"}</p>'
                f'<form class="filters" method="post" action="{b}/groups/policy?{query}">{csrf}'
                f'<label>weight (1 or more)<input name="weight" id="weight" value="{_e(p["weight"])}"></label>'
                f'<label>cap: most in flight (a number, or none)<input name="cap" id="cap" '
                f'value="{_e("none" if p["max_in_flight"] is None else p["max_in_flight"])}"></label>'
                f'<label>rate: N/PERIOD (10/1m, 5/30s), or none<input name="rate" id="rate" '
                f'value="{_e("none" if rate is None else f"{rate[0]}/{rate[1]:g}s")}"></label>'
                '<button type="submit" id="save-policy">Save</button></form>'
                '<p class="muted">An empty field keeps the stored value; <code>none</code> removes the cap or the '
                "rate. The change applies from the next claim on every worker, and is recorded in the audit log.</p>"
                f'<p><a href="{b}/jobs?{query}">its jobs</a> &middot; <a href="{b}/groups">all groups</a></p>')
        return self._page(req, f"Policy of group {group}", body, "/groups")

    # ---- schedules: pause and resume (jobq.pause_schedule, resume_schedule), audited

    def _schedule_name(self, req: _Request) -> str:
        name = _name_arg(req, "name")
        if not name:
            raise _HttpError(400, "name the schedule: /schedules/pause?name=NAME")
        return name

    def _schedule_action(self, req: _Request, action: str) -> _Response:
        """``POST /schedules/pause?name=NAME`` (or resume): the change and its audit entry
        (``schedule_pause`` / ``schedule_resume``) in one transaction; 404 for no such schedule."""
        self._authorize(req)
        name = self._schedule_name(req)
        change = jobq.pause_schedule if action == "pause" else jobq.resume_schedule

        def run(conn: sa.Connection, d: Any) -> Any:
            info = change(conn, name)
            _jq._record_audit(conn, d, "dashboard", f"schedule_{action}", {"schedule": info.name}, 1)
            return info

        try:
            info = _jq._transaction(self.engine, run)
        except jobq.InvalidJob as exc:  # the name passed _name_arg: what is left is "no such schedule"
            raise _HttpError(404, _jq._one_line(exc)) from None
        message = f"schedule {name}: {action}d" + (f", next slot {_jq._iso(info.next_run_at)}" if action == "resume" else "")
        logger.info("jobq dashboard: %s", message)
        if req.wants_json:
            return self._json({"schedule": name, "action": action, "paused": info.paused, "message": message})
        return _redirect(f"{req.base}/schedules?{urllib.parse.urlencode({'done': message})}")

    def _offer_schedule_action(self, req: _Request, action: str) -> _Response:
        """The page at a schedule action's address (a GET): its state and the button; signing in
        after a refused action lands here."""
        name = self._schedule_name(req)
        found = [s for s in jobq.schedules(self.engine) if s.name == name]
        if not found:
            raise _HttpError(404, f"no schedule named {name!r}")
        body = (f"<h1>{action.capitalize()} schedule {_e(name)}</h1>"
                f'<p id="schedule-state">schedule {_e(name)} is {_paused(found[0].paused)}.</p>'
                f"<p>{self._schedule_button(req, name, action, action)}</p>"
                f'<p><a href="{_e(req.base)}/schedules">all schedules</a></p>')
        return self._page(req, f"{action.capitalize()} schedule {name}", body, "/schedules")

    def _schedule_button(self, req: _Request, name: str, action: str, button_id: str = "") -> str:
        csrf = f'<input type="hidden" name="csrf" value="{self._csrf()}">' if self._session_ok(req) else ""
        query = _e(urllib.parse.urlencode({"name": name}))
        ident = f' id="{button_id}"' if button_id else ""
        return (f'<form class="inline" method="post" action="{_e(req.base)}/schedules/{action}?{query}">{csrf}'
                f'<button type="submit"{ident}>{action}</button></form>')

    def _bulk_form(self, req: _Request, f: Mapping[str, Any]) -> str:
        """The jobs page's "Retry all failed" button for its filter (state failed, or any)."""
        if self.token is None or f["state"] not in (None, "failed", "cancelled"):
            return ""
        csrf = f'<input type="hidden" name="csrf" value="{self._csrf()}">' if self._session_ok(req) else ""
        q = {k: v for k, v in f.items() if v is not None and k in ("state", "type", "group", "since", "until")}
        which = f["state"] or "failed"
        return (f'<form class="inline" method="post" action="{_e(req.base)}/jobs/bulk-retry?'
                f'{_e(urllib.parse.urlencode(q))}">{csrf}<button type="submit" id="bulk-retry">Retry all {which} '
                f"jobs matching this filter</button></form>")

    def _bulk_retry(self, req: _Request, post: bool) -> _Response:
        """``POST /jobs/bulk-retry?state=&type=&group=&since=&until=&error=``: jobq.bulk("retry")
        on that filter (state: failed or cancelled, default failed), recorded in the audit log.
        A GET shows how many jobs match and the button."""
        state = req.arg("state") or "failed"
        if state not in ("failed", "cancelled"):
            raise _HttpError(400, f"bulk retry takes state failed or cancelled, got {state!r}")
        now = _db_now(self.engine) if req.arg("since") or req.arg("until") else None
        since, until = _time_arg(req, "since", now), _time_arg(req, "until", now)
        error = req.arg("error")
        kw = {"states": [state], "type": _name_arg(req, "type"), "group": _name_arg(req, "group"), "error": error or None,
              "since": since and since.replace(tzinfo=_dt.UTC), "until": until and until.replace(tzinfo=_dt.UTC)}
        if not post:
            if req.wants_json or self.token is None:
                raise _HttpError(405, "actions are POST requests")
            n = self._bulk(kw, dry_run=True).matched
            q = _e(urllib.parse.urlencode({k: v[-1] for k, v in req.query.items() if k != "csrf"}))
            return self._page(req, "Retry jobs", f'<h1>Retry jobs</h1><p id="bulk-count">{n} {_e(state)} job(s) match.</p>'
                              f'<form method="post" action="{_e(req.base)}/jobs/bulk-retry?{q}">'
                              + (f'<input type="hidden" name="csrf" value="{self._csrf()}">' if self._session_ok(req) else "")
                              + '<button type="submit" id="bulk-retry">Retry them</button></form>', "/jobs")
        self._authorize(req)
        r = self._bulk(kw, dry_run=False)
        message = f"retried {r.applied} of {r.matched} {state} job(s)" + (f", {r.skipped} skipped" if r.skipped else "")
        logger.info("jobq dashboard: bulk retry: %s", message)
        if req.wants_json:
            return self._json({"action": "retry", "result": _plain(r), "message": message})
        return _redirect(f"{req.base}/audit?{urllib.parse.urlencode({'done': message})}")

    def _bulk(self, kw: Mapping[str, Any], *, dry_run: bool) -> Any:
        try:
            return jobq.bulk(self.engine, "retry", dry_run=dry_run, actor="dashboard", **kw)
        except (jobq.ConfigError, jobq.InvalidJob) as exc:
            raise _HttpError(400, _jq._one_line(exc)) from None

    def _offer_job_action(self, req: _Request, job_id: int, action: str) -> _Response:
        """The page at a job action's address (a GET): the job, and the action's button if it
        applies. Signing in after a refused action lands here, not on a 405."""
        info = jobq.get(self.engine, job_id)
        if info is None:
            raise _HttpError(404, f"no job with id {job_id}")
        b = _e(req.base)
        with self.engine.connect() as conn:
            roots = _retry_roots(conn, job_id, info.state)
            conn.rollback()
        buttons = self._job_buttons(req, info.id, info.state, info.cancel_requested, only=action, roots=roots)
        if not buttons:
            buttons = f'<p class="muted" id="not-offered">job {job_id} is {_e(info.state)}: there is nothing to {action}.</p>'
        body = (f"<h1>{action.capitalize()} job {job_id}</h1>"
                f'<p>job {job_id} (<span id="type">{_e(info.type)}</span>, group {_e(info.group_key)}) is '
                f'{_state(info.state)}{_cancel_badge(info.state, info.cancel_requested)}</p>'
                f'<p class="why" id="why">{_e(jobq.why(self.engine, job_id))}</p>{buttons}'
                f'<p><a href="{b}/jobs/{job_id}">job {job_id}&#39;s page</a></p>')
        return self._page(req, f"{action.capitalize()} job {job_id}", body, "/jobs")

    def _offer_group_action(self, req: _Request, group: str, action: str) -> _Response:
        """The page at a group action's address (a GET): the group's pause state and the button."""
        try:
            policy = jobq.get_group(self.engine, group)
        except jobq.InvalidJob as exc:
            raise _HttpError(400, _jq._one_line(exc)) from None
        b = _e(req.base)
        paused = bool(policy and policy.paused)
        query = _e(urllib.parse.urlencode({"group": group}))
        body = (f"<h1>{action.capitalize()} group {_e(group)}</h1>"
                f'<p id="group-state">group {_e(group)} is {"paused" if paused else "not paused"}.</p>'
                f"<p>{self._group_button(req, group, action, action)}</p>"
                f'<p><a href="{b}/jobs?{query}">its jobs</a> &middot; <a href="{b}/groups">all groups</a></p>')
        return self._page(req, f"{action.capitalize()} group {group}", body, "/groups")

    def _group_button(self, req: _Request, group: str, action: str, button_id: str = "") -> str:
        # The name travels in the query: a path would arrive percent-decoded, split at any "/".
        csrf = f'<input type="hidden" name="csrf" value="{self._csrf()}">' if self._session_ok(req) else ""
        query = _e(urllib.parse.urlencode({"group": group}))
        ident = f' id="{button_id}"' if button_id else ""
        return (f'<form class="inline" method="post" action="{_e(req.base)}/groups/{action}?{query}">{csrf}'
                f'<button type="submit"{ident}>{action}</button></form>')

    def _job_buttons(self, req: _Request, job_id: int, state: str, cancel_requested: bool, only: str | None = None,
                     roots: Sequence[int] = ()) -> str:
        """The Retry and Cancel buttons that apply to a job in ``state`` (or only ``only``). A job
        kept closed by failed or cancelled upstreams (``roots``, see jobq.retry's from_root)
        gets a Retry of each root (up to 3) and a Retry from the root instead of its own Retry,
        which would be refused."""
        csrf = f'<input type="hidden" name="csrf" value="{self._csrf()}">' if self._session_ok(req) else ""
        b = _e(req.base)
        buttons = []
        if state in ("failed", "cancelled") and only in (None, "retry") and roots:
            buttons += [f'<form class="inline" method="post" action="{b}/jobs/{r}/retry">{csrf}'
                        f'<button type="submit" id="retry-{r}">Retry job {r}</button></form>' for r in roots[:3]]
            buttons.append(f'<form class="inline" method="post" action="{b}/jobs/{job_id}/retry?root=1">{csrf}'
                           '<button type="submit" id="retry-root">Retry from the root</button></form>')
        elif state in ("failed", "cancelled") and only in (None, "retry"):
            buttons.append(f'<form class="inline" method="post" action="{b}/jobs/{job_id}/retry">{csrf}'
                           '<button type="submit" id="retry">Retry</button></form>')
        if state not in jobq.TERMINAL and not cancel_requested and only in (None, "cancel"):
            buttons.append(f'<form class="inline" method="post" action="{b}/jobs/{job_id}/cancel">{csrf}'
                           '<button type="submit" id="cancel">Cancel</button></form>')
        return "<p>" + " ".join(buttons) + "</p>" if buttons else ""

    def _login(self, req: _Request, which: str) -> _Response:
        expire = f"{_SESSION_COOKIE}=; Path={req.base or '/'}; Max-Age=0; HttpOnly; SameSite=Strict"
        if which == "logout":
            if req.method != "POST":
                raise _HttpError(405, "sign out with the button (a POST request)")
            return 303, [("Location", f"{req.base}/"), ("Set-Cookie", expire), ("Content-Type", "text/plain")], b""
        if self.token is None:
            raise _HttpError(403, "this dashboard is read-only: start it with --token (or JOBQ_DASHBOARD_TOKEN) to allow actions")
        if req.method == "POST":
            given = (req.form().get("token") or [""])[-1]
            if not self._same_origin(req):
                raise _HttpError(403, "sign-in from another site refused")
            if _same_secret(given, self.token):
                cookie = (f"{_SESSION_COOKIE}={self._mac('session')}; Path={req.base or '/'}; HttpOnly; "
                          "SameSite=Strict" + ("; Secure" if req.environ.get("wsgi.url_scheme") == "https" else ""))
                back = _local_path((req.form().get("next") or [""])[-1])
                return 303, [("Location", f"{req.base}{back}"), ("Set-Cookie", cookie), ("Content-Type", "text/plain")], b""
            logger.warning("jobq dashboard: a sign-in with a wrong token")
            raise _HttpError(401, "wrong token")
        nxt = _local_path(req.arg("next"))
        body = (f'<h1>Sign in</h1><form method="post" action="{_e(req.base)}/login">'
                f'<input type="hidden" name="next" value="{_e(nxt)}">'
                '<label>Dashboard token <input type="password" name="token" id="token" autofocus></label> '
                '<button type="submit" id="signin">Sign in</button></form>'
                '<p class="muted">The token was given to <code>jobq serve --token</code> (or JOBQ_DASHBOARD_TOKEN).</p>')
        return self._page(req, "Sign in", body, "")

    def _static(self, name: str) -> _Response:
        if name == "jobq.css":
            return 200, [("Content-Type", "text/css; charset=utf-8")], _CSS.encode()
        if name == "jobq.js":
            return 200, [("Content-Type", "text/javascript; charset=utf-8")], _JS.encode()
        raise _HttpError(404, f"no file {name}")

    def _metrics(self) -> _Response:
        """Prometheus's text format from one MetricsCollector per dashboard (its counters grow
        from the dashboard's start); 501 without prometheus_client."""
        try:
            import prometheus_client
        except ImportError:
            raise _HttpError(501, "metrics need prometheus_client: pip install 'jobq[prometheus]'") from None
        if self._collector is None:
            self._collector = jobq.MetricsCollector(self.engine)
        return 200, [("Content-Type", prometheus_client.CONTENT_TYPE_LATEST)], self._collector.text()

    # ---- responses

    def _json(self, data: Any, status: int = 200) -> _Response:
        body = json.dumps(data, default=_jq._json_default, sort_keys=True).encode()
        return status, [("Content-Type", "application/json")], body

    def _error(self, req: _Request, status: int, message: str) -> _Response:
        message = self._scrub(message)
        if req.wants_json:
            return self._json({"error": message, "status": status}, status)
        body = f'<h1>{status} {_e(_REASONS.get(status, "Error"))}</h1><p class="error" id="error">{_e(message)}</p>'
        if status == 401 and self.token is not None:
            body += f'<p><a href="{_e(req.base)}/login?next={_e(urllib.parse.quote(req.here))}">Sign in</a></p>'
        _, headers, page = self._page(req, f"{status} {_REASONS.get(status, 'Error')}", body, "")
        return status, headers, page

    def _page(self, req: _Request, title: str, content: str, here: str) -> _Response:
        b = _e(req.base)
        nav = "".join(f'<a href="{b}{p}"{" class=here" if p == here else ""}>{name}</a>'
                      for p, name in (("/", "Overview"), ("/jobs", "Jobs"), ("/groups", "Groups"),
                                      ("/types", "Types"), ("/schedules", "Schedules"), ("/audit", "Audit")))
        if self.token is None:
            who = "read-only"
        elif self._session_ok(req):
            who = (f'<form class="inline" method="post" action="{b}/logout">signed in '
                   '<button type="submit">sign out</button></form>')
        else:
            who = f'<a href="{b}/login?next={_e(urllib.parse.quote(req.here))}">sign in</a>'
        live = ('<label id="live" hidden><input type="checkbox" checked> live</label>'
                if req.method == "GET" else "")
        flash = req.arg("done")
        flash_html = f'<p class="flash" id="flash">{_e(flash)}</p>' if flash else ""
        doc = (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
               f'<meta name="viewport" content="width=device-width, initial-scale=1">'
               f"<title>{_e(title)} - {_e(self.title)}</title>"
               f'<link rel="stylesheet" href="{b}/static/jobq.css"></head><body>'
               f'<header><span class="brand">{_e(self.title)}</span>{nav}<span class="right">{live} {who}</span></header>'
               f"<main>{flash_html}{content}</main>"
               f'<script src="{b}/static/jobq.js"></script></body></html>')
        return 200, [("Content-Type", "text/html; charset=utf-8")], doc.encode()

    # ---- pages

    def _overview_html(self, req: _Request, d: Mapping[str, Any]) -> str:
        b = _e(req.base)
        st = d["states"]
        hours = d["window_seconds"] / 3600
        cards = "".join(
            f'<a class="card" href="{b}/jobs?state={s}"><div class="v" id="count-{s}">{st[s]}</div>'
            f'<div class="k">{_state(s)}{" (last " + f"{hours:g}h)" if s in jobq.TERMINAL else ""}</div></a>'
            for s in jobq.STATES)
        now = d["now"]
        oldest = d["oldest_ready"]
        facts = [
            ("oldest due ready job waiting", _jq._span((now - oldest).total_seconds()) if oldest else "-"),
            ("ready: due / scheduled", f"{d['ready_due']} / {d['ready_scheduled']}"),
            ("suspended, holding no slot", f'<span id="suspended">{_e(d["suspended"])}</span>, '
                                           f'<span id="awaiting-signal">{_e(d["awaiting_signal"])}</span> waiting for a signal'),
            ("next scheduled", _ago(d["next_scheduled"], now)),
            ("expired leases awaiting reclaim", str(d["expired_leases"])),
            ("global limit (stored, every worker)", _global_html(d["global_limit"])),
            ("database time", _e(now)),
        ]
        facts_html = '<dl class="fields">' + "".join(f"<dt>{_e(k)}</dt><dd>{v}</dd>" for k, v in facts) + "</dl>"
        groups = _table(["group", "weight", "due", "ready", "in flight", "cap", "rate", "paused", "starts (1h)",
                         "served share", "weight share"],
                        ([f'<a href="{b}/jobs?group={_e(urllib.parse.quote(g["group"]))}">{_e(g["group"])}</a>',
                          _num(g["weight"]), _e(g["due"]), _e(g["ready"]), _e(g["in_flight"]), _num(g["cap"]),
                          _num(g["rate"]), _paused(g["paused"]), _e(g["starts_last_hour"]), _share(g["served_share"]),
                          _share(g["weight_share"])] for g in d["groups"][:OVERVIEW_GROUPS]), "groups")
        if len(d["groups"]) > OVERVIEW_GROUPS:
            groups += (f'<p><a id="all-groups" href="{b}/groups">all {len(d["groups"])} groups &rarr;</a> '
                       f'(the first {OVERVIEW_GROUPS} by name are above)</p>')
        holders = _table(["worker", "group", "in flight"],
                         ([_e(h["worker"]), _e(h["group"]), _e(h["in_flight"])] for h in d["holders"]))
        fails = _table(["job", "type", "finished", "error"],
                       ([f'<a href="{b}/jobs/{f["id"]}">{f["id"]}</a>', _e(f["type"]), _ago(f["finished_at"], now),
                         _e(_last_line(f["error"]))] for f in d["recent_failures"]))
        return (f"<h1>Overview</h1><div class=cards>{cards}</div>"
                f"<h2>Finished per 5 minutes, last hour</h2>{_chart_svg(d['chart'])}"
                f'<p class="muted">{_state("done")} {_state("failed")} {_state("cancelled")}</p>'
                f"<h2>Queue</h2>{facts_html}<h2>Groups</h2>{groups}"
                '<p class="muted">Weight: stored with set_group, else the largest among the group\'s due jobs. '
                "Cap, rate and pause: the group's stored policy; a worker's own --cap and --rate apply too. "
                "Served share: the group's part of the job starts in the last hour; weight share: its weight's "
                "part among the groups with work.</p>"
                f"<h2>Who holds the slots</h2>{holders}<h2>Recent failures</h2>{fails}")

    def _jobs_html(self, req: _Request, d: Mapping[str, Any]) -> str:
        b = _e(req.base)
        f = d["filters"]
        opts = "".join(f'<option value="{s}"{" selected" if f["state"] == s else ""}>{s}</option>' for s in jobq.STATES)
        form = (f'<form class="filters" method="get" action="{b}/jobs">'
                f'<label>state<select name="state"><option value="">any</option>{opts}</select></label>'
                f'<label>type<input name="type" value="{_e(f["type"])}"></label>'
                f'<label>group<input name="group" value="{_e(f["group"])}"></label>'
                f'<label>created since<input name="since" placeholder="1h or 2026-12-01T09:00:00Z" value="{_e(f["since"])}"></label>'
                f'<label>created before<input name="until" placeholder="ISO time or 30m" value="{_e(f["until"])}"></label>'
                '<button type="submit">Filter</button></form>')
        table = _job_rows_table(b, d["jobs"], d["now"])
        pager = _jobs_pager(b, d, f)
        return f"<h1>Jobs</h1>{form}{self._bulk_form(req, f)}{_total_line(d)}{table}{pager}"

    def _job_html(self, req: _Request, d: Mapping[str, Any]) -> str:
        b = _e(req.base)
        jid = d["id"]
        now = d.get("now")

        def links(ids: Sequence[int]) -> str:
            return ", ".join(f'<a href="{b}/jobs/{i}">{i}</a>' for i in ids) or '<span class="muted">none</span>'

        fields = [("state", _state(d["state"])), ("group", _e(d["group_key"])), ("weight", _e(d["weight"])),
                  ("attempts", f'{d["attempts"]} of {d["max_attempts"]}'), ("container", "yes" if d["is_container"] else "no"),
                  ("parent", links([d["parent_id"]]) if d["parent_id"] else "-"), ("upstreams", links(d["depends_on"])),
                  ("dependents", links(d["dependents"])), ("children", links(d["children"])),
                  ("run after", _ago(d["run_after"], now)), ("created", _ago(d["created_at"], now)),
                  ("started", _ago(d["started_at"], now)), ("finished", _ago(d["finished_at"], now)),
                  ("ran", _took(d["started_at"], d["finished_at"])), ("timeout", _num(d["timeout"])),
                  ("lease owner", _e(d["lease_owner"]) or "-"), ("lease expires", _ago(d["lease_expires"], now)),
                  ("heartbeat", _ago(d["heartbeat_at"], now)), ("cancel requested", "yes" if d["cancel_requested"] else "no")]
        fields.insert(3, ("priority", _e(d["priority"])))
        if d["progress"] is not None:
            fields.append(("progress", f'<span id="progress">{_progress(d["progress"])}</span>'))
        actions = "" if self.token is None else self._job_buttons(req, jid, d["state"], d["cancel_requested"],
                                                                  roots=d["retry_roots"])
        actions += self._suspended_html(req, jid, d["suspended"])
        args = ('<p class="muted" id="args">hidden (the dashboard runs with --hide-args)</p>' if d["args_hidden"]
                else f'<pre id="args">{_e(_json_text(d["args"]))}</pre>')
        parts = [f'<h1>Job {jid} <span id="type">{_e(d["type"])}</span> {_state(d["state"])}'
                 f'{_cancel_badge(d["state"], d["cancel_requested"])}</h1>',
                 f'<p class="why" id="why">{_e(d["why"])}</p>', actions,
                 f'<h2>Neighbourhood</h2><div class="dagbox">{_dag_svg(d["graph"]["nodes"], d["graph"]["edges"], jid, req.base)}</div>',
                 f'<h2>Fields</h2><dl class="fields">{"".join(f"<dt>{_e(k)}</dt><dd>{v}</dd>" for k, v in fields)}</dl>',
                 f"<h2>Arguments</h2>{args}"]
        if d["result"] is not None or d["state"] == "done":
            parts.append(f'<h2>Result</h2><pre id="result">{_e(_json_text(d["result"]))}</pre>')
        if d["error"]:
            parts.append(f'<h2>Last error</h2><pre id="error">{_e(d["error"])}</pre>')
        if d["checkpoint"] is not None:
            parts.append(f'<h2>Checkpoint</h2><pre id="checkpoint">{_e(_json_text(d["checkpoint"]))}</pre>')
        history = d["attempt_history"]
        if history is not None:
            parts.append("<h2>Attempts</h2>" + _attempts_table(history, now))
        parts.append(_log_html(d["log"]))
        return "".join(parts)

    def _groups_html(self, req: _Request, d: Mapping[str, Any]) -> str:
        b = _e(req.base)
        can_act = self.token is not None and d["policy_stored"]
        rows = []
        for g in d["groups"]:
            name = urllib.parse.quote(g["group"], safe="")
            button = (self._group_button(req, g["group"], "resume" if g["paused"] else "pause")
                      + f' <a class="edit" href="{b}/groups/policy?{_e(urllib.parse.urlencode({"group": g["group"]}))}">'
                      "edit policy</a>") if can_act else ""
            rows.append([f'<a href="{b}/jobs?group={_e(name)}">{_e(g["group"])}</a>', _num(g["weight"]), _e(g["due"]),
                         _e(g["ready"]), _e(g["in_flight"]), _num(g["cap"]), _num(g["rate"]), _paused(g["paused"]),
                         _e(g["starts_last_hour"]), _share(g["served_share"]), _share(g["weight_share"])]
                        + ([button] if can_act else []))
        note = ('<p class="muted" id="policy-note">Weight, cap, rate and pause are stored per group with '
                "<code>jobq group KEY</code> (<code>jobq.set_group</code>); a worker's own <code>--cap</code> and "
                "<code>--rate</code> apply too, and the stricter limit wins.</p>")
        table = _table(["group", "weight", "due", "ready", "in flight", "cap", "rate", "paused", "starts (1h)",
                        "served share", "weight share"] + (["action"] if can_act else []), rows, "groups")
        pager = f'<p class="muted">{len(d["groups"])} of {d["groups_total"]} groups'
        if d["next_after"] is not None:
            q = {"after": d["next_after"]} | ({"limit": req.arg("limit")} if req.arg("limit") else {})
            pager += f' &middot; <a id="next-groups" href="{b}/groups?{_e(urllib.parse.urlencode(q))}">next groups &rarr;</a>'
        if req.arg("after") is not None:
            pager += f' &middot; <a href="{b}/groups">&larr; first</a>'
        limit = (f'<p id="global-limits">Global limit over all groups (stored, every worker): '
                 f'{_global_html(d["global_limit"])}</p>')
        return f"<h1>Groups</h1>{limit}{note}{table}{pager}</p>"


def _job_rows_table(b: str, jobs: Sequence[Mapping[str, Any]], now: _dt.datetime | None) -> str:
    """The job list's table: times relative to the database's ``now`` (absolute in the title),
    how long the last attempt ran, and the last error's first line."""
    def row(r: Mapping[str, Any]) -> list[str]:
        ran = (_took(r.get("started_at"), r["finished_at"]) if r["finished_at"] is not None
               else f"{_took(r.get('started_at'), now)} so far" if r["state"] == "running" and r.get("started_at") else "-")
        return [f'<a href="{b}/jobs/{r["id"]}">{r["id"]}</a>', _e(r["type"]), _state(r["state"]),
                f'<a href="{b}/jobs?group={_e(urllib.parse.quote(r["group_key"]))}">{_e(r["group_key"])}</a>',
                _num(r.get("priority")), f'{r["attempts"]}/{r["max_attempts"]}', _ago(r["run_after"], now),
                _ago(r["created_at"], now), _ago(r["finished_at"], now), ran, _error_cell(r.get("error"))]
    return _table(["id", "type", "state", "group", "priority", "attempts", "run after", "created", "finished",
                   "ran", "last error"], (row(r) for r in jobs), "jobs")


def _jobs_pager(b: str, d: Mapping[str, Any], f: Mapping[str, Any]) -> str:
    """The job list's links: newest, newer (the page above), older (the page below)."""
    keep = {k: v for k, v in f.items() if v is not None and k not in ("before", "after")}

    def link(link_id: str, text: str, extra: Mapping[str, Any]) -> str:
        return f'<a id="{link_id}" href="{b}/jobs?{_e(urllib.parse.urlencode(keep | dict(extra)))}">{text}</a>'

    links = []
    if f["before"] is not None or f.get("after") is not None:
        links.append(link("newest", "&larr;&larr; newest", {}))
    if d.get("newer_after") is not None:
        links.append(link("newer", "&larr; newer jobs", {"after": d["newer_after"]}))
    if d["next_before"] is not None:
        links.append(link("older", "older jobs &rarr;", {"before": d["next_before"]}))
    return f'<p class="pager">{" &middot; ".join(links)}</p>' if links else ""


def _total_line(d: Mapping[str, Any]) -> str:
    """ "Showing 50 of 1,234 matching jobs" above a job list."""
    total = f'{d["total"]:,}{"+" if d["total_capped"] else ""}'
    return f'<p class="muted" id="total">showing {len(d["jobs"])} of {total} matching jobs, newest first</p>'


def _healthz(engine: sa.Engine) -> _Response:
    """/healthz: 200 and a small JSON when the database answers with the schema this jobq
    expects; 503 and one line of plain text saying what is wrong otherwise."""
    def fail(reason: str) -> _Response:
        return 503, [("Content-Type", "text/plain; charset=utf-8")], reason.encode() + b"\n"

    try:
        with engine.connect() as conn:
            found = conn.execute(_jq._q_schema_version()).scalar()
            conn.rollback()
    except sa.exc.SQLAlchemyError as exc:
        return fail(f"database unreachable or without jobq's tables ({type(exc).__name__})")
    if found is None or int(found) != jobq.SCHEMA_VERSION:
        return fail(f"schema version {found}, this jobq needs {jobq.SCHEMA_VERSION}: "
                    + ("run jobq init" if found is None or int(found) < jobq.SCHEMA_VERSION else "upgrade jobq"))
    body = json.dumps({"status": "ok", "schema_version": int(found)}).encode()
    return 200, [("Content-Type", "application/json")], body


def schedule_list(engine: sa.Engine, *, hide_args: bool = False) -> dict[str, Any]:
    """The recurring jobs (jobq.schedules), as the Schedules page and /api/schedules show them."""
    found = jobq.schedules(engine) if sa.inspect(engine).has_table("jobq_schedules") else []
    return {"schedules": [{**_plain(s), "every": None if s.every is None else s.every.total_seconds()}
                          | ({"args": None} if hide_args else {}) for s in found]}


def _schedules_html(req: _Request, d: Mapping[str, Any], button: Callable[[str, str], str] | None = None) -> str:
    """The Schedules page; ``button(name, action)`` draws a schedule's pause or resume button
    (None on a read-only dashboard: no action column)."""
    b = _e(req.base)
    rows = ([_e(s["name"]), f'<a href="{b}/jobs?type={_e(urllib.parse.quote(s["type"]))}">{_e(s["type"])}</a>',
             _e(s["group_key"]), _e(f"cron {s['cron']} (UTC)" if s["cron"] else f"every {_jq._span(s['every'])}"),
             _e(s["next_run_at"]), _e(s["last_run_at"] or "-"),
             f'<a href="{b}/jobs/{int(s["last_job_id"])}">{int(s["last_job_id"])}</a>' if s["last_job_id"] else "-",
             _e(s["runs"]), _paused(s["paused"])]
            + ([button(s["name"], "resume" if s["paused"] else "pause")] if button else []) for s in d["schedules"])
    table = _table(["name", "type", "group", "timing", "next slot", "last slot", "last job", "runs", "paused"]
                   + (["action"] if button else []), rows, "schedules")
    return ('<h1>Schedules</h1><p class="muted">Recurring jobs: each slot is enqueued once by the first worker '
            "that sees it due; after downtime, one job for the latest missed slot. A resumed schedule starts from "
            "its first slot after now (the slots that fell while it was paused are skipped). Pause and resume here "
            "with the token (recorded in the audit log), or with <code>jobq schedule NAME --pause|--resume|--remove"
            "</code>.</p>" + table)


def _types_html(req: _Request, d: Mapping[str, Any]) -> str:
    """The per-type page: one row per type, escaped, with the windows' columns side by side."""
    b = _e(req.base)

    def rate(v: float | None) -> str:
        return "-" if v is None else f"{v * 100:.1f}%"

    def secs(v: float | None) -> str:
        return "-" if v is None else _duration(v)

    labels = [w["name"] for w in d["windows"]]
    rows = []
    for t in d["types"]:
        q = _e(urllib.parse.quote(t["type"]))
        cells = [f'<a href="{b}/jobs?type={q}">{_e(t["type"])}</a>',
                 f'<a href="{b}/jobs?type={q}&amp;state=ready">{_e(t["ready"])}</a>', _e(t["running"])]
        for label in labels:
            w = t[label]
            failed = (f' (<a href="{b}/jobs?type={q}&amp;state=failed">{_e(w["failed"])} failed</a>)'
                      if w["failed"] else "")
            cells += [f"{_e(w['finished'])}{failed}", rate(w["failure_rate"]), secs(w["runtime_p50"]),
                      secs(w["runtime_p95"])]
        rows.append(cells)
    heads = ["type", "ready", "running"] + [f"{h} ({label})" for label in labels
                                            for h in ("finished", "failure rate", "median run", "p95 run")]
    notes = [f'<p class="muted" id="partial-{_e(w["name"])}">The {_e(w["name"])} columns summarise the newest '
             f'{d["sample"]:,} finished jobs (since {_ago(w["covers_since"], d["now"])}), not the whole window.</p>'
             for w in d["windows"] if not w["complete"]]
    return ('<h1>Types</h1><p class="muted">Per job type: ready and running (leased or running) now; over the last '
            f"{' and '.join(_e(x) for x in labels)}, the jobs that finished (done, failed or cancelled), the failure "
            "rate (failed over done and failed: a cancelled job is neither), and how long their last attempt ran "
            "(median and 95th percentile, jobs that started).</p>" + "".join(notes) + _table(heads, rows, "types"))


def _audit_html(entries: Sequence[Mapping[str, Any]]) -> str:
    """The audit log page: bulk actions and the dashboard's changes, newest first, escaped."""
    rows = ([_e(x["id"]), _e(x["at"]), _e(x["actor"]), _e(x["action"]), _e(x["count"]),
             _e(json.dumps({k: v for k, v in x["filter"].items() if v is not None}, sort_keys=True))] for x in entries)
    return ("<h1>Audit log</h1><p class=muted>Bulk actions (retry, cancel, prune by filter; jobs: how many they "
            "applied to) and the dashboard's changes to groups and schedules (what was set), newest first.</p>"
            + _table(["id", "at", "who", "action", "jobs", "filter or change"], rows, "audit"))


def _log_html(lines: Sequence[Mapping[str, Any]]) -> str:
    """The job page's log section: ctx.log lines, oldest first, escaped."""
    if not lines:
        return '<h2>Log</h2><p class="muted" id="log">no log lines</p>'
    rows = ([_e(x["seq"]), _e(x["attempt"]), _e(x["at"]), f'<pre>{_e(x["message"])}</pre>',
             _e(_json_text(x["fields"])) if x["fields"] else ""] for x in lines)
    return '<h2>Log</h2><div id="log">' + _table(["#", "attempt", "at", "message", "fields"], rows) + "</div>"


def _global_html(g: Mapping[str, Any]) -> str:
    """The stored global limits in words, escaped; the element's id is ``global-limit``."""
    rate = g["rate_limit"]
    text = (f'cap {"none" if g["max_in_flight"] is None else g["max_in_flight"]}, '
            f'rate {"none" if rate is None else f"{rate[0]}/{rate[1]:g}s"}')
    if g["max_in_flight"] is None:
        text += " (each worker's max_concurrency caps what it runs)"
    return (f'<span id="global-limit">{_e(text)}</span> <span class="muted">(<code>jobq limit</code>, '
            "<code>jobq.set_limit</code>)</span>")


# ---- request arguments


def _ascii_int(text: str) -> int | None:
    """The number ASCII digits spell, or None: str.isdigit() is also true for "²" (which int()
    refuses) and "٣" (which it reads), and int() refuses more than 4,300 digits."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 40 else None


def _job_id(text: str) -> int:
    n = _ascii_int(text)
    if n is None or not 1 <= n < 2**63:
        raise _HttpError(400, f"a job id is a positive whole number, got {text[:40]!r}")
    return n


def _int_arg(req: _Request, name: str, default: int | None, lo: int, hi: int) -> Any:
    v = req.arg(name)
    if v is None:
        return default
    n = _ascii_int(v)
    if n is None or not lo <= n <= hi:
        raise _HttpError(400, f"{name} must be a whole number from {lo} to {hi}, got {v[:40]!r}")
    return n


def _name_arg(req: _Request, name: str) -> str | None:
    """A name to filter by: at most MAX_NAME_LENGTH characters and no control character (no
    name holds one, and PostgreSQL refuses NUL in a parameter)."""
    v = req.arg(name)
    if v is not None and len(v) > jobq.MAX_NAME_LENGTH:
        raise _HttpError(400, f"{name} is at most {jobq.MAX_NAME_LENGTH} characters")
    if v is not None and _CONTROL.search(v):
        raise _HttpError(400, f"{name} holds a control character, which no name holds: {v[:40]!r}")
    return v


def _time_arg(req: _Request, name: str, now: _dt.datetime | None) -> _dt.datetime | None:
    """A duration ago (30m, 12h, 7d) or an ISO 8601 time with a zone; naive UTC like the table."""
    v = req.arg(name)
    if v is None or now is None:
        return None
    try:
        if v[-1:] in _jq._UNITS and v[:-1].replace(".", "", 1).isdigit():
            return now - _jq._duration(v)
        return _jq._run_after(v).replace(tzinfo=None)
    except Exception:
        raise _HttpError(400, f"{name} must be a duration like 30m, 12h or 7d, or an ISO 8601 time like "
                              f"2026-12-01T09:00:00Z, got {v[:40]!r}") from None


def _group_name(req: _Request, parts: list[str]) -> str:
    """The group a group action names: ``/groups/pause?group=NAME`` (what the pages post: a
    query is never decoded by the server), or ``/groups/NAME/pause`` for scripts, where the
    server has decoded ``%2F`` already: everything between ``groups/`` and the action."""
    if len(parts) == 2:
        values = req.query.get("group")
        if not values:
            raise _HttpError(400, f"name the group: /groups/{parts[1]}?group=NAME")
        return values[-1]
    found = re.fullmatch(r"/*(?:api/+)?groups/(.+)/(?:pause|resume|policy)/*", req.path, re.DOTALL)
    assert found is not None  # parts[0] == "groups" and parts[-1] is the action
    return found.group(1)


#: What the policy form's cap and rate take to remove that limit.
_NONE_WORDS = ("none", "unlimited")


def _policy_change(form: Mapping[str, list[str]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The group policy form's fields as jobq.set_group's arguments, and the same for the audit
    log: ``weight`` (a whole number), ``cap`` (a whole number, or none) and ``rate`` (N/PERIOD,
    or none); an empty field keeps the stored value. Anything else is a 400 naming the field;
    set_group checks the ranges (and refuses before writing anything)."""
    change: dict[str, Any] = {}
    details: dict[str, Any] = {}

    def field(name: str) -> str:
        v = ((form.get(name) or [""])[-1]).strip()
        if len(v) > 40 or _CONTROL.search(v) or not v.isascii():
            raise _HttpError(400, f"{name}: at most 40 ASCII characters, no control character, got {v[:40]!r}")
        return v

    weight, cap, rate = field("weight"), field("cap"), field("rate")
    if weight:
        n = _ascii_int(weight)
        if n is None:
            raise _HttpError(400, f"weight must be a whole number of at least 1, got {weight!r}")
        change["weight"] = details["weight"] = n
    if cap.lower() in _NONE_WORDS:
        change["max_in_flight"], details["max_in_flight"] = jobq.UNLIMITED, "none"
    elif cap:
        n = _ascii_int(cap)
        if n is None:
            raise _HttpError(400, f"cap must be a whole number of at least 1, or none, got {cap!r}")
        change["max_in_flight"] = details["max_in_flight"] = n
    if rate.lower() in _NONE_WORDS:
        change["rate_limit"], details["rate_limit"] = jobq.UNLIMITED, "none"
    elif rate:
        if not re.fullmatch(r"[0-9]+/[0-9]+(?:\.[0-9]+)?[a-z]*", rate):
            raise _HttpError(400, f"rate must look like N/PERIOD (10/1m, 5/30s, 100/1h), or none, got {rate!r}")
        change["rate_limit"] = details["rate_limit"] = rate
    if not change:
        raise _HttpError(400, "nothing to change: give a weight, a cap or a rate")
    return change, details


def _policy_text(p: Mapping[str, Any]) -> str:
    """A stored group policy in words: "weight 3, cap 2, rate 10/60s" (none where unset)."""
    rate = p.get("rate_limit")
    return (f'weight {"none" if p.get("weight") is None else p["weight"]}, '
            f'cap {"none" if p.get("max_in_flight") is None else p["max_in_flight"]}, '
            f'rate {"none" if rate is None else f"{rate[0]}/{rate[1]:g}s"}')


def _cancel_badge(state: str, cancel_requested: bool) -> str:
    """A live job's "cancel requested" mark: its handler is asked to stop, the job is not cancelled yet."""
    if not cancel_requested or state in jobq.TERMINAL:
        return ""
    return ' <span class="state s-cancelled" id="cancel-requested">cancel requested</span>'


def _last_line(error: str | None) -> str:
    """The line of an error that says what went wrong (a traceback's last), for tables."""
    lines = [ln.strip() for ln in (error or "").splitlines() if ln.strip()]
    return _jq._one_line(lines[-1]) if lines else ""


def _redirect(location: str) -> _Response:
    return 303, [("Location", location), ("Content-Type", "text/plain")], b""


def _local_path(value: str | None) -> str:
    """``value`` as a path on this site to send a browser to, else "/": never another host
    (``//host``, ``/\\host``: browsers read a backslash as a slash, and drop tabs and newlines
    from URLs), a scheme, or a control character; what is not ASCII is percent-encoded."""
    if not value or not value.startswith("/") or value.startswith("//") or "\\" in value or _CONTROL.search(value):
        return "/"
    try:
        parts = urllib.parse.urlsplit(value)
    except ValueError:
        return "/"
    if parts.scheme or parts.netloc or parts.path in ("/logout", "/login"):  # POST-only, or a loop
        return "/"
    return urllib.parse.quote(value, safe="/%:@!$&'()*+,;=~?#")


def _same_secret(given: str, expected: str) -> bool:
    """Compare a secret in constant time; hmac.compare_digest refuses str with non-ASCII text."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode())


def _header_value(value: str) -> str:
    """A header value as printable ASCII. Every value is built so already (a redirect's target
    through _local_path, the prefix quoted); this is the last check before the server writes
    it: anything else, a CR or LF above all, is percent-encoded and logged."""
    if value.isascii() and value.isprintable():
        return value
    logger.error("jobq dashboard: a header value held a control or non-ASCII character: %r", value)
    return re.sub(r"[^\x20-\x7e]", lambda m: urllib.parse.quote(m.group().encode("utf-8", "surrogatepass")), value)


# =============================================================================================
# Entry points
# =============================================================================================


def app(engine: sa.Engine, *, token: str | None = None, hide_args: bool = False, title: str = "jobq") -> Dashboard:
    """The dashboard as a WSGI callable, to mount under any WSGI server or framework.

    Args:
        engine: the queue's Engine.
        token: the secret that allows actions (at least 8 characters); None: read-only.
        hide_args: never show job arguments.
        title: the name in the page header.

    Returns:
        A :class:`Dashboard` (``app(environ, start_response)``).

    Raises:
        ValueError: a token shorter than 8 characters.
    """
    return Dashboard(engine, token=token, hide_args=hide_args, title=title)


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: Query parameters whose values the request log never shows (matched in the name, any case).
_SECRET_PARAM = re.compile(r"token|pass|secret|csrf|auth|session|api.?key|signature", re.IGNORECASE)
_SECRET_VALUE = re.compile(r"([\w.-]*(?:token|pass|secret|csrf|auth|session|api.?key|signature)[\w.-]*)=[^&\s'\"]*",
                           re.IGNORECASE)


def _request_target(environ: Mapping[str, Any]) -> str:
    """The path and query of a request for the log: percent-encoded (no control character can
    split the line), with the value of every parameter whose name suggests a secret as ``***``."""
    path = urllib.parse.quote(_wsgi_text(environ.get("SCRIPT_NAME")) + (_wsgi_text(environ.get("PATH_INFO")) or "/"),
                              safe="/:@!$&'()*+,;=~")
    pairs = urllib.parse.parse_qsl(_wsgi_text(environ.get("QUERY_STRING")), keep_blank_values=True)
    query = urllib.parse.urlencode([(k, "***" if _SECRET_PARAM.search(k) else v) for k, v in pairs], safe="*")
    return path + (f"?{query}" if query else "")


def _access_log(wsgi: Dashboard) -> Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]:
    """``wsgi`` writing one INFO line per request to :data:`access_logger`: client address,
    method, path and query (secrets masked, see :func:`_request_target`), status and the time
    to the response in milliseconds. The request's body, headers and cookies are never logged,
    and the dashboard's token and the database URL's password are masked wherever they appear."""
    secrets = [*wsgi._secrets, *([wsgi.token] if wsgi.token else [])]

    def logged(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        start = time.perf_counter()
        status: list[int] = []

        def recording(line: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            status.append(int(line.split()[0]))
            return start_response(line, headers, exc_info) if exc_info is not None else start_response(line, headers)

        try:
            return wsgi(environ, recording)
        finally:
            ms = (time.perf_counter() - start) * 1000
            method = _CONTROL.sub("?", str(environ.get("REQUEST_METHOD", "-")))[:16]
            target = _jq._scrub(_request_target(environ), secrets)
            client = str(environ.get("REMOTE_ADDR", "-"))
            code = status[-1] if status else 500
            access_logger.info("%s %s %s %d %.1fms", client, method, target, code, ms,
                               extra={"action": "http_request", "client": client, "method": method, "path": target,
                                      "status": code, "duration_ms": round(ms, 1)})

    return logged


def serve(engine: sa.Engine, *, host: str = "127.0.0.1", port: int = 8080, token: str | None = None,
          hide_args: bool = False, ready: Callable[[str], None] | None = None) -> None:
    """Serve the dashboard with the standard library's threaded WSGI server until interrupted.

    Args:
        engine: the queue's Engine.
        host: the address to bind (127.0.0.1 by default: this machine only).
        port: the port (0: any free port).
        token: allow actions with this token; None: read-only.
        hide_args: never show job arguments.
        ready: called with the URL once the server listens (tests, scripts).
    """
    import socketserver
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    class _Server(socketserver.ThreadingMixIn, WSGIServer):
        daemon_threads = True

    class _Quiet(WSGIRequestHandler):
        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            pass  # _access_log writes the request's line, without its query's secrets

        def log_message(self, format: str, *args: Any) -> None:  # a malformed request: its line may hold anything
            text = _SECRET_VALUE.sub(r"\1=***", _jq._one_line(format % args))
            logger.info("%s %s", self.address_string(), _jq._scrub(text, secrets))

    dashboard = app(engine, token=token, hide_args=hide_args)
    secrets = [*dashboard._secrets, *([token] if token else [])]
    wsgi = _access_log(dashboard)
    httpd = make_server(host, port, wsgi, server_class=_Server, handler_class=_Quiet)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{httpd.server_port}/"
    if not _is_loopback(host) and not token:
        print(f"jobq: warning: the dashboard is bound to {host}, reachable from other machines, without a token: "
              "anyone who reaches it can read every job (actions stay off); bind 127.0.0.1 or put it behind "
              "your own authentication", file=sys.stderr, flush=True)
    elif not _is_loopback(host):
        print(f"jobq: warning: the dashboard is bound to {host} over plain HTTP: the token and the session cookie "
              "cross the network in clear; put it behind TLS", file=sys.stderr, flush=True)
    mode = "actions allowed with the token" if token else "read-only (no token)"
    print(f"jobq dashboard on {url} ({mode}); Ctrl-C stops it", file=sys.stderr, flush=True)
    if ready is not None:
        ready(url)
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()

