"""Tiers, measured: a cold three-tier load, a warm restart from the disk cache, and a local model root, side by side.

Every server is `weightstream serve` in its own process on 127.0.0.1; the client is this process,
writing into a module whose memory was touched before the first run. Each round runs every path once:

- cold: s3rver (the checkpoint uploaded once, to a fresh bucket) -> a shared server (--s3-bucket,
  --cache-bytes holding the whole model, restarted before every cold load so its RAM cache is
  empty) -> a sidecar server (--upstream the shared one, --disk-cache DIR, DIR emptied before every
  cold load) -> the client loads s3://BUCKET/PREFIX from the sidecar;
- warm restart: the sidecar killed with SIGKILL once the cold load's files are in its disk cache,
  started again on the same DIR, and the client loads from it; its /status must then say
  upstream_bytes_read_total = 0 (every byte came from the disk cache);
- local: a server with --model-root holding the same files, the same client settings (one server
  for the whole run, which served the model once before the clock started);
- local, fresh server (a reference, not a target): a server on the same model root started just
  before the load, so that the load is the first of its process, as the warm restart's is.

Nothing is evicted from the page cache: the disk cache's files (just written by the cold load) and
the model root's files are warm in it, and so are s3rver's files, so "cold" means cold tiers (an
empty RAM cache upstream, an empty disk cache), not a cold disk. Every load is checked bit for bit
against safetensors.torch.load_file of the source files (the module is scrambled before each load),
so that a broken load cannot be reported as fast. The sidecar's log must be free of errors.

Usage (from the repository root, after `make test` or `npm install --prefix tests/s3` installed
s3rver): .venv/bin/python benchmarks/tier_load.py [--size-mb 400] [--runs 5] [--workdir DIR] [--transport auto]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import stop_process
from tests.support.commands import clean_env
from tests.support.ports import LOOPBACK, free_ports, wait_port
from tests.support.s3_stores import REGION, S3RVER_KEY, s3rver, upload_folder
from tests.support.serve_processes import start_serve
from weightstream.allocator import tune_malloc
from weightstream.client import LoadReport, WeightStreamClient
from weightstream.samples import ParameterTree

BUCKET = "tier-bench"
PREFIX = "llama"
S3_MODEL = f"s3://{BUCKET}/{PREFIX}"
LOCAL_MODEL = PREFIX
SHARDS = 4
TENSORS_PER_SHARD = 6
COLUMNS = 2048
DTYPES = (torch.bfloat16, torch.float32, torch.float16)
START_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 60.0
FILL_COMMIT_TIMEOUT_S = 60.0
HTTP_TIMEOUT_S = 10.0
POLL_S = 0.05
# A log line at these levels, or a traceback, is a failure of the run.
ERROR_LINE = re.compile(r"^\S+ \S+ (ERROR|CRITICAL) |^Traceback ", re.MULTILINE)

COLD = "cold: s3rver -> shared -> sidecar (empty disk cache)"
WARM = "warm restart: sidecar SIGKILLed, restarted on its disk cache"
LOCAL = "local model root"
LOCAL_FRESH = "local model root, fresh server (first load of its process; reference)"
TARGET_WARM_OVER_LOCAL = 0.9
TARGET_WARM_OVER_COLD = 5.0


class BenchFailure(RuntimeError):
    """A server that did not start or logged errors, a load that was not bit-exact, a tier that read upstream."""


# ---------------------------------------------------------------------------------------------
# The checkpoint


def write_checkpoint(folder: Path, size_bytes: int) -> int:
    """SHARDS safetensors files of random float tensors (bfloat16, float32, float16), about size_bytes in all."""
    folder.mkdir(parents=True, exist_ok=True)
    per_tensor = max(1, size_bytes // (SHARDS * TENSORS_PER_SHARD))
    weight_map: dict[str, str] = {}
    total = 0
    for shard in range(SHARDS):
        generator = torch.Generator().manual_seed(shard)
        part: dict[str, torch.Tensor] = {}
        for index in range(TENSORS_PER_SHARD):
            dtype = DTYPES[index % len(DTYPES)]
            rows = max(1, per_tensor // (COLUMNS * dtype.itemsize))
            part[f"model.layers.{shard}.mlp.w{index}.weight"] = torch.randn(rows, COLUMNS, generator=generator).to(
                dtype
            )
        part[f"model.layers.{shard}.norm.weight"] = torch.rand(COLUMNS, generator=generator)
        name = f"model-{shard + 1:05d}-of-{SHARDS:05d}.safetensors"
        save_file(part, str(folder / name))
        weight_map.update(dict.fromkeys(part, name))
        total += sum(t.numel() * t.element_size() for t in part.values())
    index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2))
    return total


def expected_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the source files, as safetensors.torch.load_file reads them."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def scramble(params: dict[str, torch.Tensor]) -> None:
    """Overwrite every parameter with random bytes, so that a load which writes nothing fails the check."""
    for p in params.values():
        p.view(torch.uint8).random_()


def check_exact(params: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], path: str) -> None:
    wrong = [
        name
        for name, want in expected.items()
        if not torch.equal(params[name].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    ]
    if wrong or params.keys() != expected.keys():
        raise BenchFailure(f"{path}: the load is not bit-exact against the source files: {wrong[:5]}")


# ---------------------------------------------------------------------------------------------
# Servers in their own processes


@dataclass
class Server:
    """A `weightstream serve` process on 127.0.0.1, its ports and its log."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    grpc_port: int
    http_port: int

    @property
    def target(self) -> str:
        return f"{LOOPBACK}:{self.grpc_port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def error_lines(self) -> list[str]:
        text = self.output()
        return [text[m.start() : text.find("\n", m.start())] for m in ERROR_LINE.finditer(text)]

    def status(self) -> dict[str, Any]:
        response = httpx.get(f"http://{LOOPBACK}:{self.http_port}/status", timeout=HTTP_TIMEOUT_S, trust_env=False)
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body

    def failure(self, why: str) -> BenchFailure:
        return BenchFailure(f"{self.name}: {why}\n--- {self.log}\n{self.output()}")


class Servers:
    """Every server this run starts; stop_all() kills whichever still run (the benchmark's finally)."""

    def __init__(self, logs: Path, env: dict[str, str]) -> None:
        self.logs = logs
        self.env = env
        self.started: list[Server] = []

    def start(self, name: str, args: list[str]) -> Server:
        """Start a server on free ports; wait (bounded) until /readyz answers 200 and its log shows no error."""
        grpc_port, http_port, data_port = free_ports(3)
        log = self.logs / f"{len(self.started):02d}-{name}.log"
        command = [
            *args,
            "--host",
            LOOPBACK,
            "--grpc-port",
            str(grpc_port),
            "--http-port",
            str(http_port),
            "--data-port",
            str(data_port),
            "--log-level",
            "INFO",
        ]
        server = Server(name, start_serve(command, log, self.env), log, grpc_port, http_port)
        self.started.append(server)
        try:
            wait_port(grpc_port, START_TIMEOUT_S, alive=lambda: server.proc.poll() is None)
            wait_ready(server)
        except (RuntimeError, TimeoutError) as exc:
            raise server.failure(f"did not start ({exc})") from None
        check_log(server)
        return server

    def stop(self, server: Server) -> None:
        if server.proc.poll() is None:
            stop_process(server.proc)

    def kill(self, server: Server) -> None:
        """SIGKILL, as a node losing the process would."""
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(timeout=START_TIMEOUT_S)

    def stop_all(self) -> None:
        for server in self.started:
            if server.proc.poll() is None:
                server.proc.kill()
        for server in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.proc.wait(timeout=START_TIMEOUT_S)


def wait_ready(server: Server) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = "no answer"
    with httpx.Client(trust_env=False, timeout=2.0) as http:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise RuntimeError(f"exited with {server.proc.returncode}")
            try:
                response = http.get(f"http://{LOOPBACK}:{server.http_port}/readyz")
                if response.status_code == 200:
                    return
                last = f"{response.status_code} {response.text}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(POLL_S)
    raise TimeoutError(f"/readyz not 200 after {READY_TIMEOUT_S} s (last: {last})")


def check_log(server: Server) -> None:
    errors = server.error_lines()
    if errors:
        raise server.failure(f"logged {len(errors)} error(s), first: {errors[0]}")


def wait_committed(sidecar: Server, files: int) -> dict[str, Any]:
    """Wait until the sidecar's disk cache holds files complete files and fills none (they are renamed into
    place just after their last byte is served); its /status then."""
    deadline = time.monotonic() + FILL_COMMIT_TIMEOUT_S
    while True:
        status = sidecar.status()
        disk = status["disk_cache"]
        if disk["files"] >= files and disk["filling"] == 0:
            return status
        if time.monotonic() > deadline:
            raise sidecar.failure(f"disk cache not complete after {FILL_COMMIT_TIMEOUT_S} s: {disk}")
        time.sleep(POLL_S)


# ---------------------------------------------------------------------------------------------
# Loads


@dataclass
class PathResult:
    seconds: list[float] = field(default_factory=list)
    transports: set[str] = field(default_factory=set)

    def rates(self, total: int) -> list[float]:
        return sorted(total / s / 1e9 for s in self.seconds)

    def median_rate(self, total: int) -> float:
        return total / statistics.median(self.seconds) / 1e9


class Loader:
    """Loads into one touched module with a fresh client per load; times load_into and checks every load."""

    def __init__(self, module: torch.nn.Module, expected: dict[str, torch.Tensor], transport: str) -> None:
        self.module = module
        self.params = {name: p.data for name, p in module.named_parameters()}
        self.expected = expected
        self.transport = transport
        self.total = sum(t.numel() * t.element_size() for t in expected.values())

    def load(self, server: Server, model: str, path: str, result: PathResult | None = None) -> LoadReport:
        scramble(self.params)
        with WeightStreamClient(server.target, transport=self.transport, progress=False) as client:
            started = time.perf_counter()
            report = client.load_into(self.module, model)
            seconds = time.perf_counter() - started
        if report.missing or report.unexpected or report.bytes != self.total:
            raise BenchFailure(
                f"{path}: loaded {report.bytes} of {self.total} bytes; missing {report.missing[:5]}, "
                f"unexpected {report.unexpected[:5]}"
            )
        check_exact(self.params, self.expected, path)
        if result is not None:
            result.seconds.append(seconds)
            result.transports.add(report.transport)
        return report


# ---------------------------------------------------------------------------------------------
# The run


@dataclass
class Counters:
    """What the servers' /status said, per run."""

    cold_upstream: list[int] = field(default_factory=list)  # sidecar upstream_bytes_read_total after cold
    cold_storage: list[int] = field(default_factory=list)  # shared storage_bytes_read_total after cold
    warm_upstream: list[int] = field(default_factory=list)  # sidecar upstream_bytes_read_total after warm
    warm_hits: list[int] = field(default_factory=list)
    warm_misses: list[int] = field(default_factory=list)
    warm_resident: list[int] = field(default_factory=list)


def run(args: argparse.Namespace, work: Path) -> None:
    for name in ("model", "s3rver-data", "disk-cache", "logs"):
        shutil.rmtree(work / name, ignore_errors=True)
    root = work / "model"
    folder = root / LOCAL_MODEL
    disk_cache = work / "disk-cache"
    (work / "logs").mkdir(parents=True)
    total = write_checkpoint(folder, int(args.size_mb * 1e6))
    file_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    expected = expected_tensors(folder)
    module = ParameterTree({name: (tuple(t.shape), t.dtype) for name, t in expected.items()})
    loader = Loader(module, expected, args.transport)
    results = {COLD: PathResult(), WARM: PathResult(), LOCAL: PathResult(), LOCAL_FRESH: PathResult()}
    counters = Counters()
    env = clean_env(
        AWS_ACCESS_KEY_ID=S3RVER_KEY,
        AWS_SECRET_ACCESS_KEY=S3RVER_KEY,
        AWS_EC2_METADATA_DISABLED="true",
        AWS_REGION=REGION,
    )
    servers = Servers(work / "logs", env)
    problems: list[str] = []
    try:
        with s3rver(work) as store:
            upload_folder(store.client(), folder, BUCKET, PREFIX)
            shared_args = [
                "--s3-bucket",
                BUCKET,
                "--s3-endpoint",
                store.endpoint,
                "--s3-region",
                REGION,
                "--s3-path-style",
                "--cache-bytes",
                str(2 * file_bytes),
                "--drain-seconds",
                "2",
            ]
            local = servers.start("local", ["--model-root", str(root)])
            # Warms this process's client code paths and the model root's pages before the clock.
            loader.load(local, LOCAL_MODEL, LOCAL)
            for round_index in range(args.runs):
                shared = servers.start(f"shared-r{round_index}", shared_args)
                shutil.rmtree(disk_cache, ignore_errors=True)
                sidecar_args = [
                    "--upstream",
                    shared.target,
                    "--disk-cache",
                    str(disk_cache),
                    "--disk-cache-bytes",
                    str(2 * file_bytes + (64 << 20)),
                ]
                sidecar = servers.start(f"sidecar-r{round_index}-cold", sidecar_args)
                loader.load(sidecar, S3_MODEL, COLD, results[COLD])
                status = wait_committed(sidecar, SHARDS)
                check_log(sidecar)
                counters.cold_upstream.append(status["upstream_bytes_read_total"])
                counters.cold_storage.append(shared.status()["storage_bytes_read_total"])

                servers.kill(sidecar)
                sidecar = servers.start(f"sidecar-r{round_index}-warm", sidecar_args)
                loader.load(sidecar, S3_MODEL, WARM, results[WARM])
                status = sidecar.status()
                check_log(sidecar)
                counters.warm_upstream.append(status["upstream_bytes_read_total"])
                counters.warm_hits.append(status["disk_cache"]["hits"])
                counters.warm_misses.append(status["disk_cache"]["misses"])
                counters.warm_resident.append(status["disk_cache"]["resident_bytes"])
                if status["upstream_bytes_read_total"] != 0:
                    problems.append(
                        f"round {round_index}: the warm sidecar read {status['upstream_bytes_read_total']} bytes "
                        "from its upstream (expected 0)"
                    )

                loader.load(local, LOCAL_MODEL, LOCAL, results[LOCAL])
                fresh = servers.start(f"local-fresh-r{round_index}", ["--model-root", str(root)])
                loader.load(fresh, LOCAL_MODEL, LOCAL_FRESH, results[LOCAL_FRESH])
                servers.stop(fresh)

                servers.kill(sidecar)
                servers.stop(shared)
            for server in servers.started:
                errors = server.error_lines()
                if errors:
                    problems.append(f"{server.name} logged errors:\n" + "\n".join(errors))
    except BaseException:
        # The logs that can say why: servers that logged errors or died on their own, else the latest three.
        suspects = [s for s in servers.started if s.error_lines() or s.proc.poll() not in (None, 0, -signal.SIGKILL)]
        for server in suspects or servers.started[-3:]:
            print(f"--- {server.name} ({server.log})\n{server.output()}", file=sys.stderr)
        raise
    finally:
        servers.stop_all()

    report(args, total, file_bytes, results, counters)
    if problems:
        print("\nPROBLEMS:\n" + "\n".join(problems))
        raise SystemExit(1)


def report(
    args: argparse.Namespace, total: int, file_bytes: int, results: dict[str, PathResult], counters: Counters
) -> None:
    transports = sorted(set().union(*(r.transports for r in results.values())))
    print(
        f"checkpoint: {total / 1e9:.3f} GB of tensors ({file_bytes / 1e9:.3f} GB of files), {SHARDS} shards of random "
        f"bfloat16/float32/float16 tensors; {args.runs} rounds (each: every path once); client transport "
        f"{args.transport!r} (used: {', '.join(transports)}); load_into a touched module, fresh client per load"
    )
    print(
        "page cache: nothing evicted. The disk cache's files (just written) and the model root's files are warm "
        "in it for the warm and local loads; s3rver's files are warm too, so 'cold' = empty tiers, not a cold disk."
    )
    print("every load checked bit-exact against safetensors.torch.load_file of the source files: ok")
    print()
    print("| path | GB/s median | min | max |")
    print("|---|---|---|---|")
    for name, result in results.items():
        rates = result.rates(total)
        print(f"| {name} | {result.median_rate(total):.2f} | {rates[0]:.2f} | {rates[-1]:.2f} |")
    print()

    def per_run(values: list[int]) -> str:
        return ", ".join(f"{v:,}" for v in values)

    print(f"cold: sidecar upstream_bytes_read_total per run: {per_run(counters.cold_upstream)}")
    print(f"cold: shared storage_bytes_read_total (from s3rver) per run: {per_run(counters.cold_storage)}")
    print(f"warm: sidecar upstream_bytes_read_total after the warm load, per run: {per_run(counters.warm_upstream)}")
    print(
        f"warm: sidecar disk_cache hits {per_run(counters.warm_hits)}, misses {per_run(counters.warm_misses)}, "
        f"resident_bytes {per_run(counters.warm_resident)}"
    )
    print()
    warm = statistics.median(results[WARM].seconds)
    over_local = statistics.median(results[LOCAL].seconds) / warm
    over_cold = statistics.median(results[COLD].seconds) / warm
    verdict_local = "PASS" if over_local >= TARGET_WARM_OVER_LOCAL else "MISS"
    verdict_cold = "PASS" if over_cold >= TARGET_WARM_OVER_COLD else "MISS"
    print(f"warm / local: {over_local:.2f}x the rate (target >= {TARGET_WARM_OVER_LOCAL}): {verdict_local}")
    print(f"warm / cold:  {over_cold:.2f}x the rate (target >= {TARGET_WARM_OVER_COLD}): {verdict_cold}")
    over_fresh = statistics.median(results[LOCAL_FRESH].seconds) / warm
    print(f"warm / local, fresh server: {over_fresh:.2f}x the rate (reference: both are a process's first load)")


@contextlib.contextmanager
def workdir(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="weightstream-tier-bench-") as tmp:
        yield Path(tmp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=400.0, help="checkpoint size in MB, 10^6 bytes (default 400)")
    parser.add_argument("--runs", type=int, default=5, help="rounds; each loads every path once (default 5)")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="folder for the checkpoint, s3rver's data, the disk cache and the servers' logs, kept afterwards "
        "(its model/, s3rver-data/, disk-cache/ and logs/ are replaced); default: a temporary folder, removed",
    )
    parser.add_argument(
        "--transport", default="auto", help="the client's transport: auto, tcp, grpc or shm (default auto)"
    )
    args = parser.parse_args()
    if args.runs < 1 or args.size_mb <= 0:
        parser.error("--runs must be at least 1 and --size-mb positive")
    tune_malloc()
    # SIGTERM ends the run through the finally blocks, which kill every server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with workdir(args.workdir) as work:
        run(args, work)


if __name__ == "__main__":
    main()
