"""Process-wide limits the server sets at start-up: streams hold a descriptor per file they read."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest


@pytest.mark.slow  # a Python process that imports the server: seconds
def test_the_open_file_soft_limit_is_raised_to_the_hard_limit() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(256, hard)

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))

    code = (
        "import resource\n"
        "from weightstream_server.assembly import raise_open_file_limit\n"
        "before = resource.getrlimit(resource.RLIMIT_NOFILE)[0]\n"
        "raise_open_file_limit()\n"
        "print(before, *resource.getrlimit(resource.RLIMIT_NOFILE))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, preexec_fn=lower, check=False
    )
    assert result.returncode == 0, result.stderr
    before, soft, now_hard = (int(v) for v in result.stdout.split())
    assert before == low
    assert now_hard == hard
    assert soft == hard or (hard == resource.RLIM_INFINITY and soft > low)
