"""Collects the race figures and prints the summary table at the end of the run."""

from __future__ import annotations

import pytest

from harness import SUMMARY


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
