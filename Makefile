# kvcache: `make verify` (lint + typecheck + tests, one line each) and `make test`.
# Both create .venv on first use; the test dependencies (CPU torch, the kernels'
# triton, and the vLLM 0.25.1 reference) are installed into it once, on the
# first target that needs them (scripts/bootstrap.sh: one line per layer; the
# installers' output goes to build/setup.log).

VENV := .venv
PY := $(VENV)/bin/python
DEV_STAMP := $(VENV)/.stamp-dev
REF_STAMP := $(VENV)/.stamp-vllm-0.25.1
REF33_VENV := .venv-0.33
REF33_STAMP := $(REF33_VENV)/.stamp-vllm-0.33.0
UPSTREAM33_STAMP := $(REF33_VENV)/.stamp-upstream-0.33
FUZZ_VENV := .venv-fuzz
FUZZ_STAMP := $(FUZZ_VENV)/.stamp-fuzz
BENCH_STAMP := $(VENV)/.stamp-bench
MUTATION_STAMP := $(VENV)/.stamp-mutation
# The mypyc-compiled core (setup.py, kvcache/_builds.py): rebuilt when a core source changes.
CORE_SOURCES := $(filter-out kvcache/__init__.py kvcache/__main__.py kvcache/_builds.py,\
	$(wildcard kvcache/*.py)) kvcache/_blockhash.c
COMPILED_STAMP := kvcache/_compiled.sha256
# The compiled pass of `make verify`: the same test files, fewer Hypothesis examples.
# The drop-in checks too: the compiled build is the default one, and vLLM hands it its own objects.
COMPILED_TESTS := tests/stateful tests/conformance tests/reliability tests/scheduler \
	tests/unit/test_vllm_objects.py tests/unit/test_prompt_embeds.py tests/unit/test_kv_events_wire.py \
	tests/unit/test_partial_hits_tail.py tests/unit/test_blockhash_ext.py tests/unit/test_request_hashing_vs_vllm.py

LINT_PATHS := spec kvcache tests proofs kernels scripts examples
TYPED_PATHS := spec kvcache kernels proofs examples

export PYTHONHASHSEED := 0
export VLLM_LOGGING_LEVEL := ERROR
export HYPOTHESIS_PROFILE ?= ci

# Fuzzing campaigns (docs/kit.md, "Fuzzing campaigns"): the shared example database,
# HypoFuzz processes per target, the dashboard's address, an optional time limit.
FUZZ_DB ?= $(CURDIR)/.hypothesis/fuzz-db
FUZZ_WORKERS ?= 1
FUZZ_HOST ?= localhost
FUZZ_PORT ?= 9999
FUZZ_SECONDS ?=
FUZZ_ENV = KVCACHE_FUZZ_DB=$(FUZZ_DB) FUZZ_WORKERS=$(FUZZ_WORKERS) FUZZ_HOST=$(FUZZ_HOST) \
	FUZZ_PORT=$(FUZZ_PORT) FUZZ_SECONDS=$(FUZZ_SECONDS)

.PHONY: setup compiled reference reference-0.33 check-0.33 releases profile-check-releases verify-lane-tests \
	verify-lane-releases conformance-0.33 upstream-0.33 \
	upstream-0.33-compiled conformance-0.33-compiled lint typecheck test conformance wheel-check figures \
	verify upstream proofs traces fuzz fuzz-worker fuzz-dashboard test-kernels bench-kernels \
	bench mutation clean distclean effectiveness effectiveness-vllm effectiveness-ci nano-vllm \
	exhaustive-releases exhaustive-teeth

setup: $(DEV_STAMP) $(COMPILED_STAMP)

$(DEV_STAMP): pyproject.toml
	@bash scripts/bootstrap.sh dev $@

compiled: $(COMPILED_STAMP)

# Needs only the dev layer (mypy's mypyc): the core type-checks without torch or vLLM,
# as in `pip wheel .`'s isolated build, so `make setup` stays light (README, Install).
$(COMPILED_STAMP): $(CORE_SOURCES) setup.py kvcache/_builds.py | $(DEV_STAMP)
	@bash scripts/bootstrap.sh compiled $@

reference: $(REF_STAMP)

$(REF_STAMP): | $(DEV_STAMP)
	@bash scripts/bootstrap.sh reference $@

# vLLM 0.33.0 in a venv of its own (.venv-0.33), for the kit's release checks.
reference-0.33: $(REF33_STAMP)

$(REF33_STAMP):
	@bash scripts/bootstrap.sh reference-0.33 $@

# The kit against vLLM 0.33.0: replay the stored traces and a census of 600 sequences
# (a count, so every run meets the same sequences); every difference must be in the
# ledger (kvcache/kit/ledger.toml); then kvcache.kit.profile_check: KVCacheManager(profile="0.33.0")
# itself against vLLM 0.33.0, with its teeth, and the spec's (--subject spec: the oracle held to
# the release directly, not only through kvcache). Builds .venv-0.33 first.
CHECK33_SEQUENCES ?= 600
check-0.33: $(REF33_STAMP)
	$(REF33_VENV)/bin/python -m kvcache release-check --census-sequences $(CHECK33_SEQUENCES) \
		--census-dir build/census-0.33 tests/data/*.jsonl*
	$(REF33_VENV)/bin/python -m kvcache.kit.profile_check --sequences $(PROFILE_CHECK_SEQUENCES) \
		--teeth 3
	$(REF33_VENV)/bin/python -m kvcache.kit.profile_check --subject spec \
		--sequences $(PROFILE_CHECK_SEQUENCES) --teeth 3

# kvcache's 0.33.0 profile (kvcache.vllm_0_33) against the real vLLM 0.33.0: the random
# scheduler sequences of the conformance tests, CONFORMANCE33_SEQUENCES per family, for every
# family kvcache.kit.conformance does not list as not in 0.33.0 (it prints those).
CONFORMANCE33_SEQUENCES ?= 100
conformance-0.33: $(REF33_STAMP)
	$(REF33_VENV)/bin/python -m kvcache.kit.conformance --release 0.33.0 \
		--sequences $(CONFORMANCE33_SEQUENCES)

# vLLM 0.33.0's own tests/v1/core (its source distribution, fetched into build/upstream), run
# on stock vLLM 0.33.0 and with vLLM's core modules served by kvcache's 0.33.0 profile
# (kvcache.vllm_0_33 first, vLLM's objects); known failures, each with the feature it needs,
# in kvcache/kit/upstream_data/known_failing-0.33.0.toml. Then its compiled pass (below).
upstream-0.33: $(UPSTREAM33_STAMP)
	$(REF33_VENV)/bin/python -m kvcache.kit.upstream --version 0.33.0

# Both on the compiled (mypyc) build, the one users import by default: vLLM 0.33.0's own
# tests (stock vLLM's outcomes reused from the last upstream-0.33 run, when there is one),
# with the compiled-only ratchet kvcache/kit/upstream_data/known_failing_compiled-0.33.0.toml;
# and the conformance sequences, the same count as the pure pass: with 50 per family two
# families miss a path they must reach (swa+mamba's cow_copies, full+swa+mamba's
# full_report_hit), with 70 none does.
CONFORMANCE33_COMPILED_SEQUENCES ?= 100
upstream-0.33-compiled: $(UPSTREAM33_STAMP) $(COMPILED_STAMP)
	KVCACHE_EXPECT_COMPILED=1 $(REF33_VENV)/bin/python -m kvcache.kit.upstream --version 0.33.0 \
		--reuse-baseline

conformance-0.33-compiled: $(REF33_STAMP) $(COMPILED_STAMP)
	KVCACHE_EXPECT_COMPILED=1 $(REF33_VENV)/bin/python -m kvcache.kit.conformance --release 0.33.0 \
		--sequences $(CONFORMANCE33_COMPILED_SEQUENCES)

# Any vLLM release in a venv of its own, .venv-vllm-VERSION (`make reference-0.29.0`):
# the releases `make releases` and `python -m kvcache bisect` run on.
RELEASES := 0.25.1 0.26.0 0.27.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0 0.33.0
reference-%: .venv-vllm-%/.stamp
	@:
.PRECIOUS: .venv-vllm-%/.stamp
.venv-vllm-%/.stamp:
	@bash scripts/bootstrap.sh release $@ $*

# One release between the two the project models, in CI (verify): the stored traces
# and a short census of CHECK_RELEASE_SEQUENCES sequences on vLLM MIDDLE_RELEASE; every
# difference must be a ledger entry whose range covers that release. Then kvcache's own
# profile of that release against it, call for call with no ledger, on the layouts whose
# reports it settles, and each switch of its teeth flipped must be caught; then the spec's
# profile the same way (kvcache.kit.profile_check, --subject spec).
MIDDLE_RELEASE ?= 0.29.0
CHECK_RELEASE_SEQUENCES ?= 200
PROFILE_CHECK_SEQUENCES ?= 10
check-release-%: .venv-vllm-%/.stamp
	.venv-vllm-$*/bin/python -m kvcache release-check --census-sequences $(CHECK_RELEASE_SEQUENCES) \
		--census-dir build/census-$* tests/data/*.jsonl* tests/data/releases/*.jsonl
	.venv-vllm-$*/bin/python -m kvcache.kit.profile_check --sequences $(PROFILE_CHECK_SEQUENCES) \
		--teeth 3
	.venv-vllm-$*/bin/python -m kvcache.kit.profile_check --subject spec \
		--sequences $(PROFILE_CHECK_SEQUENCES) --teeth 3

# kvcache.kit.profile_check on every release venv present (make reference-X builds one).
profile-check-releases:
	@for v in $(RELEASES); do py=.venv-vllm-$$v/bin/python; \
		[ $$v = 0.25.1 ] && py=$(PY); [ $$v = 0.33.0 ] && py=$(REF33_VENV)/bin/python; \
		if [ -x $$py ]; then for subject in kvcache spec; do $$py -m kvcache.kit.profile_check \
			--subject $$subject --sequences $(PROFILE_CHECK_SEQUENCES) --teeth 3 || exit 1; done; \
		else echo "profile-check: vLLM $$v: no venv (make reference-$$v)"; fi; done

# Every release from 0.25.1 to 0.33.0 (a venv each; ~3 min per release to install), then
# `python -m kvcache bisect`: each ledger entry's first release, docs/bisect.md. Not in verify.
BISECT_SEQUENCES ?= 300
RELEASE_STAMPS := $(REF_STAMP) $(REF33_STAMP) \
	$(foreach v,$(filter-out 0.25.1 0.33.0,$(RELEASES)),.venv-vllm-$(v)/.stamp)
releases: $(RELEASE_STAMPS)
	$(PY) -m kvcache bisect --census-sequences $(BISECT_SEQUENCES) tests/data/*.jsonl* tests/data/releases/*.jsonl

$(UPSTREAM33_STAMP): | $(REF33_STAMP)
	@bash scripts/bootstrap.sh upstream-0.33 $@

$(FUZZ_STAMP): pyproject.toml
	@bash scripts/bootstrap.sh fuzz $@

$(BENCH_STAMP): | $(REF_STAMP)
	@bash scripts/bootstrap.sh bench $@

$(MUTATION_STAMP): | $(DEV_STAMP)
	@bash scripts/bootstrap.sh mutation $@

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)

# Needs the reference layer: the kernels and the kit import torch, numpy and vLLM's types.
typecheck: $(REF_STAMP)
	$(VENV)/bin/mypy --strict $(TYPED_PATHS)

test: $(REF_STAMP)
	KVCACHE_PURE=1 $(PY) -m pytest -q

conformance: $(REF_STAMP)
	KVCACHE_PURE=1 $(PY) -m pytest -q -m conformance tests/conformance

# Tests run twice (docs/verification.md, "Two builds"): everything on the pure-Python sources, then
# the stateful machines, conformance and reliability on the compiled build; the
# exhaustive kvcache-vs-spec search too, on the compiled build shallower (states pickled).
PROOFS_COMPILED_SHALLOWER ?= 2
verify: $(REF_STAMP) $(COMPILED_STAMP)
	@mkdir -p build && rm -f build/verify-stages.jsonl
	@$(PY) scripts/wheel_check.py --start
	@$(PY) scripts/stage.py lint -- $(VENV)/bin/ruff check $(LINT_PATHS)
	@$(PY) scripts/stage.py typecheck -- $(VENV)/bin/mypy --strict $(TYPED_PATHS)
	@$(MAKE) --no-print-directory -k -j2 verify-lane-tests verify-lane-releases
	@$(PY) scripts/stage.py wheel-check -- $(PY) scripts/wheel_check.py --await
	@$(PY) scripts/figures.py verify

# verify's two lanes, run side by side (one per core; each stage is one process), balanced
# by the stage times of the last clean-clone run: vLLM 0.25.1's own tests and the test suite
# on both builds; the proofs and every release check. (The upstream stages of two releases
# may share build/hf-home at once: kvcache.kit.upstream writes it atomically.)
verify-lane-tests: $(REF_STAMP) $(COMPILED_STAMP)
	@$(PY) scripts/stage.py upstream -- env KVCACHE_PURE=1 $(PY) -m kvcache.kit.upstream
	@$(PY) scripts/stage.py upstream-compiled -- env KVCACHE_EXPECT_COMPILED=1 \
		$(PY) -m kvcache.kit.upstream --reuse-baseline
	@$(PY) scripts/stage.py tests -- env KVCACHE_PURE=1 $(PY) -m pytest -q -p no:cacheprovider
	@$(PY) scripts/stage.py tests-compiled -- env KVCACHE_EXPECT_COMPILED=1 CONFORMANCE_SEQUENCES=30 \
		HYPOTHESIS_PROFILE=compiled $(PY) -m pytest -q -p no:cacheprovider $(COMPILED_TESTS)

verify-lane-releases: $(REF_STAMP) $(COMPILED_STAMP)
	@$(PY) scripts/stage.py proofs -- env KVCACHE_PURE=1 $(PY) -m proofs.run
	@$(PY) scripts/stage.py proofs-compiled -- env KVCACHE_EXPECT_COMPILED=1 \
		$(PY) -m proofs.exhaustive --shallower $(PROOFS_COMPILED_SHALLOWER)
	@$(PY) scripts/stage.py check-$(MIDDLE_RELEASE) -- env KVCACHE_PURE=1 \
		$(MAKE) --no-print-directory check-release-$(MIDDLE_RELEASE)
	@$(PY) scripts/stage.py check-0.33 -- env KVCACHE_PURE=1 $(MAKE) --no-print-directory check-0.33
	@$(PY) scripts/stage.py conformance-0.33 -- env KVCACHE_PURE=1 \
		$(MAKE) --no-print-directory conformance-0.33
	@$(PY) scripts/stage.py upstream-0.33 -- env KVCACHE_PURE=1 \
		$(MAKE) --no-print-directory upstream-0.33
	@$(PY) scripts/stage.py upstream-0.33-compiled -- \
		$(MAKE) --no-print-directory upstream-0.33-compiled
	@$(PY) scripts/stage.py conformance-0.33-compiled -- \
		$(MAKE) --no-print-directory conformance-0.33-compiled
	@$(PY) scripts/stage.py effectiveness -- $(MAKE) --no-print-directory effectiveness-ci

# The installed distribution as a user gets it (scripts/wheel_check.py): `pip wheel .`,
# a fresh venv (build/wheel/venv, with CPU torch and transformers, without triton), only
# kvcache's own import names, the README example, the `kvcache` command. ~2-3 min;
# `make verify` runs it in the background beside the single-process tests stage.
wheel-check: $(DEV_STAMP)
	$(PY) scripts/wheel_check.py

# docs/figures.md from the records `make verify` and `make bench` leave in build/.
figures: $(DEV_STAMP)
	$(PY) scripts/figures.py all

# The cache-effectiveness suite (docs/effectiveness.md): realized vs achievable hits,
# loss by rule. `effectiveness`: the whole suite on kvcache's two lines (tables printed);
# `effectiveness-vllm`: on real vLLM 0.25.1 and 0.33.0 and kvcache's lines, then
# docs/effectiveness.md from their JSON; `effectiveness-ci`: a subset for `make verify`.
# Each fails on a flagged row that the line's KNOWN_FLAGS (--expect-known) does not name.
EFF = env KVCACHE_PURE=1 $(PY) -m kvcache effectiveness --expect-known
EFF_DIR := build/effectiveness
EFF_CI_FAMILIES := full,full+swa,full+mamba-align,full+swa+mamba
effectiveness: $(DEV_STAMP)
	$(EFF) --impl kvcache
	$(EFF) --impl kvcache-0.33

effectiveness-vllm: $(REF_STAMP) $(REF33_STAMP)
	@mkdir -p $(EFF_DIR)
	@status=0; \
	$(EFF) --impl kvcache --json $(EFF_DIR)/kvcache.json > $(EFF_DIR)/kvcache.txt || status=1; \
	$(EFF) --impl kvcache-0.33 --json $(EFF_DIR)/kvcache-0.33.json \
		> $(EFF_DIR)/kvcache-0.33.txt || status=1; \
	env KVCACHE_PURE=1 $(PY) -m kvcache effectiveness --expect-known --impl vllm \
		--json $(EFF_DIR)/vllm-0.25.1.json > $(EFF_DIR)/vllm-0.25.1.txt || status=1; \
	env KVCACHE_PURE=1 $(REF33_VENV)/bin/python -m kvcache effectiveness --expect-known \
		--impl vllm --json $(EFF_DIR)/vllm-0.33.0.json > $(EFF_DIR)/vllm-0.33.0.txt || status=1; \
	grep -h -e " rows, " -e "^unexpected flag" -e "^expected flag" $(EFF_DIR)/kvcache.txt \
		$(EFF_DIR)/kvcache-0.33.txt $(EFF_DIR)/vllm-0.25.1.txt $(EFF_DIR)/vllm-0.33.0.txt; \
	env KVCACHE_PURE=1 $(PY) scripts/effectiveness_docs.py --plots $(EFF_DIR) \
		docs/effectiveness.md $(EFF_DIR)/kvcache.json $(EFF_DIR)/kvcache-0.33.json \
		$(EFF_DIR)/vllm-0.25.1.json $(EFF_DIR)/vllm-0.33.0.json || status=1; \
	exit $$status

effectiveness-ci: $(DEV_STAMP)
	@$(EFF) --no-table --impl kvcache --families $(EFF_CI_FAMILIES)
	@$(EFF) --no-table --impl kvcache-0.33 --families $(EFF_CI_FAMILIES)

# nano-vllm's own block manager on trial at level `hits` (docs/protocol.md): its checkout is
# fetched at run time into build/nano-vllm (never committed), or taken from NANO_VLLM_SRC.
NANO_VLLM_URL ?= https://github.com/GeeeekExplorer/nano-vllm
NANO_VLLM_COMMIT ?= bb823b3
NANO_VLLM_SRC ?= build/nano-vllm
nano-vllm: $(REF_STAMP)
	@test -d $(NANO_VLLM_SRC)/nanovllm || { git clone -q $(NANO_VLLM_URL) $(NANO_VLLM_SRC) && \
		git -C $(NANO_VLLM_SRC) checkout -q $(NANO_VLLM_COMMIT); }
	NANO_VLLM_SRC=$(NANO_VLLM_SRC) $(PY) -m kvcache fuzz --compare hits --sequences 300 --census \
		--census-dir build/nano-vllm-findings --impl examples.nano_vllm_adapter:NanoVllmSubject; \
		test $$? -le 1

# vLLM 0.25.1's own tests/v1/core, fetched into build/upstream, run unchanged on stock vLLM,
# with vLLM's core modules served by kvcache (vLLM's objects), and with kvcache's vocabulary too.
upstream: $(REF_STAMP)
	$(PY) -m kvcache.kit.upstream --verbose

traces: $(REF_STAMP)
	$(PY) scripts/record_vllm_traces.py

# HypoFuzz on this machine: one process per fuzz target plus the dashboard, until Ctrl-C.
fuzz: $(FUZZ_STAMP)
	@$(FUZZ_ENV) bash scripts/fuzz_campaign.sh all

# More fuzzing against the same FUZZ_DB (another machine: FUZZ_DB=/shared/dir or redis://).
fuzz-worker: $(FUZZ_STAMP)
	@$(FUZZ_ENV) bash scripts/fuzz_campaign.sh workers

fuzz-dashboard: $(FUZZ_STAMP)
	@$(FUZZ_ENV) bash scripts/fuzz_campaign.sh dashboard

# CrossHair contracts and diffbehavior pairs, plus the bounded exhaustive kvcache-vs-spec
# search (proofs/manifest.py), bounded by counts (same verdicts on any machine load), ~3 min on 2 cores.
proofs: $(DEV_STAMP)
	KVCACHE_PURE=1 $(PY) -m proofs.run

# The exhaustive kvcache-vs-spec search under every release's profile, `make proofs`'
# layouts and the later releases' (LATER_LAYOUTS), each at its full depth (about 6 min
# of one core per release; `make verify` runs 0.33.0's, 3 steps shallower, in
# tests/test_proofs_teeth.py).
# `make exhaustive-teeth` prints which of 0.33.0's switches the search can see.
EXHAUSTIVE_SHALLOWER ?= 0
exhaustive-releases: $(DEV_STAMP)
	@for release in $$($(PY) -c "import spec.profile as p; print(*p.RELEASES)"); do \
		KVCACHE_PURE=1 $(PY) -m proofs.exhaustive --shallower $(EXHAUSTIVE_SHALLOWER) \
			--layouts all --release $$release || exit 1; \
	done

exhaustive-teeth: $(DEV_STAMP)
	KVCACHE_PURE=1 $(PY) -m proofs.exhaustive --release 0.33.0 --layouts all --shallower 3 --teeth

# Kernel tests in the Triton interpreter on CPU (also part of `make test`).
test-kernels: $(REF_STAMP)
	$(PY) -m pytest -q tests/kernels

# CUDA only: the kernel tests compiled for the GPU, then decode-attention bandwidth ratios.
bench-kernels: $(REF_STAMP)
	TRITON_INTERPRET=0 $(PY) -m kvcache_kernels.bench

# kvcache (compiled and pure) vs vLLM 0.25.1 vs spec on the same workloads (ratios,
# per-method us, scaling), then the stored workload traces and three traces of 100
# requests recorded from vLLM now, replayed side by side.
BENCH_TRACES := $(wildcard tests/data/*workload_chat*.jsonl.gz)
BENCH_TRACE_REQUESTS ?= 100
bench: $(BENCH_STAMP) $(COMPILED_STAMP)
	@mkdir -p build
	bash -o pipefail -c '$(PY) -m kvcache bench --scaling --json build/bench.json \
		--plot build/bench.png --traces $(BENCH_TRACES) \
		--trace-requests $(BENCH_TRACE_REQUESTS) | tee build/bench.txt'
	$(PY) scripts/figures.py bench

# mutmut over kvcache/*.py (not the kit) with the quick test selection of [tool.mutmut]
# (HYPOTHESIS_PROFILE=mutation): counts and score against docs/mutation.md, which lists the
# equivalent mutants. Long (see docs/mutation.md), so not part of verify. MUTANTS="name ..."
# re-runs only those mutants, keeping the other results.
MUTATION_WORKERS ?= 2
MUTANTS ?=
mutation: $(MUTATION_STAMP)
	@KVCACHE_PURE=1 $(PY) scripts/mutation.py run --workers $(MUTATION_WORKERS) $(MUTANTS)

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache .hypothesis mutants
	rm -f kvcache/*.so $(COMPILED_STAMP)
	find . -name __pycache__ -type d -prune -not -path './$(VENV)/*' -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(FUZZ_VENV) $(REF33_VENV)
