"""Prints what the kill loop did, per engine, at the end of the run."""

from __future__ import annotations

import pytest

from procs import SUMMARY


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if SUMMARY:
        terminalreporter.write_sep("=", "crash summary")
        for line in SUMMARY:
            terminalreporter.write_line(line)
