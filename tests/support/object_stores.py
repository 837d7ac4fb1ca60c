"""Google Cloud Storage and Azure Blob emulators on 127.0.0.1 for tests, and `weightstream serve` pointed at them.

GCS: gcp-storage-emulator (Python, from the dev extra). It speaks the JSON API, which is what both
google-cloud-storage and the Run:ai streamer's GCS backend (google-cloud-cpp, reading ranges with
`GET /storage/v1/b/B/o/O?alt=media` and a Range header) call; the server reaches it through the
standard STORAGE_EMULATOR_HOST alone. fake-gcs-server, the other emulator in use, is a Go binary
that no package index here carries.

Azure: Azurite (npm). The released Run:ai Azure backend reads https://ACCOUNT.SUFFIX only: it
takes AZURE_STORAGE_ACCOUNT_NAME, _ACCOUNT_KEY and _ENDPOINT_SUFFIX (the server derives them from
AZURE_STORAGE_CONNECTION_STRING), has no http:// and no path-style endpoint (Azurite's default
http://127.0.0.1:10000/devstoreaccount1), and builds its connection-string support only for its
own tests. So Azurite serves TLS here with a certificate for devstoreaccount1.blob.localhost from a
fresh CA, and the server runs with:

- HTTPS_PROXY naming a CONNECT proxy on 127.0.0.1 (AzuriteTls.proxy) that tunnels to Azurite
  and to nothing else: libcurl (in the backend) and requests (in the SDK) both honour it, so no
  name needs resolving and nothing leaves the machine;
- the fresh CA trusted through the system bundle: the backend's libcurl reads
  /etc/ssl/certs/ca-certificates.crt and no variable, so the server runs in a private mount
  namespace (`unshare -rm`, no root needed) with a bundle of the system's CAs and the fresh one
  mounted over /etc/ssl/certs. Nothing outside that process sees it.

Only the transport is arranged; the bytes come from a real Azurite process, through the real
backend and SDK, with the account's key checked on every request.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.certificates import make_pki
from tests.support.ports import LOOPBACK, free_ports, wait_port

AZURITE_JS = (
    Path(__file__).resolve().parent.parent / "s3" / "node_modules" / "azurite" / "dist" / "src" / "blob" / "main.js"
)
START_TIMEOUT_S = 30.0
# Azurite's well-known development account (documented by Microsoft; not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
SYSTEM_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


@dataclass
class Emulator:
    """A running emulator process: its port, log, and how to stop it."""

    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


def _start(command: list[str], port: int, log: Path, what: str) -> subprocess.Popen[bytes]:
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_port(port, START_TIMEOUT_S, alive=lambda: proc.poll() is None)
    except (RuntimeError, TimeoutError):
        proc.kill()
        proc.wait(timeout=10)
        raise RuntimeError(f"{what} did not start ({proc.returncode}):\n{log.read_text(errors='replace')}") from None
    return proc


# The emulator serves one request at a time from http.server's HTTPServer, whose listen backlog is 5:
# a client opening more connections at once (the streamer's backend opens one per request, since the
# emulator closes each after its answer) has SYNs dropped, each retried by the kernel a second later.
# A store's real front end takes them; so does the emulator with a backlog of 128.
_EMULATOR_MAIN = (
    "import socketserver, sys; socketserver.TCPServer.request_queue_size = 128; "
    "from gcp_storage_emulator.__main__ import main; sys.argv[0] = 'gcp-storage-emulator'; sys.exit(main())"
)


@contextlib.contextmanager
def gcs_emulator(workdir: Path) -> Iterator[Emulator]:
    """gcp-storage-emulator on a free loopback port, keeping objects in memory."""
    if importlib.util.find_spec("gcp_storage_emulator") is None:
        raise RuntimeError("gcp-storage-emulator is not installed: install the dev extra (pip install -e '.[dev]')")
    (port,) = free_ports(1)
    log = workdir / f"gcs-emulator-{port}.log"
    command = [sys.executable, "-c", _EMULATOR_MAIN, "start", "--host", LOOPBACK, "--port", str(port), "--in-memory"]
    emulator = Emulator(port, _start(command, port, log, "gcp-storage-emulator"), log)
    try:
        yield emulator
    finally:
        emulator.stop()


def gcs_client(emulator: Emulator) -> Any:
    """A google-cloud-storage client of the emulator (anonymous, as the emulator expects)."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(
        project="test", credentials=AnonymousCredentials(), client_options={"api_endpoint": emulator.endpoint}
    )


def upload_gcs(client: Any, folder: Path, bucket: str, prefix: str) -> None:
    """Every file of folder to gs://bucket/prefix/ (creating the bucket if needed)."""
    with contextlib.suppress(Exception):
        client.create_bucket(bucket)
    for path in sorted(folder.iterdir()):
        if path.is_file():
            client.bucket(bucket).blob(f"{prefix}/{path.name}").upload_from_filename(str(path))


@dataclass
class AzuriteTls:
    """Azurite over TLS, the CONNECT proxy in front of it, and the CA bundle the server must trust."""

    azurite: Emulator
    proxy_port: int
    bundle_dir: Path
    ca: Path
    _proxy: socket.socket
    _threads: list[threading.Thread] = field(default_factory=list)

    def requests_log(self) -> str:
        """Azurite's debug log: every request, with its headers."""
        path = self.azurite.log.with_name(f"azurite-{self.azurite.port}-requests.log")
        return path.read_text(errors="replace") if path.exists() else ""

    @property
    def suffix(self) -> str:
        """The endpoint suffix of the account: https://devstoreaccount1.blob.localhost:PORT."""
        return f"blob.localhost:{self.azurite.port}"

    def connection_string(self, key: str = AZURITE_KEY) -> str:
        return (
            f"DefaultEndpointsProtocol=https;AccountName={AZURITE_ACCOUNT};AccountKey={key};"
            f"EndpointSuffix=localhost:{self.azurite.port}"
        )

    def server_env(self, key: str = AZURITE_KEY) -> dict[str, str]:
        """What `weightstream serve` needs, besides the namespace (serve_command): the standard variables."""
        proxy = f"http://{LOOPBACK}:{self.proxy_port}"
        return {
            "AZURE_STORAGE_CONNECTION_STRING": self.connection_string(key),
            "HTTPS_PROXY": proxy,
            "https_proxy": proxy,
            # *.localhost must go through the proxy; only the server's own loopback calls bypass it.
            "NO_PROXY": LOOPBACK,
            "no_proxy": LOOPBACK,
            "REQUESTS_CA_BUNDLE": str(SYSTEM_BUNDLE),
        }

    def client(self) -> Any:
        """An azure-storage-blob client of Azurite straight over loopback (for the test's own uploads)."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient(
            f"https://{LOOPBACK}:{self.azurite.port}/{AZURITE_ACCOUNT}",
            credential={"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY},
            connection_verify=str(self.ca),
        )


def namespaced(bundle_dir: Path, command: list[str]) -> list[str]:
    """command in a private mount namespace where bundle_dir is /etc/ssl/certs (see the module doc)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise RuntimeError("unshare (util-linux) is needed to run a server that trusts Azurite's test CA")
    script = 'mount --bind "$0" /etc/ssl/certs && exec "$@"'
    return [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", script, str(bundle_dir), *command]


@contextlib.contextmanager
def azurite_tls(workdir: Path) -> Iterator[AzuriteTls]:
    """Azurite's blob service over TLS on a free loopback port, with its CONNECT proxy (see the module doc)."""
    node = shutil.which("node")
    if node is None or not AZURITE_JS.exists():
        raise RuntimeError(
            f"Azurite is not installed ({AZURITE_JS}): run `make test`, or `npm install --prefix tests/s3`"
        )
    pki = make_pki(workdir / "azurite-pki", "azurite", hosts=(f"{AZURITE_ACCOUNT}.blob.localhost",))
    bundle_dir = workdir / "azurite-trust"
    bundle_dir.mkdir(exist_ok=True)
    (bundle_dir / SYSTEM_BUNDLE.name).write_bytes(SYSTEM_BUNDLE.read_bytes() + b"\n" + pki.ca.read_bytes())
    port, proxy_port = free_ports(2)
    log = workdir / f"azurite-{port}.log"
    command = [node, str(AZURITE_JS), "--blobHost", LOOPBACK, "--blobPort", str(port), "--inMemoryPersistence"]
    command += ["--skipApiVersionCheck", "--loose", "--disableTelemetry", "--silent"]
    command += ["--cert", str(pki.server_cert), "--key", str(pki.server_key)]
    # Its debug log names each request's client (User-Agent): tests tell the streamer's reads by it.
    command += ["--debug", str(workdir / f"azurite-{port}-requests.log")]
    azurite = Emulator(port, _start(command, port, log, "Azurite"), log)
    listener = socket.create_server((LOOPBACK, proxy_port))
    store = AzuriteTls(azurite, proxy_port, bundle_dir, pki.ca, listener)
    accepting = threading.Thread(target=_proxy_loop, args=(listener, port, store._threads), daemon=True)
    accepting.start()
    try:
        yield store
    finally:
        listener.close()
        azurite.stop()
        accepting.join(timeout=10)


def _proxy_loop(listener: socket.socket, port: int, threads: list[threading.Thread]) -> None:
    """Accept CONNECTs to the account's host and tunnel each to Azurite on 127.0.0.1:port; refuse the rest."""
    allowed = f"CONNECT {AZURITE_ACCOUNT}.blob.localhost:{port} ".encode()
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        thread = threading.Thread(target=_tunnel, args=(conn, port, allowed), daemon=True)
        thread.start()
        threads.append(thread)


def _tunnel(conn: socket.socket, port: int, allowed: bytes) -> None:
    with contextlib.closing(conn):
        conn.settimeout(30)
        head = b""
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in head and len(head) < 16384:
                piece = conn.recv(4096)
                if not piece:
                    return
                head += piece
        if not head.startswith(allowed):
            with contextlib.suppress(OSError):
                conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            return
        try:
            upstream = socket.create_connection((LOOPBACK, port), timeout=10)
        except OSError:
            with contextlib.suppress(OSError):
                conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
            return
        with contextlib.closing(upstream):
            conn.settimeout(None)
            upstream.settimeout(None)
            conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            rest = head.split(b"\r\n\r\n", 1)[1]
            if rest:
                upstream.sendall(rest)
            back = threading.Thread(target=_pipe, args=(upstream, conn), daemon=True)
            back.start()
            _pipe(conn, upstream)
            back.join(timeout=30)


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while True:
            data = source.recv(1 << 16)
            if not data:
                break
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


def upload_azure(client: Any, folder: Path, container: str, prefix: str) -> None:
    """Every file of folder to az://container/prefix/ (creating the container if needed)."""
    with contextlib.suppress(Exception):
        client.create_container(container)
    for path in sorted(folder.iterdir()):
        if path.is_file():
            with path.open("rb") as data:
                client.get_blob_client(container, f"{prefix}/{path.name}").upload_blob(data, overwrite=True)
