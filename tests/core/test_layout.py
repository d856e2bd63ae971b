"""jobq.py's layout rules, as a test: STYLE.md's "SQL only in its section" made to bite.

An AST walk over the banner sections of ``jobq.py``:

* a statement (``sa.select/insert/update/delete/text/union/union_all``, ``.exec_driver_sql(``)
  is built only in the schema, SQL statements and dialect sections;
* the database is branched on (``dialect.name``, ``.family``, ``.is_mariadb``, ``.driver``, a
  comparison with "postgresql", "mysql", "mariadb" or "sqlite") only in the dialect section;
* the module imports only the standard library and SQLAlchemy at module level;
* ``__all__`` is sorted and names only public names the module defines;
* the sections come in STYLE.md's order.

Run it as a script for the figures: ``python tests/core/test_layout.py [path/to/jobq.py]``
prints the violations, the counts and the largest definitions with their share of the file.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

JOBQ = pathlib.Path(__file__).resolve().parents[2] / "jobq.py"

#: STYLE.md's order, by the start of each banner's title.
SECTION_ORDER = (
    "Logging and events",
    "Errors",
    "Schema",
    "SQL statements",
    "Dialect support",
    "Scheduling policy",
    "Input validation",
    "The queue API",
    "The worker",
    "asyncio",
    "Command-line interface",
)
SQL_SECTIONS = frozenset({"Schema", "SQL statements", "Dialect support"})
BRANCH_SECTIONS = frozenset({"Dialect support"})
STATEMENT_BUILDERS = frozenset({"select", "insert", "update", "delete", "text", "union", "union_all"})
ENGINE_NAMES = frozenset({"postgresql", "mysql", "mariadb", "sqlite"})
BRANCH_ATTRS = frozenset({"family", "is_mariadb", "driver"})

#: Definitions other work in progress is rewriting (issue 13: one insert path, the worker loop,
#: the CLI). Each still builds SQL or branches on the engine outside its section; the entry
#: goes when its rewrite lands. Nothing new may join this list.
PENDING: frozenset[str] = frozenset()  # every definition follows the rules now

_BANNER = re.compile(r"^# ={20,}\n# (?P<title>[^\n]+)\n# ={20,}$", re.M)


@dataclass(frozen=True)
class Violation:
    rule: str  # "statement" | "branch" | "import" | "__all__" | "order"
    section: str
    where: str  # the top-level definition (or "module")
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.rule}: line {self.line} in {self.where} ({self.section}): {self.what}"


def sections(source: str) -> list[tuple[str, int]]:
    """(canonical section name, first line) per banner, in file order."""
    out = []
    for m in _BANNER.finditer(source):
        title = m.group("title").strip()
        line = source.count("\n", 0, m.start()) + 1
        name = next((s for s in SECTION_ORDER if title.startswith(s)), title)
        out.append((name, line))
    return out


def _section_at(secs: list[tuple[str, int]], line: int) -> str:
    name = "preamble"
    for s, start in secs:
        if start <= line:
            name = s
    return name


def _def_name(node: ast.stmt) -> str:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    names = [t.id for t in targets if isinstance(t, ast.Name)]
    return names[0] if names else "module"


def _statements(node: ast.AST) -> Iterator[tuple[int, str]]:
    for n in ast.walk(node):
        if not isinstance(n, ast.Call) or not isinstance(n.func, ast.Attribute):
            continue
        f = n.func
        if f.attr == "exec_driver_sql":
            yield n.lineno, ".exec_driver_sql("
        elif f.attr in STATEMENT_BUILDERS and isinstance(f.value, ast.Name) and f.value.id == "sa":
            yield n.lineno, f"sa.{f.attr}("


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def _branches(node: ast.AST) -> Iterator[tuple[int, str]]:
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute):
            if n.attr in BRANCH_ATTRS:
                yield n.lineno, f".{n.attr}"
            elif n.attr == "name" and isinstance(n.value, ast.Attribute) and n.value.attr == "dialect":
                yield n.lineno, "dialect.name"
        elif isinstance(n, ast.Compare):
            named = set().union(*(_strings(x) for x in [n.left, *n.comparators])) & ENGINE_NAMES
            if named:
                yield n.lineno, f"comparison with {sorted(named)}"


def check(source: str) -> list[Violation]:
    """Every layout violation in ``source`` (a jobq.py)."""
    tree = ast.parse(source)
    secs = sections(source)
    out: list[Violation] = []
    names = [s for s, _ in secs]
    known = [s for s in names if s in SECTION_ORDER]
    if known != sorted(known, key=SECTION_ORDER.index) or len(set(known)) != len(known):
        out.append(Violation("order", "module", "module", 1, f"sections {names}, expected the order {list(SECTION_ORDER)}"))
    std = set(sys.stdlib_module_names) | {"__future__", "sqlalchemy"}
    defined: set[str] = set()
    all_names: list[str] | None = None
    for node in tree.body:
        section = _section_at(secs, node.lineno)
        where = _def_name(node)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for m in mods:
                if m.split(".")[0] not in std:
                    out.append(Violation("import", section, "module", node.lineno, f"imports {m}"))
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        for t in (node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]):
            if isinstance(t, ast.Name):
                defined.add(t.id)
                if t.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                    all_names = [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
        if section not in SQL_SECTIONS:
            out += [Violation("statement", section, where, ln, w) for ln, w in _statements(node)]
        if section not in BRANCH_SECTIONS:
            out += [Violation("branch", section, where, ln, w) for ln, w in _branches(node)]
    if all_names is None:
        out.append(Violation("__all__", "preamble", "module", 1, "no literal __all__"))
    else:
        if all_names != sorted(all_names):
            out.append(Violation("__all__", "preamble", "__all__", 1, "not sorted"))
        for n in all_names:
            if n.startswith("_"):
                out.append(Violation("__all__", "preamble", "__all__", 1, f"names the internal {n}"))
            elif n not in defined:
                out.append(Violation("__all__", "preamble", "__all__", 1, f"names {n}, which is not defined"))
    return out


def largest(source: str, top: int = 5) -> list[tuple[str, int, float]]:
    """The largest top-level definitions: (name, lines, share of the file)."""
    tree = ast.parse(source)
    total = source.count("\n") + 1
    sizes = [(n.name, n.end_lineno - n.lineno + 1) for n in tree.body  # type: ignore[operator]
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    sizes.sort(key=lambda x: -x[1])
    return [(name, n, n / total) for name, n in sizes[:top]]


def report(source: str) -> str:
    vs = check(source)
    lines = [str(v) for v in vs]
    count = {r: sum(1 for v in vs if v.rule == r) for r in ("statement", "branch", "import", "__all__", "order")}
    lines.append("counts: " + ", ".join(f"{k}={v}" for k, v in count.items()))
    lines.append("flagged definitions: " + ", ".join(sorted({v.where for v in vs if v.rule in ("statement", "branch")})))
    lines.append("largest: " + ", ".join(f"{n} {k} lines ({s:.1%})" for n, k, s in largest(source)))
    return "\n".join(lines)


# ---- the rules on jobq.py ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def violations() -> list[Violation]:
    return check(JOBQ.read_text())


@pytest.mark.parametrize("rule", ["statement", "branch"])
def test_sql_and_engine_branches_stay_in_their_sections(violations: list[Violation], rule: str) -> None:
    """Statements are built only in the schema, SQL and dialect sections, and the engine is
    branched on only in the dialect section. A bug shows as a line naming the definition that
    builds a statement (or tests an engine name) in the wrong place."""
    bad = [str(v) for v in violations if v.rule == rule and v.where not in PENDING]
    assert not bad, "\n".join(bad)


def test_pending_list_only_shrinks(violations: list[Violation]) -> None:
    """PENDING names only definitions that still break a rule: an entry whose rewrite has
    landed must go, so the list cannot hide a new offender under an old name."""
    flagged = {v.where for v in violations if v.rule in ("statement", "branch")}
    stale = sorted(PENDING - flagged - {n for n in PENDING if n not in JOBQ.read_text()})
    assert not stale, f"no longer break a rule, remove from PENDING: {stale}"


@pytest.mark.parametrize("rule", ["import", "__all__", "order"])
def test_module_surface_and_order(violations: list[Violation], rule: str) -> None:
    """Module-level imports are the standard library and SQLAlchemy only; ``__all__`` is sorted
    and names public, defined names; the sections come in STYLE.md's order."""
    bad = [str(v) for v in violations if v.rule == rule]
    assert not bad, "\n".join(bad)


# ---- the checker catches what it should (deliberately broken variants) ------------------------


def _banner(title: str) -> str:
    return f"# {'=' * 30}\n# {title}\n# {'=' * 30}\n"


_GOOD = (
    "import sqlalchemy as sa\n__all__ = ['a', 'b']\n"
    + _banner("Logging and events") + _banner("SQL statements")
    + "def _q_x():\n    return sa.select(1)\n"
    + _banner("Dialect support")
    + "def _family(engine):\n    return engine.dialect.name == 'sqlite'\n"
    + _banner("The queue API, in job-lifecycle order")
    + "def a(conn):\n    return conn.execute(_q_x())\n"
    + "def b():\n    pass\n"
)


def test_checker_accepts_a_clean_module() -> None:
    """The clean model passes: the rules do not flag builders in their sections."""
    assert check(_GOOD) == []


@pytest.mark.parametrize(
    ("broken", "rule"),
    [
        ("def c(conn):\n    return conn.execute(sa.update(t))\n", "statement"),
        ("def c(conn):\n    conn.exec_driver_sql('SELECT 1')\n", "statement"),
        ("def c(conn):\n    return sa.union_all(x, y)\n", "statement"),
        ("def c(d):\n    return d.family == 'mysql'\n", "branch"),
        ("def c(e):\n    return e.dialect.name\n", "branch"),
        ("def c(e):\n    return getattr(e, 'x') in ('mariadb', 'x')\n", "branch"),
        ("def c(e):\n    return e.dialect.driver\n", "branch"),
        ("import numpy\n", "import"),
    ],
)
def test_checker_flags_a_broken_variant(broken: str, rule: str) -> None:
    """Each rule fires on a minimal offender placed in the queue API section."""
    assert {v.rule for v in check(_GOOD + broken)} == {rule}


@pytest.mark.parametrize(
    ("src", "what"),
    [
        (_GOOD.replace("['a', 'b']", "['b', 'a']"), "not sorted"),
        (_GOOD.replace("['a', 'b']", "['a', 'b', 'z']"), "not defined"),
        (_GOOD.replace("['a', 'b']", "['_q_x', 'a', 'b']"), "internal"),
        (_GOOD.replace("# Logging and events", "# Command-line interface"), "expected the order"),
    ],
)
def test_checker_flags_bad_surface(src: str, what: str) -> None:
    """``__all__`` out of order, naming an undefined or internal name, and sections out of
    STYLE.md's order are each caught."""
    assert any(what in v.what for v in check(src))


if __name__ == "__main__":
    print(report(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else JOBQ).read_text()))
