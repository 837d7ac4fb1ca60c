"""Tiers: a weightstream server reading from another (--upstream), with a node-local disk cache (--disk-cache).

The three-tier and restart tests run every tier as a real process on 127.0.0.1 (s3rver, a shared
server, sidecars); the cache-content tests run the two upper tiers in this process, on real files.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from safetensors.torch import save_file

from tests.support.certificates import make_pki
from tests.support.checkpoints import assert_bytes_identical, load_folder, skeleton
from tests.support.faults import CuttingProxy
from tests.support.metrics import samples
from tests.support.ports import LOOPBACK, free_ports, wait_port
from tests.support.s3_stores import REGION, S3_BUCKET, S3Process, upload_folder
from tests.support.serve_processes import ServerProcess, serve_process, start_serve, wait_http_ready
from tests.support.servers import loopback_settings, serving
from weightstream.client import (
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
    WeightStreamClient,
    WeightStreamError,
)
from weightstream_server import WeightStreamServer, create_server
from weightstream_server.storage.disk_cache import FILES, RECORD_SUFFIX, cache_key
from weightstream_server.storage.upstream import UPSTREAM_SCHEME

LOAD_TIMEOUT_S = 120.0


def write_shards(folder: Path, files: int, tensors: int, numel: int, seed: int) -> dict[str, torch.Tensor]:
    """A float32 model of several *.safetensors files (no index) under folder."""
    generator = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    for f in range(files):
        part = {f"f{f}.t{i}": torch.randn(numel, generator=generator) for i in range(tensors)}
        save_file(part, str(folder / f"model-{f:05d}.safetensors"))
        state.update(part)
    return state


def model_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def cache_files(directory: Path) -> dict[str, int]:
    """Sizes of the cached files (records aside) under a disk cache directory."""
    return {
        p.name: p.stat().st_size
        for p in (directory / FILES).iterdir()
        if not p.name.endswith(RECORD_SUFFIX) and p.is_file()
    }


def load(target: str, model: str, reference: dict[str, torch.Tensor], **client: Any) -> Any:
    """load_into a skeleton of reference's shapes from target; bit-exact or the test fails; the LoadReport."""
    module = skeleton({name: (t.shape, t.dtype) for name, t in reference.items()})
    with WeightStreamClient(target, progress=False, **client) as c:
        report = c.load_into(module, model)
    assert_bytes_identical(reference, dict(module.state_dict()))
    return report


def status(http: httpx.Client, port: int) -> dict[str, Any]:
    response = http.get(f"http://{LOOPBACK}:{port}/status", timeout=10.0)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


# -- in this process: what the disk cache keeps, drops and evicts --


@pytest.fixture(scope="module")
def upper_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tier-root")
    write_shards(root / "three", files=3, tensors=4, numel=250_000, seed=1)
    write_shards(root / "other", files=2, tensors=4, numel=250_000, seed=2)
    return root


@pytest.fixture(scope="module")
def upstream(upper_root: Path) -> Iterator[WeightStreamServer]:
    with serving(loopback_settings(model_root=upper_root)) as server:
        yield server


def _tier(upstream: WeightStreamServer, cache: Path, **settings: object) -> Any:
    return serving(loopback_settings(upstream=f"{LOOPBACK}:{upstream.port}", disk_cache=cache, **settings))


def test_a_restarted_tier_serves_from_its_disk_cache_with_the_upstream_revision(
    upstream: WeightStreamServer, upper_root: Path, tmp_path: Path
) -> None:
    reference = load_folder(upper_root / "three")
    size = model_bytes(upper_root / "three")
    with WeightStreamClient(f"{LOOPBACK}:{upstream.port}", progress=False) as c:
        upstream_revision = c.manifest("three").revision
    with _tier(upstream, tmp_path) as tier:
        target = f"{LOOPBACK}:{tier.port}"
        with WeightStreamClient(target, progress=False) as c:
            assert c.manifest("three").revision == upstream_revision
        load(target, "three", reference)
        assert tier.tiers.source_bytes_read == size
        assert sorted(cache_files(tmp_path).values()) == sorted(
            p.stat().st_size for p in (upper_root / "three").glob("*.safetensors")
        )
        load(target, "three", reference)
        assert tier.tiers.source_bytes_read == size, "a second load read from the upstream again"
    with _tier(upstream, tmp_path) as tier:
        load(f"{LOOPBACK}:{tier.port}", "three", reference)
        assert tier.tiers.source_bytes_read == 0
        snapshot = tier.tiers.cache.snapshot() if tier.tiers.cache is not None else None
        assert snapshot is not None and snapshot.files == 3 and snapshot.hits >= 3 and snapshot.dropped == 0


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "foreign", "symlink", "corrupt-while-running"])
def test_a_damaged_or_foreign_cache_file_is_dropped_and_read_again(
    upstream: WeightStreamServer, upper_root: Path, tmp_path: Path, damage: str
) -> None:
    reference = load_folder(upper_root / "three")
    with _tier(upstream, tmp_path) as tier:
        load(f"{LOOPBACK}:{tier.port}", "three", reference)
        cached = sorted(cache_files(tmp_path))
        victim = tmp_path / FILES / cached[1]
        if damage == "corrupt-while-running":
            with victim.open("r+b") as f:
                f.seek(victim.stat().st_size // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
            load(f"{LOOPBACK}:{tier.port}", "three", reference)
            assert tier.tiers.cache is not None and tier.tiers.cache.snapshot().dropped == 1
            assert tier.tiers.source_bytes_read == model_bytes(upper_root / "three") + victim.stat().st_size
            return
    if damage == "corrupt":
        before = victim.stat()
        with victim.open("r+b") as f:
            f.seek(victim.stat().st_size - 5)
            f.write(b"XXXXX")
        # The modification time set back as it was: the change time still tells.
        os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    elif damage == "symlink":
        # A link to a file outside the cache, of the same size: never followed, never served.
        outside = tmp_path.parent / f"{tmp_path.name}-outside"
        outside.write_bytes(b"\xab" * victim.stat().st_size)
        victim.unlink()
        victim.symlink_to(outside)
    elif damage == "truncate":
        os.truncate(victim, victim.stat().st_size - 1)
    else:
        # Another file put in under a cached file's name, its record copied too: a foreign copy.
        stranger = tmp_path / FILES / cached[0]
        victim.write_bytes(stranger.read_bytes()[: victim.stat().st_size].ljust(victim.stat().st_size, b"\0"))
        (tmp_path / FILES / "0123456789abcdef").write_bytes(b"not a cache file")
    with _tier(upstream, tmp_path) as tier:
        load(f"{LOOPBACK}:{tier.port}", "three", reference)
        assert tier.tiers.cache is not None
        snapshot = tier.tiers.cache.snapshot()
        assert snapshot.dropped == (2 if damage == "foreign" else 1), snapshot
        # Exactly the dropped file came from the upstream again; the others from the cache.
        assert tier.tiers.source_bytes_read == (tmp_path / FILES / cached[1]).stat().st_size
        assert not (tmp_path / FILES / "0123456789abcdef").exists()


def test_a_folder_in_the_disk_cache_does_not_stop_the_server(
    upstream: WeightStreamServer, upper_root: Path, tmp_path: Path
) -> None:
    with _tier(upstream, tmp_path):
        pass
    (tmp_path / FILES / "a-folder").mkdir()
    (tmp_path / FILES / "a-folder" / "inside").write_bytes(b"x")
    with _tier(upstream, tmp_path) as tier:
        load(f"{LOOPBACK}:{tier.port}", "three", load_folder(upper_root / "three"))
        assert tier.tiers.cache is not None and tier.tiers.cache.snapshot().files == 3


def test_a_tier_without_a_disk_cache_reads_the_upstream_once_through_its_ram_cache(
    upstream: WeightStreamServer, upper_root: Path
) -> None:
    reference = load_folder(upper_root / "three")
    settings = loopback_settings(upstream=f"{LOOPBACK}:{upstream.port}", cache_bytes=64 * 1024 * 1024)
    with serving(settings) as tier, concurrent.futures.ThreadPoolExecutor(3) as pool:
        loads = [pool.submit(load, f"{LOOPBACK}:{tier.port}", "three", reference) for _ in range(3)]
        for done in loads:
            done.result(timeout=LOAD_TIMEOUT_S)
        assert tier.tiers.cache is None
        # Tensor bytes only (headers are read once per manifest), each once though three loads ran at once.
        tensors = sum(t.numel() * t.element_size() for t in reference.values())
        assert tensors <= tier.tiers.source_bytes_read < tensors + 3 * 64 * 1024


def test_a_file_read_of_a_length_stops_there_and_one_past_the_end_is_refused(
    upstream: WeightStreamServer, upper_root: Path
) -> None:
    path = sorted((upper_root / "three").glob("*.safetensors"))[0]
    raw = path.read_bytes()
    with WeightStreamClient(f"{LOOPBACK}:{upstream.port}", progress=False) as c:
        pieces = list(c.read_file("three", path.name, offset=100, length=5000))
        assert b"".join(data for data, _ in pieces) == raw[100:5100]
        assert all(whole is None for _, whole in pieces)
        with pytest.raises(InvalidArgumentError, match="past the end"):
            list(c.read_file("three", path.name, offset=len(raw) - 10, length=11))


def test_the_disk_cache_stays_within_its_bound_while_larger_models_load(
    upstream: WeightStreamServer, upper_root: Path, tmp_path: Path
) -> None:
    sizes = [p.stat().st_size for p in (upper_root / "three").glob("*.safetensors")]
    bound = int(sizes[0] * 1.5)
    with _tier(upstream, tmp_path, disk_cache_bytes=bound) as tier:
        target = f"{LOOPBACK}:{tier.port}"
        for model in ("three", "other", "three"):
            load(target, model, load_folder(upper_root / model))
            assert sum(cache_files(tmp_path).values()) <= bound
            assert len(cache_files(tmp_path)) == 1
        assert tier.tiers.cache is not None
        snapshot = tier.tiers.cache.snapshot()
        assert snapshot.resident_bytes <= bound and snapshot.bypassed > 0 and snapshot.evictions > 0, snapshot


@pytest.mark.slow
def test_upstream_errors_keep_their_codes_and_name_the_tier(
    upstream: WeightStreamServer, upper_root: Path, tmp_path: Path
) -> None:
    with _tier(upstream, tmp_path) as tier, WeightStreamClient(f"{LOOPBACK}:{tier.port}", progress=False) as c:
        with pytest.raises(NotFoundError, match=f"upstream {LOOPBACK}:{upstream.port}"):
            c.manifest("no-such-model")
    (dead,) = free_ports(1)
    with (
        serving(loopback_settings(upstream=f"{LOOPBACK}:{dead}", disk_cache=tmp_path)) as tier,
        WeightStreamClient(f"{LOOPBACK}:{tier.port}", progress=False, retry=None) as c,
    ):
        with pytest.raises(UnavailableError, match=f"upstream {LOOPBACK}:{dead}"):
            c.manifest("three")


def test_an_upstream_file_name_is_never_a_cache_path(upstream: WeightStreamServer, tmp_path: Path) -> None:
    """Model ids and file names from the upstream only ever name cache files by digest."""
    from weightstream_server.storage.sources import SourceFile

    hostile = SourceFile("../../etc/passwd", f"{UPSTREAM_SCHEME}../../x/../../etc/passwd", 10, "1")
    key = cache_key(hostile)
    assert key.isalnum() and len(key) == 40
    with _tier(upstream, tmp_path) as tier, WeightStreamClient(f"{LOOPBACK}:{tier.port}", progress=False) as c:
        # The upstream refuses the id; nothing is written outside the cache directory.
        with pytest.raises(Exception, match=r"invalid model id|INVALID_ARGUMENT"):
            c.manifest("../escape")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["files", "lock", "models", "partial"]


def test_one_disk_cache_directory_serves_one_server(upstream: WeightStreamServer, tmp_path: Path) -> None:
    """A second server's start-up would remove the first's files being written: it is refused."""
    with _tier(upstream, tmp_path), pytest.raises(ValueError, match="in use by another weightstream server"):
        create_server(loopback_settings(upstream=f"{LOOPBACK}:{upstream.port}", disk_cache=tmp_path))


# -- every tier a process: s3rver -> shared -> sidecars -> clients --


@pytest.fixture(scope="module")
def tier_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tier-model") / "shards"
    write_shards(folder, files=3, tensors=6, numel=500_000, seed=5)
    return folder


def _shared_args(store: S3Process, grpc_port: int, http_port: int) -> list[str]:
    return [
        *("--s3-bucket", S3_BUCKET, "--s3-endpoint", store.endpoint, "--s3-region", REGION, "--s3-path-style"),
        *("--watch-interval", "0.5"),
        *("--cache-bytes", "512MiB", "--host", LOOPBACK, "--grpc-port", str(grpc_port)),
        *("--http-port", str(http_port), "--log-level", "INFO"),
    ]


def _sidecar_args(upstream: str, cache: Path, grpc_port: int, http_port: int, shm: Path | None) -> list[str]:
    args = [
        *("--upstream", upstream, "--disk-cache", str(cache), "--host", LOOPBACK),
        *("--grpc-port", str(grpc_port), "--http-port", str(http_port), "--log-level", "INFO"),
    ]
    return [*args, "--shm-dir", str(shm)] if shm is not None else args


@pytest.mark.slow
def test_three_tiers_from_cold_read_s3_once_and_each_sidecar_once(
    s3_store: S3Process, tier_model: Path, tmp_path: Path, http: httpx.Client
) -> None:
    prefix = "tiers/three"
    upload_folder(s3_store.client(), tier_model, S3_BUCKET, prefix)
    model = f"s3://{S3_BUCKET}/{prefix}"
    reference = load_folder(tier_model)
    size = model_bytes(tier_model)
    shared_grpc, shared_http, *ports = free_ports(6)
    with (
        serve_process(
            _shared_args(s3_store, shared_grpc, shared_http), tmp_path, log=tmp_path / "shared.log"
        ) as shared,
        tempfile.TemporaryDirectory(prefix="weightstream-tier-shm-", dir=_shm_base()) as shm,
    ):
        wait_http_ready(shared, http, f"http://{LOOPBACK}:{shared_http}/readyz")
        sidecars: list[tuple[ServerProcess, int, int, Path]] = []
        with contextlib.ExitStack() as stack:
            for i in range(2):
                grpc_port, http_port = ports[2 * i], ports[2 * i + 1]
                shm_dir = Path(shm) / f"sidecar-{i}"
                shm_dir.mkdir()
                args = _sidecar_args(
                    f"{LOOPBACK}:{shared_grpc}", tmp_path / f"cache-{i}", grpc_port, http_port, shm_dir
                )
                sidecar = stack.enter_context(serve_process(args, tmp_path, log=tmp_path / f"sidecar-{i}.log"))
                sidecars.append((sidecar, grpc_port, http_port, shm_dir))
            for sidecar, _, http_port, _ in sidecars:
                wait_http_ready(sidecar, http, f"http://{LOOPBACK}:{http_port}/readyz")
            # Two clients on each sidecar, all four at once, from cold: one over gRPC, one over shared memory.
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                futures = [
                    pool.submit(load, f"{LOOPBACK}:{port}", model, reference, transport=transport, shm_dir=shm_dir)
                    for _, port, _, shm_dir in sidecars
                    for transport in ("grpc", "shm")
                ]
                reports = [f.result(timeout=LOAD_TIMEOUT_S) for f in futures]
            assert sorted(r.transport for r in reports) == ["grpc", "grpc", "shm", "shm"]
            top = status(http, shared_http)
            # S3 read exactly one copy of the model, though two sidecars filled from it at once.
            assert top["storage_bytes_read_total"] == size, top
            assert top["bytes_served_total"] == 2 * size, top
            for sidecar, _, http_port, _ in sidecars:
                mid = status(http, http_port)
                assert mid["upstream_bytes_read_total"] == size, (mid, sidecar.output()[-3000:])
                assert mid["disk_cache"]["files"] == 3 and mid["disk_cache"]["resident_bytes"] == size, mid
            metrics = samples(http.get(f"http://{LOOPBACK}:{sidecars[0][2]}/metrics", timeout=10.0).text)
            assert metrics[("weightstream_upstream_bytes_read_total", ())] == size
            assert metrics[("weightstream_disk_cache_files", ())] == 3

            # Re-uploaded with new contents of the same sizes: never served from the old copies. The
            # sidecar follows the shared tier's watch, which looks at S3 each --watch-interval.
            changed = tmp_path / "changed"
            new_reference = write_shards(changed, files=3, tensors=6, numel=500_000, seed=6)
            upload_folder(s3_store.client(), changed, S3_BUCKET, prefix)
            with (
                WeightStreamClient(f"{LOOPBACK}:{sidecars[0][1]}", progress=False) as near,
                WeightStreamClient(f"{LOOPBACK}:{shared_grpc}", progress=False) as far,
            ):
                uploaded = far.manifest(model).revision
                deadline = time.monotonic() + 30
                while near.manifest(model).revision != uploaded and time.monotonic() < deadline:
                    time.sleep(0.1)
            load(f"{LOOPBACK}:{sidecars[0][1]}", model, new_reference)
            assert status(http, sidecars[0][2])["upstream_bytes_read_total"] == 2 * size


@pytest.mark.slow
def test_a_sidecar_killed_mid_fill_restarts_on_its_disk_cache_and_the_load_resumes(
    upper_root_process: Path, tmp_path: Path, http: httpx.Client
) -> None:
    model_dir = upper_root_process / "big"
    reference = load_folder(model_dir)
    size = model_bytes(model_dir)
    top_grpc, top_http, side_grpc, side_http = free_ports(4)
    top_args = ["--model-root", str(upper_root_process), "--host", LOOPBACK, "--grpc-port", str(top_grpc)]
    with serve_process([*top_args, "--http-port", str(top_http)], tmp_path, log=tmp_path / "top.log") as top:
        wait_http_ready(top, http, f"http://{LOOPBACK}:{top_http}/readyz")
        # The sidecar's first connection upstream freezes after about 40% of the model: its fill is
        # then certainly in the middle of a file when the sidecar is killed.
        with CuttingProxy(top_grpc, [(int(size * 0.4), "freeze")]) as proxy:
            args = _sidecar_args(f"{LOOPBACK}:{proxy.port}", tmp_path / "cache", side_grpc, side_http, None)
            log = tmp_path / "sidecar.log"
            first = ServerProcess(start_serve(args, log, cwd=tmp_path), log)
            second: ServerProcess | None = None
            try:
                for port in (side_grpc, side_http):
                    wait_port(port, alive=lambda: first.proc.poll() is None)
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    loading = pool.submit(load, f"{LOOPBACK}:{side_grpc}", "big", reference, transport="grpc")
                    deadline = time.monotonic() + LOAD_TIMEOUT_S
                    while True:
                        first.assert_running()
                        read = status(http, side_http)["upstream_bytes_read_total"]
                        if read > size * 0.3:
                            break
                        assert time.monotonic() < deadline, f"the fill did not start:\n{first.output()}"
                        time.sleep(0.05)
                    time.sleep(0.3)
                    before = status(http, side_http)
                    assert before["disk_cache"]["filling"] >= 1 and before["upstream_bytes_read_total"] < size, before
                    os.kill(first.proc.pid, signal.SIGKILL)
                    first.proc.wait(timeout=10)
                    second = ServerProcess(start_serve(args, log, cwd=tmp_path), log)
                    report = loading.result(timeout=LOAD_TIMEOUT_S)
                assert report.retries >= 1, report
                after = status(http, side_http)
                assert after["upstream_bytes_read_total"] >= 1
                # The next load: nothing from upstream, only the disk cache.
                load(f"{LOOPBACK}:{side_grpc}", "big", reference, transport="grpc")
                assert status(http, side_http)["upstream_bytes_read_total"] == after["upstream_bytes_read_total"]
                assert sum(cache_files(tmp_path / "cache").values()) == size
                assert not list((tmp_path / "cache" / "partial").iterdir())
            finally:
                for proc in (first, second):
                    if proc is not None and proc.proc.poll() is None:
                        proc.proc.kill()
                        proc.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def upper_root_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tier-process-root")
    write_shards(root / "big", files=2, tensors=8, numel=2_000_000, seed=9)
    return root


def _shm_base() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@pytest.mark.slow
def test_an_upstream_behind_mutual_tls_and_tokens_with_its_companion_files(upper_root: Path, tmp_path: Path) -> None:
    """The tier's own token and certificate reach the upstream; its clients' tokens are never passed on."""
    pki = make_pki(tmp_path / "pki", "tiers")
    (upper_root / "three" / "config.json").write_text('{"model_type": "test"}')
    tokens = tmp_path / "upstream-tokens"
    tokens.write_text("tier-token\n")
    secure = loopback_settings(
        model_root=upper_root,
        tls_cert=pki.server_cert,
        tls_key=pki.server_key,
        tls_client_ca=pki.ca,
        token_file=tokens,
    )
    mine = tmp_path / "my-token"
    mine.write_text("tier-token\n")
    with serving(secure) as top:
        upstream = f"localhost:{top.port}"
        tls = {"upstream_tls": True, "upstream_ca_file": pki.ca}
        mtls = {**tls, "upstream_client_cert": pki.client_cert, "upstream_client_key": pki.client_key}
        with (
            serving(
                loopback_settings(upstream=upstream, disk_cache=tmp_path / "c", upstream_token_file=mine, **mtls)
            ) as tier,
            WeightStreamClient(f"{LOOPBACK}:{tier.port}", progress=False, token="a-client-token") as c,
        ):
            load(f"{LOOPBACK}:{tier.port}", "three", load_folder(upper_root / "three"))
            report = c.fetch("three", tmp_path / "fetched", metadata_only=True)
            assert (tmp_path / "fetched" / "config.json").read_text() == '{"model_type": "test"}', report
        # No token, or no client certificate: the upstream refuses, and the tier says which tier did.
        for settings in ({**mtls}, {**tls, "upstream_token_file": mine}):
            with (
                serving(loopback_settings(upstream=upstream, **settings)) as tier,  # type: ignore[arg-type]
                WeightStreamClient(f"{LOOPBACK}:{tier.port}", progress=False, retry=None) as c,
                pytest.raises(WeightStreamError, match=f"upstream {upstream}") as refused,
            ):
                c.manifest("three")
            assert refused.value.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE), refused.value
    (upper_root / "three" / "config.json").unlink()


@pytest.mark.slow
def test_a_cached_model_is_served_while_the_upstream_is_down(
    upper_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reference = load_folder(upper_root / "three")
    with serving(loopback_settings(model_root=upper_root)) as top:
        settings = loopback_settings(upstream=f"{LOOPBACK}:{top.port}", disk_cache=tmp_path)
        with serving(settings) as tier:
            load(f"{LOOPBACK}:{tier.port}", "three", reference)
            with WeightStreamClient(f"{LOOPBACK}:{tier.port}", progress=False) as c:
                revision = c.manifest("three").revision
    # The upstream is gone now; a restarted tier still serves what its disk cache holds whole.
    with serving(settings) as tier, WeightStreamClient(f"{LOOPBACK}:{tier.port}", progress=False, retry=None) as c:
        assert c.manifest("three").revision == revision
        load(f"{LOOPBACK}:{tier.port}", "three", reference)
        assert "serving model 'three' from the disk cache" in caplog.text
        with pytest.raises(UnavailableError, match=f"upstream {LOOPBACK}:{top.port}"):
            c.manifest("other")
