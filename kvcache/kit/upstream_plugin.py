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

import functools
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

from kvcache.kit.upstream import AUDITED_FILES, RELEASES

MODE = os.environ.get("KVCACHE_UPSTREAM_MODE", "vllm")
REPORT = os.environ.get("KVCACHE_UPSTREAM_REPORT")
# The release whose tests run: its swaps and fallbacks (``KVCACHE_UPSTREAM_VERSION``).
RELEASE = RELEASES[os.environ.get("KVCACHE_UPSTREAM_VERSION", "0.25.1")]
FALLBACKS = RELEASE.fallbacks
NOT_MODELLED = RELEASE.not_modelled
VOCABULARY_SWAPS = RELEASE.vocabulary_swaps

_outcomes: dict[str, str] = {}
_fallbacks_used: dict[str, Counter[str]] = {}
_not_modelled_used: Counter[str] = Counter()  # placeholders called (NOT_MODELLED)
_kvcache_calls = 0
_audit: Counter[str] = Counter()  # vLLM core functions that ran (outside a fallback's tree)
_allowed: Counter[str] = Counter()  # ... inside a listed fallback's call tree
_loading_fallback = 0


def _vllm_dir() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None, "vLLM is not installed"
    return Path(spec.origin).resolve().parent


VLLM_DIR = _vllm_dir()
KVCACHE_DIR = str(Path(__file__).resolve().parents[1]) + os.sep
AUDITED = {str(VLLM_DIR.parent / path): path for path in AUDITED_FILES}


def _real_module(vllm_name: str) -> ModuleType:
    """vLLM's own module ``vllm_name``, loaded under another name (for fallbacks only)."""
    alias = f"_kvcache_upstream.{vllm_name}"
    if alias in sys.modules:
        return sys.modules[alias]
    path = VLLM_DIR.parent / (vllm_name.replace(".", "/") + ".py")
    # Named as in vLLM, so its classes and functions carry vLLM's own module name
    # (kvcache recognises vLLM's spec classes by module and name); kept in
    # sys.modules under the alias, since the real name is the swapped module's.
    spec = importlib.util.spec_from_file_location(vllm_name, path)
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


_MISSING = object()


class SwappedModule(ModuleType):
    """vLLM module ``name`` served by kvcache module ``target`` (see the module docstring).

    ``overlays`` are kvcache modules searched before ``target`` (a release's drop-in
    module, e.g. ``kvcache.vllm_0_33``, whose names replace the shared module's); a
    name set through this module goes to the first of them that has it, else to
    ``target``.
    """

    def __init__(
        self,
        name: str,
        target: ModuleType,
        reexports_from_vllm: bool,
        overlays: tuple[ModuleType, ...] = (),
    ) -> None:
        super().__init__(name)
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_overlays", overlays)
        object.__setattr__(self, "_reexports_from_vllm", reexports_from_vllm)
        # Per name set through this module, the values it replaced (see __delattr__).
        object.__setattr__(self, "_replaced", {})

    def _holder(self, attr: str) -> ModuleType:
        """The module serving ``attr``: the first overlay that has it, else the target."""
        for overlay in object.__getattribute__(self, "_overlays"):
            if attr in overlay.__dict__:
                held: ModuleType = overlay
                return held
        target: ModuleType = object.__getattribute__(self, "_target")
        return target

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr not in ("__all__", "__file__"):
            raise AttributeError(attr)
        target = object.__getattribute__(self, "_holder")(attr)
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
        target = object.__getattribute__(self, "_holder")(attr)
        replaced: dict[str, list[Any]] = object.__getattribute__(self, "_replaced")
        replaced.setdefault(attr, []).append(target.__dict__.get(attr, _MISSING))
        setattr(target, attr, value)

    def __delattr__(self, attr: str) -> None:
        # pytest's monkeypatch reads the old value from this module's own (empty)
        # __dict__ and so undoes each patch by deleting the name: each delete puts
        # back the value the matching set replaced (kvcache's own, in the end).
        target = object.__getattribute__(self, "_holder")(attr)
        stack = object.__getattribute__(self, "_replaced").get(attr)
        previous = stack.pop() if stack else _MISSING
        if previous is _MISSING:
            delattr(target, attr)
        else:
            setattr(target, attr, previous)

    def __dir__(self) -> list[str]:
        names = set(dir(object.__getattribute__(self, "_target")))
        for overlay in object.__getattribute__(self, "_overlays"):
            names.update(dir(overlay))
        return sorted(names)


_VOCABULARY = {kv: vllm for vllm, kv in VOCABULARY_SWAPS.items()}


_fallback_depth = threading.local()
_wrapped: dict[tuple[str, str], Any] = {}


def _inside_fallback() -> bool:
    return bool(_loading_fallback or getattr(_fallback_depth, "n", 0))


def _audited_call_tree(function: Any) -> Any:
    """``function`` marked so the audit knows what runs inside it is a fallback's work."""

    @functools.wraps(function)
    def fallback(*args: Any, **kwargs: Any) -> Any:
        _fallback_depth.n = getattr(_fallback_depth, "n", 0) + 1
        try:
            return function(*args, **kwargs)
        finally:
            _fallback_depth.n -= 1

    return fallback


_placeholders: dict[tuple[str, str], type] = {}


def _not_modelled(vllm_name: str, attr: str, reason: str) -> type:
    """A placeholder for ``vllm_name.attr`` (see ``Release.not_modelled``): importable,
    subclassable, and calling it (building one) raises ``NotImplementedError``."""
    key = (vllm_name, attr)
    if key not in _placeholders:

        def refuse(cls: type, *args: Any, **kwargs: Any) -> Any:
            _not_modelled_used[f"{vllm_name}.{attr}"] += 1
            raise NotImplementedError(f"{vllm_name}.{attr}: {reason}")

        _placeholders[key] = type(attr, (), {"__new__": refuse, "__module__": vllm_name})
    return _placeholders[key]


def _fallback(vllm_name: str, attr: str) -> Any:
    """vLLM's own ``attr`` of ``vllm_name`` if listed in FALLBACKS (or while loading one);
    a placeholder if the release lists it as not modelled."""
    if attr in NOT_MODELLED.get(vllm_name, {}) and not _loading_fallback:
        return _not_modelled(vllm_name, attr, NOT_MODELLED[vllm_name][attr])
    if attr in FALLBACKS.get(vllm_name, {}) or _loading_fallback:
        real = _real_module(vllm_name)
        if hasattr(real, attr):
            value = getattr(real, attr)
            if _loading_fallback:
                return value
            _fallbacks_used.setdefault(vllm_name, Counter())[attr] += 1
            if inspect.isfunction(value):
                key = (vllm_name, attr)
                if key not in _wrapped:
                    _wrapped[key] = _audited_call_tree(value)
                return _wrapped[key]
            return value
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


def _vllm_events_pool_module(modules: list[ModuleType]) -> ModuleType:
    """An overlay serving ``BlockPool`` under vLLM's module name in ``objects`` mode: a
    pool a test builds on its own, from plain numbers, emits vLLM's event structs, as
    the pool of the module it imported (vLLM's) does. Pools that managers build come
    from kvcache's own module and choose by their config (``built_from_vllm``)."""
    base = modules[0].BlockPool

    class BlockPool(base):  # type: ignore[misc, valid-type]
        __doc__ = base.__doc__

        def __init__(self, *args: Any, vllm_events: bool = True, **kwargs: Any) -> None:
            super().__init__(*args, vllm_events=vllm_events, **kwargs)

    BlockPool.__module__ = base.__module__
    overlay = ModuleType("kvcache.kit.upstream_plugin.vllm_events_pool")
    overlay.BlockPool = BlockPool  # type: ignore[attr-defined]
    return overlay


def install_swaps(mode: str) -> None:
    """Put kvcache's modules in place of vLLM's for ``mode`` (before any test imports)."""
    swaps: dict[str, tuple[str, ...]] = dict(RELEASE.core_swaps)
    if mode == "vocabulary":
        swaps = {**{k: (v,) for k, v in VOCABULARY_SWAPS.items()}, **swaps}
    for vllm_name, kv_names in swaps.items():
        if vllm_name in sys.modules:
            raise RuntimeError(f"{vllm_name} was imported before kvcache could replace it")
        *overlays, target = (importlib.import_module(name) for name in kv_names)
        if mode == "objects" and vllm_name.endswith(".block_pool"):
            overlays.insert(0, _vllm_events_pool_module(overlays or [target]))
        parent_name, _, child = vllm_name.rpartition(".")
        parent = importlib.import_module(parent_name)
        swapped = SwappedModule(
            vllm_name, target, reexports_from_vllm=mode == "objects", overlays=tuple(overlays)
        )
        sys.modules[vllm_name] = swapped
        setattr(parent, child, swapped)
    importlib.reload = _reload(importlib.reload)


def _tracer(frame: FrameType, event: str, arg: Any) -> None:
    global _kvcache_calls
    code = frame.f_code
    path = code.co_filename
    if path in AUDITED:
        if code.co_flags & inspect.CO_NEWLOCALS:  # a function, not a module or class body
            name = f"{AUDITED[path]}:{code.co_qualname}"
            if (
                MODE != "vllm"
                and not _always_forbidden(name)
                and (_inside_fallback() or _generator_of_allowed(name, code.co_flags))
            ):
                _allowed[name] += 1
            else:
                _audit[name] += 1
    elif path.startswith(KVCACHE_DIR) and "/kit/" not in path[len(KVCACHE_DIR) - 1 :]:
        _kvcache_calls += 1


def _generator_of_allowed(name: str, flags: int) -> bool:
    """A generator resumed (or closed by the collector) after its fallback returned."""
    enclosing, local, _ = name.partition(".<locals>.")
    return bool(flags & inspect.CO_GENERATOR) and bool(local) and enclosing in _allowed


def _always_forbidden(name: str) -> bool:
    """Manager, coordinator, pool and hashing logic: never vLLM's, not even in a fallback."""
    path, _, qualname = name.partition(":")
    if not path.endswith("kv_cache_utils.py"):
        return True
    if qualname.partition(".<locals>.")[0] in SIZING_PREDICATES:
        return False
    lowered = qualname.lower()
    return qualname.startswith(FORBIDDEN_CLASSES) or any(w in lowered for w in FORBIDDEN_WORDS)


FORBIDDEN_CLASSES = ("KVCacheBlock.", "FreeKVCacheBlockQueue.", "BlockHashListWithBlockSize.")
FORBIDDEN_WORDS = ("hash", "extra_keys", "tensor_data", "block_id")
# Predicates on group specs alone (no block allocated, hashed or looked up) that a
# listed sizing fallback calls inside vLLM's own module: vLLM 0.33.0's
# resolve_kv_cache_block_sizes asks partial_hash_hits_enabled whether a hash block
# may be smaller than the Mamba block. Allowed inside a fallback's call tree only;
# the managers kvcache builds use kvcache's own (kvcache.vllm_0_33).
SIZING_PREDICATES = ("partial_hash_hits_enabled",)


def _compiled_build() -> bool:
    """Whether kvcache's compiled build served the run (its calls are invisible to
    ``sys.settrace``; the audit of vLLM's files still sees any vLLM logic)."""
    import kvcache

    return bool(kvcache.COMPILED)


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
    if os.environ.get("KVCACHE_EXPECT_COMPILED") == "1" and not _compiled_build():
        raise pytest.UsageError("KVCACHE_EXPECT_COMPILED=1 but kvcache's pure build is loaded")
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
    audit = dict(_audit)
    if REPORT:
        Path(REPORT).write_text(
            json.dumps(
                {
                    "mode": MODE,
                    "outcomes": _outcomes,
                    "fallbacks": {m: dict(c) for m, c in _fallbacks_used.items()},
                    "not_modelled": dict(_not_modelled_used),
                    "audit": audit,
                    "audit_allowed": dict(_allowed),
                    "kvcache_calls": _kvcache_calls,
                    "compiled": _compiled_build(),
                },
                indent=1,
                sort_keys=True,
            )
        )
