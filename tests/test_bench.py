"""`weightstream bench` end to end on a small checkpoint: every path runs, figures and verdicts come out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from weightstream.bench import BASELINE, CEILING_GRPC, CEILING_TCP, ITER_TENSORS, LOAD_INTO, LOAD_STATE_DICT

# `weightstream bench` runs as a process, each path several times.
pytestmark = pytest.mark.slow


def test_bench_prints_table_and_writes_json_and_plot(tmp_path: Path) -> None:
    raw, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    result = subprocess.run(
        [sys.executable, "-m", "weightstream", "bench", "--gb", "0.05", "--runs", "2", "--chunk-bytes", "1048576",
         "--json", str(raw), "--plot", str(plot)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for name in (CEILING_TCP, CEILING_GRPC, BASELINE, LOAD_INTO, ITER_TENSORS, LOAD_STATE_DICT):
        assert f"| {name} |" in result.stdout
    assert "target load_into >= 0.9x ceiling 2" in result.stdout
    report = json.loads(raw.read_text())
    assert report["runs"] == 2 and report["chunk_bytes"] == 1 << 20 and report["total_bytes"] > 0
    assert {p["name"] for p in report["paths"]} >= {LOAD_INTO, CEILING_TCP}
    for path in report["paths"]:
        assert len(path["seconds"]) == 2 and all(s > 0 for s in path["seconds"]), path["name"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_on_an_existing_checkpoint(tmp_path: Path) -> None:
    from weightstream.demo import llama_like_state_dict, save_sharded

    state = llama_like_state_dict(layers=1, hidden=128, intermediate=256, vocab=512)
    save_sharded(state, tmp_path / "mine", shards=2)
    result = subprocess.run(
        [sys.executable, "-m", "weightstream", "bench", "--checkpoint", str(tmp_path / "mine"), "--runs", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"{len(state)} tensors" in result.stdout
