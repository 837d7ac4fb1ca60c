"""Packaging: the client installs without the server's dependencies, the generated code matches proto/,
the public names are in order, and the package is marked as typed."""

from __future__ import annotations

import importlib
import importlib.resources
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import weightstream
import weightstream.client

ROOT = Path(__file__).resolve().parents[2]
SERVER_ONLY = ("runai_model_streamer", "fastapi", "uvicorn", "safetensors", "boto3")
# The start of a script run in a fresh interpreter: any import of a server-only package fails there.
BLOCK_SERVER_ONLY = f"""
import importlib.abc
import sys

BLOCKED = {SERVER_ONLY!r}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked (server-only)")
        return None

sys.meta_path.insert(0, Block())
"""
GENERATED = ("weightstream_pb2.py", "weightstream_pb2.pyi", "weightstream_pb2_grpc.py")


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        check=False,
    )


def describe(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


@pytest.mark.slow
def test_client_and_cli_import_without_server_dependencies(tmp_path: Path) -> None:
    code = BLOCK_SERVER_ONLY + textwrap.dedent("""
        for name in BLOCKED:
            sys.modules.pop(name, None)

        # The blocker works: the server itself cannot be imported.
        try:
            from weightstream_server import create_server  # noqa: F401
        except ImportError:
            pass
        else:
            raise SystemExit("weightstream_server imported although its dependencies are blocked")

        import weightstream.cli
        import weightstream.client
        from weightstream.client import WeightStreamClient

        client = WeightStreamClient("127.0.0.1:1")
        client.close()
        assert weightstream.cli.build_parser().prog == "weightstream"
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
        print("ok")
    """)
    result = run_python(code, tmp_path)
    assert result.returncode == 0, describe(result)
    assert result.stdout.strip() == "ok", describe(result)


@pytest.mark.slow
def test_client_import_loads_no_server_modules(tmp_path: Path) -> None:
    code = f"""
        import sys
        import weightstream.client
        print(",".join(sorted(m for m in sys.modules if m.split(".")[0] in {SERVER_ONLY!r})))
        print("weightstream_server" in sys.modules)
    """
    result = run_python(code, tmp_path)
    assert result.returncode == 0, describe(result)
    loaded, server_loaded = result.stdout.splitlines()
    assert loaded == "", f"importing weightstream.client loaded server-only modules: {loaded}"
    assert server_loaded == "False"


def test_generated_grpc_code_matches_proto(tmp_path: Path) -> None:
    out = tmp_path / "generated"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate_proto.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, describe(result)
    generated = sorted(p.name for p in out.iterdir())
    assert generated == sorted(GENERATED)
    committed = ROOT / "client" / "weightstream" / "v1"
    stale = [name for name in generated if (out / name).read_bytes() != (committed / name).read_bytes()]
    assert not stale, f"client/weightstream/v1 is out of date with proto/ (run `make proto`): {stale}"


def test_client_all_is_sorted_and_importable() -> None:
    names = weightstream.client.__all__
    assert names, "weightstream.client.__all__ is empty"
    assert list(names) == sorted(names)
    assert len(set(names)) == len(names)
    module = importlib.import_module("weightstream.client")
    missing = [name for name in names if not hasattr(module, name)]
    assert not missing, missing
    namespace: dict[str, object] = {}
    exec("from weightstream.client import *", namespace)
    assert set(names) <= namespace.keys()


def test_package_ships_py_typed() -> None:
    marker = importlib.resources.files("weightstream").joinpath("py.typed")
    assert marker.is_file(), f"{marker} missing"
    assert (Path(weightstream.__file__).parent / "py.typed").is_file()


@pytest.mark.slow
def test_protocol_imports_with_the_client_dependencies_only_and_neither_side(tmp_path: Path) -> None:
    code = BLOCK_SERVER_ONLY + textwrap.dedent("""
        import weightstream.protocol
        from weightstream.protocol import dtypes, framing, names, shm, tcp, wire  # noqa: F401

        sides = sorted(m for m in sys.modules if m.startswith(("weightstream.client", "weightstream_server")))
        print(",".join(sides) or "none")
    """)
    result = run_python(code, tmp_path)
    assert result.returncode == 0, describe(result)
    assert result.stdout.strip() == "none", f"importing weightstream.protocol loaded {result.stdout.strip()}"


def test_no_protocol_module_imports_the_client_or_the_server() -> None:
    import ast

    offenders = []
    for path in sorted((ROOT / "client" / "weightstream" / "protocol").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            offenders += [
                f"{path.name}: {t}" for t in targets if t.startswith(("weightstream.client", "weightstream_server"))
            ]
    assert not offenders, offenders


@pytest.mark.slow
def test_the_wheel_holds_the_packages_and_no_benchmark_or_test_code(tmp_path: Path) -> None:
    import shutil
    import zipfile

    # Built from a copy of what the wheel is made of: a build/ folder in the checkout would carry stale files.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("client", "service"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), source],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, describe(result)
    (wheel,) = tmp_path.glob("weightstream-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for expected in (
        "weightstream/protocol/wire.py",
        "weightstream/client/facade.py",
        "weightstream/samples.py",
        "weightstream_server/assembly.py",
        "weightstream_server/serving/reader.py",
        "weightstream_server/transports/shm/servicer.py",
    ):
        assert expected in names, f"{expected} missing from {wheel.name}"
    tops = sorted({n.split("/")[0] for n in names if not n.startswith("weightstream-")})
    assert tops == ["weightstream", "weightstream_server"], tops
    harness = [n for n in names if "bench" in n.rsplit("/", 1)[-1] or "harness" in n or "/tests/" in n]
    assert not harness, f"{wheel.name} ships benchmark or test code: {harness}"


TEST_ONLY = {"moto", "schemathesis", "pytest", "mypy", "hypothesis", "ruff", "transformers", "grpcio-tools"}


def _closure(name: str, extras: frozenset[str]) -> set[str]:
    """The installed distributions that `pip install name[extras]` requires, transitively (by metadata)."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    pending = [(name, extras)]
    while pending:
        current, wanted = pending.pop()
        key = canonicalize_name(current)
        if key in seen and not wanted:
            continue
        seen.add(key)
        try:
            requires = distribution(current).requires or []
        except PackageNotFoundError:
            continue
        for line in requires:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in (*wanted, "")):
                if canonicalize_name(requirement.name) != key or requirement.extras - wanted:
                    pending.append((requirement.name, frozenset(requirement.extras)))
    return seen


def test_the_demo_install_pulls_no_test_only_package() -> None:
    """`make demo` installs weightstream[server]; nothing of the dev extra may come with it."""
    runtime = _closure("weightstream", frozenset({"server"}))
    assert {"grpcio", "torch", "runai-model-streamer", "fastapi"} <= runtime, sorted(runtime)
    assert not runtime & TEST_ONLY, sorted(runtime & TEST_ONLY)
    # The check can fail: the dev extra does pull them.
    assert TEST_ONLY - {"grpcio-tools"} <= _closure("weightstream", frozenset({"dev"}))
