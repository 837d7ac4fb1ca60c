"""Bearer-token authentication: the token file, the gRPC interceptor, and the check REST uses.

The token file holds one token per line (blank lines and lines starting with "#" are skipped);
several lines let a token be rotated: add the new one, move the clients over, remove the old one.
The file is re-read when its size, modification time or inode changes, so a rotation (or a
Kubernetes secret update) needs no restart. A file that cannot be read or holds no token at start-up
is an error; later, such a file keeps the tokens last read (and logs a warning), so that a file
caught half-written never locks every client out.

Tokens are compared in constant time: each check hashes the given token and compares it with
every known token's hash, so neither a token's content nor its length nor which line matched shows
in the time taken.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from weightstream_server.errors import Unauthenticated, status_code
from weightstream_server.ops.stats import ServerStats

logger = logging.getLogger(__name__)

# RPCs every caller may make: Kubernetes' gRPC probes and load balancers send no token.
OPEN_SERVICE_PREFIXES = ("/grpc.health.v1.Health/",)
PUBLISH_METHOD = "/weightstream.v1.WeightStreamService/PublishTensors"


class TokenFile:
    """The tokens of one file, re-read when it changes. Safe to use from many threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        try:
            self._stamp = self._stat()
            digests = self._read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"token file {path}: {getattr(exc, 'strerror', None) or exc}") from exc
        if not digests:
            raise ValueError(f"token file {path} holds no token (one token per line)")
        self._digests = digests

    def accepts(self, token: str | None) -> bool:
        """Whether token is one of the file's tokens (compared in constant time)."""
        if not token:
            return False
        digests = self._current()
        given = hashlib.sha256(token.encode()).digest()
        matched = False
        for known in digests:
            # No early exit: the time taken does not say which token, if any, matched.
            matched |= hmac.compare_digest(given, known)
        return matched

    def accepts_header(self, authorization: str | None) -> bool:
        """Whether an Authorization header value is "Bearer <a known token>"."""
        return self.accepts(bearer_token(authorization))

    def _current(self) -> tuple[bytes, ...]:
        try:
            stamp = self._stat()
        except OSError as exc:
            logger.warning("token file %s: %s; keeping the %d tokens read before", self.path, exc, len(self._digests))
            return self._digests
        if stamp == self._stamp:
            return self._digests
        with self._lock:
            if stamp != self._stamp:
                try:
                    digests = self._read()
                except (OSError, UnicodeDecodeError) as exc:
                    logger.warning("token file %s: %s; keeping the tokens read before", self.path, exc)
                    return self._digests
                if digests:
                    self._digests = digests
                    logger.info("token file %s re-read: %d tokens", self.path, len(digests))
                else:
                    logger.warning("token file %s holds no token now; keeping the tokens read before", self.path)
                self._stamp = stamp
        return self._digests

    def _stat(self) -> tuple[int, int, int]:
        stat = os.stat(self.path)
        return stat.st_mtime_ns, stat.st_size, stat.st_ino

    def _read(self) -> tuple[bytes, ...]:
        with open(self.path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
        tokens = [line for line in lines if line and not line.startswith("#")]
        return tuple(hashlib.sha256(token.encode()).digest() for token in tokens)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an "Authorization: Bearer <token>" value (the scheme is case-insensitive)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses every RPC but health checks with UNAUTHENTICATED unless it carries a known token."""

    def __init__(self, tokens: TokenFile, stats: ServerStats, publish_tokens: TokenFile | None = None) -> None:
        self._tokens = tokens
        self._stats = stats
        # A publisher's token admits PublishTensors (and only that) without a read token.
        self._publish_tokens = publish_tokens

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method
        if method.startswith(OPEN_SERVICE_PREFIXES):
            return continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata or ()
        authorization = next((value for key, value in metadata if key == "authorization"), None)
        if isinstance(authorization, str) and self._tokens.accepts_header(authorization):
            return continuation(handler_call_details)
        if (
            self._publish_tokens is not None
            and method == PUBLISH_METHOD
            and isinstance(authorization, str)
            and self._publish_tokens.accepts_header(authorization)
        ):
            return continuation(handler_call_details)
        reason = "no bearer token" if authorization is None else "a bearer token this server does not accept"
        return self._refusal(continuation(handler_call_details), method, reason)

    def _refusal(self, handler: grpc.RpcMethodHandler | None, method: str, reason: str) -> grpc.RpcMethodHandler:
        """A handler of the same kind as handler that ends the call with UNAUTHENTICATED."""
        error = Unauthenticated(f"{method}: the request carries {reason}; send 'authorization: Bearer <token>'")
        code = status_code(error)

        def refuse(_request: Any, context: grpc.ServicerContext) -> Any:
            self._stats.error(code.name)
            logger.warning("refused %s from %s: %s", method, context.peer(), reason)
            context.abort(code, str(error))

        streaming = (handler.request_streaming, handler.response_streaming) if handler is not None else (False, False)
        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[streaming]
        return make(refuse)
