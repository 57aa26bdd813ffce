"""The upstream stage per release (kvcache.kit.upstream): vLLM 0.33.0's selection, its
swap through the drop-in module, placeholders for what is not modelled, and the
known-failing ratchet read from TOML."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvcache.kit import upstream


def test_overlay_serves_the_drop_in_first(vllm_reference: ModuleType) -> None:
    """A name of the overlay (the release's drop-in) wins over the shared module's;
    a patch through the swapped module lands where the name is served, and its undo
    puts the overlay's own value back."""
    from kvcache.kit.upstream_plugin import SwappedModule

    shared = ModuleType("shared")
    shared.helper = len  # type: ignore[attr-defined]
    shared.only_shared = abs  # type: ignore[attr-defined]
    drop_in = ModuleType("drop_in")
    drop_in.helper = max  # type: ignore[attr-defined]
    swapped = SwappedModule("vllm.scratch", shared, reexports_from_vllm=False, overlays=(drop_in,))
    assert swapped.helper is max and swapped.only_shared is abs
    assert {"helper", "only_shared"} <= set(dir(swapped))
    with pytest.MonkeyPatch().context() as m:
        m.setattr(swapped, "helper", min)
        assert drop_in.helper is min and shared.helper is len  # type: ignore[attr-defined]
    assert drop_in.helper is max  # type: ignore[attr-defined]


def test_not_modelled_placeholder_refuses_to_run(vllm_reference: ModuleType) -> None:
    """A placeholder imports and subclasses; building or calling it raises
    NotImplementedError naming the vLLM name and the feature."""
    from kvcache.kit.upstream_plugin import _not_modelled

    placeholder = _not_modelled("vllm.v1.core.x", "CircularBufferManager", "not modelled: rings")
    assert placeholder.__name__ == "CircularBufferManager"

    class Sub(placeholder):  # type: ignore[misc,valid-type]
        pass

    for build in (placeholder, Sub):
        with pytest.raises(NotImplementedError, match=r"x\.CircularBufferManager: not modelled"):
            build(1, key=2)


def test_release_0_33_selection_and_swaps() -> None:
    """0.33.0 runs vLLM and objects mode only, serves the manager and hashing modules
    from kvcache.vllm_0_33 first, and lists no fallback that is manager, pool or
    hashing logic (those are placeholders, never vLLM's code)."""
    release = upstream.RELEASES["0.33.0"]
    assert release.modes == ("vllm", "objects")
    assert release.core_swaps["vllm.v1.core.kv_cache_manager"] == (
        "kvcache.vllm_0_33", "kvcache.kv_cache_manager",
    )  # fmt: skip
    for module in ("block_pool", "single_type_kv_cache_manager", "kv_cache_utils"):
        # The drop-in's 0.33.0 signatures (BlockPool, the single-type managers) first.
        assert release.core_swaps[f"vllm.v1.core.{module}"] == (
            "kvcache.vllm_0_33", f"kvcache.{module}",
        )  # fmt: skip
    assert set(release.core_swaps) == set(upstream.CORE_SWAPS)
    utils_fallbacks = release.fallbacks["vllm.v1.core.kv_cache_utils"]
    for name in utils_fallbacks:
        assert not any(word in name.lower() for word in ("hash", "extra_keys", "block_id"))
    for module, names in release.not_modelled.items():
        assert not set(names) & set(release.fallbacks.get(module, {})), module
    # 0.25.1 keeps its three modes and its single-module swaps.
    old = upstream.RELEASES["0.25.1"]
    assert old.modes == upstream.MODES and old.not_modelled == {}
    assert all(len(modules) == 1 for modules in old.core_swaps.values())


def test_release_0_33_known_failing_reasons() -> None:
    """Every known failure of 0.33.0 names the feature it needs, and each pattern is a
    test of the release's files."""
    release = upstream.RELEASES["0.33.0"]
    for rule in release.known_failing:  # the ratchet shrinks as features land
        assert rule.pattern.split("::")[0] in release.files, rule.pattern
        assert rule.reason.startswith(("not modelled", "no switch yet", "drop-in gap")), rule
    # A pattern ending in "[" covers every parametrization, and only those.
    prefix = upstream.Excluded("tests/v1/core/t.py::test_a[", "not modelled: x")
    assert prefix.matches("tests/v1/core/t.py::test_a[1-2]")
    assert not prefix.matches("tests/v1/core/t.py::test_ab")


def test_known_failing_toml_refuses_an_unknown_reason(tmp_path: Path) -> None:
    path = tmp_path / "known.toml"
    path.write_text('[reasons]\na = "feature A"\nb = "feature B"\n[tests]\n"t.py::x[" = "a+b"\n')
    (rule,) = upstream.known_failing_from(path)
    assert rule.pattern == "t.py::x[" and rule.reason == "feature A; feature B"
    assert rule.matches("t.py::x[1]") and not rule.matches("t.py::xy")
    path.write_text('[reasons]\na = "feature A"\n[tests]\n"t.py::y" = "a+c"\n')
    with pytest.raises(ValueError, match=r"t\.py::y: unknown reason 'c'"):
        upstream.known_failing_from(path)


def report(outcomes: dict[str, str], audit: dict[str, int] | None = None) -> dict[str, Any]:
    return {"outcomes": outcomes, "fallbacks": {}, "audit": audit or {}, "kvcache_calls": 1}


def test_judge_objects_only_release() -> None:
    """A release without the vocabulary mode is judged on objects mode alone: a known
    failure is accepted, a new one and a stale one are problems."""
    release = upstream.Release(
        "9.9.9", files=("t.py",), modes=("vllm", "objects"),
        known_failing=(upstream.Excluded("t.py::known", "not modelled: X"),),
    )  # fmt: skip
    vllm = report({"t.py::a": "passed", "t.py::known": "passed"}, audit={"f": 1})
    verdict = upstream.judge(release, {"vllm": vllm, "objects": report(
        {"t.py::a": "passed", "t.py::known": "failed"})})  # fmt: skip
    assert verdict.problems == []
    assert "1 passed of 2 (vLLM objects), kvcache vocabulary not run" in verdict.summary()
    verdict = upstream.judge(release, {"vllm": vllm, "objects": report(
        {"t.py::a": "failed", "t.py::known": "passed"})})  # fmt: skip
    assert any("1 tests pass on vLLM but not on kvcache" in p for p in verdict.problems)
    assert any("known-failing tests pass now" in p for p in verdict.problems)


def test_release_0_33_compiled_ratchet() -> None:
    """The compiled-only failures of 0.33.0 are tests of the release's files, not also
    in the pure ratchet, and each says why compiled classes refuse what the test does."""
    release = upstream.RELEASES["0.33.0"]
    pure = {rule.pattern for rule in release.known_failing}
    assert release.known_failing_compiled  # today: one test patches a manager instance
    for rule in release.known_failing_compiled:
        assert rule.pattern.split("::")[0] in release.files, rule.pattern
        assert rule.pattern not in pure, rule.pattern
        assert "compiled" in rule.reason and "__dict__" in rule.reason, rule


def test_judge_applies_the_compiled_ratchet_on_the_compiled_build_only() -> None:
    """A compiled-only known failure is accepted when the swapped run was compiled, a
    new failure on the pure build; on the compiled build it turns stale once it passes."""
    release = upstream.Release(
        "9.9.9", files=("t.py",), modes=("vllm", "objects"),
        known_failing_compiled=(upstream.Excluded("t.py::patch", "compiled: no __dict__"),),
    )  # fmt: skip
    vllm = report({"t.py::a": "passed", "t.py::patch": "passed"}, audit={"f": 1})
    failing = report({"t.py::a": "passed", "t.py::patch": "failed"})
    compiled = upstream.judge(release, {"vllm": vllm, "objects": failing | {"compiled": True}})
    assert compiled.problems == [] and compiled.compiled
    assert "compiled build; 0 excluded, 1 known failing" in compiled.summary()
    pure = upstream.judge(release, {"vllm": vllm, "objects": failing})
    assert pure.problems == ["objects: 1 tests pass on vLLM but not on kvcache"]
    passing = report({"t.py::a": "passed", "t.py::patch": "passed"}) | {"compiled": True}
    stale = upstream.judge(release, {"vllm": vllm, "objects": passing})
    assert any("known-failing tests pass now" in p for p in stale.problems)
