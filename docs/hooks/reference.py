"""MkDocs hook: the CLI reference from jobq's argument parser, and a check that the API
reference documents every public name.

``reference/cli.md`` is generated at build time from ``jobq.cli._parser()``: the top-level
``--help`` and every subcommand's, so a flag added to the parser is in the docs without an
edit. The API pages under ``reference/api/`` must name every entry of ``jobq.__all__`` in a
``::: jobq.NAME`` directive; a public name without one fails the build.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

CLI_PAGE = "reference/cli.md"
SCHEMA_PAGE = "reference/schema.md"
#: What each table is for; a table missing here fails the build (a new table needs a line).
TABLE_PURPOSE = {
    "jobs": "One row per job: its type, args, result, state, group, schedule, lease and counters.",
    "job_deps": "The DAG's edges: `job_id` waits for `depends_on_id`.",
    "jobq_meta": "The schema version (`jobq init` and `create_schema` read and upgrade it).",
    "jobq_slots": "Slots still held by handlers a worker had to abandon (a timed-out thread); "
                  "the caps count them until they expire.",
    "jobq_starts": "One row per group per claim, counting the jobs it started: fair-share turns and "
                   "rate limits. Swept after `START_LOG_RETENTION`.",
    "jobq_attempts": "One row per ended attempt: who ran it, when, the outcome and the error.",
    "jobq_groups": "Each group's stored policy (weight, cap, rate, paused) and the global limits.",
    "jobq_signals": "One row per signal key: the first signal's payload and time (`sent_at` is empty "
                    "while the key is only awaited). Read by `ctx.wait_for`.",
    "jobq_waits": "What each job's handler waited for: signal waits with their timeout, relative "
                  "sleeps with their end, the snooze count; kept for the job's life.",
    "jobq_schedules": "One row per recurring job (`jobq.schedule`): its interval or cron expression, "
                      "the job it enqueues, its next and last slot, and the revision its firing is fenced on.",
    "jobq_logs": "The lines handlers stored with `ctx.log`: job, line number, attempt, time, message, "
                 "fields; at most `LOG_LINES_PER_JOB` per job, deleted with the job.",
    "jobq_retention": "How long finished jobs are kept, per terminal state: one global row and "
                      "optional per-group rows (`set_retention`).",
    "jobq_audit": "One row per bulk action (retry, cancel, prune by filter): who, what, the filter, "
                  "how many jobs, when.",
}
API_PREFIX = "reference/api/"


def _help(parser: argparse.ArgumentParser) -> str:
    # A fixed width: the page must not depend on the terminal of whoever builds it.
    os.environ["COLUMNS"] = "100"
    return parser.format_help().rstrip()


def cli_reference() -> str:
    """The CLI reference page, as Markdown."""
    from jobq.cli import _parser

    parser = _parser()
    parser.prog = "jobq"
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = [
        "# Command line reference",
        "",
        "Generated from the argument parser (`jobq.cli`) when the site is built: this is exactly",
        "what `jobq --help` and `jobq COMMAND --help` print. The [command line guide](../guides/cli.md)",
        "shows the commands at work.",
        "",
        "## jobq",
        "",
        "```text",
        _help(parser),
        "```",
    ]
    for name, sub in subs.choices.items():
        out += ["", f"## jobq {name}", "", "```text", _help(sub), "```"]
    return "\n".join(out) + "\n"


def schema_reference() -> str:
    """The schema reference page, as Markdown, from jobq's SQLAlchemy metadata."""
    import jobq

    out = [
        "# Schema and tables",
        "",
        f"Generated from jobq's SQLAlchemy metadata (schema version {jobq.SCHEMA_VERSION}). "
        "`jobq init` or `jobq.create_schema(engine)` creates these tables and upgrades older ones "
        "([migrations](../guides/migrations.md)). Column types are SQLAlchemy's; each engine maps "
        "them (see [engines](engines.md)).",
    ]
    tables = jobq.Base.metadata.sorted_tables
    missing = sorted({t.name for t in tables} - TABLE_PURPOSE.keys())
    if missing:
        raise PluginError(f"docs/hooks/reference.py: TABLE_PURPOSE has no line for {missing}")
    for t in sorted(tables, key=lambda t: list(TABLE_PURPOSE).index(t.name)):
        out += ["", f"## {t.name}", "", TABLE_PURPOSE[t.name], "", "| column | type | null | key |", "|---|---|---|---|"]
        for c in t.columns:
            kind = str(c.type.compile()) if not hasattr(c.type, "impl") else type(c.type).__name__
            out.append(f"| `{c.name}` | `{kind}` | {'yes' if c.nullable else 'no'} | {'primary' if c.primary_key else ''} |")
        idx = sorted(t.indexes, key=lambda i: i.name or "")
        if idx:
            out += ["", "Indexes: " + "; ".join(f"`{i.name}` ({', '.join(c.name for c in i.columns) or 'expression'})"
                                                for i in idx) + "."]
    return "\n".join(out) + "\n"


#: The engine facts shown in reference/engines.md, with what each means.
ENGINE_FACTS = {
    "returning": "INSERT/UPDATE ... RETURNING",
    "partial_indexes": "partial indexes (CREATE INDEX ... WHERE)",
    "row_locks": "row locks (FOR UPDATE SKIP LOCKED); else one writer at a time",
    "key_share_locks": "FOR NO KEY UPDATE / FOR KEY SHARE lock strengths",
    "array_params": "one bound array for IN lists",
    "dml_ctes": "data-modifying statements inside WITH",
    "notify_listen": "LISTEN/NOTIFY (Worker(listen=True))",
    "local_clock": "the database clock is this machine's clock",
    "isolation": "isolation level of jobq's transactions",
    "isolation_stmt": "isolation set by a statement in each transaction",
    "json_max_depth": "deepest JSON nesting stored",
}
ENGINE_MARKER = "<!-- engine-facts -->"


def engine_facts() -> str:
    """The capability table of reference/engines.md, from jobq's per-family engine facts."""
    from jobq.engines import _ENGINES, _family_facts

    families = [e.family for e in _ENGINES]
    versions = {e.family: ".".join(map(str, e.min_version)) for e in _ENGINES}
    facts = {f: _family_facts(f) for f in families}

    def cell(value: Any) -> str:
        return "yes" if value is True else "no" if value is False else "–" if value is None else f"`{value}`"

    out = ["| fact | " + " | ".join(families) + " |", "|---" * (len(families) + 1) + "|",
           "| oldest version | " + " | ".join(versions[f] for f in families) + " |"]
    for name, text in ENGINE_FACTS.items():
        out.append(f"| {text} (`{name}`) | " + " | ".join(cell(getattr(facts[f], name)) for f in families) + " |")
    return "\n".join(out)


CLAIM_SQL_MARKER = "<!-- claim-sql -->"


def claim_sql() -> str:
    """The claim's three core statements compiled for each engine, exactly as jobq builds them
    (jobq/claim_sql.py), so the page cannot drift from the code."""
    from sqlalchemy.dialects import mysql, postgresql, sqlite

    from jobq import claim_sql as cs
    from jobq.drivers import _capabilities

    engines = [("PostgreSQL", "postgresql", (15,), postgresql.dialect()),
               ("MySQL", "mysql", (8, 0, 40), mysql.dialect()),
               ("MariaDB", "mariadb", (10, 11), mysql.dialect(is_mariadb=True)),
               ("SQLite", "sqlite", (3, 40), sqlite.dialect())]
    steps = [("The claim lock (the cap row)", cs._q_lock_claim),
             ("Lock the chosen jobs", cs._q_lock_chosen),
             ("Lease them", cs._q_lease)]
    out = []
    for label, family, version, dialect in engines:
        d = _capabilities(family, version)
        out += [f"### {label}", ""]
        for title, build in steps:
            sql = str(build(d).compile(dialect=dialect)).replace("__[POSTCOMPILE_b_ids]", "%s, %s, ...")
            out += [f"{title}:", "", "```sql", sql.strip(), "```", ""]
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if ENGINE_MARKER in markdown:
        markdown = markdown.replace(ENGINE_MARKER, engine_facts())
    if CLAIM_SQL_MARKER in markdown:
        markdown = markdown.replace(CLAIM_SQL_MARKER, claim_sql())
    return markdown


def on_files(files: Files, config: MkDocsConfig, **kwargs: Any) -> Files:
    files.append(File.generated(config, CLI_PAGE, content=cli_reference()))
    files.append(File.generated(config, SCHEMA_PAGE, content=schema_reference()))
    import jobq

    documented: set[str] = set()
    for f in files:
        if f.src_uri.startswith(API_PREFIX) and f.src_uri.endswith(".md") and f.abs_src_path:
            with open(f.abs_src_path, encoding="utf-8") as fh:
                documented |= set(re.findall(r"^::: jobq\.(\w+)", fh.read(), flags=re.M))
    missing = sorted(set(jobq.__all__) - documented)
    if missing:
        raise PluginError(f"public names without an API reference entry under docs/{API_PREFIX}: {missing}")
    unknown = sorted(documented - set(jobq.__all__))
    if unknown:
        raise PluginError(f"docs/{API_PREFIX} documents names that are not in jobq.__all__: {unknown}")
    return files
