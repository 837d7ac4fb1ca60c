"""deploy/container_test.sh, checked offline: it parses, the server it runs is reachable from loopback only,
and its load goes over the data port.

The script needs root, podman and debootstrap and takes minutes, so it is not run here: its text
is checked (bash -n, shellcheck where installed, and the podman command lines it gives).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from weightstream.cli import build_parser

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "container_test.sh"


def _podman_calls(verb: str) -> list[str]:
    """The script's `podman VERB ...` command lines, continuation lines joined."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    return [line for line in text.splitlines() if re.search(rf'"\$\{{PODMAN\[@\]\}}" {verb}\b', line)]


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck_finds_nothing() -> None:
    result = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_served_container_listens_on_loopback_only() -> None:
    """Host networking puts the container's listeners on the host: a plaintext, token-less server
    must not listen on every interface while the test runs."""
    (run,) = _podman_calls("run")
    assert "--network host" in run
    assert "-e WEIGHTSTREAM_HOST=127.0.0.1" in run or '-e "WEIGHTSTREAM_HOST=127.0.0.1"' in run, run


def test_clean_up_removes_the_containers_volumes() -> None:
    """The image declares a volume (/cache); `podman rm` without -v leaves it behind."""
    removals = _podman_calls("rm")
    assert removals
    for line in removals:
        assert re.search(r"\brm (-f -v|-v -f|-fv|-vf)\b", line), line


def test_the_load_goes_over_a_data_port_of_its_own() -> None:
    """The container gets a free data port, picked with the gRPC and REST ports so that the three differ,
    and the load asks for the data port (--transport tcp), so that a fallback to gRPC fails the test."""
    (run,) = _podman_calls("run")
    assert '-e "WEIGHTSTREAM_DATA_PORT=$data_port"' in run, run
    text = SCRIPT.read_text()
    count = re.search(r"ports=\$\(.*for _ in range\((\d+)\)", text)
    names = re.search(r"read -r ([a-z_ ]+) <<<\"\$ports\"", text)
    assert count is not None and names is not None
    assert names.group(1).split() == ["grpc_port", "data_port", "http_port"] and int(count.group(1)) == 3
    (load,) = [line for line in text.splitlines() if "-m weightstream load" in line]
    argv = shlex.split(load)
    args = build_parser().parse_args(argv[argv.index("weightstream") + 1 :])
    assert args.transport == "tcp" and args.target == "127.0.0.1:$grpc_port"
