"""The single file for vendoring, single/jobq.py: in sync with the package, standard library and
SQLAlchemy only, and it runs copied alone."""

from __future__ import annotations

import ast
import os
import pathlib
import shutil
import subprocess
import sys

import sqlalchemy

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = """
import sqlalchemy as sa, jobq, sys
e = sa.create_engine("sqlite:///" + sys.argv[1])
jobq.create_schema(e)
a = jobq.enqueue(e, "double", {"x": 2})
box = jobq.enqueue(e, "box", container=True)
b = jobq.enqueue(e, "double", {"x": 5}, parent=box, depends_on=[a])
c = jobq.enqueue(e, "double", {"x": 7}, depends_on=[box])
w = jobq.Worker(e, {"double": lambda ctx: {"y": ctx.args["x"] * 2}}, max_concurrency=2, poll_interval=0.02)
assert w.run_until_idle(timeout=60)
print([(jobq.get(e, j).state, jobq.get(e, j).result) for j in (a, box, b, c)])
print(sorted(m for m in sys.modules if m.split(".")[0] not in sys.stdlib_module_names))
"""


def test_module_level_imports_are_stdlib_and_sqlalchemy_only() -> None:
    """single/jobq.py's top-level imports (read from its AST) are the standard library and SQLAlchemy,
    nothing else."""
    tree = ast.parse((ROOT / "single" / "jobq.py").read_text())
    roots = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    assert roots - set(sys.stdlib_module_names) - {"__future__"} == {"sqlalchemy"}


def test_jobq_copied_alone_runs_a_dag_with_only_sqlalchemy(tmp_path: pathlib.Path) -> None:
    """Copy single/jobq.py next to a script; give Python nothing but the stdlib, SQLAlchemy and what
    SQLAlchemy itself needs (no site-packages, no drivers, no test tools)."""
    app = tmp_path / "app"
    site = tmp_path / "site"
    app.mkdir()
    site.mkdir()
    shutil.copy(ROOT / "single" / "jobq.py", app / "jobq.py")
    (app / "main.py").write_text(SCRIPT)
    sa_dir = pathlib.Path(sqlalchemy.__file__).parent
    os.symlink(sa_dir, site / "sqlalchemy")
    import typing_extensions

    os.symlink(typing_extensions.__file__, site / "typing_extensions.py")
    boot = f"import sys; sys.path[:0] = [{str(app)!r}, {str(site)!r}]; sys.argv = ['main.py', {str(tmp_path / 'q.db')!r}]; exec(open({str(app / 'main.py')!r}).read())"
    out = subprocess.run([sys.executable, "-S", "-I", "-c", boot], capture_output=True, text=True, timeout=120, cwd=app)
    assert out.returncode == 0, out.stderr
    states, modules = out.stdout.strip().splitlines()
    assert states == "[('done', {'y': 4}), ('done', None), ('done', {'y': 10}), ('done', {'y': 14})]"
    loaded = {m.split(".")[0] for m in eval(modules)}
    assert not loaded & {"psycopg", "pymysql", "pytest", "hypothesis", "nox"}


def test_quickstart_scenario_runs_and_reports(tmp_path: pathlib.Path) -> None:
    """scenarios/quickstart.py runs on SQLite, exits 0 and prints what it shows: the failed first
    attempt, the retried part, and 'all done' last."""
    out = subprocess.run([sys.executable, str(ROOT / "scenarios" / "quickstart.py"), "--url", f"sqlite:///{tmp_path / 'q.db'}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().endswith("all done")
    assert "attempt 1 fails" in out.stdout and "part 2 (attempt 2)" in out.stdout
