"""Load a ~1 GB checkpoint from a local S3-protocol server (s3rver on 127.0.0.1) three ways, side by side.

- weightstream: `weightstream serve` (its own process) reads S3 with the Run:ai streamer; the client
  writes into a module's existing parameters over loopback gRPC;
- boto3 download_file of every shard to local disk, then safetensors.torch.load_file and
  module.load_state_dict (the usual "download, then load");
- the Run:ai streamer reading S3 directly in the client process (SafetensorsStreamer, owned=False),
  each tensor copied into the module's parameter.

Every path writes into the same module, whose memory was touched before the first run. Prints
medians and spreads of several runs and the ratios the S3 issue targets.

Usage (from the repository root, after `make test` installed s3rver): python benchmarks/s3_load.py [--gb 1] [--runs 3]
The client process and the server tune glibc malloc (weightstream.allocator), as `weightstream bench` does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import serve_weightstream, write_checkpoint
from tests.support.s3_stores import REGION, S3RVER_KEY, s3rver, upload_folder
from weightstream.client import WeightStreamClient
from weightstream.samples import ParameterTree

BUCKET = "bench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (default 1.0)")
    parser.add_argument("--runs", type=int, default=3, help="runs per path (default 3)")
    args = parser.parse_args()

    os.environ.update(
        AWS_ACCESS_KEY_ID=S3RVER_KEY,
        AWS_SECRET_ACCESS_KEY=S3RVER_KEY,
        AWS_EC2_METADATA_DISABLED="true",
        AWS_REGION=REGION,
        RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0",
        RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS="30000",
    )
    from runai_model_streamer import SafetensorsStreamer

    from weightstream.allocator import tune_malloc

    tune_malloc()
    from runai_model_streamer.s3_utils.s3_utils import S3Credentials

    with tempfile.TemporaryDirectory(prefix="weightstream-s3-bench-") as tmp:
        work = Path(tmp)
        total, shapes = write_checkpoint(work / "model", args.gb)
        module = ParameterTree(shapes)
        params = dict(module.named_parameters())
        with s3rver(work) as store:
            s3 = store.client()
            upload_folder(s3, work / "model", BUCKET, "llama")
            for f in (work / "model").iterdir():
                f.unlink()
            keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="llama/")["Contents"])
            shards = [k for k in keys if k.endswith(".safetensors")]
            os.environ["WEIGHTSTREAM_S3_BUCKETS"] = BUCKET
            os.environ["WEIGHTSTREAM_S3_ENDPOINT"] = store.endpoint
            os.environ["WEIGHTSTREAM_S3_PATH_STYLE"] = "1"
            results: dict[str, list[float]] = {"weightstream load_into": [], "boto3 download + load_file": [],
                                                "Run:ai streamer in the client": []}  # fmt: skip
            credentials = S3Credentials(endpoint=store.endpoint, region_name=REGION)
            with (
                serve_weightstream(None, 4 << 20) as (_server, port),
                WeightStreamClient(f"127.0.0.1:{port}", progress=False) as client,
            ):
                client.load_into(module, f"s3://{BUCKET}/llama")  # warm the server's streamer and channel
                for _ in range(args.runs):
                    started = time.perf_counter()
                    client.load_into(module, f"s3://{BUCKET}/llama")
                    results["weightstream load_into"].append(time.perf_counter() - started)

                    started = time.perf_counter()
                    loaded: dict[str, torch.Tensor] = {}
                    for key in shards:
                        local = work / "download" / Path(key).name
                        local.parent.mkdir(exist_ok=True)
                        s3.download_file(BUCKET, key, str(local))
                        loaded.update(load_file(str(local)))
                    module.load_state_dict(loaded)
                    results["boto3 download + load_file"].append(time.perf_counter() - started)
                    del loaded
                    for f in (work / "download").iterdir():
                        f.unlink()

                    started = time.perf_counter()
                    with SafetensorsStreamer() as streamer:
                        streamer.stream_files([f"s3://{BUCKET}/{k}" for k in shards], credentials, "cpu", owned=False)
                        with torch.no_grad():
                            for name, tensor in streamer.get_tensors():
                                params[name].copy_(tensor)
                    results["Run:ai streamer in the client"].append(time.perf_counter() - started)
            for name in ("WEIGHTSTREAM_S3_BUCKETS", "WEIGHTSTREAM_S3_ENDPOINT", "WEIGHTSTREAM_S3_PATH_STYLE"):
                del os.environ[name]

    medians = {name: statistics.median(times) for name, times in results.items()}
    print(f"checkpoint: {total / 1e9:.2f} GB bfloat16, {len(shapes)} tensors, 4 shards in s3rver on 127.0.0.1; "
          f"{args.runs} runs each; streamer defaults (RUNAI_STREAMER_CONCURRENCY and CHUNK_BYTESIZE unset), "
          "path-style addressing")  # fmt: skip
    print("| path | median s | median GB/s | min..max GB/s |")
    print("|---|---|---|---|")
    for name, times in results.items():
        rates = sorted(total / t / 1e9 for t in times)
        print(f"| {name} | {medians[name]:.2f} | {total / medians[name] / 1e9:.2f} | {rates[0]:.2f}..{rates[-1]:.2f} |")
    ws = medians["weightstream load_into"]
    print(
        f"weightstream / download-then-load: {ws / medians['boto3 download + load_file']:.2f}x the time (target <= 0.6)"
    )
    direct = medians["Run:ai streamer in the client"]
    print(f"weightstream / direct streamer:    {ws / direct:.2f}x the time (target <= 1.2)")


if __name__ == "__main__":
    main()
