#!/bin/bash
# The GPU benchmarks in one run, for a CUDA machine whose Python has torch, grpcio, numpy and safetensors
# but not the rest of weightstream's needs and no package index.
#
#   Where pip reaches the index:   bash benchmarks/gpu_checks.sh download [PYTHON_VERSION]   (into .whl/)
#   On the GPU machine (repo root): bash benchmarks/gpu_checks.sh run [OUT_DIR]
#
# "run" installs .whl/*.whl into /tmp/site (no index, no dependencies resolved), then runs cuda_load,
# cuda_plan_load, sparse_updates and unchanged_check on cuda:0, each under its own time limit, with
# each one's output also written to OUT_DIR.
set -u
WHEELS=(
    awscrt==0.38.1 blake3==1.0.11 zstandard==0.25.0 protobuf==7.36.2 grpcio==1.85.4
    grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 runai-model-streamer==0.17.1
    runai-model-streamer-s3==0.17.1 boto3==1.44.18 botocore==1.44.18 s3transfer==0.19.3 jmespath==1.1.0
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic_core==2.50.5
    pydantic-settings==2.16.3 python-dotenv==1.2.4 annotated-types==0.8.0 annotated-doc==0.0.7
    typing-inspection==0.4.5 typing_extensions==4.16.0
)

case "${1:-}" in
download)
    python="${2:-3.12}"
    mkdir -p .whl
    for wheel in "${WHEELS[@]}"; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python" --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d .whl "$wheel" || exit 1
    done
    du -sh .whl
    ;;
run)
    out="${2:-${OUT:-/tmp/gpu-checks}}"
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD:$PWD/client:$PWD/service" PYTHONUNBUFFERED=1
    python3 -V
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, weightstream.client, weightstream_server; print('torch', torch.__version__, torch.cuda.is_available())" || exit 1
    bench() {
        local name=$1 limit=$2 start
        shift 2
        echo "=== $name: $*"
        start=$(date +%s)
        timeout "$limit" python3 "benchmarks/$name.py" "$@" 2>&1 | tee "$out/$name.txt"
        echo "=== $name: exit ${PIPESTATUS[0]}, $(($(date +%s) - start)) s"
    }
    bench cuda_load 90 --gb 1 --runs 3
    bench cuda_plan_load 90 --runs 3 --device cuda:0
    bench sparse_updates 170 --device cuda:0 --gb 1 --runs 2 --transports tcp
    bench unchanged_check 80 --device cuda:0 --gb 1 --runs 3
    ;;
*)
    echo "usage: bash benchmarks/gpu_checks.sh download [PYTHON_VERSION] | run [OUT_DIR]" >&2
    exit 2
    ;;
esac
