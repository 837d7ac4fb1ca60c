"""A weightstream fleet in network namespaces: an origin (upstream server and trainer) and N nodes.

Node 0 of a netns.Fleet is the origin: `weightstream serve --allow-publish` and a trainer process
that publishes revisions of random tensors when told (every element changes). Nodes 1..N each run a
sidecar (`--upstream` the origin) and an engine: a process that loads the model from its sidecar,
watches it, and for each new revision calls update_into and records when it returned and whether the
tensors it then holds match the revision's BLAKE3 digest (bit-exact).

The roles run as `python -m tests.support.fleet ROLE ...` inside the nodes; they talk to the
driver through files in a shared folder: the trainer publishes revision K once `go-K` exists and
writes `published-K.json`; each engine appends one JSON line per revision to `engine-I.jsonl`. The
`call` role makes the RPCs a JSON file lists, each with or without the fleet's credentials, and prints
what each answered: how a test calls a node's gRPC port from inside another node.

A secure fleet (cluster(secure=True)) runs as a tier with mutual TLS and a bearer token does: every
server serves gRPC over TLS with a certificate that names 127.0.0.1 and every node's address, asks
callers for a client certificate of the fleet's CA, and accepts one token; each sidecar shows that
certificate and token to its upstream and so to its peers, and the trainer and engines show them too.

Every wait is bounded; everything started is killed when the Fleet closes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import secrets
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.support.certificates import make_pki
from tests.support.commands import clean_env, weightstream_cmd
from tests.support.netns import Fleet, Node

if TYPE_CHECKING:
    import torch

    from weightstream.client import WeightStreamClient

MODEL = "fleet-model"
GRPC_PORT = 50051
HTTP_PORT = 8080
DATA_PORT = 50052
WAIT_S = 120.0
POLL_S = 0.02
# Seconds one RPC of the call role may take.
CALL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Security:
    """A secure fleet's PEM files and token file (see the module's docstring)."""

    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path
    token_file: Path

    @classmethod
    def make(cls, folder: Path, fleet: Fleet) -> Security:
        """A fresh CA, a server certificate for 127.0.0.1 and every node of fleet, a client certificate and a
        random token, under folder."""
        pki = make_pki(folder / "pki", "fleet", addresses=tuple(node.address for node in fleet.nodes))
        token_file = folder / "fleet-token"
        token_file.write_text(secrets.token_hex(16) + "\n")
        return cls(pki.ca, pki.server_cert, pki.server_key, pki.client_cert, pki.client_key, token_file)

    def server_args(self) -> list[str]:
        return [
            "--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-client-ca", str(self.ca),
            "--token-file", str(self.token_file),
        ]  # fmt: skip

    def upstream_args(self) -> list[str]:
        """A sidecar's: the TLS and token it uses for its upstream, and so for its peers."""
        return [
            "--upstream-tls", "--upstream-ca-file", str(self.ca), "--upstream-client-cert", str(self.client_cert),
            "--upstream-client-key", str(self.client_key), "--upstream-token-file", str(self.token_file),
        ]  # fmt: skip

    def client_args(self) -> list[str]:
        """The roles' (trainer, engine, call)."""
        return [
            "--ca", str(self.ca), "--client-cert", str(self.client_cert), "--client-key", str(self.client_key),
            "--token-file", str(self.token_file),
        ]  # fmt: skip


@dataclass
class Cluster:
    """A running fleet: the origin, the nodes with sidecar and engine, and the folder they report in."""

    fleet: Fleet
    folder: Path
    nodes: int
    # The trainer's revisions, in the order published.
    revisions: list[str] = field(default_factory=list)
    # A secure fleet's credentials; None: plaintext, no tokens.
    security: Security | None = None

    @property
    def origin(self) -> Node:
        return self.fleet.nodes[0]

    def node(self, index: int) -> Node:
        return self.fleet.nodes[index]

    def publish(self, k: int, timeout: float = WAIT_S) -> tuple[str, float]:
        """Tell the trainer to publish its k-th revision; its name and the time.time() its publish returned."""
        (self.folder / f"go-{k}").touch()
        done = self.folder / f"published-{k}.json"
        _wait(done.exists, f"the trainer's publish {k}", timeout, self.fleet)
        published = json.loads(done.read_text())
        self.revisions.append(str(published["revision"]))
        return str(published["revision"]), float(published["published"])

    def engine_records(self, index: int) -> list[dict[str, object]]:
        path = self.folder / f"engine-{index}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_engines(
        self, revision: str, indexes: Sequence[int], timeout: float = WAIT_S
    ) -> dict[int, dict[str, object]]:
        """Each engine's record of revision (its first load or an update)."""
        found: dict[int, dict[str, object]] = {}

        def all_there() -> bool:
            for i in indexes:
                for record in self.engine_records(i):
                    if record.get("revision") == revision:
                        found[i] = record
            return len(found) == len(indexes)

        _wait(all_there, f"engines {list(indexes)} at revision {revision}", timeout, self.fleet)
        return found

    def metrics(self, index: int) -> dict[str, float]:
        """Node index's server's /metrics, as {"name{labels}": value}."""
        # A secure fleet's REST port is plain HTTP (on the node's own 127.0.0.1) and needs the token.
        token = f"open({str(self.security.token_file)!r}).read().strip()" if self.security is not None else "''"
        fetch = (
            "import urllib.request; "
            f"token = {token}; "
            "headers = {'Authorization': 'Bearer ' + token} if token else {}; "
            f"request = urllib.request.Request('http://127.0.0.1:{HTTP_PORT}/metrics', headers=headers); "
            "print(urllib.request.urlopen(request).read().decode())"
        )
        text = self.node(index).run([sys.executable, "-c", fetch])
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def call(self, index: int, requests: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Make requests (see _call_one) from inside node index, all at once; what each answered."""
        path = self.folder / f"call-{secrets.token_hex(4)}.json"
        path.write_text(json.dumps(list(requests)))
        credentials = self.security.client_args() if self.security is not None else []
        argv = [sys.executable, "-m", "tests.support.fleet", "call", "--requests", str(path), *credentials]
        answers: list[dict[str, Any]] = json.loads(self.node(index).run(argv))
        return answers

    def wait(self, check: object, what: str, timeout: float = WAIT_S) -> None:
        """Until check() is true; the fleet's logs on stderr if it is not within timeout."""
        try:
            _wait(check, what, timeout, self.fleet)
        except (TimeoutError, RuntimeError):
            sys.stderr.write(self.logs())
            raise

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.folder.glob("*.log"))
        )


def _wait(check: object, what: str, timeout: float, fleet: Fleet) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        dead = [p.args for p in fleet.nodes[0].processes if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{what}: the origin's process ended: {dead}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(POLL_S)


def start_root_origin(cluster: Cluster, root: Path, watch_interval: float) -> None:
    """Start the origin serving the model root root with --fanout (storage revisions); its log in the fleet folder."""
    args = [
        "--model-root", str(root), "--host", "0.0.0.0", "--grpc-port", str(GRPC_PORT), "--http-port", str(HTTP_PORT),
        "--data-port", str(DATA_PORT), "--watch-interval", str(watch_interval), "--fanout",
    ]  # fmt: skip
    cluster.origin.start([*weightstream_cmd(), "serve", *args], cluster.folder / "origin.log", _env())


def rewrite(path: Path, state: dict[str, torch.Tensor]) -> bytes:
    """Replace the safetensors file at path whole with state's tensors, at once (a new storage revision
    above, as a checkpoint writer would); its bytes."""
    from safetensors.torch import save_file

    staged = path.with_name(path.name + ".tmp")
    save_file(state, str(staged))
    staged.replace(path)
    return path.read_bytes()


def disk_cache_holds(folder: Path, expected: bytes) -> bool:
    """Whether the disk cache at folder kept (with its record) a file of exactly these bytes."""
    files = folder / "files"
    if not files.is_dir():
        return False
    return any(
        p.stat().st_size == len(expected) and p.with_name(p.name + ".json").exists() and p.read_bytes() == expected
        for p in files.iterdir()
        if not p.name.endswith(".json")
    )


def _env() -> dict[str, str]:
    root = Path(__file__).resolve().parents[2]
    paths = [str(root), str(root / "client"), str(root / "service")]
    env = clean_env(PYTHONPATH=os.pathsep.join(paths), WEIGHTSTREAM_LOG_LEVEL="WARNING")
    return env


def sidecar_args(origin: Node, extra: Sequence[str] = (), security: Security | None = None) -> list[str]:
    # The sidecar's data port carries its engine's updates (same host, other namespaces' ports apart).
    secure = [*security.server_args(), *security.upstream_args()] if security is not None else []
    return [
        "--host", "0.0.0.0", "--grpc-port", str(GRPC_PORT), "--http-port", str(HTTP_PORT),
        "--data-port", str(DATA_PORT), "--data-advertise", "127.0.0.1",
        "--upstream", f"{origin.address}:{GRPC_PORT}", "--watch-interval", "0.5", *secure, *extra,
    ]  # fmt: skip


def start_node(cluster: Cluster, index: int, sidecar_extra: Sequence[str] = ()) -> None:
    """Start node index's sidecar and engine (the engine waits for its sidecar)."""
    node = cluster.node(index)
    env = _env()
    folder = cluster.folder
    security = cluster.security
    node.start(
        [*weightstream_cmd(), "serve", *sidecar_args(cluster.origin, sidecar_extra, security)],
        folder / f"sidecar-{index}.log",
        env,
    )
    credentials = security.client_args() if security is not None else []
    engine = [sys.executable, "-m", "tests.support.fleet", "engine", "--target", f"127.0.0.1:{GRPC_PORT}"]
    engine += credentials
    node.start([*engine, "--out", str(folder / f"engine-{index}.jsonl")], folder / f"engine-{index}.log", env)


@contextlib.contextmanager
def cluster(
    folder: Path,
    nodes: int,
    mib: int,
    rate: str = "500mbit",
    origin_extra: Sequence[str] = (),
    sidecar_extra: Sequence[str] = (),
    start: Sequence[int] | None = None,
    one_by_one: bool = False,
    secure: bool = False,
    changed: float = 1.0,
    spread: str = "elements",
) -> Iterator[Cluster]:
    """An origin and nodes sidecars with an engine each, all at revision 0 of a mib MiB model on return
    (only the nodes of start, 1..nodes by default, are started). one_by_one: each node is started once
    the one before holds revision 0, so that the upstream's fan-out lists them in this order. secure:
    TLS and a token everywhere (see the module's docstring). changed < 1: each revision after the first
    changes that share of the previous one's elements (spread "elements": scattered over every block;
    "blocks": whole 1 MiB blocks), else every element."""
    folder.mkdir(parents=True, exist_ok=True)
    with Fleet(nodes + 1, rate=rate) as fleet:
        security = Security.make(folder, fleet) if secure else None
        running = Cluster(fleet, folder, nodes, security=security)
        env = _env()
        origin = fleet.nodes[0]
        root = folder / "origin-root"
        root.mkdir(exist_ok=True)
        origin_args = [
            "--model-root", str(root), "--host", "0.0.0.0", "--grpc-port", str(GRPC_PORT),
            "--http-port", str(HTTP_PORT), "--data-port", str(DATA_PORT), "--data-advertise", origin.address,
            "--allow-publish", "--fanout", *origin_extra,
        ]  # fmt: skip
        credentials: list[str] = []
        if security is not None:
            origin_args += security.server_args()
            credentials = security.client_args()
        origin.start([*weightstream_cmd(), "serve", *origin_args], folder / "origin.log", env)
        trainer = [sys.executable, "-m", "tests.support.fleet", "trainer", "--target", f"127.0.0.1:{GRPC_PORT}"]
        trainer += credentials
        trainer += ["--mib", str(mib), "--folder", str(folder), "--changed", str(changed), "--spread", spread]
        origin.start(trainer, folder / "trainer.log", env)
        try:
            first, _ = running.publish(0)
            indexes = list(range(1, nodes + 1)) if start is None else list(start)
            for i in indexes:
                start_node(running, i, sidecar_extra)
                if one_by_one:
                    running.wait_engines(first, [i])
            running.wait_engines(first, indexes)
            yield running
        except BaseException:
            sys.stderr.write(running.logs())
            raise


# ---------------------------------------------------------------------------------------------
# The roles, run inside the nodes


@dataclass(frozen=True)
class Credentials:
    """What a role shows a server: the fleet's CA (TLS), client certificate and token, or none of them."""

    ca: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None
    token_file: Path | None = None

    @property
    def token(self) -> str | None:
        return self.token_file.read_text().strip() if self.token_file is not None else None


def _client(target: str, credentials: Credentials) -> WeightStreamClient:
    from weightstream.client import WeightStreamClient

    return WeightStreamClient(
        target,
        token=credentials.token or "",
        tls=credentials.ca is not None,
        ca_file=credentials.ca,
        client_cert=credentials.client_cert,
        client_key=credentials.client_key,
    )


def _trainer(
    target: str, mib: int, folder: Path, credentials: Credentials, changed: float = 1.0, spread: str = "elements"
) -> None:
    import torch

    from weightstream.client import WeightStreamError

    per = 4 * 1024 * 1024  # bytes per tensor: 4 MiB of float32
    count = max(1, mib * 1024 * 1024 // per)
    generator = torch.Generator().manual_seed(0)
    deadline = time.monotonic() + WAIT_S
    with _client(target, credentials) as client:
        k = 0
        tensors: dict[str, torch.Tensor] = {}
        while True:
            if not tensors or changed >= 1.0:
                tensors = {f"layers.{i}.weight": torch.randn(per // 4, generator=generator) for i in range(count)}
            else:
                tensors = {name: _changed(t, changed, spread, generator) for name, t in tensors.items()}
            go = folder / f"go-{k}"
            while not go.exists():
                time.sleep(POLL_S)
            while True:
                try:
                    revision = client.publish(MODEL, tensors)
                    break
                except WeightStreamError:
                    if time.monotonic() > deadline:  # the server is still starting
                        raise
                    time.sleep(0.1)
            published = time.time()
            out = folder / f"published-{k}.json"
            out.with_suffix(".tmp").write_text(json.dumps({"published": published, "revision": revision}))
            out.with_suffix(".tmp").rename(out)
            k += 1


def _changed(tensor: Any, share: float, spread: str, generator: Any) -> Any:
    """A copy of tensor (flat float32) with share of its elements changed: scattered, or whole 1 MiB blocks."""
    import torch

    out = tensor.clone()
    if spread == "blocks":
        per_block = 1024 * 1024 // 4
        blocks = -(-out.numel() // per_block)
        for j in (torch.rand(blocks, generator=generator) < share).nonzero().flatten().tolist():
            piece = out[j * per_block : (j + 1) * per_block]
            piece.copy_(torch.randn(piece.numel(), generator=generator))
        return out
    mask = torch.rand(out.numel(), generator=generator) < share
    out[mask] = torch.randn(int(mask.sum()), generator=generator)
    return out


def _engine(target: str, out: Path, credentials: Credentials) -> None:
    from weightstream.client import WeightStreamError

    deadline = time.monotonic() + WAIT_S
    with _client(target, credentials) as client:
        while True:
            try:
                manifest = client.manifest(MODEL)
                break
            except WeightStreamError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        tensors = client.load_state_dict(MODEL)
        held = manifest.revision

        def record(revision: str, done: float) -> None:
            manifest = client.manifest(MODEL, revision=revision)
            exact = manifest.digest != "" and manifest.digest_of(tensors) == manifest.digest
            line = json.dumps({"revision": revision, "done": done, "exact": exact})
            with out.open("a") as sink:
                sink.write(line + "\n")

        record(held, time.time())
        while True:
            try:
                for event in client.watch(MODEL, after=held):
                    if event.revision == held:
                        continue
                    report = client.update_into(tensors, MODEL, since=held)
                    done = time.time()
                    held = report.revision
                    record(held, done)
            except WeightStreamError:
                time.sleep(0.2)  # the sidecar restarting: watch again


def _call(requests: list[dict[str, Any]], credentials: Credentials) -> list[dict[str, Any]]:
    """Each request's RPC, all at once (each waits up to CALL_TIMEOUT_S); what each answered, in order."""
    with concurrent.futures.ThreadPoolExecutor(max(1, len(requests))) as pool:
        return list(pool.map(lambda request: _call_one(request, credentials), requests))


def _call_one(request: dict[str, Any], credentials: Credentials) -> dict[str, Any]:
    """request's RPC; what it answered: {"code", "messages", "bytes"} (the bytes of blocks served), and
    "revision" for a manifest.

    A request names target ("HOST:PORT"), rpc ("manifest", "hashes" or "blocks"), model, revision, tensors
    (for blocks), and "as": "fleet" (the fleet's TLS, client certificate and token), "no-token",
    "wrong-token" (no token or another one), "no-cert" (TLS without a client certificate) or
    "plaintext" (no TLS, the fleet's token)."""
    import grpc

    from weightstream.v1 import weightstream_pb2 as pb
    from weightstream.v1 import weightstream_pb2_grpc as pb_grpc

    shown = request["as"]
    if shown == "plaintext":
        channel = grpc.insecure_channel(request["target"])
    else:
        ca, cert, key = credentials.ca, credentials.client_cert, credentials.client_key
        assert ca is not None and cert is not None and key is not None, "TLS calls need the fleet's PEM files"
        tls = grpc.ssl_channel_credentials(
            root_certificates=ca.read_bytes(),
            private_key=key.read_bytes() if shown != "no-cert" else None,
            certificate_chain=cert.read_bytes() if shown != "no-cert" else None,
        )
        channel = grpc.secure_channel(request["target"], tls)
    token = {"no-token": None, "wrong-token": "not-the-fleet-token"}.get(shown, credentials.token)
    metadata = [("authorization", f"Bearer {token}")] if token else []
    model, revision = request["model"], request.get("revision", "")
    answer: dict[str, Any] = {"code": "OK", "messages": 0, "bytes": 0}
    with channel:
        stub = pb_grpc.WeightStreamServiceStub(channel)
        try:
            if request["rpc"] == "manifest":
                manifest = stub.GetManifest(
                    pb.GetManifestRequest(model=model, revision=revision), metadata=metadata, timeout=CALL_TIMEOUT_S
                )
                answer["revision"] = manifest.revision
            elif request["rpc"] == "hashes":
                hashes = pb.GetBlockHashesRequest(model=model, revision=revision)
                for _ in stub.GetBlockHashes(hashes, metadata=metadata, timeout=CALL_TIMEOUT_S):
                    answer["messages"] += 1
            else:
                blocks = pb.StreamRevisionBlocksRequest(model=model, revision=revision, tensors=request["tensors"])
                for block in stub.StreamRevisionBlocks(blocks, metadata=metadata, timeout=CALL_TIMEOUT_S):
                    answer["messages"] += 1
                    answer["bytes"] += len(block.data)
        except grpc.RpcError as exc:
            answer["code"] = exc.code().name
    return answer


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.fleet")
    parser.add_argument("role", choices=["trainer", "engine", "call"])
    parser.add_argument("--target")
    parser.add_argument("--mib", type=int, default=8)
    parser.add_argument("--folder", type=Path)
    parser.add_argument(
        "--changed", type=float, default=1.0, help="trainer: the share of elements each revision changes"
    )
    parser.add_argument("--spread", choices=["elements", "blocks"], default="elements")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--requests", type=Path, help="call: a JSON list of requests (see _call_one)")
    parser.add_argument("--ca", type=Path, help="the fleet's CA: TLS")
    parser.add_argument("--client-cert", type=Path)
    parser.add_argument("--client-key", type=Path)
    parser.add_argument("--token-file", type=Path, help="the fleet's token")
    args = parser.parse_args(argv)
    credentials = Credentials(args.ca, args.client_cert, args.client_key, args.token_file)
    if args.role == "trainer":
        _trainer(args.target, args.mib, args.folder, credentials, args.changed, args.spread)
    elif args.role == "engine":
        _engine(args.target, args.out, credentials)
    else:
        print(json.dumps(_call(json.loads(args.requests.read_text()), credentials)))


if __name__ == "__main__":
    main()
