"""The shared cache, measured: four loaders of one cold S3 model, a cached reload, and the cache's memory bound.

Every server is `weightstream serve` in its own process reading a ~1 GB checkpoint from s3rver on
127.0.0.1; every client is its own process writing into a module whose memory was touched first.
Each run starts fresh servers, so every "cold" figure starts with an empty cache:

- baseline: one client loads the model from a cold server (S3 read once);
- 4 at once, cache on: four clients start together on a cold server with --cache-bytes;
- 4 at once, cache off: the same without a cache (every client's stream reads S3 itself);
- cached reload: a second load from the server the baseline warmed;
- 4 at once, warm cache: four clients together on that warm server, which no storage slows: what
  moving four copies over loopback costs on this machine by itself.

Storage bytes come from the server's own counter (/status storage_bytes_read_total); every client
checks its module bit for bit against the checkpoint. A last part loads the model twice through a
server whose cache is a quarter of the model, and through one without a cache, and compares the
servers' peak RSS growth.

Usage (from the repository root, after `make test` installed s3rver):
python benchmarks/cache_load.py [--gb 1] [--runs 3]
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import peak_rss, rss, serve_weightstream, write_checkpoint
from tests.support.ports import free_ports
from tests.support.s3_stores import REGION, S3RVER_KEY, s3rver, upload_folder
from weightstream.client import WeightStreamClient
from weightstream.samples import ParameterTree

BUCKET = "bench"
MODEL = f"s3://{BUCKET}/llama"
MIB = 1024 * 1024


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())
    return h.hexdigest()


def client_load(target: str, shapes: Any, barrier: Any) -> tuple[float, float, str]:
    """One client process: touch a module, wait for the others, load; (start, end, digest)."""
    from weightstream.allocator import tune_malloc

    tune_malloc()
    module = ParameterTree(shapes)
    with WeightStreamClient(target, progress=False) as client:
        client.manifest(MODEL)  # the channel is up before the clock starts
        if barrier is not None:
            barrier.wait(timeout=120)
        started = time.time()
        client.load_into(module, MODEL)
        ended = time.time()
    return started, ended, digest(dict(module.named_parameters()))


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status(http_port: int) -> dict[str, Any]:
    return httpx.get(f"http://127.0.0.1:{http_port}/status", timeout=10, trust_env=False).json()


def concurrent_loads(pool: Any, manager: Any, target: str, shapes: Any, clients: int) -> tuple[float, list[str]]:
    barrier = manager.Barrier(clients) if clients > 1 else None
    futures = [pool.apply_async(client_load, (target, shapes, barrier)) for _ in range(clients)]
    results = [f.get(timeout=600) for f in futures]
    return max(r[1] for r in results) - min(r[0] for r in results), [r[2] for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (default 1.0)")
    parser.add_argument("--runs", type=int, default=3, help="runs of every path (default 3)")
    args = parser.parse_args()
    os.environ.update(
        AWS_ACCESS_KEY_ID=S3RVER_KEY,
        AWS_SECRET_ACCESS_KEY=S3RVER_KEY,
        AWS_EC2_METADATA_DISABLED="true",
        AWS_REGION=REGION,
        WEIGHTSTREAM_S3_BUCKETS=BUCKET,
        WEIGHTSTREAM_S3_PATH_STYLE="1",
    )
    with tempfile.TemporaryDirectory(prefix="weightstream-cache-bench-") as tmp:
        work = Path(tmp)
        total, shapes = write_checkpoint(work / "model", args.gb)
        expected = digest(
            {k: v for f in sorted((work / "model").glob("*.safetensors")) for k, v in load_file(f).items()}
        )
        cache_on = ["--cache-bytes", str(int(total * 1.25))]
        times: dict[str, list[float]] = {k: [] for k in ("baseline", "4 on", "4 off", "reload", "4 warm")}
        read: dict[str, list[int]] = {k: [] for k in times}
        s3_cpu: dict[str, list[float]] = {k: [] for k in times}
        server_cpu: dict[str, list[float]] = {k: [] for k in times}
        bad = 0
        with (
            s3rver(work) as store,
            multiprocessing.get_context("spawn").Pool(4) as pool,
            multiprocessing.Manager() as manager,
        ):
            upload_folder(store.client(), work / "model", BUCKET, "llama")
            for f in (work / "model").iterdir():
                f.unlink()
            os.environ["WEIGHTSTREAM_S3_ENDPOINT"] = store.endpoint
            for _ in range(args.runs):
                for key, clients, extra in (("baseline", 1, cache_on), ("4 on", 4, cache_on), ("4 off", 4, [])):
                    (http,) = free_ports(1)
                    with serve_weightstream(None, 4 * MIB, [*extra, "--http-port", str(http)]) as (server, port):
                        runs = [(key, clients)] + ([("reload", 1), ("4 warm", 4)] if key == "baseline" else [])
                        for path, count in runs:
                            before = status(http)["storage_bytes_read_total"]
                            cpu = (cpu_seconds(store.proc.pid), cpu_seconds(server.pid))
                            wall, digests = concurrent_loads(pool, manager, f"127.0.0.1:{port}", shapes, count)
                            s3_cpu[path].append(cpu_seconds(store.proc.pid) - cpu[0])
                            server_cpu[path].append(cpu_seconds(server.pid) - cpu[1])
                            bad += sum(d != expected for d in digests)
                            times[path].append(wall)
                            read[path].append(status(http)["storage_bytes_read_total"] - before)

            # The memory bound: the model loaded twice through a server whose cache is a quarter of
            # it, and through one with no cache (the baseline: read-ahead and messages in flight).
            small = int(total // 4)
            growth: dict[str, int] = {}
            for key, extra in (("no cache", []), ("cache", ["--cache-bytes", str(small)])):
                (http,) = free_ports(1)
                with serve_weightstream(None, 4 * MIB, [*extra, "--http-port", str(http)]) as (proc, port):
                    idle = rss(proc.pid)
                    for _ in range(2):
                        _, digests = concurrent_loads(pool, manager, f"127.0.0.1:{port}", shapes, 1)
                        bad += sum(d != expected for d in digests)
                    growth[key] = peak_rss(proc.pid) - idle
                    if key == "cache":
                        bound_cache = status(http)["cache"]

    def med(key: str) -> float:
        return statistics.median(times[key])

    print(f"checkpoint: {total / 1e9:.2f} GB bfloat16, {len(shapes)} tensors, 4 shards in s3rver on 127.0.0.1; "
          f"{args.runs} runs of every path, fresh servers each run; clients in their own processes")  # fmt: skip
    print(
        "| path | clients | median wall s | min..max s | GB/s per client | storage bytes read (median) | vs one copy "
        "| s3rver CPU s | server CPU s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    names = {
        "baseline": "baseline: one client, cold cache",
        "4 on": "4 clients at once, cold cache (single-flight)",
        "4 off": "4 clients at once, no cache",
        "reload": "cached reload (second load, same server)",
        "4 warm": "4 clients at once, warm cache (the transport's own cost)",
    }
    for key, name in names.items():
        clients = 4 if key.startswith("4") else 1
        bytes_read = int(statistics.median(read[key]))
        print(
            f"| {name} | {clients} | {med(key):.2f} | {min(times[key]):.2f}..{max(times[key]):.2f} | "
            f"{total / med(key) / 1e9:.2f} | {bytes_read:,} | {bytes_read / total:.2f}x | "
            f"{statistics.median(s3_cpu[key]):.2f} | {statistics.median(server_cpu[key]):.2f} |"
        )
    print(
        f"4 clients, cold, cache on / one client cold:  {med('4 on') / med('baseline'):.2f}x the time (target <= 1.5)"
    )
    print(
        f"storage read by the 4 cold clients:            {max(read['4 on']) / total:.2f} copies of the model (target 1)"
    )
    print(f"cold S3 load / cached reload:                  {med('baseline') / med('reload'):.2f}x faster (target >= 3)")
    print(f"4 clients, no cache / one client cold:         {med('4 off') / med('baseline'):.2f}x the time")
    extra_growth = growth["cache"] - growth["no cache"]
    print(
        f"model {total / 1e9:.2f} GB loaded twice, server peak RSS growth: "
        f"{growth['no cache'] / MIB:.0f} MiB without a "
        f"cache, {growth['cache'] / MIB:.0f} MiB with a cache of {small / MIB:.0f} MiB: {extra_growth / MIB:.0f} MiB "
        f"more (bound: the cache's size); resident {bound_cache['resident_bytes'] / MIB:.0f} MiB, "
        f"{bound_cache['evictions']} evictions"
    )
    print(f"modules not bit-identical to the checkpoint: {bad}")


if __name__ == "__main__":
    main()
