"""`weightstream demo`: the whole path on a made-up checkpoint, verified bit for bit."""

from __future__ import annotations

import socket
import tempfile
import time
from pathlib import Path

import torch

from weightstream.samples import ParameterTree, llama_like_state_dict, save_sharded

DEMO_MODEL = "demo-llama"


def _free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the demo's data port: its default, 50052, may be taken)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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
        settings = ServerSettings(
            model_root=root, host="127.0.0.1", grpc_port=0, http_port=0, data_port=_free_loopback_port()
        )
        server = create_server(settings)
        server.start()
        target = f"127.0.0.1:{server.port}"
        print(f"server:     gRPC on {target}, data port {settings.data_port}")
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
        finally:
            server.stop(grace=1.0)
    loaded = dict(module.named_parameters())
    mismatched = [
        name
        for name, t in state.items()
        if not torch.equal(loaded[name].detach().view(torch.uint8), t.view(torch.uint8))
    ]
    print(
        f"load_into:  {report.tensors} tensors, {report.bytes:,d} bytes in {seconds:.3f} s "
        f"({report.bytes / seconds / 1e9:.2f} GB/s over loopback, transport {report.transport}, first load); "
        f"again: {warm.seconds:.3f} s "
        f"({warm.gbps:.2f} GB/s)"
    )
    if mismatched:
        print(f"verify:     FAILED: {len(mismatched)} tensors differ, for example {mismatched[0]!r}")
        return 1
    print(f"verify:     all {len(state)} tensors bit-identical to the checkpoint")
    return 0
