"""The Python examples of README.md and the documentation site (docs/) run as written.

The rule: every fenced ```python block in README.md and docs/**/*.md runs, unless the line just
before its fence is an HTML comment starting ``<!-- not run`` (say why in it: a fragment,
top-level ``await``, an extra that is not installed). Each block runs as a script of its own, in
a fresh process whose working directory is an empty temporary directory and whose ``sys.path``
starts at the repository root (so it imports this checkout's jobq). A block that names
``sqlite:///jobs.db`` runs once per tested engine, with that URL replaced by the test's
database; a block that fails (an exception, a failed ``assert``, no exit within the timeout)
fails the test with its output.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SQLITE_URL = '"sqlite:///jobs.db"'


def runnable_blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the fence, code) of every ```python block not marked ``<!-- not run``."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        if re.fullmatch(r"```python\s*", lines[i]):
            start = i
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            before = lines[start - 1].strip() if start else ""
            if not before.startswith("<!-- not run"):
                blocks.append((start + 1, "\n".join(lines[start + 1 : j]) + "\n"))
            i = j
        i += 1
    return blocks


BLOCKS = [(page.relative_to(ROOT).as_posix(), line, code)
          for page in PAGES for line, code in runnable_blocks(page.read_text())]


def test_the_rule_finds_the_main_examples() -> None:
    """A reorganisation that silently stopped running the main examples would pass every other
    test here; this one fails then: the README's and the tutorial's example run on every engine."""
    for page in ("README.md", "docs/tutorial/using.md"):
        assert any(p == page and "jobq.Worker(" in code and SQLITE_URL in code for p, _, code in BLOCKS), page
    assert len({p for p, _, _ in BLOCKS}) >= 10  # the how-to guides carry examples that run
    marked = runnable_blocks("<!-- not run: fragment -->\n```python\nraise SystemExit(1)\n```\n")
    assert marked == []


def test_a_failing_block_fails(tmp_path: pathlib.Path) -> None:
    """The runner itself: a block that raises or fails an assert is a failure, not a pass."""
    for code in ("raise RuntimeError('x')\n", "assert 1 == 2\n"):
        out = _run(code, tmp_path)
        assert out.returncode != 0


def _run(code: str, tmp_path: pathlib.Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "block.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n" + code)
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("page,line,code", BLOCKS, ids=[f"{p}:{n}" for p, n, _ in BLOCKS])
def test_doc_block_runs_as_written(page: str, line: int, code: str, dialect: str, db_url: str,
                                   tmp_path: pathlib.Path) -> None:
    if SQLITE_URL in code:
        code = code.replace(SQLITE_URL, repr(db_url))
    elif dialect != "sqlite":
        pytest.skip("the block names no database: it runs once, on the SQLite pass")
    out = _run(code, tmp_path)
    assert out.returncode == 0, f"{page} line {line} failed:\n{out.stdout}\n{out.stderr}"


def test_testing_your_engine_names_every_table_the_suite_wipes() -> None:
    """The suite wipes with ``Base.metadata.drop_all`` (tests/dbs.py): the guide must warn about
    every one of those tables, including ones added later."""
    import jobq

    text = (ROOT / "docs" / "guides" / "testing-your-engine.md").read_text()
    warning = text[: text.index("give it a database of its own")]
    named = set(re.findall(r"`(\w+)`", warning))
    assert {t.name for t in jobq.Base.metadata.sorted_tables} <= named


def test_layout_lists_every_scenario() -> None:
    text = (ROOT / "docs" / "internals" / "layout.md").read_text()
    for script in sorted((ROOT / "scenarios").glob("*.py")):
        assert f"`{script.name}`" in text, script.name


QUICK_START = """\
python3 -m pip install nox && python3 -m nox -s demo     # a small DAG on SQLite: jobs, order, results
python3 -m nox -s tests                                   # the test suite: SQLite, plus servers you name
"""


def test_readme_is_a_short_landing_page_with_the_quick_start() -> None:
    """The README is the front door (at most 200 lines); its two Quick start commands stay
    verbatim (the demo and tests sessions they name must exist), and every page it links exists."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert f"```sh\n{QUICK_START}```" in text
    nox = (ROOT / "noxfile.py").read_text()
    assert 'nox.options.sessions = ["demo", "tests"]' in nox and "def demo(" in nox and "def tests(" in nox
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
    assert links and all((ROOT / link).exists() for link in links), [li for li in links if not (ROOT / li).exists()]


def test_no_work_history_in_the_product_text() -> None:
    """The text describes the product as it is: no "stop N" jargon of how it was built."""
    pages = [*PAGES, ROOT / "CHANGELOG.md"]
    hits = [(p.name, m.group(0)) for p in pages for m in re.finditer(r"(?i)\bstop \d+", p.read_text())]
    assert hits == []


def _fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_the_tutorial_runs_as_written(tmp_path: pathlib.Path) -> None:
    """The tutorial's handlers module (step 2), its queue commands (step 3) with the ids and
    the why line their comments promise, and its worker command (step 4), on a fresh SQLite
    file: the worker runs both jobs."""
    import shlex
    import time

    import sqlalchemy as sa

    import jobq
    from helpers import JOBQ_CLI

    text = (ROOT / "docs" / "tutorial" / "index.md").read_text()
    module = _fenced(text, "python")[0]
    (tmp_path / "myapp").mkdir()
    (tmp_path / "myapp" / "__init__.py").write_text("")
    (tmp_path / "myapp" / "jobs.py").write_text(module)
    steps = _fenced(text, "sh")
    queue = [shlex.split(line, comments=True) for line in steps[1].splitlines() if line.strip()]
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    assert queue[0] == ["export", "JOBQ_URL=sqlite:///jobs.db"]
    env = {**os.environ, "JOBQ_URL": url, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    outs = []
    for args in queue[1:]:
        assert args[0] == "jobq", args
        done = subprocess.run([*JOBQ_CLI, *args[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stderr == "", (args, done.stderr)
        outs.append(done.stdout.strip())
    assert outs[1:3] == ["1", "2"]  # "prints the job's id: 1", then "2"
    assert outs[3].startswith("job 2 (publish, group default) is waiting on 1 upstream job(s): 1 (ready")
    worker = shlex.split(steps[2], comments=True)
    assert worker[:3] == ["jobq", "worker", "--app"]
    p = subprocess.Popen([*JOBQ_CLI, *worker[1:]], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    engine = sa.create_engine(url)
    try:
        deadline = time.monotonic() + 60
        while (info := jobq.get(engine, 2)) is None or info.state != "done":
            assert time.monotonic() < deadline and p.poll() is None, "the tutorial's worker did not run job 2"
            time.sleep(0.05)
        assert info.result == {"published": True}
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        engine.dispose()
    assert p.returncode == 0, err
