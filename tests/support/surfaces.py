"""Hostile inputs for every RPC and frame type of a server: hypothesis strategies, and the runs that check them.

A Surface is a strategy of cases and a run that sends one case to a Target (a real server in this
process, on 127.0.0.1, with a data port and publishing on) and returns the outcome: a gRPC status
code's name, or for a data-port handshake what the port answered. A run raises Violation when the
server broke a property:

- every outcome is one of the surface's allowed set (never UNKNOWN or INTERNAL), and every refusal
  has a message that names what was wrong, short enough for gRPC's trailers;
- bytes a server serves (StreamTensors chunks, data-port frames, deltas once applied) match their
  CRC32C and are the bytes of the revision asked for;
- a publish the server takes was whole and checked: every chunk matched its CRC32C, every tensor
  not kept from a delta base arrived complete, and the revision then loads exactly as published;
- a publish with nothing wrong in it is taken.

Target.check_good_load says the server still serves a good model bit for bit. Shared by
tests/e2e/test_properties.py (a few cases per surface) and benchmarks/fuzz_surfaces.py (thousands).

Publishes include tensors of any size (a part's buffer once overflowed when a tensor but the last
was not a multiple of 64 bytes) and streams that end without commit (once answered OK); the
regression tests of both are in tests/e2e/test_properties.py.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeAlias

import grpc
import numpy as np
import torch
from hypothesis import strategies as st
from safetensors.torch import save_file

from tests.support.ports import LOOPBACK, free_ports
from tests.support.servers import loopback_settings, serving
from weightstream.client import WeightStreamClient, revisions
from weightstream.client.revisions import chunk_message
from weightstream.protocol import deltas, digests, dtypes, tcp, wire
from weightstream.samples import ParameterTree
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server import WeightStreamServer
from weightstream_server.errors import ServerError
from weightstream_server.revisions.layout import lay_out
from weightstream_server.revisions.peer_blocks import wanted_at

Code: TypeAlias = grpc.StatusCode
CALL_TIMEOUT_S = 15.0
SERVICE = "/weightstream.v1.WeightStreamService/"
# Refusals travel in trailers; gRPC refuses trailers over 8 KiB.
MAX_MESSAGE_CHARS = 4096

GOOD = "prop-good"  # storage only: never published to; what check_good_load loads
PUB = "prop-pub"  # storage, then published to in its own layout
NEW = "prop-new"  # published only, each time in a layout of its own (new_layout)
PARTS = "prop-parts"  # published only, in several parts at once
LAYOUT: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
    "a.weight": (torch.float32, (4, 16)),
    "b": (torch.float16, (64,)),
    "c": (torch.int64, (2, 4)),
    "d": (torch.bfloat16, (32,)),
    "e": (torch.uint8, (7,)),
}
HOSTILE_IDS = ["..", "../prop-good", "/etc/passwd", "a\x00b", "s3://bucket/x", "http://x/y", "", "x" * 600, "a//b"]
_TEXT = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=20)
_U64 = st.one_of(st.integers(0, 600), st.integers(0, 2**64 - 1))
_WIRE_DTYPES = sorted(dtypes.BY_WIRE)


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of the strategies, each as often as its weight says (roughly: hypothesis also explores)."""
    slots = [index for index, (weight, _) in enumerate(choices) for _ in range(weight)]
    return st.sampled_from(slots).flatmap(lambda index: choices[index][1])


class Violation(AssertionError):
    """The server broke a property of its surface."""


def state_of(layout: dict[str, tuple[torch.dtype, tuple[int, ...]]], seed: int) -> dict[str, torch.Tensor]:
    """Random tensors of layout (any bit pattern, NaNs included), from seed."""
    rng = np.random.default_rng(seed)
    state = {}
    for name, (dtype, shape) in layout.items():
        size = wire.numel(shape) * torch.empty(0, dtype=dtype).element_size()
        raw = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
        state[name] = raw.view(dtype).reshape(shape) if size else torch.empty(shape, dtype=dtype)
    return state


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@dataclass
class Kept:
    """A revision's tensors as the cases know them (what the server must serve for it)."""

    revision: str
    tensors: dict[str, torch.Tensor]


class Target:
    """A server in this process with the surfaces' models, and what the cases know of its revisions.

    One case at a time: the runs share this object's records and are not thread-safe.
    """

    def __init__(self, server: WeightStreamServer, good: dict[str, torch.Tensor], pub: dict[str, torch.Tensor]) -> None:
        self.server = server
        self.address = f"{LOOPBACK}:{server.port}"
        limit = 64 * 1024 * 1024
        options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        self.channel = grpc.insecure_channel(self.address, options=options)
        self.stub = pb_grpc.WeightStreamServiceStub(self.channel)
        assert server.data_port is not None, "the surfaces need a server with a data port"
        self.data_port = server.data_port.port
        self.good = good
        self._names = itertools.count()
        # Every revision a case may name, by (model, revision); the current one of each model.
        self.revisions: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        self.current: dict[str, Kept] = {}
        self.published: set[tuple[str, str]] = set()
        # Whether the peer cases published a revision of PUB close to the one before (deltas between them).
        self.published_near = False
        for model, state in ((GOOD, good), (PUB, pub)):
            revision = self.stub.GetManifest(pb.GetManifestRequest(model=model), timeout=CALL_TIMEOUT_S).revision
            self.revisions[(model, revision)] = state
            self.current[model] = Kept(revision, state)

    def fresh_name(self) -> str:
        return f"r{next(self._names)}-{time.monotonic_ns() % 10**6}"

    def took(self, model: str, revision: str, tensors: dict[str, torch.Tensor]) -> None:
        self.revisions[(model, revision)] = tensors
        self.published.add((model, revision))
        self.current[model] = Kept(revision, tensors)

    def close(self) -> None:
        self.channel.close()

    def check_good_load(self) -> None:
        """A good client loads the good model bit for bit, over gRPC and over the data port."""
        transports: tuple[Literal["grpc"], Literal["tcp"]] = ("grpc", "tcp")
        for transport in transports:
            module = ParameterTree({n: (tuple(t.shape), t.dtype) for n, t in self.good.items()})
            with WeightStreamClient(self.address, progress=False, transport=transport) as client:
                client.load_into(module, GOOD)
            got = dict(module.named_parameters())
            for name, tensor in self.good.items():
                if raw_bytes(got[name]) != raw_bytes(tensor):
                    raise Violation(f"after the cases, {transport} loads {name!r} of {GOOD!r} wrong")


@contextlib.contextmanager
def target_at(root: Path) -> Iterator[Target]:
    """The models written under root, a server on them, and the Target of both."""
    good = state_of(LAYOUT, 1)
    pub = state_of(LAYOUT, 2)
    for model, state in ((GOOD, good), (PUB, pub)):
        (root / model).mkdir(parents=True, exist_ok=True)
        save_file(state, str(root / model / "model.safetensors"))
    (data_port,) = free_ports(1)
    settings = loopback_settings(
        model_root=root,
        allow_publish=True,
        fanout=True,
        data_port=data_port,
        stall_timeout=2.0,
        watch_interval=0.2,
        max_watches=64,
        keep_revisions=4,
        publish_max_bytes=64 * 1024 * 1024,
        peer_stall_seconds=0.2,
    )
    with serving(settings) as server:
        target = Target(server, good, pub)
        try:
            yield target
        finally:
            target.close()


def outcome(run: Callable[[], Any]) -> tuple[Code, str, Any]:
    """(status code, details, result) of run(); the result is None unless the call succeeded."""
    try:
        return Code.OK, "", run()
    except grpc.RpcError as error:
        return error.code(), error.details() or "", None


def check_refusal(code: Code, details: str, allowed: frozenset[str]) -> None:
    if code.name not in allowed:
        raise Violation(f"{code.name} is not an allowed outcome: {details[:500]}")
    if code != Code.OK and not (details and len(details) < MAX_MESSAGE_CHARS):
        raise Violation(f"{code.name} with a message of {len(details)} characters: {details[:200]!r}")


@dataclass(frozen=True)
class Surface:
    """One kind of input the server takes: its cases, how one is sent and checked, the outcomes allowed."""

    name: str
    cases: st.SearchStrategy[Any]
    run: Callable[[Target, Any], str]
    allowed: frozenset[str]


# --- publishes: PublishStart, chunks, commit ---------------------------------------------------------------


@dataclass(frozen=True)
class Announced:
    name: str
    dtype: int  # weightstream.v1 DataType, valid or not
    shape: tuple[int, ...]


# What a mutation does to a valid publish: (kind, a number it draws its details from).
MUTATIONS = [
    "crc",
    "offset",
    "name",
    "truncate",
    "extend",
    "encoding",
    "payload",
    "length",
    "drop",
    "dup",
    "swap",
    "empty_crc",
    "start_again",
    "early_commit",
    "no_commit",
]
FRAME_MUTATIONS = ["end_counts", "bad_kind", "name_bytes", "huge_length", "garbage", "cut"]


@dataclass(frozen=True)
class PublishCase:
    """A publish: which model and how announced, how its new bytes relate to the base, what is broken."""

    model: str  # PUB, NEW, PARTS or a hostile id
    revision: str  # "" (named by content), "unique" (a fresh name), or text as it is
    announce: str  # "layout": PUB's own; "random": tensors; "hostile": tensors the server must refuse
    tensors: tuple[Announced, ...]
    delta_base: str  # "": none; "current": the model's current published revision; else text as it is
    change: str  # how the new bytes relate to the base: "fresh", "few", "same"
    seed: int
    chunk_bytes: int
    per_message: int
    parts: int
    mutations: tuple[tuple[str, int], ...]
    data_port: bool = False


def _aligned_shape(dtype: int, draw: Any, last: bool) -> tuple[int, ...]:
    """A shape of dtype, often of a size that is a multiple of 64 bytes (the alignment of tensors in a part)."""
    itemsize = dtypes.BY_WIRE[dtype].itemsize
    numel = draw(st.integers(0, 80)) if last or draw(st.booleans()) else draw(st.integers(0, 6)) * (64 // itemsize)
    rows = draw(st.sampled_from([d for d in (1, 2, 4) if numel % d == 0]))
    return (numel,) if rows == 1 else (rows, numel // rows)


@st.composite
def random_tensors(draw: Any) -> tuple[Announced, ...]:
    count = draw(st.integers(1, 5))
    names = draw(
        st.lists(
            st.from_regex(r"[a-z]{1,6}(\.[a-z0-9]{1,4})?", fullmatch=True), min_size=count, max_size=count, unique=True
        )
    )
    out = []
    for index, name in enumerate(names):
        dtype = draw(st.sampled_from(_WIRE_DTYPES))
        out.append(Announced(name, dtype, _aligned_shape(dtype, draw, index == count - 1)))
    return tuple(out)


@st.composite
def hostile_tensors(draw: Any) -> tuple[Announced, ...]:
    """An announcement with one thing the server must refuse before it allocates anything."""
    good = list(draw(random_tensors()))
    what = draw(st.sampled_from(["dtype", "dims", "huge", "name", "long_name", "twice", "none", "too_large"]))
    first = good[0]
    if what == "dtype":
        good[0] = replace(first, dtype=draw(st.sampled_from([0, 16, 99, -1, 2**31 - 1])))
    elif what == "dims":
        good[0] = replace(first, shape=(1,) * 17)
    elif what == "huge":
        good[0] = replace(first, shape=(2**41, draw(st.integers(0, 3))))
    elif what == "name":
        good[0] = replace(first, name="")
    elif what == "long_name":
        good[0] = replace(first, name="n" * 1025)
    elif what == "twice":
        good.append(replace(first))
    elif what == "none":
        good = []
    else:  # more than --publish-max-bytes
        good[0] = replace(first, dtype=pb.DATA_TYPE_FLOAT32, shape=(2**20, 2**7))
    return tuple(good)


def publish_cases(*, data_port: bool = False) -> st.SearchStrategy[PublishCase]:
    mutations = st.one_of(
        st.just(()),
        st.just(()),
        st.lists(
            st.tuples(st.sampled_from(MUTATIONS + (FRAME_MUTATIONS if data_port else [])), st.integers(0, 2**32)),
            min_size=1,
            max_size=3,
        ).map(tuple),
    )
    common = {
        "seed": st.integers(0, 2**32),
        "chunk_bytes": st.sampled_from([1, 7, 64, 100, 4096]),
        "per_message": st.integers(1, 3),
        "mutations": mutations,
        "change": st.sampled_from(["fresh", "few", "same"]),
        "data_port": st.just(data_port),
    }
    revision = st.sampled_from(["unique", "unique", "unique", ""]) | _TEXT | st.just("x" * 200)
    same_layout = st.builds(
        PublishCase,
        model=st.just(PUB),
        revision=revision,
        announce=st.sampled_from(["layout", "layout", "layout", "random"]),
        tensors=random_tensors(),
        delta_base=st.sampled_from(["", "current", "current"]) | _TEXT,
        parts=st.just(1),
        **common,
    )
    new_layout = st.builds(
        PublishCase,
        model=st.just(NEW),
        revision=revision,
        announce=st.sampled_from(["random", "random", "hostile"]),
        tensors=st.one_of(random_tensors(), hostile_tensors()),
        delta_base=st.sampled_from(["", "current"]),
        parts=st.just(1),
        **common,
    )
    hostile_model = st.builds(
        PublishCase,
        model=st.sampled_from(HOSTILE_IDS) | _TEXT,
        revision=st.just("unique"),
        announce=st.just("random"),
        tensors=random_tensors(),
        delta_base=st.just(""),
        parts=st.just(1),
        **common,
    )
    choices = [same_layout, same_layout, new_layout, hostile_model]
    if not data_port:
        several = st.builds(
            PublishCase,
            model=st.just(PARTS),
            revision=st.just("unique"),
            announce=st.just("random"),
            tensors=random_tensors(),
            delta_base=st.just(""),
            parts=st.integers(2, 3),
            **common,
        )
        choices.append(several)
    return st.one_of(*choices)


@dataclass
class OutChunk:
    """A chunk of a generated publish (revisions.OutChunk, but one a case may break field by field)."""

    tensor: str
    offset: int
    length: int
    crc32c: int
    encoding: int
    payload: bytes

    def sent(self) -> revisions.OutChunk:
        return revisions.OutChunk(
            self.tensor, self.offset, self.length, self.crc32c, self.encoding, memoryview(self.payload)
        )


@dataclass
class Plan:
    """One part of a publish, made from a case: its start, its chunks, and what a server that takes it must hold."""

    start: pb.PublishStart
    chunks: list[OutChunk]
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]]  # the announced tensors the cases can hold
    base: dict[str, torch.Tensor]  # tensors the part starts from (a delta base's, same dtype and shape)
    clean: bool  # nothing in it is wrong: the server must take it
    extra: list[tuple[int, str]] = field(default_factory=list)  # (position, "start" | "commit") of messages
    frame_mutations: list[tuple[str, int]] = field(default_factory=list)


def _torch_dtype(wire_dtype: int) -> torch.dtype | None:
    found = dtypes.BY_WIRE.get(wire_dtype)
    return found.torch if found is not None else None


def _acceptable(announced: list[Announced]) -> bool:
    """Whether a server must take this announcement: tensors of known dtypes and sane shapes, named once each."""
    names = [t.name for t in announced]
    total = sum(wire.numel(t.shape) * dtypes.BY_WIRE[t.dtype].itemsize for t in announced if t.dtype in dtypes.BY_WIRE)
    return (
        bool(announced)
        and all(
            t.dtype in dtypes.BY_WIRE and len(t.shape) <= 16 and all(d <= 1 << 40 for d in t.shape) for t in announced
        )
        and all(0 < len(n) <= 1024 for n in names)
        and len(set(names)) == len(names)
        and total <= 1024 * 1024
    )


def make_plans(target: Target, case: PublishCase) -> list[Plan]:
    """The parts of case against what the server holds now, mutations applied."""
    rng = np.random.default_rng(case.seed)
    model = case.model
    revision = target.fresh_name() if case.revision == "unique" else case.revision
    if case.announce == "layout":
        announced = [Announced(n, int(dtypes.BY_TORCH[d].wire), s) for n, (d, s) in LAYOUT.items()]
    else:
        announced = list(case.tensors)
    current = target.current.get(model)
    delta_base = ""
    if case.delta_base == "current" and current is not None:
        # A storage revision is no delta base (only published ones are): the server refuses it.
        delta_base = current.revision
    elif case.delta_base != "current":
        delta_base = case.delta_base
    base_state = target.revisions.get((model, delta_base), {}) if (model, delta_base) in target.published else {}
    hostile = not _acceptable(announced) or model not in (PUB, NEW, PARTS) or bool(case.mutations)
    hostile |= case.revision not in ("unique", "")
    hostile |= bool(delta_base) and not base_state
    if model == PUB and case.announce != "layout":
        hostile = True  # another layout without new_layout
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for tensor in announced:
        dtype = _torch_dtype(tensor.dtype)
        if dtype is not None and tensor.name and tensor.name not in layout and len(tensor.shape) <= 16:
            # Bytes are made only for what a server may take (a refused announcement needs none).
            if wire.numel(tensor.shape) * dtypes.BY_WIRE[tensor.dtype].itemsize <= 1024 * 1024:
                layout[tensor.name] = (dtype, tensor.shape)
    new = state_of(layout, case.seed)
    base = {
        n: t for n, t in base_state.items() if n in layout and (t.dtype, tuple(t.shape)) == (layout[n][0], layout[n][1])
    }
    for name, old in base.items():
        if case.change == "same":
            new[name] = old.clone()
        elif case.change == "few":
            flat = raw_bytes(old)
            changed = bytearray(flat)
            for _ in range(int(rng.integers(0, 4))):
                if changed:
                    changed[int(rng.integers(0, len(changed)))] ^= int(rng.integers(1, 256))
            new[name] = (
                torch.frombuffer(bytearray(changed), dtype=torch.uint8).view(old.dtype).reshape(old.shape)
                if changed
                else old.clone()
            )
    parts = min(case.parts, len(announced))  # every part announces a tensor
    groups = [announced[i::parts] for i in range(parts)] if parts > 1 else [announced]
    plans = []
    codec = deltas.Codec()
    for index, group in enumerate(groups):
        start = pb.PublishStart(
            model=model,
            revision=revision,
            part=index,
            parts=parts if parts > 1 else 0,
            new_layout=model != PUB,
            delta_base=delta_base,
            data_port=case.data_port,
        )
        for tensor in group:
            start.tensors.append(pb.PublishedTensor(name=tensor.name, dtype=tensor.dtype, shape=list(tensor.shape)))  # type: ignore[arg-type]
        chunks: list[OutChunk] = []
        for tensor in group:
            if tensor.name not in layout or tensor.name not in new:
                continue
            data = raw_bytes(new[tensor.name])
            old_bytes = raw_bytes(base[tensor.name]) if tensor.name in base else None
            step = max(1, case.chunk_bytes)
            for offset in range(0, len(data), step):
                piece = data[offset : offset + step]
                crc = wire.crc32c(piece)
                if old_bytes is not None:
                    was = old_bytes[offset : offset + step]
                    how = int(rng.integers(0, 3))
                    if how == 0 and was == piece:
                        continue  # unchanged: kept from the base
                    if how == 1:
                        xor = torch.frombuffer(
                            bytearray(bytes(a ^ b for a, b in zip(piece, was, strict=True))), dtype=torch.uint8
                        )
                        encoded = codec.encode(xor, offset)
                        if encoded is not None:
                            chunks.append(OutChunk(tensor.name, offset, len(piece), crc, encoded[0], encoded[1]))
                            continue
                chunks.append(OutChunk(tensor.name, offset, len(piece), crc, 0, piece))
        plans.append(
            Plan(start, chunks, {n: layout[n] for n in (t.name for t in group) if n in layout}, base, not hostile)
        )
    for plan in plans:
        _mutate(plan, case.mutations, rng, list(layout))
    return plans


def _mutate(plan: Plan, mutations: tuple[tuple[str, int], ...], rng: np.random.Generator, names: list[str]) -> None:
    chunks = plan.chunks
    for kind, number in mutations:
        at = number % len(chunks) if chunks else 0
        chunk = chunks[at] if chunks else None
        if kind in FRAME_MUTATIONS:
            plan.frame_mutations.append((kind, number))
        elif kind == "start_again":
            plan.extra.append((at, "start"))
        elif kind == "early_commit":
            plan.extra.append((at, "commit"))
        elif kind == "no_commit":
            plan.extra.append((-1, "no_commit"))
        elif kind == "empty_crc":
            chunks.insert(at, OutChunk(names[0] if names else "x", 0, 0, 1 + number % 1000, 0, b""))
        elif chunk is None:
            continue
        elif kind == "crc":
            chunk.crc32c ^= 1 << (number % 32)
        elif kind == "offset":
            chunk.offset = [chunk.offset + 1, max(0, chunk.offset - 1), number, 2**64 - 1 - number % 8][number % 4]
        elif kind == "name":
            chunk.tensor = [f"{chunk.tensor}x", "", *names][number % (len(names) + 2)]
        elif kind == "truncate" and chunk.payload:
            chunk.payload = chunk.payload[: number % len(chunk.payload)]
            if not chunk.encoding:
                chunk.length = len(chunk.payload)
        elif kind == "extend":
            chunk.payload += bytes(rng.integers(0, 256, 1 + number % 70, dtype=np.uint8))
            if not chunk.encoding:
                chunk.length = len(chunk.payload)
        elif kind == "encoding":
            chunk.encoding = [1, 2, 3, 2**31 - 1][number % 4]
        elif kind == "payload":
            chunk.encoding = chunk.encoding or 1 + number % 2
            chunk.payload = bytes(rng.integers(0, 256, number % 300, dtype=np.uint8))
        elif kind == "length":
            chunk.length = [0, chunk.length + 1, number, 2**40][number % 4]
        elif kind == "drop":
            del chunks[at]
        elif kind == "dup":
            chunks.insert(at, replace(chunk))
        elif kind == "swap" and len(chunks) > 1:
            other = (at + 1 + number // 7) % len(chunks)
            chunks[at], chunks[other] = chunks[other], chunks[at]
        # What a mutation leaves valid (a swap of two tensors' chunks, an offset of a kept range) is
        # still a mutation: the server may take it, and then its bytes are checked like any others.


def messages_of(plan: Plan, per_message: int) -> tuple[list[pb.PublishRequest], list[OutChunk], bool]:
    """The part's messages (start, its chunks a few per message, the extra messages placed, then commit
    unless no_commit); the chunks a server reads (those before the first commit), and whether the part
    must be refused for its messages (a second start before the commit, or no commit)."""
    body: list[tuple[pb.PublishRequest, list[OutChunk]]] = []
    for first in range(0, len(plan.chunks), per_message):
        group = plan.chunks[first : first + per_message]
        message = pb.PublishRequest()
        message.chunks.extend(chunk_message(c.sent()) for c in group)
        body.append((message, group))
    ends = not any(what == "no_commit" for _, what in plan.extra)
    for position, what in sorted(plan.extra, reverse=True):
        if what == "no_commit":
            continue
        extra = pb.PublishRequest(start=plan.start) if what == "start" else pb.PublishRequest(commit=True)
        body.insert(min(position, len(body)), (extra, []))
    if ends:
        body.append((pb.PublishRequest(commit=True), []))
    read: list[OutChunk] = []
    # A stream with no commit at all is as wrong as one with a second start before its first commit.
    second_start = not any(message.commit for message, _ in body)
    for message, group in body:
        if message.commit:
            break
        second_start |= message.HasField("start")
        read.extend(group)
    return [pb.PublishRequest(start=plan.start)] + [m for m, _ in body], read, second_start


def expected_of(plans: list[Plan], sent: list[list[OutChunk]]) -> dict[str, torch.Tensor]:
    """What a server that took every part holds; Violation when it should not have taken them: a chunk
    that fails its CRC32C, or a tensor not whole."""
    held: dict[str, torch.Tensor] = {}
    codec = deltas.Codec()
    for plan, chunks in zip(plans, sent, strict=True):
        buffers = {}
        reached: dict[str, int] = {}
        for name, (dtype, shape) in plan.layout.items():
            nbytes = wire.numel(shape) * torch.empty(0, dtype=dtype).element_size()
            if name in plan.base:
                buffers[name] = bytearray(raw_bytes(plan.base[name]))
                reached[name] = nbytes
            else:
                buffers[name] = bytearray(nbytes)
                reached[name] = 0
        for c in chunks:
            if c.tensor not in buffers:
                raise Violation(f"took a chunk of {c.tensor!r}, which the part does not announce")
            buffer = buffers[c.tensor]
            if c.encoding:
                if c.offset + c.length > len(buffer):
                    raise Violation(f"took a delta of {c.tensor!r} beyond its end")
                view = torch.frombuffer(buffer, dtype=torch.uint8)[c.offset : c.offset + c.length] if c.length else None
                payload = np.frombuffer(c.payload, dtype=np.uint8) if c.payload else np.zeros(1, dtype=np.uint8)
                try:
                    crc = (
                        codec.xor_into(view, c.offset, int(payload.ctypes.data), len(c.payload), c.encoding)
                        if view is not None
                        else 0
                    )
                except deltas.DeltaUnusable as exc:
                    raise Violation(f"took a delta of {c.tensor!r} that does not decode: {exc}") from None
            else:
                if c.offset != reached[c.tensor] and c.tensor not in plan.base:
                    raise Violation(f"took a chunk of {c.tensor!r} at {c.offset}, not where the tensor had reached")
                if c.offset + len(c.payload) > len(buffer):
                    raise Violation(f"took a chunk of {c.tensor!r} beyond its end")
                buffer[c.offset : c.offset + len(c.payload)] = c.payload
                crc = wire.crc32c(c.payload) if c.payload else 0
                reached[c.tensor] = max(reached[c.tensor], c.offset + len(c.payload))
            if crc != c.crc32c:
                raise Violation(f"took a chunk of {c.tensor!r} at {c.offset} that fails its CRC32C")
        for name, (dtype, shape) in plan.layout.items():
            if reached[name] != len(buffers[name]):
                raise Violation(f"took tensor {name!r} with {reached[name]} of {len(buffers[name])} bytes")
            held[name] = (
                torch.frombuffer(buffers[name], dtype=torch.uint8).view(dtype).reshape(shape)
                if buffers[name]
                else torch.empty(shape, dtype=dtype)
            )
    return held


def check_served(target: Target, model: str, revision: str, expected: dict[str, torch.Tensor]) -> None:
    """The revision streams exactly expected, each chunk matching its CRC32C."""
    request = pb.StreamTensorsRequest(model=model, revision=revision)
    got = {name: bytearray(len(raw_bytes(t))) for name, t in expected.items()}
    code, details, responses = outcome(lambda: list(target.stub.StreamTensors(request, timeout=CALL_TIMEOUT_S)))
    if code != Code.OK:
        raise Violation(f"revision {revision!r} of {model!r}, taken, then not served: {code.name}: {details}")
    for response in responses:
        for chunk in response.chunks:
            if chunk.encoding or wire.crc32c(chunk.data) != chunk.crc32c:
                raise Violation(f"served a chunk of {chunk.tensor!r} that fails its CRC32C")
            got[chunk.tensor][chunk.offset : chunk.offset + len(chunk.data)] = chunk.data
    for name, tensor in expected.items():
        if bytes(got[name]) != raw_bytes(tensor):
            raise Violation(f"revision {revision!r} of {model!r} serves {name!r} unlike what was published")


PUBLISH_CODES = frozenset(
    {
        "OK",
        "INVALID_ARGUMENT",
        "OUT_OF_RANGE",
        "NOT_FOUND",
        "DATA_LOSS",
        "ABORTED",  # another part failed, or a revision name taken
        "RESOURCE_EXHAUSTED",  # over --publish-max-bytes
        "PERMISSION_DENIED",  # an object store id
    }
)


def run_publish(target: Target, case: PublishCase) -> str:
    """The case's parts, each on its own call and all at once; every part's code, and the revision if taken."""
    plans = make_plans(target, case)
    if len(plans) == 1:
        codes = [_publish_part(target, plans[0], case.per_message, None)]
    else:
        codes = _publish_parts(target, plans, case.per_message)
    for code, details, _ in codes:
        check_refusal(code, details, PUBLISH_CODES)
    taken = [c for c in codes if c[0] == Code.OK]
    if taken and len(taken) != len(codes):
        raise Violation(f"parts of one revision taken and refused: {[(c[0].name, c[1]) for c in codes]}")
    if not taken:
        if all(p.clean for p in plans):
            raise Violation(f"a clean publish refused: {[(c[0].name, c[1]) for c in codes]}")
        return codes[0][0].name
    responses = [c[2] for c in codes]
    revision = responses[0].revision
    if any(r.revision != revision or not r.complete for r in responses):
        raise Violation(f"parts answered differently: {responses}")
    read = [messages_of(p, case.per_message) for p in plans]
    if any(second for _, _, second in read):
        raise Violation("took a publish with a second PublishStart, or without commit")
    expected = expected_of(plans, [chunks for _, chunks, _ in read])
    check_served(target, case.model, revision, expected)
    target.took(case.model, revision, expected)
    return "OK"


def _publish_part(target: Target, plan: Plan, per_message: int, ready: threading.Event | None) -> tuple[Code, str, Any]:
    messages, _, _ = messages_of(plan, per_message)

    def requests() -> Iterator[pb.PublishRequest]:
        yield messages[0]
        if ready is not None:
            ready.wait(5.0)
        yield from messages[1:]

    def call() -> pb.PublishResponse:
        responses = list(target.stub.PublishTensors(requests(), timeout=CALL_TIMEOUT_S))
        if len(responses) != 1:
            raise Violation(f"a publish over gRPC answered {len(responses)} messages")
        return responses[0]

    return outcome(call)


def _publish_parts(target: Target, plans: list[Plan], per_message: int) -> list[tuple[Code, str, Any]]:
    """Every part on its own thread; the chunks go once every part has joined (so that no part's failure
    comes before another part's start: revisions/published.py would then wait for the failed part)."""
    ready = threading.Event()
    results: list[tuple[Code, str, Any]] = [(Code.UNKNOWN, "not run", None)] * len(plans)
    publisher = target.server.publisher
    assert publisher is not None
    reserved = 0
    for plan in plans:
        try:
            reserved += lay_out(plan.start.model, plan.start.tensors).accounted_bytes
        except ServerError:
            reserved += 0  # a part refused at its start holds nothing

    def part(index: int) -> None:
        results[index] = _publish_part(target, plans[index], per_message, ready)

    threads = [threading.Thread(target=part, args=(i,), daemon=True) for i in range(len(plans))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 5.0
    while publisher.pending_bytes() < reserved and time.monotonic() < deadline:
        time.sleep(0.002)
    ready.set()
    for thread in threads:
        thread.join(CALL_TIMEOUT_S + 5)
    return results


# --- publishes over the data port: CHUNK, DELTA and END frames -----------------------------------------------

PUBLISH_FRAME_CODES = PUBLISH_CODES | {"UNAVAILABLE"}  # the data connection ended before END


def frames_of(plan: Plan, rng: np.random.Generator) -> tuple[bytes, bool]:
    """The part's frames, frame mutations applied; and whether they were cut short."""
    frames = []
    payload_bytes = 0
    for c in plan.chunks:
        name = c.tensor.encode()
        if c.encoding:
            frames.append(
                tcp.delta_header(name, c.offset, c.length, c.crc32c, len(c.payload), c.encoding % 256) + c.payload
            )
        else:
            frames.append(tcp.HEADER.pack(tcp.CHUNK, len(name), c.offset, c.length, c.crc32c) + name + c.payload)
        payload_bytes += len(c.payload)
    end = [len(plan.chunks), payload_bytes]
    cut = False
    for kind, number in plan.frame_mutations:
        at = number % (len(frames) + 1)
        if kind == "end_counts":
            end[number % 2] += 1 + number % 3
        elif kind == "bad_kind":
            frames.insert(at, tcp.HEADER.pack(4 + number % 250, 0, 0, 0, 0))
        elif kind == "name_bytes":
            size = [0, tcp.MAX_NAME_BYTES + 1, 65535][number % 3]
            frames.insert(at, tcp.HEADER.pack(tcp.CHUNK, size, 0, 8, 0) + b"n" * min(size, 100))
        elif kind == "huge_length":
            frames.insert(at, tcp.HEADER.pack(tcp.CHUNK, 1, 0, wire.MAX_CHUNK_BYTES + 1 + number % 2**30, 0) + b"a")
        elif kind == "garbage":
            frames.insert(at, bytes(rng.integers(0, 256, 1 + number % 40, dtype=np.uint8)))
        elif kind == "cut":
            cut = True
            frames = frames[:at]
    body = b"".join(frames)
    if cut:
        return body[: len(body) - (number % 7 if body else 0)], True
    return body + tcp.end_frame(*end), False


def run_publish_frames(target: Target, case: PublishCase) -> str:
    """One part over the data port: announced on the call, its frames on the connection, the call's answer."""
    (plan,) = make_plans(target, case)
    plan.extra.clear()  # no commit or second start on the data port: its END frame ends the part
    rng = np.random.default_rng(case.seed + 1)
    body, cut = frames_of(plan, rng)
    done = threading.Event()

    def requests() -> Iterator[pb.PublishRequest]:
        yield pb.PublishRequest(start=plan.start)
        done.wait(CALL_TIMEOUT_S)

    call = target.stub.PublishTensors(requests(), timeout=CALL_TIMEOUT_S)
    try:
        code, details, announcement = outcome(lambda: next(call))
        if code == Code.OK:
            if not announcement.ticket or announcement.complete:
                raise Violation(f"a data-port publish's first answer is no announcement: {announcement}")
            with socket.create_connection((LOOPBACK, announcement.data_port), timeout=CALL_TIMEOUT_S) as conn:
                conn.sendall(tcp.hello(announcement.ticket))
                if conn.recv(1) != tcp.ADMITTED:
                    raise Violation("the data port refused a ticket it had just issued")
                with contextlib.suppress(OSError):  # the server may refuse and close midway
                    conn.sendall(body)
                    conn.shutdown(socket.SHUT_WR)
                code, details, response = outcome(lambda: next(call))
    finally:
        done.set()
        call.cancel()
    check_refusal(code, details, PUBLISH_FRAME_CODES)
    if code != Code.OK:
        if plan.clean and not plan.frame_mutations:
            raise Violation(f"a clean publish over the data port refused: {code.name}: {details}")
        return code.name
    if cut:
        raise Violation("took a publish whose frames were cut short")
    if not response.complete:
        raise Violation(f"a data-port publish's last answer is not complete: {response}")
    expected = expected_of([plan], [plan.chunks])
    check_served(target, case.model, response.revision, expected)
    target.took(case.model, response.revision, expected)
    return "OK"


# --- tensor requests: GetManifest and StreamTensors (over gRPC and the data port) ------------------------------


@dataclass(frozen=True)
class StreamCase:
    model: str  # GOOD, PUB or hostile
    tensors: tuple[pb.TensorRequest, ...] | None  # None: every tensor
    max_chunk_bytes: int
    revision: str  # "", "current", "kept:N", or text
    delta_base: str  # "", "kept:N", or text
    bulk: bool  # over the data port (StreamTensorsBulk)
    read: int  # data port: frames read before the client hangs up (-1: all)


def _ranges(points: list[int]) -> list[pb.ByteRange]:
    ordered = sorted(points)
    return [pb.ByteRange(start=s, end=e) for s, e in reversed(list(zip(ordered[::2], ordered[1::2], strict=False)))]


@st.composite
def tensor_requests(draw: Any) -> pb.TensorRequest:
    name = draw(st.one_of(*[st.sampled_from(sorted(LAYOUT))] * 6, _TEXT))
    request = pb.TensorRequest(name=name, delta=draw(st.booleans()))
    how = draw(st.sampled_from(["whole", "whole", "whole", "ranges", "ranges", "hostile_ranges", "slice", "slice"]))
    if how == "ranges":
        request.ranges.extend(_ranges(draw(st.lists(st.integers(0, 300), unique=True, max_size=6))))
    elif how == "hostile_ranges":
        request.ranges.extend(draw(st.lists(st.builds(pb.ByteRange, start=_U64, end=_U64), max_size=3)))
    elif how == "slice":
        bound = st.integers(0, 70) | _U64
        request.slice.CopyFrom(
            pb.TensorSlice(dim=draw(st.integers(0, 2) | st.integers(0, 2**32 - 1)), start=draw(bound), stop=draw(bound))
        )
        if draw(st.booleans()):
            request.ranges.extend(_ranges(draw(st.lists(st.integers(0, 100), unique=True, max_size=4))))
    return request


def stream_cases(*, bulk: bool | None = None) -> st.SearchStrategy[StreamCase]:
    return st.builds(
        StreamCase,
        model=weighted((8, st.sampled_from([GOOD, PUB, PUB])), (1, st.sampled_from(HOSTILE_IDS)), (1, _TEXT)),
        tensors=st.none() | st.lists(tensor_requests(), max_size=5, unique_by=lambda t: t.name).map(tuple),
        max_chunk_bytes=st.one_of(
            *[st.sampled_from([0] * 12 + [4096, 4095, 2**24 + 1])] * 6, st.integers(0, 2**32 - 1)
        ),
        revision=st.one_of(*[st.sampled_from(["", "", "", "current", "kept:0", "kept:1", "kept:5"])] * 6, _TEXT),
        delta_base=st.one_of(*[st.sampled_from(["", "kept:0", "kept:1", "kept:1", "kept:2"])] * 4, _TEXT),
        bulk=st.booleans() if bulk is None else st.just(bulk),
        read=st.sampled_from([-1, -1, -1, 0, 1, 3]),
    )


STREAM_CODES = frozenset(
    {
        "OK",
        "INVALID_ARGUMENT",
        "OUT_OF_RANGE",
        "NOT_FOUND",
        "FAILED_PRECONDITION",  # a revision that does not match
        "PERMISSION_DENIED",  # an object store id
    }
)


def _kept(target: Target, model: str, choice: str) -> str:
    """A case's revision choice as a revision id: the model's current one, one the cases know (the first, or
    the Nth from the last), or text."""
    if choice == "current":
        return target.current[model].revision if model in target.current else ""
    if choice == "first":
        return next((r for m, r in target.revisions if m == model), "none-0")
    if choice.startswith("kept:"):
        known = [r for m, r in target.revisions if m == model]
        index = int(choice[5:])
        return known[-1 - index] if index < len(known) else f"none-{index}"
    return choice


def _slice_bytes(tensor: torch.Tensor, request: pb.TensorRequest) -> bytes | None:
    """The bytes a tensor request stands for (a slice's, laid out contiguously); None if it is no slice of tensor."""
    if not request.HasField("slice"):
        return raw_bytes(tensor)
    piece = request.slice
    if not (piece.dim < tensor.dim() and piece.start < piece.stop <= tensor.shape[piece.dim]):
        return None
    return raw_bytes(tensor.narrow(piece.dim, piece.start, piece.stop - piece.start))


class _Checker:
    """Checks each chunk a stream serves: its CRC32C, and its bytes against the revision's (deltas applied)."""

    def __init__(self, target: Target, case: StreamCase, request: pb.StreamTensorsRequest) -> None:
        model = case.model
        revision = request.revision or (target.current[model].revision if model in target.current else "")
        self.expected = target.revisions.get((model, revision))
        self.base = target.revisions.get((model, request.delta_base)) if request.delta_base else None
        # No tensors named: every tensor of the revision (a published one may have another layout).
        everything = self.expected if self.expected is not None else LAYOUT
        wanted = list(request.tensors) or [pb.TensorRequest(name=n) for n in everything]
        self.requests = {t.name: t for t in wanted}
        self.codec = deltas.Codec()
        self.chunks = 0
        self.nbytes = 0

    def chunk(self, tensor: str, offset: int, length: int, crc: int, encoding: int, payload: bytes) -> None:
        self.chunks += 1
        self.nbytes += len(payload)
        request = self.requests.get(tensor)
        if request is None:
            raise Violation(f"served tensor {tensor!r}, which the request did not ask for")
        expected = _slice_bytes(self.expected[tensor], request) if self.expected is not None else None
        if encoding:
            base = _slice_bytes(self.base[tensor], request) if self.base is not None and tensor in self.base else None
            if base is None or not request.delta:
                raise Violation(f"served a delta of {tensor!r} that the request cannot apply")
            view = torch.frombuffer(bytearray(base[offset : offset + length]), dtype=torch.uint8)
            address = int(np.frombuffer(payload, dtype=np.uint8).ctypes.data) if payload else 0
            try:
                got_crc = self.codec.xor_into(view, offset, address, len(payload), encoding)
            except deltas.DeltaUnusable as exc:
                raise Violation(f"served a delta of {tensor!r} that does not decode: {exc}") from None
            data = view.numpy().tobytes()
        else:
            data, got_crc = payload, wire.crc32c(payload)
            if len(payload) != length:
                raise Violation(f"served a chunk of {tensor!r} of {len(payload)} bytes that says {length}")
        if got_crc != crc:
            raise Violation(f"served a chunk of {tensor!r} at {offset} that fails its CRC32C")
        if expected is not None and data != expected[offset : offset + len(data)]:
            raise Violation(f"served bytes of {tensor!r} at {offset} that are not the revision's")


def run_stream(target: Target, case: StreamCase) -> str:
    """GetManifest, then StreamTensors or StreamTensorsBulk, of the case's request; every chunk checked."""
    model = case.model
    revision = _kept(target, model, case.revision)
    code, details, manifest = outcome(
        lambda: target.stub.GetManifest(pb.GetManifestRequest(model=model, revision=revision), timeout=CALL_TIMEOUT_S)
    )
    check_refusal(code, details, STREAM_CODES - {"OUT_OF_RANGE"})
    if code == Code.OK and (model, manifest.revision) in target.revisions:
        names = [t.name for t in manifest.tensors]
        if sorted(names) != sorted(target.revisions[(model, manifest.revision)]):
            raise Violation(f"the manifest of {model!r} {manifest.revision!r} lists {names}")
    request = pb.StreamTensorsRequest(
        model=model,
        tensors=case.tensors or (),
        max_chunk_bytes=case.max_chunk_bytes,
        revision=revision,
        delta_base=_kept(target, model, case.delta_base),
    )
    checker = _Checker(target, case, request)
    if case.bulk:
        return _run_bulk(target, case, request, checker)

    def read() -> None:
        for response in target.stub.StreamTensors(request, timeout=CALL_TIMEOUT_S):
            for c in response.chunks:
                checker.chunk(c.tensor, c.offset, c.length, c.crc32c, c.encoding, c.data)

    code, details, _ = outcome(read)
    check_refusal(code, details, STREAM_CODES)
    return code.name


def _run_bulk(target: Target, case: StreamCase, request: pb.StreamTensorsRequest, checker: _Checker) -> str:
    call = target.stub.StreamTensorsBulk(pb.StreamTensorsBulkRequest(request=request), timeout=CALL_TIMEOUT_S)
    try:
        code, details, announcement = outcome(lambda: next(call))
        if code != Code.OK:
            check_refusal(code, details, STREAM_CODES)
            return code.name
        with socket.create_connection((LOOPBACK, announcement.data_port), timeout=CALL_TIMEOUT_S) as conn:
            conn.sendall(tcp.hello(announcement.ticket))
            if _exactly(conn, 1) != tcp.ADMITTED:
                raise Violation("the data port refused a ticket it had just issued")
            frames = 0
            while case.read < 0 or frames < case.read:
                frame = tcp.decode_header(_exactly(conn, tcp.HEADER.size), deltas=True)
                if frame.kind == tcp.END:
                    if (frame.offset, frame.length) != (checker.chunks, checker.nbytes):
                        raise Violation(f"END says {frame.offset} chunks, {frame.length} bytes; not what came")
                    break
                name = _exactly(conn, frame.name_bytes).decode()
                encoding, size = 0, frame.length
                if frame.kind == tcp.DELTA:
                    size, encoding = tcp.DELTA_HEADER.unpack(_exactly(conn, tcp.DELTA_HEADER.size))
                checker.chunk(name, frame.offset, frame.length, frame.crc32c, encoding, _exactly(conn, size))
                frames += 1
            else:
                return "HUNG_UP"  # the client went away midway; the server must carry on
        code, details, _ = outcome(lambda: list(call))
        check_refusal(code, details, STREAM_CODES)
        return code.name
    finally:
        call.cancel()


def _exactly(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        piece = conn.recv(size - len(data))
        if not piece:
            raise Violation(f"the data connection ended {size - len(data)} bytes into a read")
        data += piece
    return bytes(data)


# --- data-port handshakes -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HelloCase:
    kind: str  # "bytes": hello as given; "ticket": MAGIC and these bytes; "reuse": a used ticket again
    data: bytes


def hello_cases() -> st.SearchStrategy[HelloCase]:
    return st.one_of(
        st.builds(HelloCase, kind=st.just("bytes"), data=st.binary(max_size=80)),
        st.builds(
            HelloCase, kind=st.just("bytes"), data=st.binary(max_size=40).map(lambda b: tcp.MAGIC[: len(b) % 9] + b)
        ),
        st.builds(HelloCase, kind=st.just("ticket"), data=st.binary(min_size=0, max_size=tcp.TICKET_BYTES + 4)),
        st.builds(HelloCase, kind=st.just("reuse"), data=st.just(b"")),
    )


HELLO_OUTCOMES = frozenset({"REFUSED", "CLOSED"})


def _hello(target: Target, data: bytes) -> str:
    with socket.create_connection((LOOPBACK, target.data_port), timeout=CALL_TIMEOUT_S) as conn:
        with contextlib.suppress(OSError):
            conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)  # nothing more comes: the port must not wait out its timeout
        try:
            answer = conn.recv(1)
        except ConnectionResetError:
            answer = b""
    return {tcp.REFUSED: "REFUSED", b"": "CLOSED", tcp.ADMITTED: "ADMITTED"}.get(answer, f"BYTE {answer!r}")


def run_hello(target: Target, case: HelloCase) -> str:
    """A connection to the data port that shows no ticket it may use: never admitted."""
    if case.kind == "reuse":
        request = pb.StreamTensorsRequest(model=GOOD, tensors=[pb.TensorRequest(name="e")])
        call = target.stub.StreamTensorsBulk(pb.StreamTensorsBulkRequest(request=request), timeout=CALL_TIMEOUT_S)
        try:
            ticket = next(call).ticket
            with socket.create_connection((LOOPBACK, target.data_port), timeout=CALL_TIMEOUT_S) as first:
                first.sendall(tcp.hello(ticket))
                if first.recv(1) != tcp.ADMITTED:
                    raise Violation("the data port refused a ticket it had just issued")
                got = _hello(target, tcp.hello(ticket))
        finally:
            call.cancel()
    elif case.kind == "ticket":
        got = _hello(target, tcp.MAGIC + case.data)
    else:
        got = _hello(target, case.data)
    if got not in HELLO_OUTCOMES:
        raise Violation(f"the data port answered {got} to a hello with no usable ticket")
    return got


# --- GetChanges and WatchModel ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RevisionCase:
    rpc: str  # "changes" or "watch"
    model: str
    since: str  # a revision choice (see _kept): GetChanges.since, WatchModel.after
    revision: str  # GetChanges.revision


def revision_cases() -> st.SearchStrategy[RevisionCase]:
    choice = weighted((6, st.sampled_from(["current", "kept:0", "kept:1", "kept:2", "kept:3", ""])), (1, _TEXT))
    return st.builds(
        RevisionCase,
        rpc=st.sampled_from(["changes", "changes", "watch"]),
        model=weighted((8, st.sampled_from([PUB, PUB, GOOD, NEW])), (1, st.sampled_from(HOSTILE_IDS)), (1, _TEXT)),
        since=choice,
        revision=weighted((6, st.sampled_from(["", "", "current", "kept:1"])), (1, _TEXT)),
    )


REVISION_CODES = frozenset(
    {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "PERMISSION_DENIED", "FAILED_PRECONDITION", "WAITING"}
)


def run_revisions(target: Target, case: RevisionCase) -> str:
    model = case.model
    since = _kept(target, model, case.since)
    if case.rpc == "watch":
        return _run_watch(target, model, since)
    revision = _kept(target, model, case.revision)
    request = pb.GetChangesRequest(model=model, since=since, revision=revision)
    code, details, response = outcome(lambda: target.stub.GetChanges(request, timeout=CALL_TIMEOUT_S))
    check_refusal(code, details, REVISION_CODES - {"WAITING"})
    if code != Code.OK:
        return code.name
    old = target.revisions.get((model, since))
    new = target.revisions.get((model, response.revision))
    listed = {t.name: t for t in response.tensors}
    for name, changes in listed.items():
        previous = 0
        for r in changes.ranges:
            if not previous <= r.start < r.end:
                raise Violation(f"GetChanges gives tensor {name!r} ranges out of order: {list(changes.ranges)}")
            previous = r.end
    if old is None or new is None:
        return "OK"
    for name, tensor in new.items():
        was = old.get(name)
        same_layout = was is not None and (was.dtype, was.shape) == (tensor.dtype, tensor.shape)
        entry = listed.get(name)
        if entry is None or not (entry.whole or entry.ranges):
            if not same_layout or raw_bytes(was) != raw_bytes(tensor):  # type: ignore[arg-type]
                raise Violation(f"GetChanges {since!r} -> {response.revision!r} misses a change of {name!r}")
        elif not entry.whole:
            if not same_layout:
                raise Violation(f"GetChanges gives ranges of {name!r}, whose layout changed")
            before, after = bytearray(raw_bytes(was)), bytearray(raw_bytes(tensor))  # type: ignore[arg-type]
            for r in entry.ranges:
                before[r.start : r.end] = after[r.start : r.end]
            if before != after:
                raise Violation(f"GetChanges {since!r} -> {response.revision!r}: {name!r} changed outside its ranges")
    gone = set(old) - set(new)
    if gone != set(response.removed):
        raise Violation(f"GetChanges says {sorted(response.removed)} removed, not {sorted(gone)}")
    return "OK"


def _run_watch(target: Target, model: str, after: str) -> str:
    current = target.current.get(model)
    waits = current is not None and after == current.revision
    call = target.stub.WatchModel(
        pb.WatchModelRequest(model=model, after=after), timeout=0.5 if waits else CALL_TIMEOUT_S
    )
    try:
        code, details, first = outcome(lambda: next(call))
    finally:
        call.cancel()
    if waits and code == Code.DEADLINE_EXCEEDED:
        return "WAITING"
    check_refusal(code, details, REVISION_CODES - {"WAITING"})
    if code == Code.OK and current is not None:
        if first.revision != current.revision or current.revision not in first.kept:
            raise Violation(
                f"WatchModel of {model!r} says {first.revision!r} (kept {list(first.kept)}), not {current.revision!r}"
            )
    return code.name


# --- request bytes that are no valid message --------------------------------------------------------------


def _valid_requests() -> dict[str, bytes]:
    return {
        "GetManifest": pb.GetManifestRequest(model=GOOD).SerializeToString(),
        "StreamTensors": pb.StreamTensorsRequest(
            model=GOOD, tensors=[pb.TensorRequest(name="c", ranges=[pb.ByteRange(start=8, end=24)])]
        ).SerializeToString(),
        "StreamTensorsBulk": pb.StreamTensorsBulkRequest(
            request=pb.StreamTensorsRequest(model=GOOD)
        ).SerializeToString(),
        "ListModelFiles": pb.ListModelFilesRequest(model=GOOD).SerializeToString(),
        "ReadModelFile": pb.ReadModelFileRequest(model=GOOD, file="model.safetensors").SerializeToString(),
        "GetChanges": pb.GetChangesRequest(model=PUB, since="x").SerializeToString(),
        "WatchModel": pb.WatchModelRequest(model=GOOD).SerializeToString(),
        "OpenSharedMemory": pb.OpenSharedMemoryRequest(nonce_file="n", nonce=b"1").SerializeToString(),
        "PublishTensors": pb.PublishRequest(
            start=pb.PublishStart(
                model=NEW, new_layout=True, tensors=[pb.PublishedTensor(name="t", dtype=pb.DATA_TYPE_UINT8, shape=[2])]
            )
        ).SerializeToString(),
        "StreamTensorsShared": pb.StreamTensorsSharedRequest(
            request=pb.StreamTensorsRequest(model=GOOD)
        ).SerializeToString(),
    }


VALID_REQUESTS = _valid_requests()
_CLIENT_STREAMING = {"PublishTensors", "StreamTensorsShared"}


@dataclass(frozen=True)
class RawCase:
    method: str
    messages: tuple[bytes, ...]


@st.composite
def mutated(draw: Any, valid: bytes) -> bytes:
    """valid with a few bytes replaced, inserted or cut away."""
    raw = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(0, len(raw)))
        change = draw(st.sampled_from(["replace", "insert", "cut"]))
        byte = draw(st.integers(0, 255))
        if change == "insert" or position == len(raw):
            raw.insert(position, byte)
        elif change == "replace":
            raw[position] = byte
        else:
            del raw[position:]
    return bytes(raw)


@st.composite
def raw_cases(draw: Any) -> RawCase:
    method = draw(st.sampled_from(sorted(VALID_REQUESTS)))
    one = st.binary(max_size=200) | mutated(VALID_REQUESTS[method])
    count = draw(st.integers(1, 3)) if method in _CLIENT_STREAMING else 1
    return RawCase(method, tuple(draw(one) for _ in range(count)))


RAW_CODES = frozenset(
    {
        "OK",
        "INVALID_ARGUMENT",
        "OUT_OF_RANGE",
        "NOT_FOUND",
        "FAILED_PRECONDITION",
        "PERMISSION_DENIED",
        "DATA_LOSS",
        "ABORTED",
        "RESOURCE_EXHAUSTED",
        "WAITING",
    }
)


def run_raw(target: Target, case: RawCase) -> str:
    """The case's bytes as the method's request messages; the call's first answer, or how it ended."""
    path = SERVICE + case.method
    if case.method in _CLIENT_STREAMING:
        # Ended with a commit, so that a publish whose bytes parse as a part can be taken.
        commit = pb.PublishRequest(commit=True).SerializeToString() if case.method == "PublishTensors" else b""
        messages = [*case.messages, commit] if commit else list(case.messages)
        stream: Any = target.channel.stream_stream(path, request_serializer=None, response_deserializer=None)
        call = stream(iter(messages), timeout=CALL_TIMEOUT_S)
    else:
        unary: Any = target.channel.unary_stream(path, request_serializer=None, response_deserializer=None)
        # A watch of the current revision waits for the next one: its first answer is all that is asked.
        call = unary(case.messages[0], timeout=1.0 if case.method == "WatchModel" else CALL_TIMEOUT_S)
    try:
        # The first answer only: a stream over the data port then waits for a connection that never comes.
        code, details, _ = outcome(lambda: next(call, None))
    finally:
        call.cancel()
    if case.method == "WatchModel" and code == Code.DEADLINE_EXCEEDED:
        return "WAITING"
    check_refusal(code, details, RAW_CODES - {"WAITING"})
    return code.name


# --- delta payloads, decoded where they arrive (weightstream.protocol.deltas) ----------------------------------


@dataclass(frozen=True)
class DeltaCase:
    length: int
    offset: int
    encoding: int
    form: str  # "encoded": Codec.encode's; "dense"/"sparse": made here; "random": any bytes
    seed: int
    mutation: str  # "", "flip", "cut", "append", "size", "count", "gaps", "beyond"


def delta_cases() -> st.SearchStrategy[DeltaCase]:
    return st.builds(
        DeltaCase,
        length=st.integers(0, 300) | st.sampled_from([1, 2, 4095, 4096]),
        offset=st.integers(0, 9),
        encoding=st.sampled_from([0, 0, 0, 0, 3, -1]),  # 0: the form's own
        form=st.sampled_from(["encoded", "dense", "sparse", "sparse", "random"]),
        seed=st.integers(0, 2**32),
        mutation=st.sampled_from(["", "", "", "flip", "cut", "append", "size", "count", "gaps", "beyond"]),
    )


def _zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=1, write_content_size=True).compress(data)


def run_delta(target: Target | None, case: DeltaCase) -> str:
    """Codec.decode of the case's payload: a delta that applies as its form promises, or DeltaUnusable."""
    rng = np.random.default_rng(case.seed)
    length, offset = case.length, case.offset
    xor = np.zeros(length, dtype=np.uint8)
    for at in rng.integers(0, max(length, 1), int(rng.integers(0, 6))):
        if length:
            xor[at] = rng.integers(1, 256)
    word = deltas.word_bytes(offset, length)
    words = xor.view(np.int16 if word == 2 else np.uint8) if length % word == 0 else xor
    places = np.flatnonzero(words).astype(np.int64)
    count = places.size
    gaps = np.diff(places, prepend=0).astype(np.uint32)
    mutation = case.mutation
    if mutation == "count":
        count += 1 + case.seed % 3
    if mutation == "gaps" and gaps.size > 1:
        gaps[1] = 0
    if mutation == "beyond" and gaps.size:
        gaps[-1] += np.uint32(length)
    encoding: int = deltas.SPARSE_XOR_ZSTD if case.form == "sparse" else deltas.XOR_ZSTD
    if case.form == "sparse":
        payload = _zstd(deltas.COUNT.pack(count) + gaps.tobytes() + words[places].tobytes())
    elif case.form == "dense":
        payload = _zstd(xor.tobytes() + (b"\0" if mutation == "size" else b""))
    elif case.form == "encoded":
        encoded = deltas.Codec().encode(torch.from_numpy(xor.copy()), offset)
        if encoded is None:
            return "WHOLE"  # not worth a delta: the chunk goes as its bytes
        encoding, payload = encoded
    else:
        payload = bytes(rng.integers(0, 256, int(rng.integers(0, 80)), dtype=np.uint8))
    if mutation == "flip" and payload:
        flipped = bytearray(payload)
        flipped[int(rng.integers(0, len(flipped)))] ^= 1 << int(rng.integers(0, 8))
        payload = bytes(flipped)
    elif mutation == "cut" and payload:
        payload = payload[: int(rng.integers(0, len(payload)))]
    elif mutation == "append":
        payload += bytes(rng.integers(0, 256, 1 + int(rng.integers(0, 20)), dtype=np.uint8))
    encoding = case.encoding or encoding
    base = rng.integers(0, 256, length, dtype=np.uint8)
    view = torch.from_numpy(base.copy())
    held = np.frombuffer(payload, dtype=np.uint8) if payload else np.zeros(1, dtype=np.uint8)
    try:
        crc = deltas.Codec().xor_into(view, offset, int(held.ctypes.data), len(payload), encoding)
    except deltas.DeltaUnusable:
        if not torch.equal(view, torch.from_numpy(base)):
            raise Violation("a delta refused as unusable changed its destination") from None
        return "UNUSABLE"
    result = view.numpy()
    if crc != wire.crc32c(result.tobytes()):
        raise Violation("xor_into's CRC32C is not that of the bytes it left")
    made_here = case.form != "random" and case.encoding == 0
    if made_here and mutation in ("", "append", "size") and not np.array_equal(result, base ^ xor):
        raise Violation(f"a {case.form} delta (mutation {mutation!r}) applied to other bytes than its XOR")
    return "APPLIED"


DELTA_OUTCOMES = frozenset({"APPLIED", "UNUSABLE", "WHOLE"})


# --- GetBlockHashes and StreamRevisionBlocks (fleet fan-out) -------------------------------------------------


@dataclass(frozen=True)
class PeerCase:
    rpc: str  # "hashes" or "blocks"
    model: str
    revision: str  # a revision choice (see _kept)
    tensors: tuple[str, ...]  # names of the model's tensors (as the layout names them) or text
    first_block: int
    refused_peer: str
    keepalive_ms: int = 0
    wanted: bytes = b""  # the bitmap of blocks asked for (empty: all)
    since: str = ""  # a revision choice (see _kept), "" or text: the revision the puller says it holds


def peer_cases() -> st.SearchStrategy[PeerCase]:
    names = weighted((6, st.sampled_from(sorted(LAYOUT))), (1, _TEXT), (1, st.just("x" * 5000)))
    # The current revision's blocks, since the one before (one element away): served as deltas.
    deltas_case = st.builds(
        PeerCase,
        rpc=st.just("blocks"),
        model=st.just(PUB),
        revision=st.just("current"),
        tensors=st.permutations(sorted(LAYOUT)).map(tuple),
        first_block=st.integers(0, 2),
        refused_peer=st.just(""),
        wanted=st.binary(max_size=1),
        since=st.just("kept:1"),
    )
    return weighted((1, deltas_case), (5, _hostile_peer_cases(names)))


def _hostile_peer_cases(names: st.SearchStrategy[str]) -> st.SearchStrategy[PeerCase]:
    return st.builds(
        PeerCase,
        rpc=st.sampled_from(["hashes", "blocks", "blocks"]),
        model=weighted((8, st.sampled_from([PUB, PUB, GOOD, NEW])), (1, st.sampled_from(HOSTILE_IDS)), (1, _TEXT)),
        # "first": the first revision the cases knew of the model: PUB's files, superseded by its publishes.
        revision=weighted((6, st.sampled_from(["current", "current", "kept:1", "first", "first"])), (1, _TEXT)),
        tensors=st.lists(names, max_size=4).map(tuple),
        first_block=weighted((6, st.integers(0, 4)), (1, st.integers(0, 2**64 - 1))),
        refused_peer=weighted(
            (6, st.just("")),
            (1, st.sampled_from(["198.18.0.9:50051", "[::1]:1", "evil.example:80", "1.2.3.4"])),
            (1, _TEXT),
        ),
        # Held to 50 ms .. 5 s by the server: 1 must not make it flood, 2**32 - 1 not make it hang.
        keepalive_ms=weighted(
            (4, st.just(0)), (2, st.sampled_from([1, 2, 50, 2**32 - 1])), (1, st.integers(0, 2**32 - 1))
        ),
        # Random, empty, longer than the blocks, all ones past the end, and far too long.
        wanted=weighted(
            (4, st.just(b"")),
            (3, st.binary(min_size=1, max_size=3)),
            (1, st.sampled_from([b"\xff" * 64, b"\x00" * 64, b"\x01", b"\xff" * (1 << 20), b"\xaa" * ((1 << 22) + 1)])),
        ),
        # Kept (a delta may come), the revision itself, unknown, hostile text.
        since=weighted(
            (2, st.just("")),
            (4, st.sampled_from(["kept:1", "kept:1", "kept:2", "current"])),
            (1, st.sampled_from(["none-1", "../../etc", "a" * 129, "pub-" + "0" * 20])),
            (1, _TEXT),
        ),
    )


PEER_CODES = frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND"})
# OK where at least one block came as a delta (checked: it decodes against since to the revision's block).
PEER_OUTCOMES = PEER_CODES | {"OK_DELTAS"}


def run_peer(target: Target, case: PeerCase) -> str:
    """One GetBlockHashes or StreamRevisionBlocks; what it serves must be the revision's own blocks."""
    if not any(m == PUB for m, _ in target.published):  # run alone: a published revision to serve
        state = state_of(LAYOUT, 7)
        with WeightStreamClient(target.address, progress=False) as client:
            target.took(PUB, client.publish(PUB, state), state)
    if not target.published_near:  # a revision one element away from the one before: blocks as deltas
        target.published_near = True
        near = {name: tensor.clone() for name, tensor in target.current[PUB].tensors.items()}
        near["a.weight"].view(torch.int32).view(-1)[3] ^= 1
        with WeightStreamClient(target.address, progress=False) as client:
            target.took(PUB, client.publish(PUB, near), near)
    model, revision = case.model, _kept(target, case.model, case.revision)
    # Served: a published revision kept, and the model's current storage revision (GOOD's files); never
    # a storage revision superseded (PUB's files once published to).
    current = target.current.get(model)
    storage = current is not None and current.revision == revision and (model, revision) not in target.published
    served = (model, revision) in target.published or storage
    state = target.revisions.get((model, revision)) if served else None
    if case.rpc == "hashes":
        request = pb.GetBlockHashesRequest(model=model, revision=revision)
        code, details, got = outcome(lambda: list(target.stub.GetBlockHashes(request, timeout=CALL_TIMEOUT_S)))
        check_refusal(code, details, PEER_CODES)
        if got is not None and state is not None:
            for message in got:
                flat = raw_bytes(state[message.tensor])
                step = digests.DIGEST_BLOCK_BYTES
                # An empty tensor has no blocks (digests.tensor_hash of no bytes hashes no block).
                want = [digests.block_hash(memoryview(flat)[i : i + step]) for i in range(0, len(flat), step)]
                if list(message.hashes) != want:
                    raise Violation(f"GetBlockHashes gives wrong hashes of {message.tensor!r}")
        return code.name
    request = pb.StreamRevisionBlocksRequest(
        model=model,
        revision=revision,
        tensors=list(case.tensors),
        first_block=case.first_block,
        refused_peer=case.refused_peer,
        keepalive_ms=case.keepalive_ms,
        wanted=case.wanted,
        since=_kept(target, model, case.since) if case.since else "",
    )
    code, details, got = outcome(lambda: list(target.stub.StreamRevisionBlocks(request, timeout=CALL_TIMEOUT_S)))
    check_refusal(code, details, PEER_CODES)
    if got is not None:
        if state is None:
            raise Violation(
                f"StreamRevisionBlocks served blocks of {model!r} revision {revision!r}, neither published nor current"
            )
        step = digests.DIGEST_BLOCK_BYTES
        # (tensor, offset) of each block, in the request's numbering.
        places = [
            (name, i) for name in case.tensors for i in range(0, state[name].numel() * state[name].element_size(), step)
        ]
        want = [
            (n, raw_bytes(state[name])[i : i + step])
            for n, (name, i) in enumerate(places)
            if n >= case.first_block and wanted_at(case.wanted, n)
        ]
        base = target.revisions.get((model, request.since)) if (model, request.since) in target.published else None
        taken = [(m.index, _block_of(m, places, base)) for m in got]
        # A kept revision (or the current storage one) is served at once: no keep-alive (waiting) among its
        # blocks, asked for or not.
        if taken != want or any(m.waiting for m in got):
            raise Violation(f"StreamRevisionBlocks served other blocks than {model!r} revision {revision!r} holds")
        if any(m.encoding for m in got):
            return "OK_DELTAS"
    return code.name


def _block_of(
    message: pb.StreamRevisionBlocksResponse,
    places: list[tuple[str, int]],
    base: dict[str, torch.Tensor] | None,
) -> bytes | None:
    """The block a served message stands for: its data, or a delta decoded against base (the request's
    since, as published); None where a delta cannot stand for one (no such since, or it does not decode)."""
    if not message.encoding:
        return message.data
    if base is None or message.index >= len(places):
        return None
    name, offset = places[message.index]
    if name not in base:
        return None
    old = raw_bytes(base[name])[offset : offset + digests.DIGEST_BLOCK_BYTES]
    view = torch.frombuffer(bytearray(old), dtype=torch.uint8) if old else torch.empty(0, dtype=torch.uint8)
    payload = np.frombuffer(message.data, dtype=np.uint8)
    try:
        decoded = deltas.Codec().decode(view.numel(), offset, payload.ctypes.data, payload.size, message.encoding)
    except deltas.DeltaUnusable:
        return None
    decoded.xor_into(view)
    return view.numpy().tobytes()


SURFACES: dict[str, Surface] = {
    s.name: s
    for s in (
        Surface("publish", publish_cases(), run_publish, PUBLISH_CODES),
        Surface("publish_frames", publish_cases(data_port=True), run_publish_frames, PUBLISH_FRAME_CODES),
        Surface("stream", stream_cases(bulk=False), run_stream, STREAM_CODES),
        Surface("bulk_stream", stream_cases(bulk=True), run_stream, STREAM_CODES | {"HUNG_UP"}),
        Surface("hello", hello_cases(), run_hello, HELLO_OUTCOMES),
        Surface("revisions", revision_cases(), run_revisions, REVISION_CODES),
        Surface("raw_bytes", raw_cases(), run_raw, RAW_CODES),
        Surface("deltas", delta_cases(), run_delta, DELTA_OUTCOMES),
        Surface("peer_blocks", peer_cases(), run_peer, PEER_OUTCOMES),
    )
}
