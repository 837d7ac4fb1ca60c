"""Sparse updates, measured: update_into with XOR deltas against without them and a full load_into, in one run.

A `weightstream serve --allow-publish` process holds revision A of a Llama-shaped bfloat16 checkpoint of
--gb GB, published (so in its memory). Revision B is A with a share of the elements of every tensor
changed at random places (an optimizer step: --fractions, default 0.005, 0.02 and 1.0), published too.
A module holding A is then updated to B, per transport (--transports, default tcp and grpc) and per
number of client streams (--streams, default 1; 2 decodes deltas on two threads):

- full load_into: the baseline, the whole model over the same transport;
- update_into(deltas=False): chunk skipping only (every 1 MiB block holds a change, so all of it);
- update_into, first: the server computes the deltas (what the first engine of a fleet pays; measured
  for the first transport only, since the others find them kept);
- update_into, first after a delta publish: B published again by a trainer with publish(deltas=True)
  from its copy of A; the server keeps the payloads it received as its A -> B deltas, so the first
  engine finds them ready (first transport only);
- update_into, kept: the deltas come from the server's delta cache (every later engine and rank);
- floor (on cpu): what the client's apply costs with nothing else, the changed words known beforehand:
  every block of the module XORed at them and checksummed, on as many threads as the client's. The update cannot beat
  it by much on a host whose cores it shares with the server, since reading and writing the
  module's memory (not decoding) is most of it.

Each run takes the full load and every update in turn (a host whose speed drifts moves them
together); before each update the module is set back to A locally (not timed). Reported: medians of --runs of the
update's seconds, its ratio to the full load, bytes on the wire (the server's /status), their ratio
to the model, and the server's CPU seconds for the update (/proc). Then four modules update from A
to B at once (tcp): wall time, and how many deltas the server computed against how many it served.
Last, on a server of its own, a trainer publishes A then B, whole and with publish(deltas=True):
the publish's time and the bytes the server received. With --device cuda:0 the modules' parameters
and the trainer's tensors live on that GPU (deltas XORed on the device, publishes copied from it);
every update is still checked bit for bit.

Usage (from the repository root): python benchmarks/sparse_updates.py [--gb 1] [--runs 3] [--streams 1,2] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (
    check_module,
    free_port,
    process_cpu_seconds,
    reset_module,
    serve_weightstream,
    write_checkpoint,
)
from weightstream.client import WeightStreamClient
from weightstream.client.deltas import APPLIER_THREADS
from weightstream.protocol import wire
from weightstream.protocol.deltas import Decoded
from weightstream.samples import ParameterTree

MODEL = "sparse-llama"


def status(http_port: int) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=30) as answer:
        return json.loads(answer.read())


def served(http_port: int) -> int:
    return int(status(http_port)["bytes_served_total"])  # type: ignore[call-overload]


def deltas(http_port: int) -> dict[str, float]:
    return status(http_port)["revisions"]["deltas"]  # type: ignore[index,no-any-return]


def stepped(state: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """state with fraction of the elements of every tensor changed at random places."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in state.items():
        flat = tensor.clone().view(-1)
        if fraction >= 1.0:
            out[name] = (flat.float() * 1.01 + 0.01).to(tensor.dtype).view(tensor.shape)
            continue
        count = max(1, int(fraction * flat.numel()))
        places = torch.randint(0, flat.numel(), (count,), generator=generator)
        flat[places] = (flat[places].float() * 1.01 + 0.01).to(tensor.dtype)
        out[name] = flat.view(tensor.shape)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size (default 1)")
    parser.add_argument("--runs", type=int, default=3, help="runs per case (default 3)")
    parser.add_argument("--fractions", default="0.005,0.02,1.0", help="shares of the elements changed")
    parser.add_argument("--transports", default="tcp,grpc", help="transports to measure (tcp, grpc, shm)")
    parser.add_argument("--streams", default="1", help="client streams to measure each transport with (e.g. 1,2)")
    parser.add_argument(
        "--device", default="cpu", help="where the modules and the trainer's tensors live (cpu, cuda:0)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"no CUDA device here: nothing measured on {device}")
        return 0
    fractions = [float(f) for f in args.fractions.split(",")]
    transports = [(t, int(n)) for t in args.transports.split(",") for n in args.streams.split(",")]
    rows: list[tuple[str, str, float, float, int, float]] = []
    with tempfile.TemporaryDirectory(prefix="weightstream-sparse-") as tmp:
        root = Path(tmp) / "root"
        total, shapes = write_checkpoint(Path(tmp) / "files", args.gb)
        root.mkdir()
        http_port = free_port()
        # A stays kept while every B of the run is published (each update is from A).
        # Each fraction also publishes A and B again with deltas (the case after a delta publish).
        kept = 3 * len(fractions) + 2
        extra = ["--allow-publish", "--http-port", str(http_port), "--keep-revisions", str(kept)]
        extra += ["--publish-max-bytes", str(int((kept + 1) * total))]
        if any(t == "shm" for t, _ in transports):
            extra += ["--shm-dir", "/dev/shm"]
        with serve_weightstream(root, wire.DEFAULT_CHUNK_BYTES, extra) as (proc, port):
            loader = ParameterTree(shapes).to(device)
            with WeightStreamClient(f"127.0.0.1:{port}", progress=False) as client:
                from safetensors.torch import load_file

                a: dict[str, torch.Tensor] = {}
                for path in sorted((Path(tmp) / "files").glob("*.safetensors")):
                    a.update(load_file(str(path)))
                revision_a = client.publish(MODEL, a, revision="a")
            for fraction in fractions:
                b = stepped(a, fraction, seed=int(fraction * 1000) + 1)
                with WeightStreamClient(f"127.0.0.1:{port}", progress=False) as client:
                    revision_b = client.publish(MODEL, b, revision=f"b-{fraction}")
                for transport, streams in transports:
                    options: dict[str, object] = {"progress": False, "transport": transport, "streams": streams}
                    if transport == "shm":
                        options["shm_dir"] = "/dev/shm"
                    with WeightStreamClient(f"127.0.0.1:{port}", **options) as client:  # type: ignore[arg-type]
                        via = f"{transport}" if streams == 1 else f"{transport} x{streams}"
                        # The server keeps each (A, B, chunk) delta for every client: only the first
                        # configuration of a B sees them computed, once, before the runs.
                        first = (transport, streams) == transports[0]
                        if first:
                            computed = _update(client, loader, a, revision_a, revision_b, True, proc.pid, http_port)
                            published = _after_delta_publish(client, loader, a, b, fraction, proc.pid, http_port)
                        # Each run takes the full load and every update in turn, so that a host whose
                        # speed drifts during the run moves them together.
                        loads: list[float] = []
                        updates: dict[bool, list[tuple[float, int, float]]] = {False: [], True: []}
                        for _ in range(args.runs):
                            loads.append(client.load_into(loader, MODEL, revision=revision_b).seconds)
                            for use, kept in updates.items():
                                kept.append(
                                    _update(client, loader, a, revision_a, revision_b, use, proc.pid, http_port)
                                )
                        full = statistics.median(loads)
                        rows.append((f"{fraction:.1%}", f"{via}: full load_into", full, 1.0, total, 0.0))
                        cases = [("update_into, no deltas", updates[False])]
                        if first:
                            cases.append(("update_into, first (computes)", [computed]))
                            cases.append(("update_into, first after a delta publish", [published]))
                        cases.append(("update_into, kept deltas", updates[True]))
                        for label, measured in cases:
                            seconds = statistics.median(m[0] for m in measured)
                            rows.append(
                                (
                                    f"{fraction:.1%}",
                                    f"{via}: {label}",
                                    seconds,
                                    seconds / full,
                                    int(statistics.median(m[1] for m in measured)),
                                    statistics.median(m[2] for m in measured),
                                )
                            )
                    check_module(loader, b)
                if device.type == "cpu" and fraction < 1.0:
                    base = next(
                        row[2] for row in rows if row[0] == f"{fraction:.1%}" and row[1].endswith("full load_into")
                    )
                    seconds = _floor(loader, a, b, args.runs)
                    rows.append((f"{fraction:.1%}", FLOOR, seconds, seconds / base, 0, 0.0))
            fleet = _fleet(port, http_port, shapes, a, revision_a, device)
        publishes = _publishes(root, total, a, fractions, args.runs, device)
        print(f"checkpoint: {total / 1e9:.2f} GB bfloat16, {len(shapes)} tensors on {device}; medians of {args.runs}")
        print("| changed elements | case | seconds | x full load | bytes on the wire | x model | server CPU s |")
        print("|---|---|---|---|---|---|---|")
        for fraction_label, label, seconds, ratio, nbytes, cpu_s in rows:
            print(
                f"| {fraction_label} | {label} | {seconds:.3f} | {ratio:.3f}x | {nbytes:,d} | "
                f"{nbytes / total:.3f} | {cpu_s:.2f} |"
            )
        print(fleet)
        print()
        print("publishing B after A (tcp): whole, and with deltas=True (the trainer's host copy of A)")
        print("| changed elements | publish | seconds | x whole | bytes the server received | x model |")
        print("|---|---|---|---|---|---|")
        for fraction_label, label, seconds, ratio, nbytes in publishes:
            share = nbytes / total
            print(f"| {fraction_label} | {label} | {seconds:.3f} | {ratio:.3f}x | {nbytes:,d} | {share:.3f} |")
    return 0


def _publishes(
    root: Path, total: int, a: dict[str, torch.Tensor], fractions: list[float], runs: int, device: torch.device
) -> list[tuple[str, str, float, float, int]]:
    """A trainer publishes A, then B, whole and with deltas, on a server of its own (medians of runs)."""
    on_device = {name: tensor.to(device) for name, tensor in a.items()}
    http_port = free_port()
    extra = ["--allow-publish", "--http-port", str(http_port), "--publish-max-bytes", str(int(4 * total))]
    rows: list[tuple[str, str, float, float, int]] = []
    with serve_weightstream(root, wire.DEFAULT_CHUNK_BYTES, extra) as (_proc, port):
        for fraction in fractions:
            b = {
                name: tensor.to(device) for name, tensor in stepped(a, fraction, seed=int(fraction * 1000) + 7).items()
            }
            results: dict[bool, tuple[float, int]] = {}
            for deltas in (False, True):
                times, sizes = [], []
                for _ in range(runs):
                    with WeightStreamClient(f"127.0.0.1:{port}", progress=False) as trainer:
                        trainer.publish(MODEL, on_device, deltas=deltas)
                        before = received(http_port)
                        started = time.perf_counter()
                        trainer.publish(MODEL, b, deltas=deltas)
                        times.append(time.perf_counter() - started)
                        sizes.append(received(http_port) - before)
                results[deltas] = (statistics.median(times), int(statistics.median(sizes)))
            whole = results[False][0]
            for deltas, label in ((False, "whole"), (True, "deltas")):
                seconds, nbytes = results[deltas]
                rows.append((f"{fraction:.1%}", label, seconds, seconds / whole, nbytes))
    return rows


FLOOR = f"floor: XOR + CRC32C in memory (no wire, no decode, {APPLIER_THREADS} threads)"


def _floor(module: torch.nn.Module, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], runs: int) -> float:
    """The least an update from a to b can cost on this host: each chunk of module's memory XORed at its
    changed words and checksummed, as the client's delta threads do (Decoded.xor_into), with the words
    found and decoded beforehand (median of runs, module reset to a between them)."""
    import numpy as np

    blocks = []
    for name, parameter in module.named_parameters():
        old = a[name].reshape(-1).view(torch.int16).numpy()
        new = b[name].reshape(-1).view(torch.int16).numpy()
        target = parameter.detach().reshape(-1).view(torch.uint8)
        step = wire.DEFAULT_CHUNK_BYTES // 2
        for start in range(0, old.size, step):
            places = np.flatnonzero(old[start : start + step] != new[start : start + step])
            xor = old[start : start + step][places] ^ new[start : start + step][places]
            length = 2 * min(step, old.size - start)
            blocks.append((target[2 * start : 2 * start + length], Decoded(length, places=places, values=xor)))

    def apply(share: list[tuple[torch.Tensor, Decoded]]) -> None:
        for target, decoded in share:
            decoded.xor_into(target)

    times = []
    with ThreadPoolExecutor(APPLIER_THREADS) as pool:
        for _ in range(runs):
            reset_module(module, a)
            started = time.perf_counter()
            list(pool.map(apply, [blocks[i::APPLIER_THREADS] for i in range(APPLIER_THREADS)]))
            times.append(time.perf_counter() - started)
    check_module(module, b)
    return statistics.median(times)


def _update(
    client: WeightStreamClient,
    loader: torch.nn.Module,
    a: dict[str, torch.Tensor],
    revision_a: str,
    revision_b: str,
    use: bool,
    server_pid: int,
    http_port: int,
) -> tuple[float, int, float]:
    """loader set back to a, then updated to revision_b (with deltas or not): the update's seconds,
    the bytes the server sent for it and the server's CPU seconds meanwhile."""
    reset_module(loader, a)
    before, cpu_before = served(http_port), process_cpu_seconds(server_pid)
    report = client.update_into(loader, MODEL, since=revision_a, revision=revision_b, deltas=use)
    cpu = process_cpu_seconds(server_pid) - cpu_before
    assert report.revision == revision_b and not report.delta_fallbacks
    return report.seconds, served(http_port) - before, cpu


def _after_delta_publish(
    client: WeightStreamClient,
    loader: torch.nn.Module,
    a: dict[str, torch.Tensor],
    b: dict[str, torch.Tensor],
    fraction: float,
    server_pid: int,
    http_port: int,
) -> tuple[float, int, float]:
    """A trainer publishes A then B with deltas=True (new revisions, so nothing of them is kept yet);
    the first update from A to B after it (_update's answer). Reports how many deltas the server
    computed for it (none, where the layouts match)."""
    with WeightStreamClient(client.target, progress=False) as trainer:
        revision_a = trainer.publish(MODEL, a, deltas=True, revision=f"a-d-{fraction}")
        revision_b = trainer.publish(MODEL, b, deltas=True, revision=f"b-d-{fraction}")
    before = deltas(http_port)["computed_total"]
    measured = _update(client, loader, a, revision_a, revision_b, True, server_pid, http_port)
    computed = deltas(http_port)["computed_total"] - before
    print(f"{fraction:.1%}: the first update after a delta publish: the server computed {computed:.0f} deltas")
    return measured


def received(http_port: int) -> int:
    return int(status(http_port)["revisions"]["publish_received_bytes_total"])  # type: ignore[index]


def _fleet(
    port: int, http_port: int, shapes: dict, a: dict[str, torch.Tensor], revision_a: str, device: torch.device
) -> str:
    """Four modules update from A to a new B at once over tcp: wall time, deltas computed and served."""
    b = stepped(a, 0.02, seed=4242)
    with WeightStreamClient(f"127.0.0.1:{port}", progress=False) as client:
        client.publish(MODEL, b, revision="b-fleet")
    modules = [ParameterTree(shapes).to(device) for _ in range(4)]
    for module in modules:
        reset_module(module, a)
    before = deltas(http_port)
    sent_before = served(http_port)
    seconds: list[float] = [0.0] * 4
    errors: list[BaseException] = []

    def update(index: int) -> None:
        try:
            with WeightStreamClient(f"127.0.0.1:{port}", progress=False, transport="tcp") as own:
                seconds[index] = own.update_into(modules[index], MODEL, since=revision_a).seconds
        except BaseException as exc:
            errors.append(exc)

    started = time.perf_counter()
    threads = [threading.Thread(target=update, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    for module in modules:
        check_module(module, b)
    after = deltas(http_port)
    computed = after["computed_total"] - before["computed_total"]
    reused = after["reused_total"] - before["reused_total"]
    cpu = after["compute_seconds_total"] - before["compute_seconds_total"]
    return (
        f"4 engines updating at once (2% of the elements changed, tcp): {wall:.3f} s wall (each "
        f"{min(seconds):.3f}..{max(seconds):.3f} s), {served(http_port) - sent_before:,d} bytes on the wire in all; "
        f"the server computed {computed:.0f} deltas ({cpu:.2f} CPU s) and served {reused:.0f} more from those kept"
    )


if __name__ == "__main__":
    raise SystemExit(main())
