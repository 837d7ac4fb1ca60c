"""What the client and the server both speak: the wire contract and the helpers around it.

wire (chunk placement, checksums, limits), framing (chunks packed into gRPC messages), dtypes
(safetensors and protobuf data types), names (transports, file kinds), shm (the shared-memory
transport's names, sizes and mapping) and tcp (the data port's frames). Nothing here imports
weightstream.client or weightstream_server; both import this. The generated protobuf code stays
importable as weightstream.v1.
"""
