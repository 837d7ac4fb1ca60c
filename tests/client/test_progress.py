"""The byte progress bar: drawn on rank 0, silent on other ranks and when turned off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightstream.client import WeightStreamClient
from weightstream.client.progress import is_rank_zero

MODEL = "progress-model"


@pytest.fixture(scope="module")
def model(model_root: Path) -> str:
    (model_root / MODEL).mkdir()
    save_file({"w": torch.ones(1024, 1024)}, str(model_root / MODEL / "model.safetensors"))
    return MODEL


@pytest.mark.parametrize(
    ("env", "progress", "drawn"),
    [({}, True, True), ({"RANK": "1"}, True, False), ({"LOCAL_RANK": "3"}, True, False), ({}, False, False)],
)
def test_bar_shows_on_rank_zero_only(
    model: str,
    target: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    progress: bool,
    drawn: bool,
) -> None:
    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with WeightStreamClient(target, progress=progress) as client:
        dict(client.iter_tensors(model))
    err = capsys.readouterr().err
    assert (f"{model}:" in err) == drawn, err
    if drawn:
        assert "100%" in err


def test_rank_zero_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert is_rank_zero()
    monkeypatch.setenv("RANK", "2")
    assert not is_rank_zero()
