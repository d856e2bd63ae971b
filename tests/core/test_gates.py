"""The test gates' rule, as a test: a test that runs on some engines only asks a capability
(``@needs("row_locks")``, decided from the drivers' facts, so a new engine is gated by what it
can do); ``@only("sqlite")`` names engines only for a test of one engine's own behaviour (its
error codes, its planner, its driver's lock file), and says why on the same line.

ONLY_GATES counts the ``@only`` gates: a new one must be an engine's own behaviour, not a
capability question in disguise. Lower the count when one goes; raise it only for such a test.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from dbs import ALL_DIALECTS, needs

TESTS = pathlib.Path(__file__).resolve().parents[1]
#: The @only gates today (each commented with why it names engines).
ONLY_GATES = 40


def _gates(source: str) -> list[tuple[int, str, bool]]:
    """(line, the gate's text, whether that line says why) for every call of ``only(...)``."""
    lines = source.splitlines()
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "only":
            text = lines[n.lineno - 1]
            comment = text.partition("#")[2].strip() if "#" in text[n.end_col_offset:] else ""
            out.append((n.lineno, text.strip(), bool(comment)))
    return out


def _all_gates() -> list[tuple[str, int, str, bool]]:
    return [(str(p.relative_to(TESTS)), *g) for p in sorted(TESTS.rglob("*.py")) for g in _gates(p.read_text())]


def test_every_only_gate_says_why_it_names_engines() -> None:
    silent = [f"{f}:{line}: {text}" for f, line, text, why in _all_gates() if not why]
    assert silent == [], "an @only gate without a comment saying why: " + "; ".join(silent)


def test_the_only_gates_do_not_grow() -> None:
    gates = _all_gates()
    assert len(gates) <= ONLY_GATES, (
        f"{len(gates)} @only gates, {ONLY_GATES} allowed: a test for a capability asks @needs(fact)")


def test_the_gate_check_catches_a_gate_without_a_reason() -> None:
    """BROKEN: a gate with no comment, and one whose only '#' is inside the call's strings."""
    src = '@only("sqlite")\ndef t(): ...\n@only("a#b")\ndef u(): ...\n@only("sqlite")  # why\ndef v(): ...\n'
    assert [why for _, _, why in _gates(src)] == [False, False, True]


def test_needs_refuses_a_fact_the_drivers_do_not_have() -> None:
    with pytest.raises(AttributeError, match="no such fact"):
        needs("row_lock")  # a misspelt fact would otherwise gate the test off every engine
    assert set(needs("row_locks")(lambda: None).jobq_dialects) | set(
        needs(no="row_locks")(lambda: None).jobq_dialects) == set(ALL_DIALECTS)
