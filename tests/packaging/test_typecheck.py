"""The type check sees across modules: mypy, configured as `make typecheck` runs it, resolves every
weightstream import and fails on a type error made in one module against another's signature."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def mypy(tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    """mypy with the project's configuration on one probe module that imports the packages."""
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent(code))
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), str(probe)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        check=False,
    )


def test_imports_resolve_to_the_real_classes(tmp_path: Path) -> None:
    result = mypy(
        tmp_path,
        """
        from weightstream.client import WeightStreamClient, WeightStreamError
        from weightstream_server import WeightStreamServer

        reveal_type(WeightStreamError)
        reveal_type(WeightStreamClient.manifest)
        reveal_type(WeightStreamServer)
        """,
    )
    out = result.stdout
    assert "weightstream.client.errors.WeightStreamError" in out, out
    assert "weightstream.client.manifest.Manifest" in out, out
    assert "weightstream_server.assembly.WeightStreamServer" in out, out
    assert "Any" not in out, out
    assert result.returncode == 0, out


def test_a_cross_module_type_error_fails_the_check(tmp_path: Path) -> None:
    result = mypy(
        tmp_path,
        """
        from weightstream.protocol import wire

        wire.crc32c("not bytes")
        """,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert 'Argument 1 to "crc32c" has incompatible type "str"' in result.stdout, result.stdout
