"""The revision RPCs: PublishTensors, GetChanges and WatchModel, translated to the revisions package.

A publish's bytes come in PublishRequest chunks, or, when its PublishStart asks, over the data
port (transports.tcp.upload): the first answer then announces the port and a ticket.

Admission: a publish is a stream like the others (a stream slot, the per-client share, the stall
rule on the publisher's messages); a watch holds a worker thread while it waits, so watches have
slots of their own (--max-watches, half of them per client), and the worker pool counts them. Each
watch message is sent under the stall rule, and a watch ends when its client goes.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterator

import grpc

from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.errors import InvalidRequest, PublishRefused, TcpUnavailable
from weightstream_server.ops.auth import TokenFile, bearer_token
from weightstream_server.revisions.changes import Changes
from weightstream_server.revisions.fanout import Fanout, peer_address
from weightstream_server.revisions.published import Publisher
from weightstream_server.revisions.store import Revision, RevisionStore
from weightstream_server.serving.stream_session import Streams, StreamSlots, client_of
from weightstream_server.transports import rpc
from weightstream_server.transports.tcp.listener import DataPort
from weightstream_server.transports.tcp.servicer import CallConnection, accept, issue
from weightstream_server.transports.tcp.upload import receive_part

logger = logging.getLogger(__name__)

# A first PublishStart must come within this long.
FIRST_MESSAGE_S = 10.0


class RevisionsServicer:
    """PublishTensors, GetChanges and WatchModel. Safe to call from many threads."""

    def __init__(
        self,
        streams: Streams,
        revisions: RevisionStore,
        publisher: Publisher,
        changes: Changes,
        publish_tokens: TokenFile | None,
        data_port: DataPort | None = None,
        advertise: tuple[str, int] = ("", 0),
        fanout: Fanout | None = None,
    ) -> None:
        self._streams = streams
        # Who follows each model as a peer (watches with a peer_port), and whom each takes a revision from.
        # None: fan-out is off here (no --fanout): a watch's peer_port is ignored.
        self._fanout = fanout
        # Where publishes that ask for it send their bytes; None: over gRPC only.
        self._data_port = data_port
        self._advertise = advertise
        self._revisions = revisions
        self._publisher = publisher
        self._changes = changes
        self._publish_tokens = publish_tokens
        # Watches hold a worker thread each while they wait: slots of their own, half per client.
        settings = streams.settings
        self._watch_slots = StreamSlots(
            settings.max_watches, max(1, settings.max_watches // 2), what="watch", flag="--max-watches"
        )

    def PublishTensors(self, requests: Iterator[pb.PublishRequest], context: grpc.ServicerContext) -> Iterator[bytes]:
        streams = self._streams
        with streams.session(context, method="PublishTensors", kind="publish") as session:
            self._check_publisher(context)
            first = rpc.first_message(requests, FIRST_MESSAGE_S, "PublishRequest")
            if first is None:
                raise InvalidRequest("the publish stream ended before its PublishStart: nothing was published")
            if not first.HasField("start"):
                raise InvalidRequest("the first PublishRequest must carry a PublishStart")
            start = first.start
            session.model_id = start.model
            if start.data_port:
                session.transport = "tcp"
                response = yield from self._publish_over_data_port(start, context, session.peer)
            else:
                response = self._publisher.publish(start, requests, session.peer, context.is_active)
            session.model = response.model
            yield response.SerializeToString()

    def _publish_over_data_port(
        self, start: pb.PublishStart, context: grpc.ServicerContext, peer: str
    ) -> Generator[bytes, None, pb.PublishResponse]:
        """Announce the data port, then land the part's frames from it (tcp.upload); the last answer."""
        port = self._data_port
        if port is None:
            raise TcpUnavailable("this server has no data port (--data-port 0); publish over gRPC")
        part = self._publisher.begin(start, peer)
        connection = CallConnection()
        context.add_callback(connection.close)
        with part.failing():
            pending = issue(port, context, peer)
            try:
                host, announced = self._advertise
                announcement = pb.PublishResponse(
                    model=start.model, data_host=host, data_port=announced, ticket=pending.ticket
                )
                yield announcement.SerializeToString()
            except BaseException:
                port.tickets.withdraw(pending)
                raise
            conn = accept(port, pending, context)
            connection.set(conn)
            receive_part(conn, part, self._streams.settings.stall_timeout)
        return part.finish(context.is_active)

    def GetChanges(self, request: pb.GetChangesRequest, context: grpc.ServicerContext) -> pb.GetChangesResponse:
        streams = self._streams
        try:
            if not request.since:
                raise InvalidRequest("GetChanges needs since: the revision the client holds")
            manifest = streams.catalog.manifest(request.model, request.revision)
            revision = self._revisions.find(manifest.model, manifest.revision)
            if revision is None:
                revision = self._revisions.observe_storage(manifest.model, manifest)
            return self._changes.changes(manifest.model, request.since, revision)
        except Exception as exc:
            rpc.abort(context, streams.stats, "GetChanges", request.model, exc)

    def WatchModel(
        self, request: pb.WatchModelRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.WatchModelResponse]:
        streams = self._streams
        slots = self._watch_slots
        peer = context.peer()
        client = client_of(context, peer)
        try:
            streams.catalog.manifest(request.model)  # the model exists (and its storage revision is seen)
            slots.take(client)
        except Exception as exc:
            rpc.abort(context, streams.stats, "WatchModel", request.model, exc)
        logger.info("watch of model %r from %s", request.model, peer)
        joined = None
        if request.peer_port and self._fanout is not None:
            address = peer_address(peer, request.peer_port)
            if address is not None:
                joined = self._fanout.join(request.model, address)
        try:
            self._changes.follow(request.model)
            after = request.after
            while context.is_active() and not streams.readiness.draining:
                current = self._revisions.wait_for_change(request.model, after, streams.settings.watch_interval)
                if current is None:
                    # Nothing published meanwhile: look at storage (a stat of each file).
                    streams.catalog.manifest(request.model)
                    continue
                with streams.stalls.waiting(context, lambda: f"watch of model {request.model!r} from {peer}"):
                    message = _watch_message(current, self._revisions.kept(request.model))
                    if joined is not None and self._fanout is not None:
                        message.peer = self._fanout.parent(request.model, current.id, joined)
                    yield message
                after = current.id
        except Exception as exc:
            if context.is_active():
                rpc.abort(context, streams.stats, "WatchModel", request.model, exc)
        finally:
            if joined is not None and self._fanout is not None:
                self._fanout.leave(request.model, joined)
            slots.give_back(client)
            logger.info("watch of model %r from %s ended", request.model, peer)

    def _check_publisher(self, context: grpc.ServicerContext) -> None:
        settings = self._streams.settings
        if self._publish_tokens is not None:
            authorization = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
            token = bearer_token(authorization) if isinstance(authorization, str) else None
            if not self._publish_tokens.accepts(token):
                raise PublishRefused(
                    "publishing needs a publisher's token (one of --publish-token-file); "
                    + ("this call carries none" if token is None else "this call's token is not one")
                )
            return
        if not settings.allow_publish:
            raise PublishRefused(
                "this server takes no publishes: start it with --allow-publish or --publish-token-file"
            )


def _watch_message(revision: Revision, kept: list[str]) -> pb.WatchModelResponse:
    return pb.WatchModelResponse(
        model=revision.model,
        revision=revision.id,
        origin=revision.origin,
        total_bytes=revision.manifest.total_bytes,
        kept=kept,
    )


def add_to_server(servicer: RevisionsServicer, server: grpc.Server) -> None:
    rpc.register(
        server,
        rpc.handler(servicer.PublishTensors, serialized=True),
        rpc.handler(servicer.GetChanges),
        rpc.handler(servicer.WatchModel),
    )
