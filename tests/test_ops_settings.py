"""The operations options: flags and WEIGHTSTREAM_* variables reach ServerSettings, and the CLI client takes TLS."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ops_helpers import make_pki, running, write_model
from weightstream.cli import build_parser, main
from weightstream_server import ServerSettings


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
    args = build_parser().parse_args(
        ["serve", "--model-root", str(tmp_path), "--drain-seconds", "7", "--token-file", str(tmp_path / "t")]
    )
    given = {"model_root": args.model_root, "drain_seconds": args.drain_seconds, "token_file": args.token_file}
    settings = ServerSettings.load(given, {"WEIGHTSTREAM_DRAIN_SECONDS": "1"})
    assert settings.drain_seconds == 7.0
    assert settings.token_file == tmp_path / "t"


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
