"""A hostile peer for the fleet fan-out tests: joins its upstream's fan-out, then serves wrong bytes.

`python -m tests.support.hostile_peer --upstream HOST:PORT --model M --port P` holds a watch of M on
the upstream with peer_port P (so the upstream plans other peers below it) and serves
StreamRevisionBlocks on P with the upstream's own blocks, one byte of each flipped: the right index
and length, and a CRC32C of the wrong bytes would match too; only the BLAKE3 hashes tell them apart.

serve_blocks(blocks) is the same kind of server in a test's own process, answering StreamRevisionBlocks
with whatever blocks (a function of the request) yields, serialized.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc

from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc

SERVICE = "weightstream.v1.WeightStreamService"

Blocks = Callable[[pb.StreamRevisionBlocksRequest, grpc.ServicerContext], Iterator[bytes]]


def serve_blocks(blocks: Blocks, host: str = "127.0.0.1", port: int = 0) -> tuple[grpc.Server, int]:
    """A started gRPC server whose StreamRevisionBlocks is blocks (its only method), and its port."""
    handler = grpc.unary_stream_rpc_method_handler(
        blocks, request_deserializer=pb.StreamRevisionBlocksRequest.FromString, response_serializer=None
    )
    server = grpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"StreamRevisionBlocks": handler}),))
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server, bound


def flipping(upstream: str) -> Blocks:
    """StreamRevisionBlocks answered with upstream's own blocks, one byte of each flipped."""
    stub = pb_grpc.WeightStreamServiceStub(grpc.insecure_channel(upstream))

    def blocks(request: pb.StreamRevisionBlocksRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        for response in stub.StreamRevisionBlocks(request):
            data = bytearray(response.data)
            data[len(data) // 2] ^= 0x5A
            yield pb.StreamRevisionBlocksResponse(index=response.index, data=bytes(data)).SerializeToString()

    return blocks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    stub = pb_grpc.WeightStreamServiceStub(grpc.insecure_channel(args.upstream))
    server, _ = serve_blocks(flipping(args.upstream), "0.0.0.0", args.port)

    def watch() -> None:
        while True:
            try:
                for _ in stub.WatchModel(pb.WatchModelRequest(model=args.model, peer_port=args.port)):
                    pass
            except grpc.RpcError:
                time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()
    server.wait_for_termination()


if __name__ == "__main__":
    main()
