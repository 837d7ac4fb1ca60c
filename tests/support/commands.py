"""The `weightstream` command, run as a process: which executable, with what environment, and its result."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

COMMAND_TIMEOUT_S = 60.0


def console_script() -> str | None:
    """The installed `weightstream` script: next to this interpreter first, then on PATH."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return shutil.which("weightstream", path=search)


def weightstream_cmd(how: str = "script") -> list[str]:
    """The command that runs the CLI: the console script, or `python -m weightstream`."""
    if how == "module":
        return [sys.executable, "-m", "weightstream"]
    script = console_script()
    return [script] if script else [sys.executable, "-m", "weightstream"]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without WEIGHTSTREAM_* settings and proxies, plus extra."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("WEIGHTSTREAM_") and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")
    }
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env.update(extra)
    return env


def run_cli(
    *args: str,
    how: str = "script",
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = COMMAND_TIMEOUT_S,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*weightstream_cmd(how), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or clean_env(),
        cwd=cwd,
        check=False,
    )


def describe(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
