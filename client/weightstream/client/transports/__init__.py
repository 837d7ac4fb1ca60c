"""The data transports: how chunk bytes reach this process, one module each.

base.py is the interface every transport implements (ChunkRef, StreamCancel, Transport);
grpc_stream.py carries the bytes inside gRPC messages and works everywhere; shared_memory.py reads
them from a ring the server fills on the same host; call_reader.py reads a call's messages on a
helper thread, for both. Which one a stream uses is chosen in one place,
weightstream.client.channels.
"""
