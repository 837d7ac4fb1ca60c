"""Figures that the reliability tests (chaos, load, fuzz) record, printed together at the end of the run.

Tests call record(section, **figures); the terminal summary prints one block per section, so that a
run's log shows what load was held, which faults were survived and how many bad inputs were tried.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

_FIGURES: dict[str, dict[str, Any]] = defaultdict(dict)


def record(section: str, **figures: Any) -> None:
    """Add (or add to, for numbers already recorded) the figures of section."""
    current = _FIGURES[section]
    for key, value in figures.items():
        if isinstance(value, int | float) and isinstance(current.get(key), int | float):
            current[key] += value
        else:
            current[key] = value


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _FIGURES:
        return
    terminalreporter.section("reliability summary")
    for section in sorted(_FIGURES):
        terminalreporter.write_line(f"{section}:")
        for key, value in _FIGURES[section].items():
            shown = f"{value:,.3f}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else value
            terminalreporter.write_line(f"  {key}: {shown}")
