"""The vLLM test's pieces: a tiny Llama vLLM can run on CPU, its tokenizer, and engine runs in .venv-vllm.

The engine runs and the loader checks are scripts in vllm_scripts/, run by path with .venv-vllm's
interpreter (vLLM is not installed where pytest runs).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.support.ports import LOOPBACK, free_ports
from weightstream.samples import save_sharded

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
BUILD_SCRIPT = ROOT / "scripts" / "vllm_venv.sh"
SCRIPTS = Path(__file__).resolve().parent / "vllm_scripts"
ENGINE_SCRIPT = SCRIPTS / "engine.py"
LOADER_CHECKS_SCRIPT = SCRIPTS / "loader_checks.py"
VOCAB = 512
ENGINE_TIMEOUT_S = 300
# How long the processes a run started may take to end after it (an engine core notices its parent's end).
LEFTOVER_GRACE_S = 30.0

# Each loader's own line for its load_weights: vLLM's DefaultModelLoader prints 2 decimals.
_DEFAULT_LOADER_LINE = re.compile(r"Loading weights took ([0-9.]+) seconds")
_WEIGHTSTREAM_LINE = re.compile(r"weightstream: loaded .* in ([0-9.]+) s \(.*")
_RECEIVED = re.compile(r": (\d+) bytes in ")


def vllm_llama_config(
    hidden: int = 128,
    layers: int = 2,
    intermediate: int = 256,
    *,
    vocab: int = VOCAB,
    kv_heads: int | None = None,
    tied: bool = False,
) -> transformers.LlamaConfig:
    """A tiny Llama with head size 64 (DESIGN.md: smaller heads and bfloat16 crash vLLM's CPU kernels).

    kv_heads fewer than hidden // 64 gives grouped-query attention; a vocab that is no multiple of
    64 is padded by vLLM; tied shares the embedding with the output layer (no lm_head.weight).
    """
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=kv_heads or hidden // 64,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        # Larger than the default 0.02, so that random weights give varied greedy tokens.
        initializer_range=0.2,
        torch_dtype="float32",
    )


def write_tokenizer(folder: Path, vocab_size: int = VOCAB) -> None:
    """A WordLevel tokenizer over the words <unk> <s> </s> w3 .. w(vocab_size - 1), built offline."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(str(folder))


def write_config_folder(folder: Path, config: transformers.LlamaConfig) -> None:
    """config.json and the tokenizer: all vLLM reads from its model folder when the weights are streamed."""
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(folder))
    write_tokenizer(folder, config.vocab_size)


def write_vllm_llama(
    folder: Path, config: transformers.LlamaConfig, seed: int = 4321, dtype: torch.dtype = torch.float32
) -> int:
    """A random Llama of config in 2 safetensors shards of dtype with an index, plus config and tokenizer;
    returns its bytes. A tied model's checkpoint has no lm_head.weight, as Hugging Face saves it."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    state = {k: v.to(dtype).contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_sharded(state, folder, shards=2)
    write_config_folder(folder, config)
    return sum(t.numel() * t.element_size() for t in state.values())


def ensure_vllm_venv() -> None:
    """Build .venv-vllm when it is missing (scripts/vllm_venv.sh); fail, with its output, when that fails."""
    ensure_engine_venv("vLLM", BUILD_SCRIPT, VLLM_PYTHON, timeout=1200)


def ensure_engine_venv(engine: str, script: Path, python: Path, *, timeout: float) -> None:
    """Run an engine's environment script (it returns at once when the environment is built); fail,
    with its output, when it fails or leaves no interpreter at python."""
    started = time.perf_counter()
    command = ["bash", str(script)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)
    if result.returncode != 0 or not python.exists():
        raise AssertionError(
            f"could not build the {engine} environment {python.parent.parent} with {script} "
            f"(exit {result.returncode} after {time.perf_counter() - started:.0f} s); the {engine} tests need it.\n"
            f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
        )


@dataclass(frozen=True)
class EngineRun:
    """What one engine run printed: the generated tokens, the loader's load_weights time (its slowest
    rank's), LLM(...)'s time."""

    token_ids: list[list[int]]
    init_seconds: float
    load_seconds: float | None
    weightstream_line: str | None
    wall_seconds: float
    # Every rank's line (one per rank), in the order printed, and the bytes each says it received.
    weightstream_lines: list[str]

    @property
    def received_bytes(self) -> list[int]:
        return [int(m.group(1)) for line in self.weightstream_lines if (m := _RECEIVED.search(line))]


def run_engine(model_dir: Path, load_format: str, extra: dict[str, object] | None = None, *, tp: int = 1) -> EngineRun:
    """Build a vLLM LLM on model_dir in .venv-vllm (a subprocess), generate greedily, return what it printed.

    tp > 1 runs that many CPU workers, one core each (vLLM refuses several CPU workers on one NUMA
    node unless each is bound to its own cores).
    """
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    started = time.perf_counter()
    result = subprocess.run(
        [str(VLLM_PYTHON), str(ENGINE_SCRIPT), str(model_dir), load_format, json.dumps(extra or {}), str(tp)],
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
        cwd=model_dir.parent,
        env=env,
        check=False,
    )
    wall = time.perf_counter() - started
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise AssertionError(
            f"vLLM with load_format={load_format!r} on {model_dir} failed (exit {result.returncode}, {wall:.0f} s)\n"
            f"--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-8000:]}"
        )
    printed = json.loads(lines[-1].removeprefix("RESULT "))
    logs = result.stdout + result.stderr
    line = _WEIGHTSTREAM_LINE.search(logs)
    # One line per rank: the load took as long as its slowest rank.
    loads = [float(m.group(1)) for m in (_WEIGHTSTREAM_LINE if line else _DEFAULT_LOADER_LINE).finditer(logs)]
    return EngineRun(
        token_ids=printed["token_ids"],
        init_seconds=printed["init_seconds"],
        load_seconds=max(loads) if loads else None,
        weightstream_line=line.group(0) if line else None,
        wall_seconds=wall,
        weightstream_lines=[m.group(0) for m in _WEIGHTSTREAM_LINE.finditer(logs)],
    )


def session_processes(session: int) -> dict[int, str]:
    """The live processes (pid: name) of a session: a process started with start_new_session=True (its id is
    its pid) and all that it and they started, unless one left with setsid."""
    found: dict[int, str] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            name, fields = stat.read_text().rsplit(")", 1)
            state, _ppid, _pgrp, sid = fields.split()[:4]
            if int(sid) == session and state != "Z":
                found[int(stat.parent.name)] = name.split("(", 1)[1]
    return found


def end_session(session: int, grace: float = LEFTOVER_GRACE_S) -> dict[int, str]:
    """Wait up to grace seconds for a session's processes to end, kill those left with SIGKILL; return them."""
    deadline = time.monotonic() + grace
    while (left := session_processes(session)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


# The prompts the served engines are asked for, as engine.py asks its LLM.
PROMPTS = ["w1 w2 w3 w4", "w10 w200 w30", "w5 w5 w5 w5 w5 w5"]


@contextlib.contextmanager
def serving_vllm(config_dir: Path, target: str, model: str, log: Path, *, tp: int = 1) -> Iterator[str]:
    """`vllm serve` (its OpenAI server module) on config_dir with load_format weightstream from target and
    the weightstream weight-transfer backend, its RL routes on (VLLM_SERVER_DEV_MODE=1), float32, greedy
    runs reproducible; yields its base URL once /health answers, and stops it on the way out."""
    (port,) = free_ports(1)
    base = f"http://{LOOPBACK}:{port}"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1")
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    # The server's own entry (the `vllm` script asks for package metadata this environment's build lacks).
    args = [
        str(VLLM_PYTHON),
        *("-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server"),
        *("--model", str(config_dir)),
        *("--host", LOOPBACK, "--port", str(port), "--load-format", "weightstream"),
        *("--model-loader-extra-config", json.dumps({"target": target, "model": model})),
        *("--weight-transfer-config", json.dumps({"backend": "weightstream"})),
        *("--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--seed", "0"),
        *("--tensor-parallel-size", str(tp)),
    ]
    with log.open("w") as sink:
        engine = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=log.parent)
    try:
        with httpx.Client(trust_env=False) as http:
            deadline = time.monotonic() + ENGINE_TIMEOUT_S
            while time.monotonic() < deadline and engine.poll() is None:
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(f"{base}/health", timeout=2.0).status_code == 200:
                        break
                time.sleep(0.5)
            else:
                raise AssertionError(f"vllm serve did not come up (exit {engine.poll()}):\n{log.read_text()[-6000:]}")
        yield base
    finally:
        engine.terminate()
        try:
            engine.wait(timeout=30)
        except subprocess.TimeoutExpired:
            engine.kill()


def served_completions(http: httpx.Client, base: str, model: str) -> list[list[int]]:
    """Greedy token ids of PROMPTS from a vLLM OpenAI server, as engine.py asks its LLM for them."""
    body = {
        "model": model,
        "prompt": PROMPTS,
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = http.post(f"{base}/v1/completions", json=body, timeout=120.0)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    return [list(c["token_ids"]) for c in choices]
