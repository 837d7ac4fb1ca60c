"""A weightstream fleet in network namespaces: an origin (upstream server and trainer) and N nodes.

Node 0 of a netns.Fleet is the origin: `weightstream serve --allow-publish` and a trainer process
that publishes revisions of random tensors when told (every element changes). Nodes 1..N each run a
sidecar (`--upstream` the origin) and an engine: a process that loads the model from its sidecar,
watches it, and for each new revision calls update_into and records when it returned and whether the
tensors it then holds match the revision's BLAKE3 digest (bit-exact).

The roles run as `python -m tests.support.fleet ROLE ...` inside the nodes; they talk to the
driver through files in a shared folder: the trainer publishes revision K once `go-K` exists and
writes `published-K.json`; each engine appends one JSON line per revision to `engine-I.jsonl`.

Every wait is bounded; everything started is killed when the Fleet closes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.commands import clean_env, weightstream_cmd
from tests.support.netns import Fleet, Node

MODEL = "fleet-model"
GRPC_PORT = 50051
HTTP_PORT = 8080
DATA_PORT = 50052
WAIT_S = 120.0
POLL_S = 0.02


@dataclass
class Cluster:
    """A running fleet: the origin, the nodes with sidecar and engine, and the folder they report in."""

    fleet: Fleet
    folder: Path
    nodes: int
    # The trainer's revisions, in the order published.
    revisions: list[str] = field(default_factory=list)

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
        fetch = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{HTTP_PORT}/metrics').read().decode())"
        text = self.node(index).run([sys.executable, "-c", fetch])
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

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


def _env() -> dict[str, str]:
    root = Path(__file__).resolve().parents[2]
    paths = [str(root), str(root / "client"), str(root / "service")]
    env = clean_env(PYTHONPATH=os.pathsep.join(paths), WEIGHTSTREAM_LOG_LEVEL="WARNING")
    return env


def sidecar_args(origin: Node, extra: Sequence[str] = ()) -> list[str]:
    # The sidecar's data port carries its engine's updates (same host, other namespaces' ports apart).
    return [
        "--host", "0.0.0.0", "--grpc-port", str(GRPC_PORT), "--http-port", str(HTTP_PORT),
        "--data-port", str(DATA_PORT), "--data-advertise", "127.0.0.1",
        "--upstream", f"{origin.address}:{GRPC_PORT}", "--watch-interval", "0.5", *extra,
    ]  # fmt: skip


def start_node(cluster: Cluster, index: int, sidecar_extra: Sequence[str] = ()) -> None:
    """Start node index's sidecar and engine (the engine waits for its sidecar)."""
    node = cluster.node(index)
    env = _env()
    folder = cluster.folder
    node.start(
        [*weightstream_cmd(), "serve", *sidecar_args(cluster.origin, sidecar_extra)],
        folder / f"sidecar-{index}.log",
        env,
    )
    engine = [sys.executable, "-m", "tests.support.fleet", "engine", "--target", f"127.0.0.1:{GRPC_PORT}"]
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
) -> Iterator[Cluster]:
    """An origin and nodes sidecars with an engine each, all at revision 0 of a mib MiB model on return
    (only the nodes of start, 1..nodes by default, are started). one_by_one: each node is started once
    the one before holds revision 0, so that the upstream's fan-out lists them in this order."""
    folder.mkdir(parents=True, exist_ok=True)
    with Fleet(nodes + 1, rate=rate) as fleet:
        running = Cluster(fleet, folder, nodes)
        env = _env()
        origin = fleet.nodes[0]
        root = folder / "origin-root"
        root.mkdir(exist_ok=True)
        origin_args = [
            "--model-root", str(root), "--host", "0.0.0.0", "--grpc-port", str(GRPC_PORT),
            "--http-port", str(HTTP_PORT), "--data-port", str(DATA_PORT), "--data-advertise", origin.address,
            "--allow-publish", "--fanout", *origin_extra,
        ]  # fmt: skip
        origin.start([*weightstream_cmd(), "serve", *origin_args], folder / "origin.log", env)
        trainer = [sys.executable, "-m", "tests.support.fleet", "trainer", "--target", f"127.0.0.1:{GRPC_PORT}"]
        origin.start([*trainer, "--mib", str(mib), "--folder", str(folder)], folder / "trainer.log", env)
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


def _client(target: str):  # type: ignore[no-untyped-def]
    from weightstream.client import WeightStreamClient

    return WeightStreamClient(target)


def _trainer(target: str, mib: int, folder: Path) -> None:
    import torch

    from weightstream.client import WeightStreamError

    per = 4 * 1024 * 1024  # bytes per tensor: 4 MiB of float32
    count = max(1, mib * 1024 * 1024 // per)
    generator = torch.Generator().manual_seed(0)
    deadline = time.monotonic() + WAIT_S
    with _client(target) as client:
        k = 0
        while True:
            tensors = {f"layers.{i}.weight": torch.randn(per // 4, generator=generator) for i in range(count)}
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


def _engine(target: str, out: Path) -> None:
    from weightstream.client import WeightStreamError

    deadline = time.monotonic() + WAIT_S
    with _client(target) as client:
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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.fleet")
    parser.add_argument("role", choices=["trainer", "engine"])
    parser.add_argument("--target", required=True)
    parser.add_argument("--mib", type=int, default=8)
    parser.add_argument("--folder", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.role == "trainer":
        _trainer(args.target, args.mib, args.folder)
    else:
        _engine(args.target, args.out)


if __name__ == "__main__":
    main()
