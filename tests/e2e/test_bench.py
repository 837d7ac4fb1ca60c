"""benchmarks/load_bench.py end to end on a small checkpoint: every path runs, figures and verdicts come out."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.harness import process_cpu_seconds, self_cpu_seconds
from benchmarks.load_bench import (
    BARE_GRPC,
    BASELINE,
    CACHE_GRPC,
    CACHE_TCP,
    CEILING,
    ITER_TENSORS,
    LOAD_INTO_GRPC,
    LOAD_INTO_TCP,
    LOAD_STATE_DICT,
    SERVER_CACHE,
    TLS,
    TLS_GRPC,
    TLS_TCP,
    run_bench,
)

# The bench runs as a process, each path several times.
pytestmark = pytest.mark.slow

HAS_CRYPTOGRAPHY = importlib.util.find_spec("cryptography") is not None
NETWORK_ROWS = (CEILING, BARE_GRPC, LOAD_INTO_TCP, LOAD_INTO_GRPC, ITER_TENSORS, LOAD_STATE_DICT, CACHE_TCP, CACHE_GRPC)
TLS_ROWS = (TLS_TCP, TLS_GRPC)
LOAD_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "load_bench.py"


def test_bench_prints_table_and_writes_json_and_plot(tmp_path: Path) -> None:
    raw, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    result = subprocess.run(
        [sys.executable, str(LOAD_BENCH), "--gb", "0.05", "--runs", "2", "--chunk-bytes", "1048576",
         "--json", str(raw), "--plot", str(plot)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = (BASELINE, *NETWORK_ROWS, *(TLS_ROWS if HAS_CRYPTOGRAPHY else ()))
    for name in rows:
        assert f"| {name} |" in result.stdout
    assert "| client CPU s/GB (min..max) | vs ceiling | server CPU s/GB (min..max) | vs ceiling |" in result.stdout
    for target in (
        "target load_into tcp >= 0.8x the ceiling's GB/s",
        "target load_into tcp client CPU/GB <= 1.3x the ceiling's",
        "target load_into tcp server CPU/GB <= 2x the ceiling's",
        "target load_into grpc >= 0.9x the bare gRPC stream's GB/s",
    ):
        assert target in result.stdout
    if HAS_CRYPTOGRAPHY:
        assert "target load_into tcp+TLS >= 2x the GB/s of grpc+TLS" in result.stdout
    else:
        assert "TLS table skipped" in result.stdout
    assert "ceiling 2" not in result.stdout  # the bare gRPC stream is a reference, not a ceiling

    report = json.loads(raw.read_text())
    assert report["runs"] == 2 and report["chunk_bytes"] == 1 << 20 and report["total_bytes"] > 0
    paths = {p["name"]: p for p in report["paths"]}
    assert set(paths) == set(rows)
    for path in report["paths"]:
        assert len(path["seconds"]) == 2 and all(s > 0 for s in path["seconds"]), path["name"]
        assert len(path["client_cpu"]) == 2 and all(c > 0 for c in path["client_cpu"]), path["name"]
        if path["name"] == BASELINE:
            assert path["server_cpu"] == []  # in this process: no server
        else:
            assert len(path["server_cpu"]) == 2 and all(c > 0 for c in path["server_cpu"]), path["name"]
    for name in (LOAD_INTO_TCP, CACHE_TCP, *(TLS_ROWS[:1] if HAS_CRYPTOGRAPHY else ())):
        assert paths[name]["transport"] == "tcp", name
    for name in (LOAD_INTO_GRPC, CACHE_GRPC, *(TLS_ROWS[1:] if HAS_CRYPTOGRAPHY else ())):
        assert paths[name]["transport"] == "grpc", name
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_on_an_existing_checkpoint(tmp_path: Path) -> None:
    from weightstream.samples import llama_like_state_dict, save_sharded

    state = llama_like_state_dict(layers=1, hidden=128, intermediate=256, vocab=512)
    save_sharded(state, tmp_path / "mine", shards=2)
    result = subprocess.run(
        [sys.executable, str(LOAD_BENCH), "--checkpoint", str(tmp_path / "mine"), "--runs", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"{len(state)} tensors" in result.stdout


def test_bench_runs_only_the_tables_asked_for(tmp_path: Path) -> None:
    from weightstream.samples import llama_like_state_dict, save_sharded

    save_sharded(llama_like_state_dict(layers=1, hidden=128, intermediate=256, vocab=512), tmp_path / "mine", shards=2)
    tables = (SERVER_CACHE, TLS) if HAS_CRYPTOGRAPHY else (SERVER_CACHE,)
    report = run_bench(gb=0, runs=1, chunk_bytes=1 << 20, checkpoint=tmp_path / "mine", tables=tables)
    assert report.tables == list(tables)
    assert [p.name for p in report.paths] == [CEILING, CACHE_TCP, CACHE_GRPC, *(TLS_ROWS if HAS_CRYPTOGRAPHY else ())]
    with pytest.raises(ValueError, match="unknown bench tables"):
        run_bench(gb=0, runs=1, chunk_bytes=1 << 20, checkpoint=tmp_path / "mine", tables=("disk",))


def test_cpu_seconds_count_every_thread_of_a_process() -> None:
    """A child that burns CPU on two threads: its clock and /proc/PID/stat agree; our own clock moves."""
    burn = (
        "import threading, time\n"
        "def spin():\n"
        "    end = time.process_time() + 0.3\n"
        "    while time.process_time() < end: pass\n"
        "t = threading.Thread(target=spin); t.start(); spin(); t.join()\n"
        "print('done', flush=True); time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "done\n"
        fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        assert process_cpu_seconds(child.pid) >= 0.3
        assert abs(process_cpu_seconds(child.pid) - ticks) < 0.05
    finally:
        child.kill()
        child.wait(timeout=10)
    before = self_cpu_seconds()
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert self_cpu_seconds() - before >= 0.05
