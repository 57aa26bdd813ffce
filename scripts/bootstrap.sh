#!/usr/bin/env bash
# Usage: scripts/bootstrap.sh dev|compiled|reference|reference-0.33|upstream-0.33|release|fuzz|bench|mutation STAMP [VERSION]
#
# Installs one layer of the test environment into .venv, quietly: the
# installers' output goes to build/setup.log and one summary line is printed
# (on failure: the log's tail and the step that failed). Touches STAMP on
# success, so make runs each layer once.
#   dev        python3 -m venv .venv; pip install -e '.[dev]'
#   compiled   the mypyc build of kvcache's core and the C extension
#              kvcache._blockhash, in place (setup.py build_ext --inplace);
#              writes STAMP, kvcache/_compiled.sha256, itself
#   reference  CPU torch and triton (the kernels extra), vLLM 0.25.1 without its
#              GPU dependencies, plus the few packages `import vllm.v1.core` needs
#   reference-0.33  a venv of its own, .venv-0.33: vLLM 0.33.0 without its GPU
#              dependencies (it pins torch 2.14.0 but imports with CPU torch 2.13.0),
#              its import-time needs, and this repo (-e .) for the kit
#   upstream-0.33  pytest in .venv-0.33, for vLLM 0.33.0's own core tests (make upstream-0.33)
#   release    any vLLM release VERSION (0.26.0 ... 0.32.0) in a venv of its own,
#              .venv-vllm-VERSION (make reference-VERSION): CPU torch, that vLLM without
#              its GPU dependencies, the import-time needs of that release (pins below),
#              this repo (-e .) and pytest
#   fuzz       a venv of its own, .venv-fuzz, with pip install -e '.[fuzz]' (HypoFuzz
#              and the Hypothesis it works with)
#   bench      pip install -e '.[bench]' (matplotlib)
#   mutation   pip install -e '.[mutation]' (mutmut, for `make mutation`)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
usage="usage: bootstrap.sh dev|compiled|reference|reference-0.33|upstream-0.33|release|fuzz|bench|mutation STAMP [VERSION]"
layer=${1:?$usage}
stamp=${2:?$usage}
version=${3:-}
log=build/setup.log
venv=.venv
mkdir -p build
started=$SECONDS

# What importing vllm.v1.core needs, without vLLM's full (GPU) dependency set.
vllm_import_deps=(numpy packaging regex psutil pyzmq urllib3 msgspec pydantic cbor2
    transformers aiohttp requests openai-harmony openai pillow pybase64 cachetools
    cloudpickle uvloop py-cpuinfo prometheus_client "llguidance>=1.7.0,<1.8.0" apache-tvm-ffi
    einops)  # einops: vLLM's worker utilities, imported by its core tests (make upstream)
# vLLM 0.33.0 adds and swaps a few: oss-harmony for openai-harmony, fastapi,
# partial-json-parser, and a transformers below 5.21.
vllm33_import_deps=("${vllm_import_deps[@]/openai-harmony/oss-harmony}" "transformers<5.21"
    fastapi partial-json-parser)

# The import-time needs of vLLM release $1 (measured on CPU venvs, release by release):
# 0.26.0's apache-tvm-ffi 0.1.10 needs xgrammar 0.2.7 (0.2.9 wants a newer tvm-ffi);
# 0.30.0 and later import fastapi and partial-json-parser; 0.31.0 and later swap
# openai-harmony for oss-harmony; 0.33.0 also needs a transformers below 5.21.
release_import_deps() {
    local minor=${1#0.}
    minor=${minor%%.*}
    if ((minor >= 33)); then
        echo "${vllm33_import_deps[@]}"
    elif ((minor >= 31)); then
        echo "${vllm_import_deps[@]/openai-harmony/oss-harmony}" fastapi partial-json-parser
    elif ((minor >= 30)); then
        echo "${vllm_import_deps[@]}" fastapi partial-json-parser
    else
        echo "${vllm_import_deps[@]}"
    fi
}
release_xgrammar() {
    case $1 in
    0.26.*) echo "xgrammar==0.2.7" ;;
    *) echo "xgrammar" ;;
    esac
}

step() {  # step DESCRIPTION COMMAND...: run quietly, or fail with the log's tail
    local what=$1
    shift
    echo "### $what: $*" >>"$log"
    if ! "$@" >>"$log" 2>&1; then
        tail -n 40 "$log"
        echo "$layer: FAILED at '$what' (full log: $log)"
        exit 1
    fi
}
# KVCACHE_BUILD_PURE=1: an editable install of this repo builds no extensions (the
# `compiled` layer builds them in place, once, with the digest check of setup.py).
pip_install() {
    KVCACHE_BUILD_PURE=1 "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"
}

case $layer in
dev)
    step "create .venv" python3 -m venv "$venv"
    step "dev tools" pip_install -e '.[dev]'
    summary="ruff, mypy, pytest, hypothesis, crosshair, matplotlib in .venv"
    ;;
compiled)
    # Extensions of an earlier build go first: a module no longer compiled must not
    # keep loading from a stale .so (Python prefers it over the source).
    rm -f kvcache/*.so "$stamp"
    step "mypyc build of kvcache's core" "$venv/bin/python" setup.py build_ext --inplace
    if [[ ! -f $stamp ]]; then
        tail -n 40 "$log"
        echo "compiled: FAILED, no compiled modules were built (a C compiler is needed; log: $log)"
        exit 1
    fi
    summary="mypyc-compiled kvcache core and kvcache._blockhash in kvcache/*.so"
    ;;
reference)
    step "CPU torch" pip_install torch==2.13.0
    step "triton (kernels extra)" pip_install -e '.[kernels]'
    step "vLLM 0.25.1" pip_install --no-deps vllm==0.25.1
    step "vLLM's import dependencies" pip_install "${vllm_import_deps[@]}"
    step "xgrammar" pip_install --no-deps xgrammar
    step "import check" "$venv/bin/python" -c \
        "from vllm.v1.core.kv_cache_manager import KVCacheManager"
    summary="vLLM 0.25.1 reference, CPU torch, triton in .venv"
    ;;
reference-0.33)
    venv=.venv-0.33
    step "create .venv-0.33" python3 -m venv "$venv"
    step "CPU torch" pip_install torch==2.13.0
    step "vLLM 0.33.0" pip_install --no-deps vllm==0.33.0
    step "vLLM 0.33.0's import dependencies" pip_install "${vllm33_import_deps[@]}"
    step "xgrammar" pip_install --no-deps xgrammar
    step "kvcache (-e .)" pip_install -e .
    step "import check" "$venv/bin/python" -c \
        "from vllm.v1.core.kv_cache_manager import KVCacheManager; import kvcache.kit.vllm_side"
    summary="vLLM 0.33.0, CPU torch in .venv-0.33"
    ;;
upstream-0.33)
    venv=.venv-0.33
    step "pytest" pip_install "pytest>=8"
    summary="pytest in .venv-0.33"
    ;;
release)
    [[ $version =~ ^0\.[0-9]+\.[0-9]+$ ]] || { echo "release: VERSION must look like 0.29.0, not '$version'"; exit 2; }
    venv=.venv-vllm-$version
    layer="reference-$version"
    log=build/setup-$version.log  # one log per release: several can install at once
    # shellcheck disable=SC2207
    deps=($(release_import_deps "$version"))
    step "create $venv" python3 -m venv "$venv"
    step "CPU torch" pip_install torch==2.13.0
    step "vLLM $version" pip_install --no-deps "vllm==$version"
    step "vLLM $version's import dependencies" pip_install "${deps[@]}"
    step "xgrammar" pip_install --no-deps "$(release_xgrammar "$version")"
    step "kvcache (-e .) and pytest" pip_install -e . "pytest>=8"
    step "import check" "$venv/bin/python" -c \
        "from vllm.v1.core.kv_cache_manager import KVCacheManager; import kvcache.kit.vllm_side"
    summary="vLLM $version, CPU torch in $venv"
    ;;
fuzz)
    venv=.venv-fuzz
    step "create .venv-fuzz" python3 -m venv "$venv"
    step "HypoFuzz (fuzz extra)" pip_install -e '.[fuzz]'
    summary="HypoFuzz in .venv-fuzz"
    ;;
bench)
    step "matplotlib (bench extra)" pip_install -e '.[bench]'
    summary="matplotlib in .venv"
    ;;
mutation)
    step "mutmut (mutation extra)" pip_install -e '.[mutation]'
    summary="mutmut in .venv"
    ;;
*)
    echo "unknown layer $layer (dev, compiled, reference, reference-0.33, upstream-0.33, release, fuzz, bench or mutation)"
    exit 2
    ;;
esac
touch "$stamp"
echo "setup $layer: $summary ($((SECONDS - started)) s; log: $log)"
