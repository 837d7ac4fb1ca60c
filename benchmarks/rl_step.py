"""One RL step's weight sync to a vLLM engine: send_weights with and without deltas, against the disk path.

A Llama-shaped bfloat16 checkpoint (head size 64; the default, hidden 1024 and 12 layers over a
32000-word vocabulary, is about 440 MB) is revision A under the root of a `weightstream serve
--allow-publish` process (no shared-memory directory: every byte goes over TCP). A trainer (a module
holding the bfloat16 weights) and one real vLLM engine (the CPU build in .venv-vllm, an offline
`LLM` in benchmarks/rl_step_script.py) then take --steps RL steps per mode, after --warmup steps that
are not counted. Each step changes --fraction (default 2%) of the elements of every tensor in place,
then times:

- send_weights, no deltas: vLLM's WeightTransferTrainerFactory with the weightstream backend
  (WeightStreamTrainerInitInfo, OfflineLLMClient): the trainer publishes the whole model, then the
  engine (loaded with load_format="weightstream") pulls what changed (every tensor);
- send_weights, deltas: the same with init_info deltas=True: the trainer publishes only the changed
  chunks as XOR deltas against its host copy, and the engine pulls deltas into its own host copy
  and feeds the model from there;
- send_weights, deltas="auto": the same, but each publish sends what changed as deltas, or every
  chunk whole (nothing compared, and then the engine streams it straight in), whichever took less
  time in its recent publishes; the two steps after the warm-up, in which it measures both ways, are
  shown apart and not counted (its goal on bytes applies on the 1 Gbit/s link only);
- disk: what users do without weightstream: the trainer saves its weights with safetensors'
  save_file to a folder, and an engine loaded from A's files (load_format="safetensors") reloads
  them in place with vLLM's reload_weights(weights_path=...), on every worker;
- full load: after each step of the weightstream modes (not part of it), a `load_into` of the
  just-published revision over the data port into a bfloat16 module: the baseline for the engine's
  pull of a delta publish into its host copy (the engine's own log line), the first engine's update.

The engine runs in float32 (vLLM's bfloat16 CPU kernels crash on some machines), while the
checkpoint and everything the trainer publishes or saves is bfloat16: vLLM converts on load, so an
engine update includes that conversion on every path.

Bytes on the wire per step are what the server received from the trainer plus what it sent (its
/status counters, read before and after each send); the disk path moves none (the file it writes
and reads back is shown for scale). --link 1gbit runs everything (server, trainer and engine) inside
a network namespace made for the run, whose loopback is shaped with `tc qdisc ... tbf rate 1gbit`:
all traffic stays on that namespace's 127.0.0.1, and both directions share the one gigabit (a step
moves its bytes one way at a time: the publish in, then the update out). --link both runs the
loopback case, then the 1 Gbit/s one. Prints one table per link (medians and spreads of --steps) and
the goals, met or missed, that apply to it.

Usage (from the repository root, with .venv-vllm built; --link 1gbit needs root, `ip` and `tc`):
    PYTHONPATH=client:service .venv/bin/python benchmarks/rl_step.py [--hidden 1024] [--layers 12]
        [--steps 5] [--warmup 1] [--fraction 0.02] [--link loopback|1gbit|both] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import free_port, serve_weightstream
from tests.support.commands import clean_env
from tests.support.vllm_runs import VLLM_PYTHON, ensure_vllm_venv, vllm_llama_config, write_config_folder
from weightstream.protocol import wire
from weightstream.samples import llama_like_state_dict, save_sharded

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "rl_step_script.py"
MODEL = "rl-llama"
SCRIPT_TIMEOUT_S = 3600
NAMESPACE_TIMEOUT_S = 30
SHAPING = ["tbf", "rate", "1gbit", "burst", "256kb", "latency", "50ms"]

# The goals: (what, the mode's median / the baseline's median at most, the link it applies to).
GOALS = (
    ("deltas never slower than without on loopback", "deltas", "whole", 1.0, "loopback"),
    ('deltas="auto" never slower than without on loopback', "auto", "whole", 1.0, "loopback"),
    ("deltas <= 0.3x the whole path on 1 Gbit/s", "deltas", "whole", 0.3, "1gbit"),
    ('deltas="auto" <= 0.3x the whole path on 1 Gbit/s', "auto", "whole", 0.3, "1gbit"),
    ("deltas <= 0.5x the disk path's time", "deltas", "disk", 0.5, None),
    (
        "first engine's pull of a delta publish (its host copy) <= 1.0x a full load",
        "deltas pull",
        "full load",
        1.0,
        None,
    ),
)
MODES = (("whole", "no deltas"), ("deltas", "deltas"), ("auto", 'deltas="auto"'))
BYTES_GOAL = 0.10
# deltas="auto" measures both ways in its first two publishes against a base (rl_step_script.AUTO_MEASURING).
AUTO_MEASURING = 2
# The engine's own lines (vllm_transfer): its whole update to a revision, and its host copy's pull.
_ENGINE_UPDATE = re.compile(r"weightstream: updated \S+ from \S+ to (\S+): .* in ([0-9.]+) s \(")
_HOST_COPY = re.compile(r"weightstream: host copy of \S+ at (\S+): .* in ([0-9.]+) s")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size, a multiple of 64 (default 1024)")
    parser.add_argument("--layers", type=int, default=12, help="decoder layers (default 12: about 440 MB bf16)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    parser.add_argument("--steps", type=int, default=5, help="counted steps per mode (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="steps per mode before those counted (default 1)")
    parser.add_argument("--fraction", type=float, default=0.02, help="share of the elements changed (default 0.02)")
    parser.add_argument("--link", choices=("loopback", "1gbit", "both"), default="loopback", help="(default loopback)")
    parser.add_argument("--quick", action="store_true", help="a small model (hidden 256, 2 layers) and 2 steps")
    parser.add_argument("--in-namespace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.vocab, args.steps = 256, 2, 4096, 2
    if args.link == "loopback" or args.in_namespace:
        return measure(args)
    if args.link == "both":
        measure(argparse.Namespace(**{**vars(args), "link": "loopback"}))
        print(flush=True)
    forwarded: list[str] = []
    skip = False
    for arg in sys.argv[1:]:
        if not skip and not arg.startswith("--link"):
            forwarded.append(arg)
        skip = arg == "--link"
    with shaped_namespace() as namespace:
        command = ["ip", "netns", "exec", namespace, sys.executable, __file__, *forwarded]
        return subprocess.run([*command, "--link", "1gbit", "--in-namespace"], check=False).returncode


@contextlib.contextmanager
def shaped_namespace() -> Iterator[str]:
    """A network namespace of its own with its loopback up and shaped to 1 Gbit/s; removed on the way out."""
    name = f"ws-rl-step-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=NAMESPACE_TIMEOUT_S)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, timeout=NAMESPACE_TIMEOUT_S)
        shape = ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", *SHAPING]
        subprocess.run(shape, check=True, timeout=NAMESPACE_TIMEOUT_S)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, timeout=NAMESPACE_TIMEOUT_S)


def measure(args: argparse.Namespace) -> int:
    ensure_vllm_venv()
    with tempfile.TemporaryDirectory(prefix="weightstream-rl-step-") as tmp:
        root = Path(tmp) / "root"
        config = vllm_llama_config(
            hidden=args.hidden, layers=args.layers, intermediate=args.hidden * 11 // 4, vocab=args.vocab
        )
        state = llama_like_state_dict(
            layers=args.layers, hidden=args.hidden, intermediate=args.hidden * 11 // 4, vocab=args.vocab
        )
        total = sum(t.numel() * t.element_size() for t in state.values())
        save_sharded(state, root / MODEL, shards=4)
        del state
        # The disk path's engine starts on A's files; the weightstream engine on config and tokenizer only.
        write_config_folder(root / MODEL, config)
        write_config_folder(Path(tmp) / "config" / MODEL, config)
        http_port = free_port()
        extra = ["--allow-publish", "--http-port", str(http_port), "--publish-max-bytes", str(6 * total)]
        print(
            f"checkpoint: {total / 1e6:.0f} MB bfloat16 (hidden {args.hidden}, {args.layers} layers, vocab "
            f"{args.vocab}); engine float32; {args.fraction:.1%} of the elements changed per step; "
            f"link {args.link}; {args.steps} steps per mode after {args.warmup} not counted",
            flush=True,
        )
        common = {
            "model": MODEL,
            "weights": str(root / MODEL),
            "steps": args.steps,
            "warmup": args.warmup,
            "fraction": args.fraction,
            "seed": 1,
        }
        with serve_weightstream(root, wire.DEFAULT_CHUNK_BYTES, extra) as (_process, port):
            streamed = run_script(
                Path(tmp),
                {
                    **common,
                    "mode": "weightstream",
                    "model_dir": str(Path(tmp) / "config" / MODEL),
                    "target": f"127.0.0.1:{port}",
                    "http_port": http_port,
                },
            )
        on_disk = run_script(
            Path(tmp), {**common, "mode": "disk", "model_dir": str(root / MODEL), "out": str(Path(tmp) / "saved")}
        )
    report(args, total, streamed, on_disk)
    return 0


def run_script(tmp: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """rl_step_script.py in .venv-vllm with this checkout's code; its RESULT, and its first-load time."""
    log = tmp / f"engine-{settings['mode']}.log"
    env = clean_env(
        VLLM_CPU_KVCACHE_SPACE="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=f"{ROOT / 'client'}:{ROOT / 'service'}",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    started = time.perf_counter()
    with log.open("w") as sink:
        result = subprocess.run(
            [str(VLLM_PYTHON), str(SCRIPT), json.dumps(settings)],
            stdout=subprocess.PIPE,
            stderr=sink,
            text=True,
            timeout=SCRIPT_TIMEOUT_S,
            env=env,
            cwd=tmp,
            check=False,
        )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise SystemExit(
            f"{SCRIPT.name} ({settings['mode']}) failed (exit {result.returncode}, "
            f"{time.perf_counter() - started:.0f} s)\n--- stdout\n{result.stdout[-4000:]}\n"
            f"--- log\n{log.read_text()[-8000:]}"
        )
    printed: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    # vLLM logs to stdout, in every process of the engine.
    logs = result.stdout + log.read_text()
    printed["engine_updates"] = {m.group(1): float(m.group(2)) for m in _ENGINE_UPDATE.finditer(logs)}
    printed["host_copies"] = {m.group(1): float(m.group(2)) for m in _HOST_COPY.finditer(logs)}
    return printed


def report(args: argparse.Namespace, total: int, streamed: dict[str, Any], on_disk: dict[str, Any]) -> None:
    blocks = {**streamed["blocks"], **on_disk["blocks"]}
    # deltas="auto" measures both ways in the two steps after the warm-up: shown apart, not counted.
    measuring = blocks["auto"][args.warmup : args.warmup + AUTO_MEASURING]
    counted = {name: steps[args.warmup + (AUTO_MEASURING if name == "auto" else 0) :] for name, steps in blocks.items()}
    loads = [s["full_load_seconds"] for name, _ in MODES for s in counted[name]]
    medians = {name: statistics.median(s["seconds"] for s in steps) for name, steps in counted.items()}
    pulls = [streamed["host_copies"].get(s["revision"]) for s in counted["deltas"]]
    medians["deltas pull"] = statistics.median(p for p in pulls if p is not None) if None not in pulls else float("nan")
    medians["full load"] = statistics.median(loads)

    def wire_bytes(name: str) -> int:
        return int(statistics.median(s["received_bytes"] + s["served_bytes"] for s in counted[name]))

    def spread(values: list[float]) -> str:
        return f"{min(values):.3f}-{max(values):.3f}"

    print(f"link {args.link}: medians of {args.steps} steps per mode (spread min-max)")
    print(
        "| mode | seconds per step | spread | publish or save s | engine update or reload s "
        "| x no deltas | x disk path | bytes on the wire (in + out) | x model |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, label in (
        *((mode, f"send_weights, {text}") for mode, text in MODES),
        ("disk", "disk: save_file + reload_weights"),
    ):
        steps = counted[name]
        seconds = [s["seconds"] for s in steps]
        first = statistics.median(s.get("publish_seconds", s.get("save_seconds", 0.0)) for s in steps)
        second = statistics.median(s.get("update_seconds", s.get("reload_seconds", 0.0)) for s in steps)
        if name == "disk":
            moved = f"0 ({steps[0]['file_bytes']:,d} B file written and read)"
            share = "0"
        else:
            received = int(statistics.median(s["received_bytes"] for s in steps))
            served = int(statistics.median(s["served_bytes"] for s in steps))
            moved = f"{wire_bytes(name):,d} ({received:,d} + {served:,d})"
            share = f"{wire_bytes(name) / total:.3f}"
        print(
            f"| {label} | {medians[name]:.3f} | {spread(seconds)} | {first:.3f} | {second:.3f} "
            f"| {medians[name] / medians['whole']:.2f}x | {medians[name] / medians['disk']:.2f}x | {moved} | {share} |"
        )
    print(
        f"| full load_into over the data port (bf16 module, baseline) | {medians['full load']:.3f} | "
        f"{spread(loads)} | | | | | {total:,d} | 1.000 |"
    )
    for name, label in MODES:
        warm = blocks[name][: args.warmup]
        if warm:
            print(
                f"warm-up step, {label} (not counted; with deltas the trainer's host copy starts empty): "
                + ", ".join(
                    f"{s['seconds']:.3f} s ({s['publish_seconds']:.3f} publish, {s['update_seconds']:.3f} update), "
                    f"{s['received_bytes'] + s['served_bytes']:,d} B on the wire"
                    for s in warm
                )
            )
    print(
        'deltas="auto" measuring both ways (not counted): '
        + ", ".join(
            f"{s['seconds']:.3f} s ({s['publish_seconds']:.3f} publish, {s['update_seconds']:.3f} update), "
            f"{s['received_bytes'] + s['served_bytes']:,d} B on the wire"
            for s in measuring
        )
    )
    for name, label in MODES:
        inside = [streamed["engine_updates"].get(s["revision"]) for s in counted[name]]
        copies = [streamed["host_copies"].get(s["revision"]) for s in counted[name]]
        if None not in inside:
            text = f"engine update, {label}: {statistics.median(inside):.3f} s in the engine"
            if None not in copies:
                pulled = statistics.median(copies)
                text += f", of which {pulled:.3f} s pulling its host copy (the rest: vLLM's load_weights and reload)"
            print(text + " (medians; the engine's own log)")
    print(
        f"engine start: LLM() {streamed['init_seconds']:.1f} s (load_format weightstream), "
        f"{on_disk['init_seconds']:.1f} s (safetensors)"
    )
    print("goals:")
    for text, mode, baseline, limit, link in GOALS:
        if link is not None and link != args.link:
            print(f"  {text}: not measured here (--link {link})")
            continue
        ratio = medians[mode] / medians[baseline]
        print(f"  {text}: {ratio:.2f}x: {'met' if ratio <= limit else 'MISSED'}")
    for name, label in MODES[1:]:
        on_wire = wire_bytes(name) / total
        if name == "auto" and args.link == "loopback":
            # Where sending everything is faster, "auto" does: its goal on loopback is time, not bytes.
            print(f"  {label} <= {BYTES_GOAL:.2f}x the model's bytes on the wire: {on_wire:.3f}x: not a goal here")
            continue
        print(
            f"  {label} <= {BYTES_GOAL:.2f}x the model's bytes on the wire: {on_wire:.3f}x: "
            f"{'met' if on_wire <= BYTES_GOAL else 'MISSED'}"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
