"""The README's Python examples run as written (examples as tests, as River's are).

The rule: every fenced ```python block in README.md runs, unless the line just before its
fence is an HTML comment starting ``<!-- not run`` (say why in it: a fragment, top-level
``await``). Each block runs as a script of its own, in a fresh process whose working directory
is an empty temporary directory and whose ``sys.path`` starts at the repository root (so it
imports this checkout's jobq.py). A block that names ``sqlite:///jobs.db`` runs once per tested
engine, with that URL replaced by the test's database; a block that fails (an exception, a
failed ``assert``, no exit within the timeout) fails the test with its output.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
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


BLOCKS = runnable_blocks(README.read_text())


def test_the_rule_finds_the_using_jobq_example() -> None:
    """A README reorganisation that silently stopped running the main example would pass
    every other test here; this one fails then."""
    assert any("jobq.Worker(" in code and SQLITE_URL in code for _, code in BLOCKS)
    marked = runnable_blocks("<!-- not run: fragment -->\n```python\nraise SystemExit(1)\n```\n")
    assert marked == []


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{n}" for n, _ in BLOCKS])
def test_readme_block_runs_as_written(line: int, code: str, dialect: str, db_url: str, tmp_path: pathlib.Path) -> None:
    if SQLITE_URL in code:
        code = code.replace(SQLITE_URL, repr(db_url))
    elif dialect != "sqlite":
        pytest.skip("the block names no database: it runs once, on the SQLite pass")
    script = tmp_path / f"readme_{line}.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n" + code)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"README.md line {line} failed:\n{out.stdout}\n{out.stderr}"
