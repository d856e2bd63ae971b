"""Collects the race figures and prints the summary table at the end of the run.

Under pytest-xdist the rows are made on the workers: each worker hands its rows to the
controller in ``workeroutput`` when it finishes, and the controller prints them all.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from harness import SUMMARY


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = getattr(session.config, "workeroutput", None)  # set on xdist workers only
    if out is not None:
        out["race_summary"] = json.dumps(SUMMARY)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: the controller hears a worker finish
def pytest_testnodedown(node: Any, error: Any) -> None:
    SUMMARY.extend(json.loads(getattr(node, "workeroutput", {}).get("race_summary", "[]")))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not SUMMARY:
        return
    tr = terminalreporter
    tr.write_sep("=", "race summary")
    head = f"{'engine':<11}{'check':<34}{'claimers':>8}{'claims':>8}{'dups':>6}{'lost':>6}{'overlap/cap':>13}{'secs':>7}  caught"
    tr.write_line(head)
    for row in SUMMARY:
        tr.write_line(
            f"{row['engine']!s:<11}{row['check']!s:<34}{row.get('claimers', ''):>8}{row.get('claims', ''):>8}"
            f"{row.get('dups', ''):>6}{row.get('lost', ''):>6}{row.get('overlap', ''):>13}{row.get('secs', ''):>7}  {row.get('caught', '')}"
        )
