"""The `weightstream` command: serve, demo, manifest, load, fetch, publish, watch, update."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from weightstream import __version__
from weightstream.protocol import names

if TYPE_CHECKING:
    from weightstream.client import WeightStreamClient
    from weightstream.client.sglang import SglangServer
    from weightstream.client.vllm_http import VllmServer

SERVER_INSTALL = "pip install 'weightstream[server]'"
MODEL_HELP = "model id, for example tiny-llama, s3://bucket/prefix, gs://bucket/prefix or az://container/prefix"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightstream",
        description="Stream safetensors checkpoints straight into a model's parameters, in place. A server "
        "(serve) reads them from a folder, S3, Google Cloud Storage, Azure Blob or another weightstream server and "
        "streams them over gRPC, a TCP data port or shared memory; trainers publish new revisions to it, and "
        "engines update to a revision by pulling only what changed.",
    )
    parser.add_argument("--version", action="version", version=f"weightstream {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = commands.add_parser(
        "serve",
        help="serve models from a folder, S3, GCS, Azure Blob or another server; take published revisions",
        description="Serve the safetensors models under --model-root, in S3 (--s3-bucket), Google Cloud Storage "
        "(--gcs-bucket) or Azure Blob (--azure-container), or held by another weightstream server (--upstream: "
        "this one is then a tier), with a RAM cache (--cache-bytes) and a disk cache (--disk-cache) in between. "
        "Tensors go over gRPC, the TCP data port (--data-port) or shared memory (--shm-dir); REST health, status "
        "and metrics on --http-port. Each model's revisions are kept (--keep-revisions) and watched, and what "
        "changed between two is sent alone; trainers publish revisions when --allow-publish or "
        "--publish-token-file says so (held in memory, or written to --publish-dir or --publish-s3-prefix). "
        "Every option can also be set by the environment variable its help names, for example "
        "WEIGHTSTREAM_MODEL_ROOT; a flag beats its variable, and an empty variable counts as not set. Byte sizes "
        "take units (16GiB, 512MiB, 16GB) or a plain number of bytes; in the environment, lists are "
        "comma-separated and switches are 1/0, true/false, yes/no or on/off.",
    )
    _add_serve_options(serve)

    commands.add_parser(
        "demo",
        help="make a small checkpoint, serve it, load it, update it live with a new revision, verify both",
        description="Make a small Llama-like checkpoint in a temporary folder, serve it on free loopback ports, "
        "load it through the client into a torch module and verify it bit for bit; then publish a next revision "
        "with a few tensors changed, update the module in place (only the changed bytes move) and verify it "
        "against the new revision. Reports the speed and the bytes moved against the model's size.",
    )

    manifest = commands.add_parser(
        "manifest",
        help="list a model's tensors: names, dtypes, shapes, sizes and files",
        description="Print the tensors of MODEL's current revision as the server holds them: name, dtype, shape, "
        "bytes and file, then the totals. --json prints the same with the revision's name.",
    )
    manifest.add_argument("model", help=MODEL_HELP)
    manifest.add_argument("--target", required=True, help="server address, HOST:PORT")
    manifest.add_argument("--json", action="store_true", help="print the manifest as JSON")
    _add_connection_options(manifest)

    load = commands.add_parser(
        "load",
        help="stream a model's tensors into memory (CPU or GPU), check them and report the speed",
        description="Stream every tensor of MODEL's current revision into memory on --device, every chunk "
        "CRC32C-checked and every tensor checked complete, and print the tensors, bytes, seconds and GB/s. "
        "Nothing is written to disk (fetch does that).",
    )
    load.add_argument("model", help=MODEL_HELP)
    load.add_argument("--target", required=True, help="server address, HOST:PORT")
    load.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    load.add_argument("--no-progress", action="store_true", help="do not draw a progress bar")
    _add_connection_options(load)

    fetch = commands.add_parser(
        "fetch",
        help="download a model's weights and companion files into a folder (resumable)",
        description="Write a model's safetensors files and its companion files (config, tokenizer, index) into "
        "DIR, bit-identical to the server's, each checked by size and CRC32C. An interrupted fetch is "
        "continued by running the same command again.",
    )
    fetch.add_argument("model", help=MODEL_HELP)
    fetch.add_argument("directory", metavar="DIR", type=Path, help="folder to write the files into (made if needed)")
    fetch.add_argument("--target", required=True, help="server address, HOST:PORT")
    fetch.add_argument(
        "--metadata-only", action="store_true", help="only the companion files (config, tokenizer), not the weights"
    )
    fetch.add_argument("--no-progress", action="store_true", help="do not draw a progress bar")
    _add_connection_options(fetch)

    publish = commands.add_parser(
        "publish",
        help="publish safetensors files as a model's next revision, which engines then update to",
        description="Send the tensors of FILE (a .safetensors file) or DIR (its *.safetensors files) to the server "
        "as MODEL's next revision. The revision is current only once every tensor arrived whole and "
        "CRC32C-checked; a publish that fails leaves the current one. The server holds it in memory (and "
        "writes it to its --publish-dir or --publish-s3-prefix, if set). The server must take publishes "
        "(--allow-publish, or --publish-token-file with a publisher's token in WEIGHTSTREAM_TOKEN). The files "
        "are read into memory first.",
    )
    publish.add_argument("path", metavar="FILE|DIR", type=Path, help="a .safetensors file, or a folder of them")
    publish.add_argument("model", help="model id the revision is published under")
    publish.add_argument("--target", required=True, help="server address, HOST:PORT")
    publish.add_argument("--revision", default=None, help="the revision's name (default: named by its content)")
    publish.add_argument(
        "--new-layout", action="store_true", help="the tensors differ from the current revision's on purpose"
    )
    _add_connection_options(publish)

    watch = commands.add_parser(
        "watch",
        help="print a model's current revision, then each new one (a publish, or files changed in storage)",
        description="Print one JSON line per revision of MODEL as it becomes current: its name, origin "
        "(published or storage), size and the revisions the server keeps. Stops after --count lines, or on Ctrl-C.",
    )
    watch.add_argument("model", help=MODEL_HELP)
    watch.add_argument("--target", required=True, help="server address, HOST:PORT")
    watch.add_argument("--after", default="", help="a revision already held: start with the next one")
    watch.add_argument("--count", type=int, default=0, help="stop after this many revisions (default: never)")
    _add_connection_options(watch)

    update = commands.add_parser(
        "update",
        help="tell a running vllm serve or SGLang server to pull a revision of MODEL in place (or each new one, "
        "with --follow)",
        description="Pull MODEL's current revision (or --revision R) into a running `vllm serve` through its "
        "weight-transfer HTTP routes (the engine must run with VLLM_SERVER_DEV_MODE=1 and "
        '--weight-transfer-config \'{"backend": "weightstream"}\'), or into an SGLang server started with '
        "--load-format weightstream through its /update_weights_from_disk route. Every rank pulls only what "
        "changed since the revision it holds. The revision is resolved here, once, so that every rank pulls the "
        "same one. With --follow, watch MODEL and pull each new revision as it becomes current (a continuous "
        "deployment loop); one JSON line per update. The engine's API key, if any, comes from VLLM_API_KEY "
        "(vLLM) or SGLANG_API_KEY (SGLang).",
    )
    update.add_argument("model", help=MODEL_HELP)
    update.add_argument("--target", required=True, help="weightstream server address, HOST:PORT")
    engines = update.add_mutually_exclusive_group(required=True)
    engines.add_argument("--vllm", metavar="URL", help="the vLLM server, e.g. http://127.0.0.1:8000")
    engines.add_argument("--sglang", metavar="URL", help="the SGLang server, e.g. http://127.0.0.1:30000")
    update.add_argument(
        "--engine-target",
        default=None,
        help="vLLM: the weightstream address as the engine reaches it (default: --target)",
    )
    update.add_argument("--revision", default=None, help="the revision to pull (default: the current one)")
    update.add_argument("--follow", action="store_true", help="keep watching, and pull each new revision")
    update.add_argument("--count", type=int, default=0, help="with --follow: stop after this many updates")
    _add_connection_options(update)
    return parser


def _add_serve_options(serve: argparse.ArgumentParser) -> None:
    """The serve options, made from the server's settings; without the server installed, serve says what to install."""
    try:
        from weightstream_server.settings import ServerSettings
    except ImportError as exc:
        serve.set_defaults(server_missing=str(exc))
        serve.epilog = f"Needs the server's dependencies: {SERVER_INSTALL}."
        return
    serve.set_defaults(server_missing=None)
    ServerSettings.add_arguments(serve)


def _add_connection_options(parser: argparse.ArgumentParser) -> None:
    """TLS options of the client commands; the token comes from WEIGHTSTREAM_TOKEN."""
    parser.add_argument("--tls", action="store_true", help="connect over TLS")
    parser.add_argument("--tls-ca", metavar="FILE", help="PEM CA bundle to verify the server (default: system roots)")
    parser.add_argument("--tls-cert", metavar="FILE", help="PEM client certificate, for mutual TLS (with --tls-key)")
    parser.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--transport",
        choices=names.TRANSPORTS,
        default="auto",
        help="data path: auto (shared memory where WEIGHTSTREAM_SHM_DIR works, else the server's data port, "
        "else gRPC), shm, tcp or grpc (default auto)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Unknown arguments are refused below, as parse_args would, except by a serve without the server
    # installed: it has no options, and what to install is the message that helps.
    args, unknown = parser.parse_known_args(argv)
    if args.command == "serve" and args.server_missing:
        print(
            f"weightstream serve needs the server's dependencies: {SERVER_INSTALL} "
            f"(importing the server failed: {args.server_missing})",
            file=sys.stderr,
        )
        return 2
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "serve":
        return _serve(args)
    if args.command == "demo":
        from weightstream.demo import run_demo

        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return run_demo()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from weightstream.client import WeightStreamClient, WeightStreamError

    try:
        with WeightStreamClient(
            args.target,
            tls=args.tls or bool(args.tls_ca or args.tls_cert),
            ca_file=args.tls_ca,
            client_cert=args.tls_cert,
            client_key=args.tls_key,
            progress=not getattr(args, "no_progress", False),
            transport=args.transport,
        ) as client:
            if args.command == "manifest":
                return _manifest(client, args)
            if args.command == "fetch":
                return _fetch(client, args)
            if args.command == "publish":
                return _publish(client, args)
            if args.command == "watch":
                return _watch(client, args)
            if args.command == "update":
                return _update(client, args)
            return _load(client, args)
    except KeyboardInterrupt:
        return 130
    except (WeightStreamError, OSError, ValueError, RuntimeError) as exc:
        print(f"weightstream {args.command}: {exc}", file=sys.stderr)
        return 1


def _serve(args: argparse.Namespace) -> int:
    from weightstream_server.settings import ServerSettings

    try:
        settings = ServerSettings.load(vars(args))
    except ValueError as exc:
        print(f"weightstream serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from weightstream_server.app import serve

    try:
        serve(settings)
    except (OSError, ValueError) as exc:
        print(f"weightstream serve: {exc}", file=sys.stderr)
        return 1
    return 0


def _manifest(client: WeightStreamClient, args: argparse.Namespace) -> int:
    manifest = client.manifest(args.model)
    if args.json:
        print(
            json.dumps(
                {
                    "model": manifest.model,
                    "revision": manifest.revision,
                    "total_bytes": manifest.total_bytes,
                    "files": list(manifest.files),
                    "tensors": [
                        {
                            "name": t.name,
                            "dtype": str(t.dtype).removeprefix("torch."),
                            "shape": list(t.shape),
                            "nbytes": t.nbytes,
                            "file": t.file,
                        }
                        for t in manifest.tensors
                    ],
                },
                indent=2,
            )
        )
        return 0
    width = max((len(t.name) for t in manifest.tensors), default=4)
    for t in manifest.tensors:
        dtype = str(t.dtype).removeprefix("torch.")
        print(f"{t.name:<{width}}  {dtype:<14} {list(t.shape)!s:<20} {t.nbytes:>14,d}  {t.file}")
    print(f"{len(manifest.tensors)} tensors, {manifest.total_bytes:,d} bytes in {len(manifest.files)} files")
    return 0


def _load(client: WeightStreamClient, args: argparse.Namespace) -> int:
    from weightstream.allocator import tune_malloc

    tune_malloc()
    started = time.perf_counter()
    count = 0
    nbytes = 0
    for _name, tensor in client.iter_tensors(args.model, device=args.device):
        count += 1
        nbytes += tensor.numel() * tensor.element_size()
    seconds = time.perf_counter() - started
    print(
        f"loaded {args.model} from {args.target} to {args.device}: {count} tensors, {nbytes:,d} bytes in "
        f"{seconds:.3f} s, {nbytes / seconds / 1e9 if seconds else 0:.2f} GB/s over {client.transport} (every chunk "
        "CRC32C-verified, every tensor complete)"
    )
    return 0


def _fetch(client: WeightStreamClient, args: argparse.Namespace) -> int:
    report = client.fetch(args.model, args.directory, metadata_only=args.metadata_only)
    print(
        f"fetched {args.model} from {args.target} into {report.directory}: {len(report.files)} files "
        f"({len(report.downloaded)} downloaded, {len(report.resumed)} resumed, {len(report.skipped)} already "
        f"complete), {report.bytes:,d} bytes received in {report.seconds:.3f} s (every file size- and CRC32C-checked)"
    )
    return 0


def _publish(client: WeightStreamClient, args: argparse.Namespace) -> int:
    import torch
    from safetensors.torch import load_file

    path: Path = args.path
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            if name in tensors:
                raise ValueError(f"{file}: tensor {name!r} is in another file too")
            tensors[name] = tensor
    started = time.perf_counter()
    revision = client.publish(args.model, tensors, revision=args.revision, new_layout=args.new_layout)
    seconds = time.perf_counter() - started
    print(f"published {args.model} revision {revision} to {args.target}: {len(tensors)} tensors in {seconds:.3f} s")
    return 0


def _watch(client: WeightStreamClient, args: argparse.Namespace) -> int:
    for count, event in enumerate(client.watch(args.model, after=args.after), start=1):
        line = {
            "model": event.model,
            "revision": event.revision,
            "origin": event.origin,
            "total_bytes": event.total_bytes,
            "kept": list(event.kept),
        }
        print(json.dumps(line), flush=True)
        if args.count and count >= args.count:
            break
    return 0


def _update(client: WeightStreamClient, args: argparse.Namespace) -> int:
    import os

    from weightstream.client.sglang import SglangServer
    from weightstream.client.vllm_http import VllmServer

    if args.revision and args.follow:
        raise ValueError("--revision and --follow: pass one")
    engine: VllmServer | SglangServer
    if args.sglang:
        # The SGLang server pulls from where its --model-loader-extra-config points.
        engine = SglangServer(args.sglang, api_key=os.environ.get("SGLANG_API_KEY"))
    else:
        engine = VllmServer(args.vllm, api_key=os.environ.get("VLLM_API_KEY"))
        engine.init({"target": args.engine_target or args.target, "model": args.model})
    holding = engine.weight_version()
    if not args.follow:
        revision = args.revision or client.manifest(args.model).revision
        _pull(engine, args.model, revision, holding)
        return 0
    updates = 0
    for event in client.watch(args.model, after=holding or ""):
        _pull(engine, args.model, event.revision, holding)
        holding = event.revision
        updates += 1
        if args.count and updates >= args.count:
            break
    return 0


def _pull(engine: VllmServer | SglangServer, model: str, revision: str, holding: str | None) -> None:
    seconds = engine.pull(revision)
    line = {"model": model, "revision": revision, "since": holding, "seconds": round(seconds, 3)}
    line[engine.kind] = engine.url
    print(json.dumps(line), flush=True)
