"""The package reads and writes as one namespace, as the single file does.

``jobq`` is a package of modules (jobq/__init__.py's ``_MODULES``), while single/jobq.py is one
module: code written against either must work on both. So a name written on the package
(``jobq.TX_RETRIES = 5``, a test's ``monkeypatch.setattr(jobq, "_checkpoint", hook)``) reaches
every module that reads it, and is restored in each when the write is undone; any top-level
name reads as ``jobq.name``. A bug shows as a module still reading the old value after a write
(or the replacement after an undo).
"""

from __future__ import annotations

import os
import pathlib
import pickle
import types

import pytest

import jobq

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = not os.environ.get("JOBQ_TEST_SINGLE_FILE")


def test_the_suite_runs_on_the_layout_it_names() -> None:
    """JOBQ_TEST_SINGLE_FILE runs the suite on single/jobq.py; without it, on the package."""
    expected = ROOT / "jobq" / "__init__.py" if PACKAGE else ROOT / "single" / "jobq.py"
    assert pathlib.Path(jobq.__file__ or "").resolve() == expected


def _holders(name: str) -> list[types.ModuleType]:
    return [m for m in jobq._MODULES if name in vars(m)] if PACKAGE else [jobq]


@pytest.mark.parametrize("name", ["_on_cursor", "TX_RETRIES", "_checkpoint"])
def test_a_write_through_the_package_reaches_every_module_and_its_undo_restores_them(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    holders = _holders(name)
    assert holders and (len(holders) > 1 or not PACKAGE or name != "_checkpoint")  # read by several modules
    real = [vars(m)[name] for m in holders]
    replacement = object()
    for _ in range(2):  # the second round starts from a name the package now holds itself
        with monkeypatch.context() as mp:
            mp.setattr(jobq, name, replacement)
            assert [vars(m)[name] for m in holders] == [replacement] * len(holders)
            assert getattr(jobq, name) is replacement
        assert [vars(m)[name] for m in holders] == real
        assert getattr(jobq, name) is real[0]


@pytest.mark.skipif(not PACKAGE, reason="the single file is one module: there is nothing to reach")
def test_a_plain_module_write_would_leave_the_modules_reading_the_old_value() -> None:
    """BROKEN: a package without _Package (a write lands on the package only) is what the test
    above catches: the module that reads the name still has the old value."""
    real = jobq.fastpath._on_cursor
    types.ModuleType.__setattr__(jobq, "_broken_probe", 1)  # a plain module's setattr
    try:
        types.ModuleType.__setattr__(jobq, "_on_cursor", object())
        assert jobq.fastpath._on_cursor is real
    finally:
        types.ModuleType.__delattr__(jobq, "_on_cursor")
        types.ModuleType.__delattr__(jobq, "_broken_probe")
    assert jobq._on_cursor is real


def test_public_names_live_in_jobq_and_pickle_by_that_name() -> None:
    """Every public class and function names ``jobq`` as its module (reprs, docs, pickles), and
    an error pickled by one layout loads in the other."""
    for name in jobq.__all__:
        obj = getattr(jobq, name)
        if isinstance(obj, type) or callable(obj) and hasattr(obj, "__module__") and not isinstance(obj, types.ModuleType):
            assert obj.__module__ == "jobq", (name, obj.__module__)
    exc = pickle.loads(pickle.dumps(jobq.UniqueKeyHeld("k", 3, 2)))
    assert type(exc) is jobq.UniqueKeyHeld and (exc.key, exc.job_id, exc.spawned_by) == ("k", 3, 2)


def test_any_top_level_name_reads_through_the_package_and_a_missing_one_is_an_attribute_error() -> None:
    assert jobq.MAX_TIMEDELTA is not None and callable(jobq._hot_rows)
    with pytest.raises(AttributeError, match="no attribute '_no_such_name'"):
        jobq._no_such_name  # noqa: B018
