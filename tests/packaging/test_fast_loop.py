"""The figure the docs state about `make test-fast`, checked against pytest's own count of the tests it runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# How a doc states the count, on one line: "the 543 tests not marked slow". The Makefile's comment on
# test-fast is the one place that must state it; any other doc that does must agree.
STATED = re.compile(r"\bthe (\d+) tests not marked slow\b")
DOCS = ("Makefile", "README.md", "docs/development.md")


def fast_tests_collected() -> int:
    """How many tests `pytest -m "not slow"` (what `make test-fast` runs) collects here."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, f"collecting failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    counted = re.search(r"^(\d+)/\d+ tests collected", result.stdout, re.MULTILINE)
    assert counted, result.stdout[-3000:]
    return int(counted.group(1))


@pytest.mark.slow  # collects the whole suite in another interpreter: seconds
def test_the_stated_count_of_fast_tests_is_pytests() -> None:
    stated = {doc: [int(n) for n in STATED.findall((ROOT / doc).read_text())] for doc in DOCS}
    assert stated["Makefile"], f"the Makefile's comment on test-fast states no count ({STATED.pattern!r})"
    count = fast_tests_collected()
    for doc, figures in stated.items():
        for figure in figures:
            assert figure == count, (
                f"{doc} says `make test-fast` runs {figure} tests; pytest -m 'not slow' collects {count}: "
                "update the figure (or mark the new tests slow, if they take over about a second)"
            )
