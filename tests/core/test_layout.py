"""The package's layout rules, as tests: STYLE.md's "SQL only in its modules", "engine names only
in the drivers" and "imports in one direction" made to bite.

An AST walk over the modules of ``jobq/``:

* a statement (``sa.select/insert/update/delete/text/union/union_all``, ``.exec_driver_sql(``)
  is built only in the schema, SQL, fast-path, driver and migration modules;
* the database is branched on (``dialect.name``, ``.family``, ``.is_mariadb``, ``.driver``, a
  comparison with "postgresql", "mysql", "mariadb" or "sqlite", a type's ``with_variant``, a
  ``ddl_if``/``execute_if`` by ``dialect=``) only in the engines and drivers modules (and the
  fast path, which is the drivers' cursor): the schema asks for capabilities;
* an engine is named (a string that is an engine's name, a URL or driver of it such as
  "mysql+pymysql", a dialect option such as ``postgresql_where=`` or ``{"mysql_engine": ...}``)
  only in the engines and drivers modules: adding an engine touches only them;
* a module imports the standard library, SQLAlchemy, and modules before it in ``_MODULES``
  (jobq/__init__.py's import order), nothing else, at module level or inside a function
  (annotations may name a later module's class under ``if TYPE_CHECKING:``: nothing runs);
* ``__all__`` is sorted and names only public names the package defines;
* every module is in ``_MODULES``, and none is longer than ``MAX_LINES``;
* SQLAlchemy's private names (non-public modules, compiled-statement internals,
  ``conn._autobegin``) are used only in the fast path (private_sqlalchemy).

Run it as a script for the figures: ``python tests/core/test_layout.py`` prints the violations
and the lines per module.
"""

from __future__ import annotations

import ast
import pathlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/, when run as a script
from engine_table import ENGINES  # noqa: E402

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "jobq"

SQL_MODULES = frozenset({"schema", "sql", "fastpath", "drivers", "migrations", "claim_sql"})
BRANCH_MODULES = frozenset({"engines", "drivers", "fastpath"})
STATEMENT_BUILDERS = frozenset({"select", "insert", "update", "delete", "text", "union", "union_all"})
ENGINE_NAMES = frozenset(ENGINES)  # every engine the tests run on (tests/engine_table.py)
BRANCH_ATTRS = frozenset({"family", "is_mariadb", "driver"})
#: The modules that may name an engine: its class in engines.py, its driver in drivers.py.
NAME_MODULES = frozenset({"engines", "drivers"})
#: A module this long is more than a sitting's read: split it rather than raise this.
MAX_LINES = 1_500

#: Imports that still run against the order (module, the later module it imports inside a
#: function). Nothing may join; an entry goes when its import does.
LATE_IMPORTS: frozenset[tuple[str, str]] = frozenset()


@dataclass(frozen=True)
class Violation:
    rule: str  # "statement" | "branch" | "name" | "import" | "__all__" | "modules" | "size"
    module: str
    where: str  # the top-level definition (or "module")
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.rule}: jobq/{self.module}.py:{self.line} in {self.where}: {self.what}"


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
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and (
                n.func.attr == "with_variant" or n.func.attr in ("ddl_if", "execute_if")
                and any(k.arg == "dialect" for k in n.keywords)):
            yield n.lineno, f".{n.func.attr}() by engine name"
        elif isinstance(n, ast.Compare):
            named = set().union(*(_strings(x) for x in [n.left, *n.comparators])) & ENGINE_NAMES
            if named:
                yield n.lineno, f"comparison with {sorted(named)}"


def _engine_names(node: ast.AST) -> Iterator[tuple[int, str]]:
    """Strings that are an engine's name, URL scheme or driver ("mysql", "sqlite://",
    "mariadb+pymysql"), and dialect options (``postgresql_where=``, a ``"mysql_engine"`` key)."""
    keys = {id(k) for d in ast.walk(node) if isinstance(d, ast.Dict) for k in d.keys if k is not None}
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            for engine in ENGINE_NAMES:
                if n.value == engine or n.value.startswith((f"{engine}+", f"{engine}:")) or (
                        id(n) in keys and n.value.startswith(f"{engine}_")):
                    yield n.lineno, f"the string {n.value!r}"
        elif isinstance(n, ast.keyword) and n.arg and n.arg.startswith(tuple(f"{e}_" for e in ENGINE_NAMES)):
            yield n.value.lineno, f"the dialect option {n.arg}="


def _imports(name: str, tree: ast.Module, order: list[str]) -> Iterator[Violation]:
    std = set(sys.stdlib_module_names) | {"__future__", "sqlalchemy"}
    rank = {m: i for i, m in enumerate(order)}
    top = set(map(id, tree.body))
    typing_only = {id(n) for block in tree.body if isinstance(block, ast.If) and isinstance(block.test, ast.Name)
                   and block.test.id == "TYPE_CHECKING" for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in typing_only:  # names for annotations only: nothing is imported at run time
            continue
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            mods = [node.module or ""]
        elif isinstance(node, ast.ImportFrom):
            targets = [node.module] if node.module else [a.name for a in node.names]
            for target in targets:
                if name in ("__init__", "__main__"):
                    continue
                if target not in rank or rank[target] >= rank.get(name, -1):
                    if (name, target) not in LATE_IMPORTS:
                        yield Violation("import", name, "module", node.lineno, f"imports jobq/{target}.py, not before it")
            continue
        else:
            continue
        for m in mods:
            if m.split(".")[0] not in std and (id(node) in top or m.split(".")[0] != "sqlalchemy"):
                # inside a function an optional library may be imported where it is used
                if id(node) in top:
                    yield Violation("import", name, "module", node.lineno, f"imports {m} at module level")


def check(modules: dict[str, str]) -> list[Violation]:
    """Every layout violation in ``modules`` (name -> source, with ``__init__``)."""
    out: list[Violation] = []
    init = ast.parse(modules["__init__"])
    order: list[str] = []
    all_names: list[str] | None = None
    public: set[str] = set()
    for node in init.body:
        if isinstance(node, ast.AnnAssign) and _def_name(node) == "_MODULES" and isinstance(node.value, ast.Tuple):
            order = [e.id for e in node.value.elts if isinstance(e, ast.Name)]
        if isinstance(node, ast.Assign) and _def_name(node) == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
            all_names = [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            public |= {a.asname or a.name for a in node.names}
    missing = sorted(set(modules) - {"__init__", "__main__"} - set(order))
    if missing or len(set(order)) != len(order):
        out.append(Violation("modules", "__init__", "_MODULES", 1, f"not in _MODULES once: {missing or order}"))
    for name, source in modules.items():
        tree = ast.parse(source)
        out += list(_imports(name, tree, order))
        lines = source.count("\n")
        if lines > MAX_LINES:
            out.append(Violation("size", name, "module", lines, f"{lines} lines, over {MAX_LINES}"))
        for node in tree.body:
            where = _def_name(node)
            if name not in SQL_MODULES:
                out += [Violation("statement", name, where, ln, w) for ln, w in _statements(node)]
            if name not in BRANCH_MODULES:
                out += [Violation("branch", name, where, ln, w) for ln, w in _branches(node)]
            if name not in NAME_MODULES:
                out += [Violation("name", name, where, ln, w) for ln, w in _engine_names(node)]
    if all_names is None:
        out.append(Violation("__all__", "__init__", "module", 1, "no literal __all__"))
    else:
        if all_names != sorted(all_names):
            out.append(Violation("__all__", "__init__", "__all__", 1, "not sorted"))
        for n in all_names:
            if n.startswith("_"):
                out.append(Violation("__all__", "__init__", "__all__", 1, f"names the internal {n}"))
            elif n not in public:
                out.append(Violation("__all__", "__init__", "__all__", 1, f"names {n}, which is not defined"))
    return out


def package() -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted(PACKAGE.glob("*.py"))}


def report(modules: dict[str, str]) -> str:
    lines = [str(v) for v in check(modules)]
    lines += [f"{name:>12}.py {src.count(chr(10)):6} lines" for name, src in modules.items()]
    lines.append(f"{'total':>15} {sum(src.count(chr(10)) for src in modules.values()):6} lines")
    return "\n".join(lines)


# ---- the rules on jobq/ -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def violations() -> list[Violation]:
    return check(package())


@pytest.mark.parametrize("rule", ["statement", "branch", "name"])
def test_sql_and_engine_branches_stay_in_their_modules(violations: list[Violation], rule: str) -> None:
    """Statements are built only in the schema, SQL, fast-path, driver and migration modules,
    the engine is branched on only in the drivers, and named only in the engines and drivers
    modules (the schema asks them: _where_options, _table_options, _column_type). A bug shows
    as a line naming the definition that builds a statement (or names an engine) in the wrong
    module."""
    bad = [str(v) for v in violations if v.rule == rule]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("rule", ["import", "__all__", "modules", "size"])
def test_imports_run_one_way_and_the_surface_is_all(violations: list[Violation], rule: str) -> None:
    """Each module imports only the standard library, SQLAlchemy and the modules before it;
    ``__all__`` is sorted and names public, defined names; every module is in the order and
    none is over MAX_LINES."""
    bad = [str(v) for v in violations if v.rule == rule]
    assert not bad, "\n".join(bad)


def test_late_imports_only_shrink() -> None:
    """LATE_IMPORTS names only imports that are still there: one that has gone must leave the
    list, so that it cannot come back unnoticed."""
    modules = package()
    found = set()
    for name, source in modules.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                found.add((name, node.module))
    assert LATE_IMPORTS <= found, f"no longer imported, remove from LATE_IMPORTS: {sorted(LATE_IMPORTS - found)}"


# ---- the checker catches what it should (deliberately broken variants) ------------------------

_GOOD = {
    "__init__": "from .sql import a, b\n__all__ = ['a', 'b']\n_MODULES: tuple = (sql, drivers, jobs)\n",
    "sql": "import sqlalchemy as sa\ndef _q_x():\n    return sa.select(1)\ndef a():\n    pass\ndef b():\n    pass\n",
    "drivers": "from .sql import _q_x\ndef _family(engine):\n    return engine.dialect.name == 'sqlite'\n",
    "jobs": "from .sql import _q_x\nfrom .drivers import _family\ndef c(conn):\n    return conn.execute(_q_x())\n",
}


def _with(module: str, extra: str) -> dict[str, str]:
    return {**_GOOD, module: _GOOD[module] + extra}


def test_checker_accepts_a_clean_package() -> None:
    """The clean model passes: builders in the SQL module, branches in the drivers, imports
    from earlier modules only."""
    assert check(_GOOD) == []


@pytest.mark.parametrize(
    ("module", "broken", "rule"),
    [
        ("jobs", "def d(conn):\n    return conn.execute(sa.update(t))\n", "statement"),
        ("jobs", "def d(conn):\n    conn.exec_driver_sql('SELECT 1')\n", "statement"),
        ("jobs", "def d(conn):\n    return sa.union_all(x, y)\n", "statement"),
        ("jobs", "def d(d):\n    return d.family == 'mysql'\n", {"branch", "name"}),
        ("jobs", "def d(e):\n    return e.dialect.name\n", "branch"),
        ("jobs", "def d(e):\n    return getattr(e, 'x') in ('mariadb', 'x')\n", {"branch", "name"}),
        ("sql", "_HINT = {'postgres': 'x', 'mariadb': ('mariadb+pymysql', 'x')}\n", "name"),
        ("sql", "_URL = 'sqlite+pysqlite:///x.db'\n", "name"),
        ("sql", "_I = sa.Index('i', 'c', postgresql_where=sa.text('x'))\n", "name"),
        ("sql", "_T = sa.Table('t', m, mysql_engine='InnoDB')\n", "name"),
        ("sql", "_A = ({'sqlite_autoincrement': True},)\n", "name"),
        ("sql", "def d(e):\n    return e.dialect.driver\n", "branch"),
        ("sql", "_T = sa.Text().with_variant(x, 'mysql')\n", {"branch", "name"}),
        ("sql", "_I = sa.Index('i', 'c').ddl_if(dialect=('postgresql', 'sqlite'))\n", {"branch", "name"}),
        ("jobs", "import numpy\n", "import"),
        ("sql", "from .jobs import c\n", "import"),
        ("sql", "def d():\n    from .drivers import _family\n", "import"),
        ("jobs", "\n" * MAX_LINES, "size"),
    ],
)
def test_checker_flags_a_broken_variant(module: str, broken: str, rule: str | set[str]) -> None:
    """Each rule fires on a minimal offender."""
    assert {v.rule for v in check(_with(module, broken))} == ({rule} if isinstance(rule, str) else rule)


@pytest.mark.parametrize("fine", ["_Q = sa.text('SELECT sql FROM sqlite_master')\n",
                                  "def d():\n    'On mysql the index is named.'\n",
                                  "_X = {'mysqlx_port': 1, 'key': 'sqlite_sequence'}\n"])
def test_a_catalog_name_or_prose_is_not_an_engine_name(fine: str) -> None:
    """SQL text naming an engine's catalog, a docstring, a key that only starts like an
    engine's name: none of them names an engine."""
    assert check(_with("sql", fine)) == []


@pytest.mark.parametrize(
    ("src", "what"),
    [
        ({**_GOOD, "__init__": _GOOD["__init__"].replace("['a', 'b']", "['b', 'a']")}, "not sorted"),
        ({**_GOOD, "__init__": _GOOD["__init__"].replace("['a', 'b']", "['a', 'b', 'z']")}, "not defined"),
        ({**_GOOD, "__init__": _GOOD["__init__"].replace("['a', 'b']", "['_q_x', 'a', 'b']")}, "internal"),
        ({**_GOOD, "extra": "x = 1\n"}, "not in _MODULES"),
    ],
)
def test_checker_flags_bad_surface(src: dict[str, str], what: str) -> None:
    """``__all__`` out of order, naming an undefined or internal name, and a module outside the
    import order are each caught."""
    assert any(what in v.what for v in check(src))


if __name__ == "__main__":
    print(report(package()))


# ---- SQLAlchemy's private names: only in the fast path -----------------------------------------

#: SQLAlchemy's modules that are its public API (import from anything else is private).
SQLALCHEMY_PUBLIC = frozenset({"sqlalchemy", "sqlalchemy.engine", "sqlalchemy.orm", "sqlalchemy.exc", "sqlalchemy.event",
                               "sqlalchemy.types", "sqlalchemy.ext.compiler", "sqlalchemy.ext.asyncio"})
#: The private or semi-private names the fast path uses (attributes of compiled statements,
#: connections and dialects).
SQLALCHEMY_PRIVATE_ATTRS = frozenset({"_autobegin", "construct_expanded_state", "post_compile_params",
                                      "literal_execute_params", "escaped_bind_names", "insert_prefetch",
                                      "update_prefetch", "positiontup", "bind_names", "bind_typing", "dispatch",
                                      "_execution_options", "_connection_record"})
#: Names whose private attributes are SQLAlchemy's (a Connection, Engine, Dialect, compiled).
SQLALCHEMY_OBJECTS = frozenset({"conn", "connection", "dialect", "engine", "compiled", "sa"})


def private_sqlalchemy(module: str, source: str) -> list[str]:
    """Where ``source`` uses a SQLAlchemy private name: an import from a non-public module, a
    known private attribute, or ``conn._x``-style access on a SQLAlchemy object."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sqlalchemy":
            if node.module not in SQLALCHEMY_PUBLIC and not node.module.startswith("sqlalchemy.dialects"):
                found.append(f"{module}:{node.lineno} from {node.module} import")
        elif isinstance(node, ast.Attribute):
            base = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", None)
            if node.attr in SQLALCHEMY_PRIVATE_ATTRS or (
                    node.attr.startswith("_") and not node.attr.startswith("__") and base in SQLALCHEMY_OBJECTS):
                found.append(f"{module}:{node.lineno} .{node.attr}")
    return found


def test_only_the_fast_path_uses_sqlalchemys_private_names() -> None:
    """A SQLAlchemy release that changes them can break one module, which checks them once per
    engine and falls back to Connection.execute (tests/core/test_direct.py)."""
    found = [hit for path in sorted(PACKAGE.glob("*.py")) if path.stem != "fastpath"
             for hit in private_sqlalchemy(path.stem, path.read_text())]
    assert found == []
    assert private_sqlalchemy("fastpath", (PACKAGE / "fastpath.py").read_text())  # and the check sees them there


@pytest.mark.parametrize("broken", ["def f(conn):\n    conn._autobegin()\n",
                                    "def f():\n    from sqlalchemy.util import await_only\n",
                                    "def f(c):\n    return c.compiled.positiontup\n",
                                    "def f(engine):\n    return engine.dialect._json_serializer\n"])
def test_a_private_sqlalchemy_name_outside_the_fast_path_is_caught(broken: str) -> None:
    assert private_sqlalchemy("jobs", broken)
