"""The CUDA paths of load_into, measured on a GPU: pinned staging ring, registered slots and buffers.

Loads a Llama-shaped checkpoint straight into a module whose parameters live on cuda:0, over
loopback gRPC (slot-free: message -> pinned staging -> device), over the data port (transport tcp:
socket -> the stream's buffer, registered with CUDA -> device) and over the shared-memory
transport twice: with its ring registered with CUDA (slot -> device, one DMA copy) and with
registration turned off (slot -> pinned staging -> device). Each path's last load goes into
parameters filled with random bytes first and is checked bit for bit against the checkpoint. The
baseline, side by side: safetensors.torch.load_file(device="cuda:0") plus load_state_dict. On a
machine without CUDA it says so and measures nothing.

Usage: python benchmarks/cuda_load.py [--gb 1] [--runs 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

SHM_ROOT = Path("/dev/shm")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing measured (the CPU path is covered by the test suite)")
        return 0
    from safetensors.torch import load_file

    from benchmarks.harness import serve_weightstream, write_checkpoint
    from weightstream.allocator import tune_malloc
    from weightstream.client import WeightStreamClient, cuda_host
    from weightstream.samples import ParameterTree

    tune_malloc()
    device = torch.device("cuda:0")
    registrations = {"registered": 0, "declined": 0}
    register = cuda_host.register

    def counting_register(address: int, size: int, *, writable: bool) -> bool:
        done = register(address, size, writable=writable)
        registrations["registered" if done else "declined"] += 1
        return done

    @contextlib.contextmanager
    def registration_off() -> Iterator[None]:
        cuda_host.register = lambda address, size, *, writable: False  # type: ignore[assignment]
        try:
            yield
        finally:
            cuda_host.register = counting_register  # type: ignore[assignment]

    cuda_host.register = counting_register  # type: ignore[assignment]
    with (
        tempfile.TemporaryDirectory(prefix="weightstream-cuda-") as tmp,
        tempfile.TemporaryDirectory(prefix="weightstream-cuda-", dir=SHM_ROOT) as shm_dir,
    ):
        root = Path(tmp)
        total, shapes = write_checkpoint(root / "m", args.gb)
        files = sorted(str(p) for p in (root / "m").glob("*.safetensors"))
        reference: dict[str, torch.Tensor] = {}
        for f in files:
            reference.update(load_file(f))
        module = ParameterTree(shapes).to(device)
        times: dict[str, list[float]] = {}
        mismatched: dict[str, int] = {}

        def safetensors_load() -> None:
            loaded: dict[str, torch.Tensor] = {}
            for f in files:
                loaded.update(load_file(f, device="cuda:0"))
            module.load_state_dict(loaded)

        def measure(name: str, load: Callable[[], object]) -> None:
            load()  # warm
            for _ in range(args.runs):
                torch.cuda.synchronize()
                started = time.perf_counter()
                load()
                torch.cuda.synchronize()
                times.setdefault(name, []).append(time.perf_counter() - started)
            for p in module.parameters():
                p.data.view(torch.uint8).random_()
            load()
            torch.cuda.synchronize()
            mismatched[name] = sum(
                not torch.equal(p.detach().cpu().view(torch.uint8), reference[n].view(torch.uint8))
                for n, p in module.named_parameters()
            )

        os.environ["WEIGHTSTREAM_SHM_DIR"] = shm_dir
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            data_port = probe.getsockname()[1]
        with (
            serve_weightstream(root, 4 << 20, ["--data-port", str(data_port)]) as (_server, port),
            WeightStreamClient(f"127.0.0.1:{port}", progress=False, transport="tcp") as tcp_client,
            WeightStreamClient(f"127.0.0.1:{port}", progress=False, transport="grpc") as grpc_client,
            WeightStreamClient(f"127.0.0.1:{port}", progress=False, transport="shm", shm_dir=shm_dir) as shm,
        ):
            measure("safetensors load_file(cuda:0) + load_state_dict", safetensors_load)
            measure("weightstream load_into over gRPC (pinned staging)", lambda: grpc_client.load_into(module, "m"))
            measure("weightstream load_into over tcp (registered buffer)", lambda: tcp_client.load_into(module, "m"))
            measure("weightstream load_into over shm (registered slots)", lambda: shm.load_into(module, "m"))
            with registration_off():
                measure("weightstream load_into over shm (pinned staging)", lambda: shm.load_into(module, "m"))
        leftovers = os.listdir(shm_dir)
    baseline = statistics.median(times["safetensors load_file(cuda:0) + load_state_dict"])
    print(f"checkpoint: {total / 1e9:.2f} GB bfloat16 on {torch.cuda.get_device_name(device)}; {args.runs} runs")
    print(f"shm rings registered with CUDA: {registrations['registered']}, declined: {registrations['declined']}")
    print(f"segments left in the shm dir: {len(leftovers)}")
    print("| path | median GB/s | min..max GB/s | vs safetensors | tensors differing |")
    print("|---|---|---|---|---|")
    for name, values in times.items():
        rates = sorted(total / t / 1e9 for t in values)
        median = statistics.median(values)
        print(
            f"| {name} | {total / median / 1e9:.2f} | {rates[0]:.2f}..{rates[-1]:.2f} | {baseline / median:.2f}x "
            f"| {mismatched[name]} |"
        )
    failed = any(mismatched.values()) or leftovers
    print("verify: " + ("FAILED" if failed else "every path bit-identical, no segment left"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
