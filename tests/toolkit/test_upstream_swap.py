"""The upstream stage's module swap survives pytest's monkeypatch (kvcache.kit.upstream_plugin).

vLLM's tests patch names of ``vllm.v1.core.kv_cache_utils`` (e.g. ``tensor_data``)
with ``monkeypatch.setattr``; on the swapped module the patch must land on
kvcache's module and its undo must put kvcache's own function back, not
delete it (which broke every later prompt-embeds test of the run).
"""

from __future__ import annotations

from types import ModuleType

import pytest


def test_monkeypatch_undo_restores_the_served_name(vllm_reference: ModuleType) -> None:
    from kvcache.kit.upstream_plugin import SwappedModule

    target = ModuleType("scratch")
    target.helper = len  # type: ignore[attr-defined]
    swapped = SwappedModule("vllm.scratch", target, reexports_from_vllm=False)
    with pytest.MonkeyPatch().context() as m:
        m.setattr(swapped, "helper", abs)
        m.setattr(swapped, "helper", max)  # twice: the undo still ends at the original
        m.setattr(swapped, "added", 1, raising=False)
        assert target.helper is max and swapped.helper is max  # type: ignore[attr-defined]
    assert target.helper is len  # type: ignore[attr-defined]
    assert not hasattr(target, "added")
    with pytest.raises(AttributeError):
        del swapped.missing
