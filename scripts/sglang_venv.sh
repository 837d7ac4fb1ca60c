#!/usr/bin/env bash
# Build the virtual environment the SGLang tests and benchmark run in (.venv-sglang at the repo root).
#
# SGLang gets its own environment because it pins torch, transformers and a CUDA stack of its own
# (they install and are not used on a CPU machine). Then this project, editable and with no extras:
# the plugin needs only the client.
#
# The one CPU-only workaround lives here and nowhere in the package: `import sglang` fails without
# libcuda because sgl_kernel cannot load its CUDA `common_ops`; its loader then falls back to a plain
# `import common_ops`, so an empty module of that name, put on the environment's path by a .pth file,
# lets it import (Llama on a CPU without AMX never calls those ops). On a machine with CUDA the real
# module loads first and the empty one is never looked at.
#
# Stamps make a second run return at once; the project is reinstalled when pyproject.toml changes
# (its entry points), SGLang when SGLANG_SPEC does. pip's output goes to $VENV/build.log and is
# shown only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${SGLANG_VENV:-.venv-sglang}
SGLANG_SPEC=${SGLANG_SPEC:-sglang==0.5.23}
SGLANG_STAMP="$VENV/.sglang-installed"
PROJECT_STAMP="$VENV/.weightstream-installed"
LOG="$VENV/build.log"

SCRIPT=sglang_venv.sh
# shellcheck source=scripts/venv_steps.sh
source scripts/venv_steps.sh

start=$(date +%s)
built=""
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip)
if [[ "$(cat "$SGLANG_STAMP" 2>/dev/null)" != "$SGLANG_SPEC" ]]; then
    : >"$LOG"
    step "${pip[@]}" install --upgrade pip
    step "${pip[@]}" install "$SGLANG_SPEC"
    site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    mkdir -p "$VENV/cpu-shims"
    echo "# Empty: lets sgl_kernel import on a machine without libcuda (see scripts/sglang_venv.sh)." \
        >"$VENV/cpu-shims/common_ops.py"
    realpath "$VENV/cpu-shims" >"$site/weightstream-cpu-shims.pth"
    echo "$SGLANG_SPEC" >"$SGLANG_STAMP"
    rm -f "$PROJECT_STAMP"
    built="$SGLANG_SPEC, "
fi
if [[ ! -f "$PROJECT_STAMP" || pyproject.toml -nt "$PROJECT_STAMP" ]]; then
    step editable_install "${pip[@]}"
    step env CUDA_VISIBLE_DEVICES= SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c "import sglang, weightstream.client.sglang_loader"
    touch "$PROJECT_STAMP"
    echo "sglang_venv.sh: $VENV ready (${built}weightstream editable) in $(( $(date +%s) - start )) s"
fi
