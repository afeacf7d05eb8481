# kvplan: `make demo` and `make test` set everything up on a fresh machine, then run.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# no byte-compiling at install: it took half of the set-up (torch, SGLang, vLLM, mostly modules no test
# imports); Python compiles what a process imports and keeps it, for the next process, in __pycache__
# (even where the environment says not to: the tests start hundreds of processes)
PIP_INSTALL := $(PIP) install -q --no-compile
unexport PYTHONDONTWRITEBYTECODE
STAMP := $(VENV)/.kvplan-installed

export UCX_NET_DEVICES := lo
export NIXL_LOG_LEVEL := WARN
export MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER := 65535
export MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER := 65535
export PYTHONUNBUFFERED := 1

# test processes (pytest-xdist): one per core and two more, at most 8. Many tests spend their time
# waiting on processes of their own (engines, the demo's sides). Measured on two cores, the first pass
# alone: two workers 5:17-6:26, three 4:40-5:08, four 3:39-4:03 (session 34, a smaller suite). With the vLLM
# pass beside it (session 42): four 7:45-7:48 (make test 7:54-8:02), three 7:19 (make test 7:35). With both
# engines' passes beside it (2026-12-07; the two cores about 55% busy over the run): three, make test 7:54-9:32;
# four, 8:32 (the first pass 7:42)
WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n + 2 > 8 ? 8 : n + 2 )))
# the vLLM pass: one per core. Each of its workers imports vLLM twice (itself and its fork server), which
# outweighs what a third or fourth worker overlaps: on two cores 59 s with two, 64 with three, 69-72 with four
VLLM_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 2 ? 2 : n > 8 ? 8 : n )))

.PHONY: setup setup-sglang setup-vllm lint test test-sglang test-vllm demo bench dist clean

setup: $(STAMP)

# A Python that already has a CUDA build of torch keeps it (the venv sees system packages);
# elsewhere the CPU build and the triton it pairs with are installed. Mooncake's wheel links
# libibverbs (RDMA's user-space library) even for TCP: as root, set-up installs the system package.
$(STAMP): pyproject.toml Makefile
	@if ! ldconfig -p | grep -q 'libibverbs.so.1 '; then \
	  if [ "$$(id -u)" = 0 ]; then echo "installing libibverbs1 (apt-get): Mooncake's wheel needs it to import"; \
	    apt-get update -q && apt-get install -y -q --no-install-recommends libibverbs1; \
	  else echo "warning: libibverbs1 is missing and we are not root: Mooncake will not import" >&2; fi; fi
	@if $(PYTHON) -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then \
	  echo "using the system's CUDA build of torch"; \
	  [ -x $(PY) ] || $(PYTHON) -m venv --system-site-packages $(VENV); \
	  $(PIP_INSTALL) numpy pytest pytest-benchmark pytest-xdist hypothesis pyzmq prometheus-client uv==0.13.10 ruff==0.17.6; \
	else \
	  [ -x $(PY) ] || $(PYTHON) -m venv $(VENV); \
	  $(PIP_INSTALL) "torch==2.13.0+cpu" "triton==3.7.1" "numpy>=2,<3" pytest pytest-benchmark pytest-xdist hypothesis pyzmq \
	    prometheus-client uv==0.13.10 ruff==0.17.6; \
	fi
	$(PIP_INSTALL) --no-deps nixl-cu12==1.5.1
	$(PIP_INSTALL) --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1
	$(PIP_INSTALL) --no-deps --no-build-isolation -e .
	@touch $(STAMP)

# The engines' own environments: kvplan's wheel resolved beside SGLang 0.5.23 and beside vLLM 0.33.0 (each
# with the torch and triton it pins), what their integration tests import of that resolution (uv installs
# those: 5 GB an environment), then kvplan's wheel through pip's resolver (tests/engine_env.py says what
# and why: uv resolves, pip's resolver installs kvplan against the result). Built beside the first test pass.
SGLANG_VENV := .venv-sglang
VLLM_VENV := .venv-vllm
SGLANG_STAMP := $(SGLANG_VENV)/.kvplan-installed
VLLM_STAMP := $(VLLM_VENV)/.kvplan-installed
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
# the wheel the engines' environments resolve: rebuilt when the package's metadata changes (their tests
# import kvplan's modules from this checkout, ahead of the copy the wheel installed)
ENGINE_WHEEL := .engine-wheel/kvplan-$(VERSION)-py3-none-any.whl

$(ENGINE_WHEEL): pyproject.toml | $(STAMP)
	rm -rf .engine-wheel
	$(PIP) wheel -q --no-deps --no-build-isolation -w .engine-wheel .

setup-sglang: $(SGLANG_STAMP)

$(SGLANG_STAMP): $(ENGINE_WHEEL) tests/engine_env.py
	$(PY) tests/engine_env.py sglang $(SGLANG_VENV) $(ENGINE_WHEEL)
	@touch $(SGLANG_STAMP)

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(ENGINE_WHEEL) tests/engine_env.py
	$(PY) tests/engine_env.py vllm $(VLLM_VENV) $(ENGINE_WHEEL)
	@touch $(VLLM_STAMP)

# ruff's checks (pyproject.toml [tool.ruff]); make test runs them first
lint: setup
	$(VENV)/bin/ruff check kvplan tests benchmarks examples

# Four passes: every test with the kernels interpreted on the CPU (torch 2.13, triton 3.7), then a compile
# check of every kernel for sm_90 in a process of its own (the two cannot share a process); beside both,
# each engine's environment is built and its integration tests run in it (torch 2.14, triton 3.8): SGLang's
# with two workers, vLLM's with one (each of its workers imports vLLM twice); their output comes last
test: setup dist lint $(ENGINE_WHEEL)
	@sglang_log=$$(mktemp); vllm_log=$$(mktemp); \
	$(MAKE) --no-print-directory test-sglang SGLANG_WORKERS=2 > $$sglang_log 2>&1 & sglang=$$!; \
	$(MAKE) --no-print-directory test-vllm VLLM_WORKERS=1 > $$vllm_log 2>&1 & vllm=$$!; \
	trap 'kill $$sglang $$vllm 2>/dev/null; rm -f $$sglang_log $$vllm_log' INT TERM; \
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(WORKERS) --dist worksteal -m "not compile_check and not vllm and not sglang" \
	  --benchmark-disable -p no:cacheprovider; first=$$?; \
	TRITON_INTERPRET=0 $(PY) -m pytest -q -n $(WORKERS) -m compile_check -p no:cacheprovider tests/kernels; \
	compiled=$$?; wait $$sglang; sglang_rc=$$?; wait $$vllm; vllm_rc=$$?; \
	echo "--- make test-sglang (run beside the passes above):"; cat $$sglang_log; \
	echo "--- make test-vllm (run beside the passes above):"; cat $$vllm_log; rm -f $$sglang_log $$vllm_log; \
	test $$first -eq 0 -a $$compiled -eq 0 -a $$sglang_rc -eq 0 -a $$vllm_rc -eq 0

# vLLM 0.33.0's own KV-connector tests, from its source distribution (pinned by sha256), run with
# kvplan's connector in place of NixlConnector (tests/integrations/vllm_suite/; docs/vllm.md says which)
VLLM_TESTS := .vllm-tests/vllm-0.33.0
VLLM_OWN_TESTS := tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py \
  tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py

$(VLLM_TESTS)/tests/v1/kv_connector/unit/utils.py:
	$(PY) tests/integrations/vllm_suite/fetch_vllm_tests.py .vllm-tests

# only the vLLM connector's tests, against vLLM's own code: kvplan's, then vLLM's own
test-vllm: setup-vllm $(VLLM_TESTS)/tests/v1/kv_connector/unit/utils.py
	VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 $(VLLM_VENV)/bin/python -m pytest -q -n $(VLLM_WORKERS) -m vllm -p no:cacheprovider \
	  tests/test_engine_envs.py tests/integrations/test_vllm_connector.py tests/integrations/test_vllm_stats.py \
	  tests/integrations/test_vllm_cuda_imports.py \
	  tests/integrations/test_vllm_transfer.py tests/integrations/test_vllm_scheduler.py
	cd $(VLLM_TESTS) && HF_HUB_OFFLINE=1 PYTHONPATH=$(CURDIR):.:$(CURDIR)/tests/integrations/vllm_suite \
	  VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 $(CURDIR)/$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider \
	  -p kvplan_vllm_plugin --rootdir=. -c /dev/null $(VLLM_OWN_TESTS)

# only the tests against SGLang's own code, in SGLang's environment
SGLANG_WORKERS ?= $(WORKERS)
test-sglang: setup-sglang
	TRITON_INTERPRET=1 $(SGLANG_VENV)/bin/python -m pytest -q -n $(SGLANG_WORKERS) -m sglang --benchmark-disable \
	  -p no:cacheprovider

demo: setup
	$(VENV)/bin/kvplan demo

# kvplan's wheel, in dist/ (pure Python: one wheel serves every platform); README: install
dist: setup
	rm -rf dist build
	$(PIP) wheel -q --no-deps --no-build-isolation -w dist .

bench: setup
	$(VENV)/bin/kvplan bench

clean:
	rm -rf $(VENV) $(SGLANG_VENV) $(VLLM_VENV) .engine-wheel .vllm-tests .pytest_cache .hypothesis dist build
