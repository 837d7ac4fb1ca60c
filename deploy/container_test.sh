#!/usr/bin/env bash
# Builds the server image with podman from a locally made Debian base (no registry needed), serves a
# demo checkpoint from it and loads it through the client on the host, over the data port;
# `make container-test`.
#
# Needs podman and debootstrap (apt-get install podman runc debootstrap), root, and the project's
# venv (PYTHON). The flags are those that work inside a VM without a full container host: vfs
# storage, runc with cgroupfs, host networking, and ulimits set explicitly (below the caller's,
# since raising them is refused there). Environment:
#   PYTHON          python of the project's venv (default .venv/bin/python)
#   BASE_IMAGE      base to build on (default: made once with debootstrap as localhost/weightstream-base)
#   TORCH_INDEX_URL index the image's torch comes from (default PyPI; a CPU wheel in WHEELS wins)
#   WHEELS          folder of wheels pip prefers in the build (default /opt/wheels if present)
#   PIP_CA_BUNDLE   CA bundle pip trusts in the build (default the host's, which knows a TLS-inspecting proxy)
set -euo pipefail

PYTHON=${PYTHON:-.venv/bin/python}
BASE_IMAGE=${BASE_IMAGE:-localhost/weightstream-base:bookworm}
IMAGE=${IMAGE:-localhost/weightstream:test}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://pypi.org/simple}
WHEELS=${WHEELS:-/opt/wheels}
PIP_CA_BUNDLE=${PIP_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
PODMAN=(podman --storage-driver vfs --cgroup-manager cgroupfs --runtime runc)
LIMITS=(--ulimit nofile=4096:4096 --ulimit nproc=4096:4096)

work=$(mktemp -d)
container=""
cleanup() {
    # -v: the image's anonymous volumes (/cache) go with the container.
    if [ -n "$container" ]; then "${PODMAN[@]}" rm -f -v "$container" >/dev/null 2>&1 || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

if ! "${PODMAN[@]}" image exists "$BASE_IMAGE"; then
    echo "== base image $BASE_IMAGE from debootstrap (bookworm, python3)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$work/rootfs" \
        http://deb.debian.org/debian >"$work/debootstrap.log"
    tar -C "$work/rootfs" -c . | "${PODMAN[@]}" import - "$BASE_IMAGE" >/dev/null
    rm -rf "$work/rootfs"
fi

echo "== build $IMAGE"
# The build's pip gets the host's CA bundle and wheel folder through a pip.conf mounted for the build
# only: nothing of this machine ends up in the image. --format docker keeps the HEALTHCHECK.
printf '[global]\ncert = /etc/pip-build/ca.crt\n' >"$work/pip.conf"
build=(--format docker --network host "${LIMITS[@]}" --build-arg "PYTHON_IMAGE=$BASE_IMAGE"
       --build-arg "TORCH_SPEC=$TORCH_SPEC" --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL"
       --volume "$PIP_CA_BUNDLE:/etc/pip-build/ca.crt:ro")
if [ -d "$WHEELS" ]; then
    printf 'find-links = /wheels\n' >>"$work/pip.conf"
    build+=(--volume "$WHEELS:/wheels:ro")
fi
build+=(--volume "$work/pip.conf:/etc/pip.conf:ro")
"${PODMAN[@]}" build "${build[@]}" -t "$IMAGE" -f Dockerfile .

echo "== serve a demo checkpoint from the image"
"$PYTHON" -c "import sys; from pathlib import Path; from weightstream.samples import llama_like_state_dict, save_sharded; \
save_sharded(llama_like_state_dict(layers=2), Path(sys.argv[1]) / 'demo-llama', shards=2)" "$work/models"
chmod -R a+rX "$work/models"
ports=$("$PYTHON" -c "import socket; s=[socket.socket() for _ in range(3)]; [x.bind(('127.0.0.1', 0)) for x in s]; \
print(' '.join(str(x.getsockname()[1]) for x in s))")
read -r grpc_port data_port http_port <<<"$ports"
# As Kubernetes runs it: read-only root, no capabilities, the image's non-root user. Without systemd,
# podman logs that it cannot schedule the HEALTHCHECK's timer; the check is run by hand below. With
# host networking the image's 0.0.0.0 would be every interface of this machine, for a plaintext,
# token-less server: it listens on loopback only, the data port included (which the server then
# announces as 127.0.0.1).
container=$("${PODMAN[@]}" run -d --network host "${LIMITS[@]}" --read-only --cap-drop ALL \
    --security-opt no-new-privileges -v "$work/models:/models:ro" -e WEIGHTSTREAM_HOST=127.0.0.1 \
    -e "WEIGHTSTREAM_GRPC_PORT=$grpc_port" -e "WEIGHTSTREAM_DATA_PORT=$data_port" \
    -e "WEIGHTSTREAM_HTTP_PORT=$http_port" -e WEIGHTSTREAM_DRAIN_SECONDS=5 "$IMAGE")
ready=""
for _ in $(seq 60); do
    if "$PYTHON" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)" \
        "http://127.0.0.1:$http_port/readyz" 2>/dev/null; then ready=1; break; fi
    sleep 1
done
if [ -z "$ready" ]; then
    echo "server in the container did not become ready in 60 s; its log:" >&2
    "${PODMAN[@]}" logs "$container" >&2
    exit 1
fi
user=$("${PODMAN[@]}" exec "$container" id -u)
[ "$user" = 10001 ] || { echo "the server runs as uid $user, not 10001" >&2; exit 1; }
# The image's own HEALTHCHECK command, run in the container.
"${PODMAN[@]}" healthcheck run "$container" >/dev/null 2>&1 \
    || "${PODMAN[@]}" exec "$container" python3 -c "import os, urllib.request; \
urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ['WEIGHTSTREAM_HTTP_PORT'], timeout=2)"
# --transport tcp: the tensors must come over the data port; a fallback to gRPC would hide a broken one.
"$PYTHON" -m weightstream load demo-llama --target "127.0.0.1:$grpc_port" --transport tcp --no-progress
"${PODMAN[@]}" stop -t 20 "$container" >/dev/null
code=$("${PODMAN[@]}" inspect "$container" --format '{{.State.ExitCode}}')
[ "$code" = 0 ] || { echo "the server exited with $code after SIGTERM, not 0" >&2; "${PODMAN[@]}" logs "$container" >&2; exit 1; }
echo "container test passed: image $IMAGE built, served from a read-only root as uid 10001 over gRPC and the" \
    "data port, drained on SIGTERM"
