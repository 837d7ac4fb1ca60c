"""`weightstream demo`: the whole path on a made-up checkpoint, verified bit for bit: a cold load, then
a live update (a new revision published with a few tensors changed, pulled into the same module in place)."""

from __future__ import annotations

import socket
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from weightstream.samples import ParameterTree, llama_like_state_dict, save_sharded

DEMO_MODEL = "demo-llama"
# The tensors the demo's "training step" changes: the last layer's attention projections, a few
# tensors of many, so that the update moves a small part of the model.
UPDATED = tuple(f"model.layers.3.self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o"))


def _free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the demo's data port: its default, 50052, may be taken)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def next_revision(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The demo's second revision: state with the UPDATED tensors nudged, as a training step would, the rest as is."""
    generator = torch.Generator().manual_seed(1)
    nudged = dict(state)
    for name in UPDATED:
        tensor = state[name]
        noise = torch.randn(tensor.shape, generator=generator)
        nudged[name] = (tensor.float() + 0.05 * noise).to(tensor.dtype)
    return nudged


def _differing(module: torch.nn.Module, expected: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of expected whose bytes module's parameter of that name does not hold."""
    held = dict(module.named_parameters())
    return [
        name
        for name, tensor in expected.items()
        if not torch.equal(held[name].detach().view(torch.uint8), tensor.view(torch.uint8))
    ]


def _verified(module: torch.nn.Module, expected: Mapping[str, torch.Tensor], what: str) -> bool:
    """Print whether module holds expected bit for bit; False (after a FAILED line) when it does not."""
    differing = _differing(module, expected)
    if differing:
        print(
            f"verify:     FAILED: {len(differing)} of {len(expected)} tensors differ from {what}, for example "
            f"{differing[0]!r}"
        )
        return False
    print(f"verify:     all {len(expected)} tensors bit-identical to {what}")
    return True


def run_demo() -> int:
    try:
        from weightstream_server import ServerSettings, create_server
    except ImportError as exc:
        print(f"weightstream demo needs the server's dependencies (pip install 'weightstream[server]'): {exc}")
        return 2
    from weightstream.client import WeightStreamClient

    state = llama_like_state_dict()
    total = sum(t.numel() * t.element_size() for t in state.values())
    with tempfile.TemporaryDirectory(prefix="weightstream-demo-") as tmp:
        root = Path(tmp)
        save_sharded(state, root / DEMO_MODEL, shards=3)
        print(f"checkpoint: {len(state)} tensors, {total / 1e6:.1f} MB of bfloat16 in 3 shards under {root}")
        # allow_publish: the demo's own client publishes the second revision; the server listens on loopback only.
        settings = ServerSettings(
            model_root=root,
            host="127.0.0.1",
            grpc_port=0,
            http_port=0,
            data_port=_free_loopback_port(),
            allow_publish=True,
        )
        server = create_server(settings)
        server.start()
        target = f"127.0.0.1:{server.port}"
        print(f"server:     gRPC on {target}, data port {settings.data_port}, publishing allowed")
        try:
            module = ParameterTree({n: (tuple(t.shape), t.dtype) for n, t in state.items()})
            with WeightStreamClient(target, progress=False) as client:
                manifest = client.manifest(DEMO_MODEL)
                print(
                    f"manifest:   {len(manifest.tensors)} tensors, {manifest.total_bytes:,d} bytes, "
                    f"files {', '.join(manifest.files)}"
                )
                started = time.perf_counter()
                report = client.load_into(module, DEMO_MODEL)
                seconds = time.perf_counter() - started
                # A second load shows the steady state: streamer threads, channel and page cache warm.
                warm = client.load_into(module, DEMO_MODEL)
                print(
                    f"load_into:  {report.tensors} tensors, {report.bytes:,d} bytes in {seconds:.3f} s "
                    f"({report.bytes / seconds / 1e9:.2f} GB/s over loopback, transport {report.transport}, "
                    f"first load); again: {warm.seconds:.3f} s ({warm.gbps:.2f} GB/s)"
                )
                if not _verified(module, state, "the checkpoint"):
                    return 1

                # The live update: a trainer publishes the next revision, the module pulls what changed.
                nudged = next_revision(state)
                started = time.perf_counter()
                revision = client.publish(DEMO_MODEL, nudged)
                published_s = time.perf_counter() - started
                print(
                    f"publish:    revision {revision}: {len(UPDATED)} of {len(nudged)} tensors changed "
                    f"(the last layer's attention projections), published whole in {published_s:.3f} s"
                )
                update = client.update_into(module, DEMO_MODEL, since=manifest.revision)
                print(
                    f"update:     update_into moved {update.bytes:,d} bytes of the model's {total:,d} "
                    f"({update.bytes / total:.1%}): {update.tensors} tensors, in place, in {update.seconds:.3f} s, "
                    f"from revision {manifest.revision} to {update.revision}"
                )
                if update.revision != revision:
                    print(f"verify:     FAILED: the update reached revision {update.revision}, not {revision}")
                    return 1
                return 0 if _verified(module, nudged, f"revision {revision}") else 1
        finally:
            server.stop(grace=1.0)
