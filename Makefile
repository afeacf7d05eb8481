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
SGLANG_STAMP := $(VENV)/.sglang-installed
VLLM_SITE := .vllm-site
VLLM_STAMP := $(VLLM_SITE)/.kvplan-installed

export UCX_NET_DEVICES := lo
export NIXL_LOG_LEVEL := WARN
export MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER := 65535
export MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER := 65535
export PYTHONUNBUFFERED := 1

# test processes (pytest-xdist): one per core and one more, at most 8. Many tests spend their time
# waiting on processes of their own (engines, the demo's sides). Measured on two cores, the first pass
# alone: two workers 5:17-6:26, three 4:40-5:08, four 3:39-4:03 (session 34, a smaller suite). With the vLLM
# pass beside it (session 42): four 7:45-7:48 (make test 7:54-8:02), three 7:19 (make test 7:35)
WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n + 1 > 8 ? 8 : n + 1 )))
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
	  $(PIP_INSTALL) numpy pytest pytest-benchmark pytest-xdist hypothesis pyzmq ruff==0.17.6; \
	else \
	  [ -x $(PY) ] || $(PYTHON) -m venv $(VENV); \
	  $(PIP_INSTALL) "torch==2.13.0+cpu" "triton==3.7.1" "numpy>=2,<3" pytest pytest-benchmark pytest-xdist hypothesis pyzmq ruff==0.17.6; \
	fi
	$(PIP_INSTALL) --no-deps nixl-cu12==1.5.1
	$(PIP_INSTALL) --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1
	$(PIP_INSTALL) --no-deps --no-build-isolation -e .
	@touch $(STAMP)

# SGLang 0.5.23's own code for the differential tests (tests/sglang_real.py): sglang without its
# dependencies (they would replace the CPU torch), then what its import chain needs (the extra).
setup-sglang: $(SGLANG_STAMP)

$(SGLANG_STAMP): $(STAMP)
	$(PIP_INSTALL) --no-deps sglang==0.5.23
	$(PIP_INSTALL) --no-build-isolation -e ".[sglang-test]"
	@touch $(SGLANG_STAMP)

# vLLM 0.33.0's own code for the connector tests (tests/integrations/test_vllm_connector.py), in a
# folder of its own: vLLM wants a newer openai than SGLang 0.5.23 pins, so the two never share a
# process. vllm without its dependencies, then what its connector modules import, pinned.
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	$(PIP_INSTALL) --no-deps --target $(VLLM_SITE) vllm==0.33.0 openai==3.57.0 openai-harmony==0.0.8 \
	  cbor2==6.3.0 cachetools==8.0.2 cloudpickle==3.1.3 uvloop==0.23.0 xgrammar==0.2.9 fastapi==0.136.3 llguidance==1.9.1
	@touch $(VLLM_STAMP)

# Three passes: every test with the kernels interpreted on the CPU (the SGLang differential tests
# among them), then a compile check of every kernel for sm_90 in a process of its own (the two
# cannot share a process), and beside both the vLLM connector's tests with vLLM's folder on the path.
# ruff's checks (pyproject.toml [tool.ruff]); make test runs them first
lint: setup
	$(VENV)/bin/ruff check kvplan tests benchmarks examples

# the vLLM pass runs beside the others, with one worker (its tests mostly wait on processes of their own;
# session 42, two cores: with two workers beside the first pass it ended at 3:06 of the first pass's 7:45,
# and the whole took 7:54-8:02, against 9:03-9:48 one after the other); its output comes last
test: setup setup-sglang setup-vllm dist lint
	@vllm_log=$$(mktemp); $(MAKE) --no-print-directory test-vllm VLLM_WORKERS=1 > $$vllm_log 2>&1 & vllm=$$!; \
	trap 'kill $$vllm 2>/dev/null; rm -f $$vllm_log' INT TERM; \
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(WORKERS) --dist worksteal -m "not compile_check and not vllm" \
	  --benchmark-disable -p no:cacheprovider; first=$$?; \
	TRITON_INTERPRET=0 $(PY) -m pytest -q -n $(WORKERS) -m compile_check -p no:cacheprovider tests/kernels; \
	compiled=$$?; wait $$vllm; vllm_rc=$$?; echo "--- make test-vllm (run beside the passes above):"; \
	cat $$vllm_log; rm -f $$vllm_log; test $$first -eq 0 -a $$compiled -eq 0 -a $$vllm_rc -eq 0

# vLLM 0.33.0's own KV-connector tests, from its source distribution (pinned by sha256), run with
# kvplan's connector in place of NixlConnector (tests/integrations/vllm_suite/; docs/vllm.md says which)
VLLM_TESTS := .vllm-tests/vllm-0.33.0
VLLM_OWN_TESTS := tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py \
  tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py

$(VLLM_TESTS)/tests/v1/kv_connector/unit/utils.py:
	$(PY) tests/integrations/vllm_suite/fetch_vllm_tests.py .vllm-tests

# only the vLLM connector's tests, against vLLM's own code: kvplan's, then vLLM's own
test-vllm: setup-vllm $(VLLM_TESTS)/tests/v1/kv_connector/unit/utils.py
	PYTHONPATH=$(VLLM_SITE) VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(VLLM_WORKERS) -m vllm -p no:cacheprovider \
	  tests/integrations/test_vllm_connector.py tests/integrations/test_vllm_stats.py tests/integrations/test_vllm_transfer.py
	cd $(VLLM_TESTS) && HF_HUB_OFFLINE=1 PYTHONPATH=$(CURDIR)/$(VLLM_SITE):.:$(CURDIR)/tests/integrations/vllm_suite \
	  VLLM_TARGET_DEVICE=cpu TRITON_INTERPRET=1 $(CURDIR)/$(PY) -m pytest -q -p no:cacheprovider -p kvplan_vllm_plugin \
	  --rootdir=. -c /dev/null $(VLLM_OWN_TESTS)

# only the differential tests against SGLang's own code
test-sglang: setup setup-sglang
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(WORKERS) -m sglang --benchmark-disable -p no:cacheprovider

demo: setup
	$(VENV)/bin/kvplan demo

# kvplan's wheel, in dist/ (pure Python: one wheel serves every platform); README: install
dist: setup
	rm -rf dist build
	$(PIP) wheel -q --no-deps --no-build-isolation -w dist .

bench: setup
	$(VENV)/bin/kvplan bench

clean:
	rm -rf $(VENV) $(VLLM_SITE) .vllm-tests .pytest_cache .hypothesis dist build
