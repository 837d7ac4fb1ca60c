"""The SGLang tests' pieces: a tiny Llama SGLang runs on this CPU, and engine sessions in .venv-sglang.

SGLang is not installed where pytest runs: an engine session is tests/support/sglang_scripts/session.py
run by path with .venv-sglang's interpreter (built by scripts/sglang_venv.sh, which also holds the
CPU-only workaround for sgl_kernel), and `python -m sglang.launch_server` for the HTTP server.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
import transformers

from tests.support.ports import LOOPBACK, free_ports
from tests.support.vllm_runs import ensure_engine_venv, vllm_llama_config, write_vllm_llama

ROOT = Path(__file__).resolve().parents[2]
SGLANG_VENV = Path(os.environ.get("SGLANG_VENV", ROOT / ".venv-sglang"))
SGLANG_PYTHON = SGLANG_VENV / "bin" / "python"
BUILD_SCRIPT = ROOT / "scripts" / "sglang_venv.sh"
SESSION_SCRIPT = Path(__file__).resolve().parent / "sglang_scripts" / "session.py"
# Importing SGLang alone takes about 30 s here, an engine start as much again.
ENGINE_TIMEOUT_S = 400
# As session.py asks its engine.
PROMPT_IDS = [[1, 5, 6, 7, 8], [1, 10, 200, 30], [1, 5, 5, 5, 5, 5, 5]]
MAX_TOKENS = 8

_LOADED_LINE = re.compile(r"weightstream: loaded .* in ([0-9.]+) s \(.*")
_UPDATED_LINE = re.compile(r"weightstream: updated .*")
# SGLang's own start-up line for the weights (either loader): "Load weight end. elapsed=0.15 s".
_LOAD_END = re.compile(r"Load weight end\. elapsed=([0-9.]+) s")


def sglang_llama_config(**shape: Any) -> transformers.LlamaConfig:
    """vllm_llama_config's tiny Llama, with the architecture SGLang reads from config.json."""
    config = vllm_llama_config(**shape)
    config.architectures = ["LlamaForCausalLM"]
    return config


def write_sglang_llama(folder: Path, config: transformers.LlamaConfig, seed: int = 4321) -> int:
    """A random float32 Llama of config in 2 safetensors shards with config and tokenizer; its bytes."""
    return write_vllm_llama(folder, config, seed=seed, dtype=torch.float32)


def sglang_env() -> dict[str, str]:
    """The environment of an SGLang process here: CPU engine, no CUDA device, unbuffered output."""
    return dict(os.environ, SGLANG_USE_CPU_ENGINE="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")


def ensure_sglang_venv() -> None:
    """Build .venv-sglang when it is missing (scripts/sglang_venv.sh); fail, with its output, when that fails."""
    ensure_engine_venv("SGLang", BUILD_SCRIPT, SGLANG_PYTHON, timeout=1800)


@dataclass(frozen=True)
class Session:
    """What one engine session printed: a record per step, the engine's start-up time, and its log."""

    steps: list[dict[str, Any]]
    init_seconds: float
    log: str

    def step(self, index: int) -> dict[str, Any]:
        """Step index's record, which must have succeeded."""
        record = self.steps[index]
        assert record["ok"], f"step {index} ({record['do']}) failed: {record.get('error')}\n{self.log[-6000:]}"
        return record

    def tokens(self, index: int) -> list[list[int]]:
        return list(self.step(index)["token_ids"])

    @property
    def loaded_lines(self) -> list[str]:
        return [m.group(0) for m in _LOADED_LINE.finditer(self.log)]

    @property
    def updated_lines(self) -> list[str]:
        return [m.group(0) for m in _UPDATED_LINE.finditer(self.log)]

    @property
    def load_seconds(self) -> float | None:
        """SGLang's own measure of its weight load (the slowest rank's), either loader."""
        loads = [float(m.group(1)) for m in _LOAD_END.finditer(self.log)]
        return max(loads) if loads else None


def _session_process(spec: dict[str, Any], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SGLANG_PYTHON), str(SESSION_SCRIPT), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
        cwd=cwd,
        env=sglang_env(),
        check=False,
    )


def run_session(spec: dict[str, Any], cwd: Path) -> tuple[dict[str, Any], str]:
    """session.py with spec in .venv-sglang: its RESULT and its log (stdout and stderr)."""
    started = time.perf_counter()
    result = _session_process(spec, cwd)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    log = result.stdout + result.stderr
    if result.returncode != 0 or not lines:
        raise AssertionError(
            f"the SGLang session failed (exit {result.returncode}, {time.perf_counter() - started:.0f} s)\n"
            f"--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-8000:]}"
        )
    return json.loads(lines[-1].removeprefix("RESULT ")), log


def engine_session(engine: dict[str, Any], steps: list[dict[str, Any]], cwd: Path) -> Session:
    """One SGLang Engine(**engine) (on top of session.py's CPU settings) running steps in order."""
    printed, log = run_session({"engine": engine, "steps": steps}, cwd)
    return Session(printed["steps"], printed["init_seconds"], log)


def engine_sessions(specs: list[dict[str, Any]], cwd: Path) -> list[Session]:
    """Each spec's engine (spec: {"engine": {...}, "steps": [...]}) started in turn in one process
    (SGLang imported once), each of which must start: their Sessions (sharing the process's log)."""
    printed, log = run_session({"starts": specs}, cwd)
    sessions = []
    for one in printed["starts"]:
        assert one["ok"], f"an SGLang engine did not start: {one['error']}\n{log[-6000:]}"
        sessions.append(Session(one["steps"], one["init_seconds"], log))
    return sessions


def failed_start(engine: dict[str, Any], cwd: Path) -> str:
    """Engine(**engine), which must fail to start: the log of its process."""
    result = _session_process({"engine": engine, "steps": []}, cwd)
    log = result.stdout + result.stderr
    assert result.returncode != 0 and "RESULT " not in result.stdout, f"the engine started:\n{log[-4000:]}"
    return log


@contextlib.contextmanager
def serving_sglang(config_dir: Path, target: str, model: str, log: Path) -> Iterator[str]:
    """`python -m sglang.launch_server` on config_dir with load_format weightstream from target, float32 on
    the CPU; yields its base URL once /health answers, and stops it on the way out."""
    (port,) = free_ports(1)
    base = f"http://{LOOPBACK}:{port}"
    args = [
        str(SGLANG_PYTHON),
        *("-W", "ignore", "-m", "sglang.launch_server"),
        *("--model-path", str(config_dir), "--host", LOOPBACK, "--port", str(port)),
        *("--load-format", "weightstream"),
        *("--model-loader-extra-config", json.dumps({"target": target, "model": model})),
        *("--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_native"),
        *("--sampling-backend", "pytorch", "--skip-tokenizer-init", "--mem-fraction-static", "0.3"),
        *("--max-total-tokens", "2048", "--disable-cuda-graph", "--random-seed", "0"),
    ]
    with log.open("w") as sink:
        server = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT, env=sglang_env(), cwd=log.parent)
    try:
        with httpx.Client(trust_env=False) as http:
            deadline = time.monotonic() + ENGINE_TIMEOUT_S
            while time.monotonic() < deadline and server.poll() is None:
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(f"{base}/health", timeout=2.0).status_code == 200:
                        break
                time.sleep(0.5)
            else:
                raise AssertionError(
                    f"launch_server did not come up (exit {server.poll()}):\n{log.read_text()[-6000:]}"
                )
        yield base
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def served_tokens(http: httpx.Client, base: str) -> list[list[int]]:
    """Greedy token ids of PROMPT_IDS from an SGLang server's /generate, as session.py asks its engine."""
    body = {
        "input_ids": PROMPT_IDS,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True},
    }
    response = http.post(f"{base}/generate", json=body, timeout=120.0)
    assert response.status_code == 200, response.text
    return [list(out["output_ids"]) for out in response.json()]
