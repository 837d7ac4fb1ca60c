"""Live updates, measured: update_into of a new revision against a full load_into, in the same run.

A `weightstream serve --allow-publish` process serves a Llama-shaped bfloat16 checkpoint of --gb GB
(revision A). A module loaded with A is then updated in place to revisions where a fraction of the
tensors changed (--fraction, by bytes, default 0.1) and where every tensor changed:

- published: the trainer publishes the revision (client.publish), the module pulls it
  (update_into); the revision is held in the server's memory;
- storage: the revision's files are written over A's in the model root; the server reads the
  files that changed once, to learn which blocks changed, and the module pulls those.

Each case alternates between two revisions --runs times (A -> B -> A ...), so every update changes
the same tensors. Reported: medians of update time, bytes the server sent per update (its /status),
changed bytes, and the baseline: a full load_into of the same module (median of --runs) in the same
run. Four updaters pulling one published revision at once show the server's work per revision (the
GetChanges answers come from block CRC32Cs kept with it, no storage read). A sidecar in front of the
server (--upstream, --disk-cache) shows a published revision relayed between the tiers: how long
until the sidecar's watch reports it, the bytes that went between them, and the update from it. With --vllm, a vLLM CPU
engine on a small Llama (.venv-vllm) is updated in place through the weight-transfer API and
compared with vLLM's own in-place reload from the new files (reload_weights(weights_path=...)) and
with starting a fresh engine on them (how users update today).

Usage (from the repository root): python benchmarks/updates.py [--gb 1] [--runs 3] [--fraction 0.1] [--vllm]
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
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import free_port, serve_weightstream, write_checkpoint
from weightstream.client import WeightStreamClient
from weightstream.protocol import wire
from weightstream.samples import ParameterTree

MODEL = "live-llama"
MB = 1e6


def status(http_port: int) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=30) as answer:
        return json.loads(answer.read())


def served(http_port: int) -> int:
    return int(status(http_port)["bytes_served_total"])  # type: ignore[call-overload]


def pick(state: dict[str, torch.Tensor], fraction: float) -> list[str]:
    """Tensors to change, about fraction of the model's bytes: every k-th of the layers' tensors, spread
    over the model (an RL step's update touches layers, not the embeddings)."""
    total = sum(t.numel() * t.element_size() for t in state.values())
    layers = [n for n in state if ".layers." in n] or list(state)
    chosen: list[str] = []
    nbytes = 0
    step = max(1, round(1 / fraction)) if fraction > 0 else len(layers)
    for offset in range(step):
        for name in layers[offset::step]:
            if nbytes >= fraction * total:
                return chosen
            chosen.append(name)
            nbytes += state[name].numel() * state[name].element_size()
    return chosen


def perturbed(state: dict[str, torch.Tensor], names: list[str], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = dict(state)
    for name in names:
        out[name] = (state[name].float() + torch.randn(state[name].shape, generator=generator) * 1e-2).to(
            state[name].dtype
        )
    return out


def nbytes(state: dict[str, torch.Tensor], names: list[str]) -> int:
    return sum(state[n].numel() * state[n].element_size() for n in names)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/updates.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size (default 1)")
    parser.add_argument("--runs", type=int, default=3, help="updates per case and full loads (default 3)")
    parser.add_argument("--fraction", type=float, default=0.1, help="share of the bytes changed (default 0.1)")
    parser.add_argument("--vllm", action="store_true", help="also update a vLLM CPU engine in place (.venv-vllm)")
    args = parser.parse_args()
    rows: list[tuple[str, float, float, int, int]] = []
    with tempfile.TemporaryDirectory(prefix="weightstream-updates-") as tmp:
        root = Path(tmp) / "root"
        total, shapes = write_checkpoint(root / MODEL, args.gb)
        http_port = free_port()
        extra = ["--allow-publish", "--http-port", str(http_port), "--publish-max-bytes", str(int(4 * total))]
        with (
            serve_weightstream(root, wire.DEFAULT_CHUNK_BYTES, extra) as (_proc, port),
            WeightStreamClient(f"127.0.0.1:{port}", progress=False) as client,
        ):
            module = ParameterTree(shapes)
            loads = []
            for _ in range(args.runs):
                loads.append(client.load_into(module, MODEL).seconds)
            full_s = statistics.median(loads)
            rows.append(("baseline: full load_into (revision A)", full_s, 1.0, total, total))
            a = {name: p.detach().clone() for name, p in module.named_parameters()}
            revision_a = client.manifest(MODEL).revision
            client.changes(MODEL, since=revision_a, revision=revision_a)  # the baseline's block CRCs
            holding = revision_a
            for label, names in (
                (f"{args.fraction:.0%} of the bytes changed", pick(a, args.fraction)),
                ("every tensor changed", list(a)),
            ):
                b = perturbed(a, names, seed=len(names))
                changed = nbytes(a, names)
                # published: A -> B -> A ...
                times, sent, publishes = [], [], []
                for run in range(args.runs):
                    target = b if run % 2 == 0 else a
                    started = time.perf_counter()
                    revision = client.publish(MODEL, target, revision=f"{len(names)}-{run}")
                    publishes.append(time.perf_counter() - started)
                    before = served(http_port)
                    report = client.update_into(module, MODEL, since=holding)
                    sent.append(served(http_port) - before)
                    times.append(report.seconds)
                    holding = revision
                rows.append(
                    (
                        f"published, {label}: update_into",
                        statistics.median(times),
                        statistics.median(times) / full_s,
                        int(statistics.median(sent)),
                        changed,
                    )
                )
                rows.append(
                    (
                        f"published, {label}: publish",
                        statistics.median(publishes),
                        statistics.median(publishes) / full_s,
                        0,
                        changed,
                    )
                )
                # Back to A's content for the next case, through one more publish.
                holding_module_is = "a" if args.runs % 2 == 0 else "b"
                if holding_module_is == "b":
                    revision = client.publish(MODEL, a, revision=f"{len(names)}-back")
                    client.update_into(module, MODEL, since=holding)
                    holding = revision
            # storage: the same share changed, written over A's files (the module holds A's content).
            names = pick(a, args.fraction)
            b = perturbed(a, names, seed=99)
            files = sorted((root / MODEL).glob("*.safetensors"))
            times, sent, reads = [], [], []
            for run in range(args.runs):
                _rewrite(files, b if run % 2 == 0 else a)
                digested = _digested(http_port)
                before = served(http_port)
                report = client.update_into(module, MODEL, since=holding)
                times.append(report.seconds)
                sent.append(served(http_port) - before)
                reads.append(_digested(http_port) - digested)
                holding = report.revision
            rows.append(
                (
                    f"storage, {args.fraction:.0%} changed: update_into (the server read "
                    f"{statistics.median(reads) / MB:.0f} MB of rewritten files to find the changes)",
                    statistics.median(times),
                    statistics.median(times) / full_s,
                    int(statistics.median(sent)),
                    nbytes(a, names),
                )
            )
            # Four updaters pull one published revision at once.
            fanout = _fanout(client, port, http_port, shapes, a, holding, args.fraction)
            # A sidecar in front of the server follows its revisions.
            tier = _tier(client, port, http_port, shapes, Path(tmp), args.fraction)
    print(f"checkpoint: {total / 1e9:.2f} GB bfloat16, {len(shapes)} tensors; medians of {args.runs}")
    print("| case | seconds | x full load_into | bytes sent | changed bytes | sent / changed |")
    print("|---|---|---|---|---|---|")
    for label, seconds, ratio, sent_bytes, changed in rows:
        share = f"{sent_bytes / changed:.3f}" if sent_bytes and changed else "-"
        print(f"| {label} | {seconds:.3f} | {ratio:.3f}x | {sent_bytes:,d} | {changed:,d} | {share} |")
    print(fanout)
    print(tier)
    if args.vllm:
        print(_vllm())
    return 0


def _digested(http_port: int) -> int:
    """Bytes the server read to digest storage revisions (their block CRC32Cs)."""
    return int(status(http_port)["revisions"]["digested_bytes_total"])  # type: ignore[index]


def _rewrite(files: list[Path], state: dict[str, torch.Tensor]) -> None:
    """Write state over the checkpoint's files, each tensor into the file that holds it now (by rename)."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names = list(f.keys())
        staged = file.with_suffix(".incoming")
        save_file({n: state[n].contiguous() for n in names}, str(staged))
        staged.replace(file)


def _fanout(
    client: WeightStreamClient,
    port: int,
    http_port: int,
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
    a: dict[str, torch.Tensor],
    holding: str,
    fraction: float,
) -> str:
    names = pick(a, fraction)
    b = perturbed(a, names, seed=123)
    modules = []
    for _ in range(4):
        module = ParameterTree(shapes)
        with torch.no_grad():
            for name, parameter in module.named_parameters():
                parameter.copy_(a[name])
        modules.append(module)
    revision = client.publish(MODEL, b, revision="fanout")
    before = status(http_port)
    seconds: list[float] = []

    def update(module: torch.nn.Module) -> None:
        with WeightStreamClient(f"127.0.0.1:{port}", progress=False) as updater:
            seconds.append(updater.update_into(module, MODEL, since=holding).seconds)

    threads = [threading.Thread(target=update, args=(m,)) for m in modules]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    after = status(http_port)
    sent = int(after["bytes_served_total"]) - int(before["bytes_served_total"])  # type: ignore[call-overload]
    read = int(after["storage_bytes_read_total"]) - int(before["storage_bytes_read_total"])  # type: ignore[call-overload]
    changes = after["revisions"]["changes_total"] - before["revisions"]["changes_total"]  # type: ignore[index,operator]
    for module in modules:
        got = dict(module.named_parameters())
        assert all(torch.equal(got[n], b[n]) for n in names), "an updater did not get the revision"
    return (
        f"4 updaters from one published revision ({revision}): {wall:.3f} s wall (each {min(seconds):.3f}.."
        f"{max(seconds):.3f} s), {sent:,d} bytes sent for 4 x {nbytes(a, names):,d} changed, {read:,d} bytes "
        f"read from storage, {changes} GetChanges answered from the kept block CRC32Cs"
    )


def _tier(
    client: WeightStreamClient,
    port: int,
    http_port: int,
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
    tmp: Path,
    fraction: float,
) -> str:
    """A sidecar (--upstream, --disk-cache) in front of the server: a module loaded through it, then a
    revision published to the server, relayed by the sidecar and pulled from it."""
    sidecar_http = free_port()
    extra = ["--upstream", f"127.0.0.1:{port}", "--disk-cache", str(tmp / "sidecar-cache")]
    extra += ["--http-port", str(sidecar_http), "--publish-max-bytes", "64GiB"]
    with (
        serve_weightstream(None, wire.DEFAULT_CHUNK_BYTES, extra) as (_proc, sidecar_port),
        WeightStreamClient(f"127.0.0.1:{sidecar_port}", progress=False) as near,
    ):
        module = ParameterTree(shapes)
        first = near.load_into(module, MODEL)
        current = {name: p.detach().clone() for name, p in module.named_parameters()}
        names = pick(current, fraction)
        b = perturbed(current, names, seed=321)
        events = near.watch(MODEL, after=first.revision)
        before = served(http_port)
        revision = client.publish(MODEL, b, revision="tier")
        published = time.perf_counter()
        event = next(events)
        relayed = time.perf_counter() - published
        events.close()
        between = served(http_port) - before
        before_near = served(sidecar_http)
        report = near.update_into(module, MODEL, since=first.revision)
        sent = served(sidecar_http) - before_near
        relay = status(sidecar_http)["revisions"]["relay"]  # type: ignore[index]
    got = dict(module.named_parameters())
    assert event.revision == revision and all(torch.equal(got[n], b[n]) for n in names), "the sidecar's update"
    return (
        f"through a sidecar: first load {first.seconds:.3f} s; a published revision with {nbytes(b, names):,d} "
        f"bytes changed reached the sidecar's watch {relayed:.3f} s after publish returned, {between:,d} bytes "
        f"between the tiers over {relay.get('transport', '?')} ({relay['shared_bytes_total']:,d} shared with the "
        f"revision the sidecar held, {relay['copied_bytes_total']:,d} copied from it); update_into from the "
        f"sidecar {report.seconds:.3f} s, {sent:,d} bytes sent"
    )


def _vllm() -> str:
    """A small vLLM CPU engine updated in place vs a fresh engine on the new files (both in .venv-vllm)."""
    import subprocess

    from safetensors.torch import load_file

    from tests.support.vllm_runs import SCRIPTS, VLLM_PYTHON, run_engine, vllm_llama_config, write_vllm_llama
    from weightstream.samples import save_sharded

    with tempfile.TemporaryDirectory(prefix="weightstream-updates-vllm-") as tmp:
        root = Path(tmp) / "root"
        config = vllm_llama_config(hidden=512, layers=4, intermediate=1536, vocab=8192)
        write_vllm_llama(root / MODEL, config)
        state: dict[str, torch.Tensor] = {}
        for file in sorted((root / MODEL).glob("*.safetensors")):
            state.update(load_file(str(file)))
        names = pick(state, 0.1)
        new = Path(tmp) / "B" / MODEL
        save_sharded(perturbed(state, names, seed=5), new, shards=2)
        from tests.support.vllm_runs import write_config_folder

        write_config_folder(new, config)
        http_port = free_port()
        with (
            serve_weightstream(root, wire.DEFAULT_CHUNK_BYTES, ["--allow-publish", "--http-port", str(http_port)]) as (
                _proc,
                port,
            ),
            WeightStreamClient(f"127.0.0.1:{port}", progress=False) as client,
        ):
            config_dir = Path(tmp) / "config" / MODEL
            client.fetch(MODEL, config_dir, metadata_only=True)
            target = f"127.0.0.1:{port}"
            result = subprocess.run(
                [
                    str(VLLM_PYTHON),
                    str(SCRIPTS / "update.py"),
                    str(config_dir),
                    target,
                    MODEL,
                    str(new),
                    "publish",
                    "1",
                    str(root / MODEL),
                ],
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
                cwd=tmp,
            )
            line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
            update_s = json.loads(line.removeprefix("RESULT "))["update_seconds"]
        fresh = run_engine(new, "safetensors")
        # vLLM's own path: an engine on A's files reloads B's from disk in place (reload_weights).
        script = Path(__file__).resolve().parent / "vllm_reload_script.py"
        reloaded = subprocess.run(
            [str(VLLM_PYTHON), str(script), str(root / MODEL), str(new)],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
            cwd=tmp,
        )
        line = next(x for x in reloaded.stdout.splitlines() if x.startswith("RESULT "))
        reload_s = json.loads(line.removeprefix("RESULT "))["reload_seconds"]
    changed = nbytes(state, names)
    return (
        f"vLLM (CPU, {sum(t.numel() * 4 for t in state.values()) / MB:.0f} MB float32 Llama, {changed / MB:.1f} MB "
        f"changed): in-place update {update_s:.3f} s; vLLM's own reload_weights from the new files "
        f"{reload_s:.3f} s ({reload_s / update_s:.1f}x); a fresh LLM on the new files {fresh.wall_seconds:.1f} s "
        f"(LLM() {fresh.init_seconds:.1f} s): {fresh.wall_seconds / update_s:.0f}x"
    )


if __name__ == "__main__":
    sys.exit(main())
