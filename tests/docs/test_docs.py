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

from dbs import needs

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SQLITE_URL = '"sqlite:///jobs.db"'


def fenced_blocks(text: str, lang: str) -> list[tuple[int, str, bool]]:
    """(line number of the fence, code, marked ``<!-- not run``) of every ```LANG block."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        if re.fullmatch(rf"```{lang}\s*", lines[i]):
            start = i
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            before = lines[start - 1].strip() if start else ""
            blocks.append((start + 1, "\n".join(lines[start + 1 : j]) + "\n", before.startswith("<!-- not run")))
            i = j
        i += 1
    return blocks


def runnable_blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the fence, code) of every ```python block not marked ``<!-- not run``."""
    return [(line, code) for line, code, marked in fenced_blocks(text, "python") if not marked]


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


#: The shell blocks a test runs as written, by page and first line, with the test (or CI step)
#: that runs them. Every other ```sh block of README.md and docs/ is marked ``<!-- not run: why -->``.
SHELL_RUN_BY = {
    ("README.md", "python3 -m pip install nox && python3 -m nox -s demo"):
        ".ci/run runs nox -s demo and nox -s tests; test_readme_is_a_short_landing_page_with_the_quick_start keeps it verbatim",
    ("docs/getting-started/quickstart.md", "python3 -m pip install nox && python3 -m nox -s demo"):
        "the README's Quick start, the same two lines (test_the_quick_start_page_is_the_readmes)",
    ("docs/tutorial/index.md", "export JOBQ_URL=sqlite:///jobs.db"): "test_the_tutorial_runs_as_written",
    ("docs/tutorial/index.md", "jobq worker --app myapp.jobs:handlers --concurrency 4"): "test_the_tutorial_runs_as_written",
    ("docs/tutorial/index.md", "jobq serve --port 8080"): "test_the_tutorial_runs_as_written",
    ("docs/tutorial/index.md", 'python3 -m pip install "/path/to/jobq-checkout[postgres]"'):
        "test_the_tutorial_on_postgresql_runs_as_written (the install line aside)",
    ("docs/guides/cli.md", "jobq init"): "tests/cli/test_cli.py::test_the_cli_guide_examples_run_on_a_fresh_database",
    ("docs/guides/vendoring.md", "cp /path/to/jobq-checkout/single/jobq.py myproject/"):
        "test_the_vendoring_commands_run_as_written",
}


def _shell_blocks() -> list[tuple[str, int, str, bool]]:
    return [(page.relative_to(ROOT).as_posix(), line, code, marked) for page in PAGES
            for lang in ("sh", "bash", "console", "shell") for line, code, marked in fenced_blocks(page.read_text(), lang)]


def test_every_shell_block_runs_in_a_test_or_says_why_not() -> None:
    """A shell block is run by a named test, or marked ``<!-- not run: reason -->`` (installs,
    benchmarks, the suites themselves, servers that run until stopped). A run-by entry whose
    block is gone fails too, so the list cannot go stale."""
    blocks = _shell_blocks()
    first = {(page, code.split("#")[0].strip().splitlines()[0].strip()) for page, _, code, _ in blocks}
    unaccounted = []
    for page, line, code, marked in blocks:
        head = code.split("#")[0].strip().splitlines()[0].strip()
        run = any(page == p and head.startswith(h) for p, h in SHELL_RUN_BY)
        if marked == run:  # neither run nor marked, or marked although a test runs it
            unaccounted.append(f"{page}:{line} {head!r} ({'marked not run, yet listed' if marked else 'neither'})")
    assert unaccounted == []
    stale = [key for key in SHELL_RUN_BY if not any(p == key[0] and h.startswith(key[1]) for p, h in first)]
    assert stale == []


def test_every_other_block_is_output_or_marked_not_run() -> None:
    """Besides Python and shell blocks (above), a page may show output (```text); a block in
    any other language (SQL, a config file) is marked ``<!-- not run: why -->``."""
    unmarked = []
    for page in PAGES:
        text = page.read_text()
        for lang in sorted(set(re.findall(r"^```(\w+)", text, flags=re.M)) - {"python", "sh", "bash", "console", "shell", "text"}):
            unmarked += [f"{page.relative_to(ROOT)}:{line} {lang}" for line, _, marked in fenced_blocks(text, lang) if not marked]
    assert unmarked == []


def test_the_quick_start_page_is_the_readmes() -> None:
    text = (ROOT / "docs" / "getting-started" / "quickstart.md").read_text()
    assert f"```sh\n{QUICK_START}```" in text


def test_the_vendoring_commands_run_as_written(tmp_path: pathlib.Path) -> None:
    """The vendoring guide's commands, with this checkout as ``/path/to/jobq-checkout``: the two
    copies, then the copied file's CLI (run as a script, beside nothing but its dashboard)."""
    import shlex

    text = (ROOT / "docs" / "guides" / "vendoring.md").read_text()
    lines = [shlex.split(line, comments=True) for line in _fenced(text, "sh")[0].splitlines() if line.strip()]
    (tmp_path / "myproject").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for args in lines:
        args = [a.replace("/path/to/jobq-checkout", str(ROOT)) for a in args]
        if args[0] == "python":
            args[0] = sys.executable
        done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stderr == "", (args, done.stderr)
    assert done.stdout.startswith("usage: jobq "), done.stdout
    assert (tmp_path / "myproject" / "jobq_web.py").exists()


def test_testing_your_engine_names_every_table_the_suite_wipes() -> None:
    """The suite wipes with ``Base.metadata.drop_all`` (tests/dbs.py): the guide must warn about
    every one of those tables, including ones added later."""
    import jobq

    text = (ROOT / "docs" / "guides" / "testing-your-engine.md").read_text()
    warning = text[: text.index("give it a database of its own")]
    named = set(re.findall(r"`(\w+)`", warning))
    assert {t.name for t in jobq.Base.metadata.sorted_tables} <= named


def test_observability_names_every_event_action_and_attempt_outcome() -> None:
    """The guide lists the event actions and attempt outcomes; one added to jobq must be added there."""
    import jobq

    text = (ROOT / "docs" / "guides" / "observability.md").read_text()
    named = set(re.findall(r"`(\w+)`", text))
    assert set(jobq.EVENT_ACTIONS) <= named, set(jobq.EVENT_ACTIONS) - named
    assert set(jobq.ATTEMPT_OUTCOMES) <= named, set(jobq.ATTEMPT_OUTCOMES) - named


def test_the_front_pages_link_every_page_of_the_site() -> None:
    """Every page in the site's navigation outside the reference (which its own index lists, and
    part of which is generated) is linked from the docs' home page and the README, so a new
    guide cannot be left out of the two lists readers start from."""
    nav = re.findall(r"^\s*- (?:[^:\n]+: )?([\w/-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    assert len(nav) > 30, nav
    home = (ROOT / "docs" / "index.md").read_text()
    readme = (ROOT / "README.md").read_text()
    pages = [page for page in nav if page not in ("index.md", "changelog.md") and not page.startswith("reference/")]
    assert [page for page in pages if f"]({page}" not in home] == []
    assert [page for page in pages if f"](docs/{page}" not in readme] == []


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


def _tutorial_app(tmp_path: pathlib.Path, text: str) -> None:
    """Step 2 of the tutorial: its handlers module, saved where it says (``myapp/jobs.py``)."""
    (tmp_path / "myapp").mkdir()
    (tmp_path / "myapp" / "__init__.py").write_text("")
    (tmp_path / "myapp" / "jobs.py").write_text(_fenced(text, "python")[0])


def _run_worker_until(args: list[str], env: dict[str, str], cwd: pathlib.Path, url: str, job: int,
                      result: dict[str, object]) -> None:
    """Run the tutorial's worker command until ``job`` is done with ``result``, then SIGTERM it:
    it must exit cleanly."""
    import time

    import sqlalchemy as sa

    import jobq
    from helpers import JOBQ_CLI

    assert args[:3] == ["jobq", "worker", "--app"], args
    p = subprocess.Popen([*JOBQ_CLI, *args[1:]], cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)
    engine = sa.create_engine(url)
    try:
        deadline = time.monotonic() + 60
        while (info := jobq.get(engine, job)) is None or info.state != "done":
            assert time.monotonic() < deadline and p.poll() is None, f"the tutorial's worker did not run job {job}"
            time.sleep(0.05)
        assert info.result == result
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        engine.dispose()
    assert p.returncode == 0, err


def test_the_tutorial_runs_as_written(tmp_path: pathlib.Path) -> None:
    """The tutorial's handlers module (step 2), its queue commands (step 3) with the ids and
    the why line their comments promise, its worker command (step 4), on a fresh SQLite
    file: the worker runs both jobs; then its dashboard command (step 5), whose overview
    answers (on a free port instead of 8080, which another process may hold)."""
    import shlex
    import urllib.request

    from helpers import JOBQ_CLI

    text = (ROOT / "docs" / "tutorial" / "index.md").read_text()
    _tutorial_app(tmp_path, text)
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
    _run_worker_until(shlex.split(steps[2], comments=True), env, tmp_path, url, 2, {"published": True})

    serve = shlex.split(steps[3], comments=True)
    assert serve == ["jobq", "serve", "--port", "8080"], serve
    p = subprocess.Popen([*JOBQ_CLI, *serve[1:3], "0"], cwd=tmp_path, env=env, stderr=subprocess.PIPE,
                         stdout=subprocess.DEVNULL, text=True)
    try:
        assert p.stderr is not None
        said = []
        for line in p.stderr:  # "jobq dashboard on http://127.0.0.1:PORT/ ..." once it listens
            said.append(line)
            if line.startswith("jobq dashboard on "):
                break
        else:
            raise AssertionError("jobq serve exited before listening: " + "".join(said))
        base = said[-1].split()[3]
        assert base.startswith("http://127.0.0.1:"), base  # loopback unless told otherwise
        with urllib.request.urlopen(base + "jobs/2", timeout=30) as r:
            page = r.read().decode()
        assert r.status == 200 and "publish" in page and "published" in page, page[:500]
    finally:
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=30)
    assert p.returncode in (0, 130)


@needs("notify_listen")  # the step's worker runs with --listen
def test_the_tutorial_on_postgresql_runs_as_written(tmp_path: pathlib.Path, db_url: str) -> None:
    """Step 6: the same application on PostgreSQL, its commands as written (the install line
    aside) with the suite's database as ``JOBQ_URL``: init, enqueue, and the worker with
    ``--listen`` runs the job."""
    import shlex

    from helpers import JOBQ_CLI

    text = (ROOT / "docs" / "tutorial" / "index.md").read_text()
    _tutorial_app(tmp_path, text)
    lines = [line for line in _fenced(text, "sh")[4].splitlines() if line.strip()]
    assert lines[0].startswith("python3 -m pip install ") and "[postgres]" in lines[0]  # the install: not run here
    export = shlex.split(lines[1], comments=True)
    assert export[0] == "export" and export[1].startswith("JOBQ_URL=postgresql+psycopg://"), export
    env = {**os.environ, "JOBQ_URL": db_url, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    outs = []
    for command in lines[2].split("#")[0].split("&&"):
        args = shlex.split(command)
        assert args[0] == "jobq", args
        done = subprocess.run([*JOBQ_CLI, *args[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stderr == "", (args, done.stderr)
        outs.append(done.stdout.strip())
    worker = shlex.split(lines[3], comments=True)
    assert "--listen" in worker
    _run_worker_until(worker, env, tmp_path, db_url, int(outs[-1]), {"image": 8, "size": "640x480"})
