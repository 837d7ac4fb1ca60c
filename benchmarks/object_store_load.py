"""Load a checkpoint from Google Cloud Storage and Azure Blob emulators on 127.0.0.1 three ways, side by side.

Per store (gcp-storage-emulator for gs://, Azurite over TLS for az://; tests/support/object_stores.py
says how each is reached):

- weightstream: `weightstream serve --gcs-bucket/--azure-container` (its own process) reads the
  objects with the Run:ai streamer's backend for the store; the client writes into a module's
  existing parameters from the server's data port (what transport="auto" takes from another host),
  and again over gRPC alone;
- the Run:ai streamer reading the store directly (SafetensorsStreamer, owned=False) in a process
  of its own set up like the server's, each tensor copied into the module's parameter: the baseline
  of the "<= 1.2x" goal;
- the store's SDK downloading every shard to local disk, then safetensors.torch.load_file and
  module.load_state_dict (the usual "download, then load"): the baseline of the "<= 0.6x" goal.

Every path writes into a module of the same shapes whose memory was touched before the first run.
Prints medians and spreads of --runs runs per path, the ratios, and the CPU seconds of a load on
each side: the processes that load (weightstream: its server and client) and the emulator. On a
host of few cores they say where the time goes when every process wants one.

Usage (from the repository root, after `make test`): python benchmarks/object_store_load.py [--gb 0.5] [--runs 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import process_cpu_seconds, self_cpu_seconds, write_checkpoint
from tests.support.commands import clean_env
from tests.support.object_stores import (
    azurite_tls,
    gcs_client,
    gcs_emulator,
    namespaced,
    upload_azure,
    upload_gcs,
)
from tests.support.ports import LOOPBACK, free_ports
from tests.support.serve_processes import serve_process, wait_grpc_ready
from weightstream.client import WeightStreamClient
from weightstream.samples import ParameterTree

BUCKET = "bench"
# The client's default (transport="auto") on another host than the server's: its data port.
TCP = "tcp"
WEIGHTSTREAM = "weightstream load_into (data port, the default)"
OVER_GRPC = "weightstream load_into over gRPC"
STREAMER = "Run:ai streamer on its own"

# The Run:ai streamer in a process of its own: argv[1] a JSON list of object URLs, argv[2] runs; prints
# [seconds of each run, CPU seconds of each run].
STREAMER_SCRIPT = """
import json, sys, time
import torch
from runai_model_streamer import SafetensorsStreamer
from weightstream.allocator import tune_malloc
tune_malloc()
urls, runs = json.loads(sys.argv[1]), int(sys.argv[2])
params = {}
times, cpu = [], []
for run in range(runs + 1):  # the first run warms up
    started, cpu_started = time.perf_counter(), time.process_time()
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(urls, None, "cpu", owned=False)
        with torch.no_grad():
            for name, tensor in streamer.get_tensors():
                if name not in params:
                    params[name] = torch.empty_like(tensor)
                    params[name].fill_(0)
                params[name].copy_(tensor)
    if run:
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
print(json.dumps([times, cpu]))
"""


@contextlib.contextmanager
def _store(kind: str, work: Path) -> Iterator[tuple[dict[str, str], Callable[[list[str]], list[str]] | None, Any, int]]:
    """The emulator of kind: the environment that points a process at it, the command wrapper it needs,
    (folder, prefix) -> None uploading with (prefix) -> {name: bytes} downloading through the SDK,
    and the emulator's process id."""
    if kind == "gcs":
        with gcs_emulator(work) as emulator:
            client = gcs_client(emulator)

            def download(prefix: str, into: Path) -> list[Path]:
                paths = []
                for blob in client.list_blobs(BUCKET, prefix=f"{prefix}/"):
                    if blob.name.endswith(".safetensors"):
                        paths.append(into / Path(blob.name).name)
                        blob.download_to_filename(str(paths[-1]))
                return paths

            env = {"STORAGE_EMULATOR_HOST": emulator.endpoint, "CLOUD_STORAGE_EMULATOR_ENDPOINT": emulator.endpoint}
            uploads = (lambda folder, prefix: upload_gcs(client, folder, BUCKET, prefix), download)
            yield env, None, uploads, emulator.proc.pid
    else:
        with azurite_tls(work) as azurite:
            client = azurite.client()

            def download(prefix: str, into: Path) -> list[Path]:
                container = client.get_container_client(BUCKET)
                paths = []
                for item in container.list_blobs(name_starts_with=f"{prefix}/"):
                    if item.name.endswith(".safetensors"):
                        paths.append(into / Path(item.name).name)
                        with paths[-1].open("wb") as sink:
                            container.download_blob(item.name, max_concurrency=8).readinto(sink)
                return paths

            env = azurite.server_env()
            # What the server derives from the connection string, for a streamer used on its own.
            env.update(
                AZURE_STORAGE_ACCOUNT_NAME="devstoreaccount1",
                AZURE_STORAGE_ACCOUNT_KEY=azurite.connection_string().split("AccountKey=")[1].split(";")[0],
                AZURE_STORAGE_ENDPOINT_SUFFIX=azurite.suffix,
            )

            def wrap(command: list[str]) -> list[str]:
                return namespaced(azurite.bundle_dir, command)

            uploads = (lambda folder, prefix: upload_azure(client, folder, BUCKET, prefix), download)
            yield env, wrap, uploads, azurite.azurite.proc.pid


def measure(kind: str, gb: float, runs: int) -> tuple[int, dict[str, list[float]], dict[str, tuple[float, float]]]:
    """The checkpoint's bytes; each path's seconds per run; each path's median CPU seconds per load
    (the loading side's processes, the emulator's)."""
    scheme = {"gcs": "gs://", "azure": "az://"}[kind]
    flag = {"gcs": "--gcs-bucket", "azure": "--azure-container"}[kind]
    results: dict[str, list[float]] = {}
    cpu: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(prefix=f"weightstream-{kind}-bench-") as tmp:
        work = Path(tmp)
        total, shapes = write_checkpoint(work / "model", gb)
        module = ParameterTree(shapes)
        with _store(kind, work) as (env, wrap, (upload, download), store_pid):

            def timed(name: str, load: Callable[[], float], *loaders: int) -> None:
                """runs of load (its seconds), with the CPU seconds of this process, loaders and the store."""
                times, spent, served = [], [], []
                for _ in range(runs):
                    before = self_cpu_seconds() + sum(map(process_cpu_seconds, loaders))
                    store_before = process_cpu_seconds(store_pid)
                    times.append(load())
                    spent.append(self_cpu_seconds() + sum(map(process_cpu_seconds, loaders)) - before)
                    served.append(process_cpu_seconds(store_pid) - store_before)
                results[name] = times
                cpu[name] = (statistics.median(spent), statistics.median(served))

            upload(work / "model", "llama")
            shards = sorted(p.name for p in (work / "model").glob("*.safetensors"))
            model = f"{scheme}{BUCKET}/llama"
            grpc_port, http_port, data_port = free_ports(3)
            args = ["--host", LOOPBACK, "--grpc-port", str(grpc_port), "--http-port", str(http_port), flag, BUCKET]
            args += ["--data-port", str(data_port)]
            with serve_process(args, work, clean_env(**env), wrap=wrap) as server:
                target = f"{LOOPBACK}:{grpc_port}"
                wait_grpc_ready(server, target, model)
                for transport, name in ((TCP, WEIGHTSTREAM), ("grpc", OVER_GRPC)):
                    with WeightStreamClient(target, progress=False, transport=transport) as client:
                        client.load_into(module, model)  # warm the server's streamer and the channel
                        timed(name, lambda c=client: c.load_into(module, model).seconds, server.proc.pid)

            command = [sys.executable, "-c", STREAMER_SCRIPT, json.dumps([f"{model}/{s}" for s in shards]), str(runs)]
            store_before = process_cpu_seconds(store_pid)
            done = subprocess.run(
                wrap(command) if wrap else command,
                env=clean_env(**env, PYTHONPATH=str(Path(__file__).resolve().parent.parent)),
                capture_output=True,
                text=True,
                timeout=1800,
                check=False,
            )
            if done.returncode:
                raise SystemExit(f"the Run:ai streamer run failed ({done.returncode}):\n{done.stderr[-4000:]}")
            times, spent = json.loads(done.stdout.strip().splitlines()[-1])
            results[STREAMER] = times
            # The store served runs + 1 loads (the first warmed up), and nothing else meanwhile.
            cpu[STREAMER] = (statistics.median(spent), (process_cpu_seconds(store_pid) - store_before) / (runs + 1))

            def download_then_load() -> float:
                into = work / "download"
                into.mkdir(exist_ok=True)
                started = time.perf_counter()
                loaded: dict[str, torch.Tensor] = {}
                for path in download("llama", into):
                    loaded.update(load_file(str(path)))
                module.load_state_dict(loaded)
                seconds = time.perf_counter() - started
                del loaded
                for path in into.iterdir():
                    path.unlink()
                return seconds

            sdk = "google-cloud-storage" if kind == "gcs" else "azure-storage-blob"
            timed(f"{sdk} download + load_file", download_then_load)
    return total, results, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=0.5, help="checkpoint size in GB (default 0.5)")
    parser.add_argument("--runs", type=int, default=3, help="runs per path (default 3)")
    parser.add_argument("--stores", default="gcs,azure", help="stores to measure (gcs, azure)")
    args = parser.parse_args()
    from weightstream.allocator import tune_malloc

    tune_malloc()
    for kind in args.stores.split(","):
        total, results, cpu = measure(kind, args.gb, args.runs)
        medians = {name: statistics.median(times) for name, times in results.items()}
        emulator = "gcp-storage-emulator" if kind == "gcs" else "Azurite (TLS)"
        print(f"\n{kind}: {total / 1e9:.2f} GB bfloat16 in {emulator} on 127.0.0.1; medians of {args.runs} runs")
        print("| path | median s | median GB/s | min..max GB/s | x weightstream | CPU s: loading side | CPU s: store |")
        print("|---|---|---|---|---|---|---|")
        ws = medians[WEIGHTSTREAM]
        for name, times in results.items():
            rates = sorted(total / t / 1e9 for t in times)
            print(
                f"| {name} | {medians[name]:.2f} | {total / medians[name] / 1e9:.2f} | "
                f"{rates[0]:.2f}..{rates[-1]:.2f} | {medians[name] / ws:.2f} | "
                f"{cpu[name][0]:.2f} | {cpu[name][1]:.2f} |"
            )
        direct = medians[STREAMER]
        download = next(v for k, v in medians.items() if k.endswith("download + load_file"))
        fastest = min(medians.values())
        over_grpc = medians[OVER_GRPC]
        print(f"weightstream / Run:ai streamer on its own: {ws / direct:.2f}x the time (goal <= 1.2)")
        print(f"weightstream / download-then-load:          {ws / download:.2f}x the time (goal <= 0.6)")
        print(f"weightstream over gRPC / Run:ai streamer:    {over_grpc / direct:.2f}x the time")
        bound = "goal <= 1.1 where the emulator bounds every path"
        print(f"weightstream / fastest path:                {ws / fastest:.2f}x the time ({bound})")
        print(
            "CPU s: medians per load; the loading side is the server and client for weightstream, the process "
            "for the others"
            + (" (the benchmark's own, with the CONNECT proxy to Azurite in it)" if kind == "azure" else "")
        )


if __name__ == "__main__":
    main()
