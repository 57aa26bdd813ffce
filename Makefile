# kvcache: `make verify` (lint + typecheck + tests, one line each) and `make test`.
# Both create .venv on first use; the test dependencies (CPU torch, the kernels'
# triton, and the vLLM 0.25.1 reference) are installed into it once, on the
# first target that needs them. Installer output goes to build/setup.log.

VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
QUIET := bash scripts/quietly.sh build/setup.log --
DEV_STAMP := $(VENV)/.stamp-dev
REF_STAMP := $(VENV)/.stamp-vllm-0.25.1

# What importing vllm.v1.core needs, without vLLM's full (GPU) dependency set.
VLLM_IMPORT_DEPS := numpy packaging regex psutil pyzmq urllib3 msgspec pydantic cbor2 \
	transformers aiohttp requests openai-harmony openai pillow pybase64 cachetools \
	cloudpickle uvloop py-cpuinfo prometheus_client "llguidance>=1.7.0,<1.8.0" apache-tvm-ffi

LINT_PATHS := spec kvcache tests proofs kernels
TYPED_PATHS := spec kvcache

export PYTHONHASHSEED := 0
export VLLM_LOGGING_LEVEL := ERROR
export HYPOTHESIS_PROFILE ?= ci

.PHONY: setup reference lint typecheck test conformance verify traces clean distclean

setup: $(DEV_STAMP)

$(DEV_STAMP): pyproject.toml
	$(QUIET) python3 -m venv $(VENV)
	$(QUIET) $(PIP) -e '.[dev]'
	touch $@

reference: $(REF_STAMP)

$(REF_STAMP): | $(DEV_STAMP)
	$(QUIET) $(PIP) torch==2.13.0
	$(QUIET) $(PIP) -e '.[kernels]'
	$(QUIET) $(PIP) --no-deps vllm==0.25.1
	$(QUIET) $(PIP) $(VLLM_IMPORT_DEPS)
	$(QUIET) $(PIP) --no-deps xgrammar
	$(QUIET) $(PY) -c "from vllm.v1.core.kv_cache_manager import KVCacheManager"
	touch $@

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)

typecheck: $(DEV_STAMP)
	$(VENV)/bin/mypy --strict $(TYPED_PATHS)

test: $(REF_STAMP)
	$(PY) -m pytest -q

conformance: $(REF_STAMP)
	$(PY) -m pytest -q -m conformance tests/conformance

verify: $(REF_STAMP)
	@$(PY) scripts/stage.py lint -- $(VENV)/bin/ruff check $(LINT_PATHS)
	@$(PY) scripts/stage.py typecheck -- $(VENV)/bin/mypy --strict $(TYPED_PATHS)
	@$(PY) scripts/stage.py tests -- $(PY) -m pytest -q -p no:cacheprovider

traces: $(REF_STAMP)
	$(PY) scripts/record_vllm_traces.py

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -not -path './$(VENV)/*' -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
