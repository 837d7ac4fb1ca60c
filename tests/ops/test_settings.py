"""The server's settings: flags and WEIGHTSTREAM_* variables reach ServerSettings with their types, units
and precedence, bad values are named by where they came from, and the CLI client takes TLS."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.support.certificates import make_pki
from tests.support.checkpoints import write_model
from tests.support.servers import running
from weightstream.cli import build_parser, main
from weightstream_server import ServerSettings

GiB = 1 << 30
MiB = 1 << 20


def serve_settings(argv: list[str], environ: Mapping[str, str]) -> ServerSettings:
    """What `weightstream serve ARGV` would run with in environ: the CLI's own parser, then ServerSettings.load."""
    return ServerSettings.load(vars(build_parser().parse_args(["serve", *argv])), environ)


def test_environment_sets_the_operations_options(tmp_path: Path) -> None:
    environ = {
        "WEIGHTSTREAM_MODEL_ROOT": str(tmp_path),
        "WEIGHTSTREAM_TOKEN_FILE": str(tmp_path / "tokens"),
        "WEIGHTSTREAM_TLS_CERT": str(tmp_path / "cert.pem"),
        "WEIGHTSTREAM_TLS_KEY": str(tmp_path / "key.pem"),
        "WEIGHTSTREAM_TLS_CLIENT_CA": str(tmp_path / "ca.pem"),
        "WEIGHTSTREAM_DRAIN_SECONDS": "2.5",
    }
    settings = ServerSettings.load({}, environ)
    assert settings.token_file == tmp_path / "tokens"
    assert settings.tls_cert == tmp_path / "cert.pem"
    assert settings.tls_key == tmp_path / "key.pem"
    assert settings.tls_client_ca == tmp_path / "ca.pem"
    assert settings.drain_seconds == 2.5
    assert ServerSettings.load({}, {"WEIGHTSTREAM_MODEL_ROOT": str(tmp_path)}).drain_seconds == 30.0


def test_flags_win_over_the_environment(tmp_path: Path) -> None:
    environ = {"WEIGHTSTREAM_DRAIN_SECONDS": "1", "WEIGHTSTREAM_HOST": "0.0.0.0", "WEIGHTSTREAM_S3_BUCKETS": "env"}
    argv = ["--model-root", str(tmp_path), "--drain-seconds", "7", "--token-file", str(tmp_path / "t")]
    settings = serve_settings([*argv, "--s3-bucket", "flag"], environ)
    assert settings.drain_seconds == 7.0
    assert settings.token_file == tmp_path / "t"
    assert settings.s3_buckets == ("flag",)
    # Not given as a flag: the variable wins over the default.
    assert settings.host == "0.0.0.0"


def test_an_empty_variable_counts_as_not_set(tmp_path: Path) -> None:
    settings = serve_settings([], {"WEIGHTSTREAM_MODEL_ROOT": str(tmp_path), "WEIGHTSTREAM_GRPC_PORT": ""})
    assert settings.grpc_port == 50051


def test_keyword_construction_reads_no_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTSTREAM_TOKEN_FILE", str(tmp_path / "tokens"))
    monkeypatch.setenv("WEIGHTSTREAM_GRPC_PORT", "1234")
    settings = ServerSettings(model_root=tmp_path)
    assert settings.token_file is None
    assert settings.grpc_port == 50051
    monkeypatch.setenv("WEIGHTSTREAM_MODEL_ROOT", str(tmp_path))
    assert ServerSettings.load({}).token_file == tmp_path / "tokens"


@pytest.mark.parametrize("how", ["flag", "env"])
def test_byte_sizes_take_units(tmp_path: Path, how: str) -> None:
    sizes = {
        "cache-bytes": "16GiB",
        "read-ahead-bytes": "256MiB",
        "chunk-bytes": "1MiB",
        "streamer-chunk-bytes": "16MB",
    }
    if how == "flag":
        argv = [part for option, size in sizes.items() for part in (f"--{option}", size)]
        environ = {"WEIGHTSTREAM_MODEL_ROOT": str(tmp_path)}
    else:
        argv = []
        environ = {"WEIGHTSTREAM_" + option.upper().replace("-", "_"): size for option, size in sizes.items()}
        environ["WEIGHTSTREAM_MODEL_ROOT"] = str(tmp_path)
    settings = serve_settings(argv, environ)
    assert settings.cache_bytes == 16 * GiB
    assert settings.read_ahead_bytes == 256 * MiB
    assert settings.chunk_bytes == MiB
    assert settings.streamer_chunk_bytes == 16_000_000
    # Plain ints for the code that reads them, and for /status, which serializes them.
    assert type(settings.cache_bytes) is int and type(settings.streamer_chunk_bytes) is int
    assert settings.cache_bytes // GiB + 1 == 17
    assert json.loads(settings.model_dump_json())["cache_bytes"] == 16 * GiB
    assert type(settings.model_dump()["read_ahead_bytes"]) is int


def test_byte_sizes_take_plain_integers(tmp_path: Path) -> None:
    environ = {"WEIGHTSTREAM_MODEL_ROOT": str(tmp_path), "WEIGHTSTREAM_READ_AHEAD_BYTES": "268435456"}
    settings = serve_settings(["--cache-bytes", "1073741824"], environ)
    assert settings.cache_bytes == GiB
    assert settings.read_ahead_bytes == 256 * MiB
    assert ServerSettings(model_root=tmp_path, cache_bytes=5 * MiB).cache_bytes == 5 * MiB


def test_a_bad_byte_size_names_its_flag_or_variable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expected = "'16 gigs' is not a byte size (for example 16GiB, 512MiB or 1073741824)"
    root = {"WEIGHTSTREAM_MODEL_ROOT": str(tmp_path)}
    with pytest.raises(ValueError) as from_flag:
        serve_settings(["--cache-bytes", "16 gigs"], root)
    assert str(from_flag.value) == f"--cache-bytes: {expected}"
    with pytest.raises(ValueError) as from_env:
        serve_settings([], {**root, "WEIGHTSTREAM_CACHE_BYTES": "16 gigs"})
    assert str(from_env.value) == f"WEIGHTSTREAM_CACHE_BYTES: {expected}"
    # What `weightstream serve` prints, with its exit code for bad settings; nothing is started.
    assert main(["serve", "--model-root", str(tmp_path), "--cache-bytes", "16 gigs"]) == 2
    assert capsys.readouterr().err.strip() == f"weightstream serve: --cache-bytes: {expected}"


def test_every_bad_value_is_named_at_once(tmp_path: Path) -> None:
    environ = {"WEIGHTSTREAM_MODEL_ROOT": str(tmp_path), "WEIGHTSTREAM_GRPC_PORT": "fifty"}
    with pytest.raises(ValueError) as caught:
        serve_settings(["--max-streams", "many", "--drain-seconds", "soon"], environ)
    assert str(caught.value) == (
        "WEIGHTSTREAM_GRPC_PORT: 'fifty' is not an integer; --max-streams: 'many' is not an integer; "
        "--drain-seconds: 'soon' is not a number"
    )


def test_rules_across_settings_are_checked_in_code_and_from_the_command_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"invalid server settings: grpc_port 70000 is not a port number; nothing"):
        ServerSettings(grpc_port=70000)
    with pytest.raises(ValueError) as caught:
        serve_settings(["--model-root", str(tmp_path), "--preload", "m", "--tls-key", "k.pem"], {})
    assert str(caught.value) == (
        "invalid server settings: TLS needs both --tls-cert and --tls-key; "
        "--preload needs a cache: pass --cache-bytes SIZE (WEIGHTSTREAM_CACHE_BYTES)"
    )


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("Off", False),
    ],
)
def test_switches_in_the_environment(tmp_path: Path, raw: str, value: bool) -> None:
    settings = serve_settings([], {"WEIGHTSTREAM_MODEL_ROOT": str(tmp_path), "WEIGHTSTREAM_S3_PATH_STYLE": raw})
    assert settings.s3_path_style is value


def test_a_switch_flag_and_a_bad_switch_variable(tmp_path: Path) -> None:
    root = {"WEIGHTSTREAM_MODEL_ROOT": str(tmp_path)}
    assert serve_settings(["--s3-path-style"], root).s3_path_style is True
    assert serve_settings([], root).s3_path_style is False
    with pytest.raises(ValueError, match=r"^WEIGHTSTREAM_S3_PATH_STYLE: 'maybe' is not a boolean \(1/0, true/false"):
        serve_settings([], {**root, "WEIGHTSTREAM_S3_PATH_STYLE": "maybe"})


def test_lists_are_comma_separated_in_the_environment_and_repeated_as_flags(tmp_path: Path) -> None:
    environ = {"WEIGHTSTREAM_S3_BUCKETS": "models, weights,,models", "WEIGHTSTREAM_PRELOAD": "a,b"}
    settings = serve_settings(["--cache-bytes", "1GiB"], environ)
    assert settings.s3_buckets == ("models", "weights")
    assert settings.preload == ("a", "b")
    settings = serve_settings(["--s3-bucket", "one", "--s3-bucket", "two", "--s3-bucket", "one"], {})
    assert settings.s3_buckets == ("one", "two")


@pytest.mark.parametrize("raw", ["-1", "soon"])
def test_bad_drain_seconds_are_refused(tmp_path: Path, raw: str) -> None:
    with pytest.raises(ValueError, match=r"DRAIN_SECONDS|drain_seconds"):
        ServerSettings.load({}, {"WEIGHTSTREAM_MODEL_ROOT": str(tmp_path), "WEIGHTSTREAM_DRAIN_SECONDS": raw})


def test_cli_client_commands_take_tls_and_the_token_variable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pki = make_pki(tmp_path / "pki")
    write_model(tmp_path / "root", "m", tensors=2, numel=100)
    token_file = tmp_path / "tokens"
    token_file.write_text("cli-token\n")
    with running(
        tmp_path / "root", tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca, token_file=token_file
    ) as r:
        tls = ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]
        monkeypatch.setenv("WEIGHTSTREAM_TOKEN", "cli-token")
        assert main(["manifest", "m", "--target", r.target, "--json", *tls]) == 0
        assert len(json.loads(capsys.readouterr().out)["tensors"]) == 2
        assert main(["load", "m", "--target", r.target, "--no-progress", *tls]) == 0
        assert "2 tensors, 800 bytes" in capsys.readouterr().out
        monkeypatch.setenv("WEIGHTSTREAM_TOKEN", "wrong")
        assert main(["manifest", "m", "--target", r.target, *tls]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
