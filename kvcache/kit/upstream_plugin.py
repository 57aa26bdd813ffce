"""pytest plugin of the upstream stage: serve vLLM's core modules from kvcache, audit calls.

Loaded with ``-p kvcache.kit.upstream_plugin`` by :mod:`kvcache.kit.upstream` in
each pytest process that runs vLLM's own tests; ``KVCACHE_UPSTREAM_MODE`` picks
the mode (``vllm``, ``objects``, ``vocabulary``) and ``KVCACHE_UPSTREAM_REPORT``
names the JSON report written at the end (outcome per test, fallbacks used, the
call audit).

Each swapped vLLM module is a :class:`SwappedModule`: an empty module whose
attribute reads and writes go to the kvcache module serving it, so a test that
monkeypatches ``vllm.v1.core.kv_cache_utils.X`` patches kvcache's ``X``, and
``importlib.reload`` of it reloads kvcache's module. In ``objects`` mode a
vocabulary name that a core module re-exports (``kv_cache_manager.Request``,
``kv_cache_utils.KVCacheSpec``) is vLLM's own object, as it is in vLLM.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import sys
import threading
from collections import Counter
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import pytest

from kvcache.kit.upstream import AUDITED_FILES, CORE_SWAPS, FALLBACKS, VOCABULARY_SWAPS

MODE = os.environ.get("KVCACHE_UPSTREAM_MODE", "vllm")
REPORT = os.environ.get("KVCACHE_UPSTREAM_REPORT")

_outcomes: dict[str, str] = {}
_fallbacks_used: dict[str, Counter[str]] = {}
_kvcache_calls = 0
_audit: Counter[str] = Counter()
_loading_fallback = 0


def _vllm_dir() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None, "vLLM is not installed"
    return Path(spec.origin).resolve().parent


VLLM_DIR = _vllm_dir()
KVCACHE_DIR = str(Path(__file__).resolve().parents[1]) + os.sep
AUDITED = {str(VLLM_DIR.parent / path): path for path in AUDITED_FILES}
# Functions of the audited files a listed fallback may run (its own call tree).
ALLOWED_AUDIT = {
    f"vllm/{module.removeprefix('vllm.').replace('.', '/')}.py:{name}"
    for module, names in FALLBACKS.items()
    for name in names
}


def _real_module(vllm_name: str) -> ModuleType:
    """vLLM's own module ``vllm_name``, loaded under another name (for fallbacks only)."""
    alias = f"_kvcache_upstream.{vllm_name}"
    if alias in sys.modules:
        return sys.modules[alias]
    path = VLLM_DIR.parent / (vllm_name.replace(".", "/") + ".py")
    spec = importlib.util.spec_from_file_location(alias, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    global _loading_fallback
    _loading_fallback += 1
    try:
        spec.loader.exec_module(module)
    finally:
        _loading_fallback -= 1
    return module


class SwappedModule(ModuleType):
    """vLLM module ``name`` served by kvcache module ``target`` (see the module docstring)."""

    def __init__(self, name: str, target: ModuleType, reexports_from_vllm: bool) -> None:
        super().__init__(name)
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_reexports_from_vllm", reexports_from_vllm)

    def __getattr__(self, attr: str) -> Any:
        target: ModuleType = object.__getattribute__(self, "_target")
        if attr.startswith("__") and attr not in ("__all__", "__file__"):
            raise AttributeError(attr)
        if hasattr(target, attr):
            value = getattr(target, attr)
            origin = getattr(value, "__module__", None)
            if object.__getattribute__(self, "_reexports_from_vllm") and origin in _VOCABULARY:
                # vLLM's core modules re-export vLLM's vocabulary: serve vLLM's object.
                vllm_module = importlib.import_module(_VOCABULARY[origin])
                if hasattr(vllm_module, attr):
                    return getattr(vllm_module, attr)
            return value
        return _fallback(self.__name__, attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_target"), attr, value)

    def __delattr__(self, attr: str) -> None:
        delattr(object.__getattribute__(self, "_target"), attr)

    def __dir__(self) -> list[str]:
        return dir(object.__getattribute__(self, "_target"))


_VOCABULARY = {kv: vllm for vllm, kv in VOCABULARY_SWAPS.items()}


def _fallback(vllm_name: str, attr: str) -> Any:
    """vLLM's own ``attr`` of ``vllm_name`` if listed in FALLBACKS (or while loading one)."""
    if attr in FALLBACKS.get(vllm_name, {}) or _loading_fallback:
        real = _real_module(vllm_name)
        if hasattr(real, attr):
            if not _loading_fallback:
                _fallbacks_used.setdefault(vllm_name, Counter())[attr] += 1
            return getattr(real, attr)
    raise AttributeError(
        f"kvcache serves {vllm_name} and has no {attr!r} (not a listed fallback: "
        "kvcache.kit.upstream.FALLBACKS)"
    )


def _reload(original: Any) -> Any:
    def reload(module: ModuleType) -> ModuleType:
        if isinstance(module, SwappedModule):
            original(object.__getattribute__(module, "_target"))
            return module
        result: ModuleType = original(module)
        return result

    return reload


def install_swaps(mode: str) -> None:
    """Put kvcache's modules in place of vLLM's for ``mode`` (before any test imports)."""
    swaps = dict(CORE_SWAPS)
    if mode == "vocabulary":
        swaps = {**VOCABULARY_SWAPS, **CORE_SWAPS}
    for vllm_name, kv_name in swaps.items():
        if vllm_name in sys.modules:
            raise RuntimeError(f"{vllm_name} was imported before kvcache could replace it")
        target = importlib.import_module(kv_name)
        parent_name, _, child = vllm_name.rpartition(".")
        parent = importlib.import_module(parent_name)
        swapped = SwappedModule(vllm_name, target, reexports_from_vllm=mode == "objects")
        sys.modules[vllm_name] = swapped
        setattr(parent, child, swapped)
    importlib.reload = _reload(importlib.reload)


def _tracer(frame: FrameType, event: str, arg: Any) -> None:
    global _kvcache_calls
    code = frame.f_code
    path = code.co_filename
    if path in AUDITED:
        if code.co_flags & inspect.CO_NEWLOCALS:  # a function, not a module or class body
            _audit[f"{AUDITED[path]}:{code.co_name}"] += 1
    elif path.startswith(KVCACHE_DIR) and "/kit/" not in path[len(KVCACHE_DIR) - 1 :]:
        _kvcache_calls += 1


def pin_cpu_platform() -> None:
    """Use vLLM's CPU platform when vLLM detects none (no GPU, a non-CPU build of vLLM).

    Some tests build a ``VllmConfig``, which asks for the current platform's device.
    """
    import vllm.platforms as platforms

    if platforms.resolve_current_platform_cls_qualname().endswith("UnspecifiedPlatform"):
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()


def pytest_configure(config: pytest.Config) -> None:
    """Install the swaps and the call audit before collection imports vLLM's tests."""
    if MODE not in ("vllm", "objects", "vocabulary"):
        raise pytest.UsageError(f"KVCACHE_UPSTREAM_MODE={MODE!r}: vllm, objects or vocabulary")
    pin_cpu_platform()
    if MODE != "vllm":
        install_swaps(MODE)
    sys.settrace(_tracer)
    threading.settrace(_tracer)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Record each test's outcome: passed only if setup, call and teardown all passed."""
    if report.when == "call" or report.outcome != "passed":
        previous = _outcomes.get(report.nodeid)
        if previous is None or previous == "passed":
            _outcomes[report.nodeid] = report.outcome


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the report: outcomes, fallbacks used, audited calls, kvcache call count."""
    sys.settrace(None)
    threading.settrace(None)
    if MODE == "vllm":
        audit = dict(_audit)
    else:
        audit = {name: n for name, n in _audit.items() if name not in ALLOWED_AUDIT}
    if REPORT:
        Path(REPORT).write_text(
            json.dumps(
                {
                    "mode": MODE,
                    "outcomes": _outcomes,
                    "fallbacks": {m: dict(c) for m, c in _fallbacks_used.items()},
                    "audit": audit,
                    "audit_allowed": {n: c for n, c in _audit.items() if n in ALLOWED_AUDIT},
                    "kvcache_calls": _kvcache_calls,
                },
                indent=1,
                sort_keys=True,
            )
        )
