"""kvcache's ``KVCacheSpecRegistry`` (vLLM 0.33.0's ``vllm.v1.kv_cache_spec_registry``
API, exposed by ``kvcache.vllm_0_33``): registered spec classes and group roles
choose the manager a coordinator builds; built-in kinds answer by class name."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

import kvcache.kv_cache_utils as kcu
from kvcache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    MLAAttentionSpec,
    Request,
    SlidingWindowSpec,
    sha256,
)
from kvcache import vllm_0_33 as v33
from kvcache.kv_cache_interface import KVCacheSpecValueError
from kvcache.single_type_kv_cache_manager import (
    FullAttentionManager,
    SlidingWindowManager,
)

Registry = v33.KVCacheSpecRegistry


@dataclass(frozen=True, kw_only=True)
class ScratchFullSpec(FullAttentionSpec):
    """A custom spec (as a platform plug-in would define one)."""


@dataclass(frozen=True, kw_only=True)
class UnregisteredSpec(FullAttentionSpec):
    """A subclass nobody registers: found as full attention by its base."""


class CountingManager(FullAttentionManager):
    """A custom manager: full attention that counts its allocations."""

    allocations = 0

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list[kcu.KVCacheBlock]:
        type(self).allocations += 1
        return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)


@dataclass
class RoleGroupSpec(KVCacheGroupSpec):
    """A group with vLLM 0.33.0's ``role`` field."""

    role: str = "default"


@pytest.fixture(autouse=True)
def clean_registry() -> Iterator[None]:
    kcu.init_none_hash(sha256)
    yield
    Registry.unregister(ScratchFullSpec)
    Registry.unregister(role="scratch_role")


def spec(cls: type = FullAttentionSpec, heads: int = 1) -> FullAttentionSpec:
    made: FullAttentionSpec = cls(block_size=4, num_kv_heads=heads, head_size=8, dtype="float16")
    return made


def test_builtin_kinds_answer_by_class_name() -> None:
    assert Registry.get_manager_class(spec()) is FullAttentionManager
    assert Registry.get_manager_class(spec(MLAAttentionSpec)) is FullAttentionManager
    assert Registry.get_uniform_type_base_spec(spec(MLAAttentionSpec)) is FullAttentionSpec
    swa = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16",
                            sliding_window=8)
    assert Registry.get_manager_class(swa) is SlidingWindowManager
    assert Registry.get_uniform_type_base_spec(swa) is SlidingWindowSpec
    assert Registry.get_manager_class(spec(UnregisteredSpec)) is FullAttentionManager
    assert Registry.get_manager_class(object()) is None
    assert Registry.get_uniform_type_base_spec(object()) is None


def test_registered_spec_class_chooses_the_manager_the_coordinator_builds() -> None:
    @v33.register_kv_cache_spec(CountingManager, uniform_type_base_spec=FullAttentionSpec)
    @dataclass(frozen=True, kw_only=True)
    class _Alias(ScratchFullSpec):
        pass

    Registry.register(ScratchFullSpec, CountingManager, uniform_type_base_spec=FullAttentionSpec)
    Registry.register(ScratchFullSpec, CountingManager, FullAttentionSpec)  # same: a no-op
    assert Registry.get_manager_class(spec(ScratchFullSpec)) is CountingManager
    assert Registry.get_manager_class(spec(_Alias)) is CountingManager
    assert Registry.get_uniform_type_base_spec(spec(ScratchFullSpec)) is FullAttentionSpec
    config = KVCacheConfig(8, [], [KVCacheGroupSpec(["l0"], spec(ScratchFullSpec))])
    m = v33.KVCacheManager(config, max_model_len=32, scheduler_block_size=4, hash_block_size=4)
    assert type(m.coordinator.single_type_managers[0]) is CountingManager
    before = CountingManager.allocations
    r = Request("r", [1, 2, 3, 4, 5], block_hasher=v33.get_request_block_hasher(4, sha256))
    assert m.allocate_slots(r, 5) is not None
    assert CountingManager.allocations == before + 1
    Registry.unregister(_Alias)


def test_a_group_role_takes_precedence_over_the_spec() -> None:
    Registry.register_role_manager("scratch_role", CountingManager)
    Registry.register_role_manager("scratch_role", CountingManager)  # same: a no-op
    config = KVCacheConfig(16, [], [
        RoleGroupSpec(["l0"], spec(heads=1), role="scratch_role"),
        RoleGroupSpec(["l1"], spec(heads=2)),
    ])
    m = v33.KVCacheManager(config, max_model_len=32, scheduler_block_size=4, hash_block_size=4)
    kinds = [type(x) for x in m.coordinator.single_type_managers]
    assert kinds == [CountingManager, FullAttentionManager]
    assert Registry.get_manager_class(spec(), role="scratch_role") is CountingManager
    assert Registry.get_manager_class(spec(), role="default") is FullAttentionManager


def test_without_registrations_0_25_1_managers_are_as_before() -> None:
    config = KVCacheConfig(8, [], [KVCacheGroupSpec(["l0"], spec(ScratchFullSpec))])
    m = KVCacheManager(config, 32, 4, 4)
    assert type(m.coordinator.single_type_managers[0]) is FullAttentionManager


def test_bad_registrations_are_refused_naming_the_argument() -> None:
    with pytest.raises(KVCacheSpecValueError, match="manager_class is required"):
        Registry.register(ScratchFullSpec)
    with pytest.raises(KVCacheSpecValueError, match="manager_class=<class 'object'>"):
        Registry.register(ScratchFullSpec, object)
    with pytest.raises(KVCacheSpecValueError, match="must subclass"):
        Registry.register(ScratchFullSpec, CountingManager, SlidingWindowSpec)
    Registry.register(ScratchFullSpec, CountingManager, FullAttentionSpec)
    with pytest.raises(KVCacheSpecValueError, match="conflicting registration"):
        Registry.register(ScratchFullSpec, FullAttentionManager, FullAttentionSpec)
    assert Registry.get_manager_class(spec(ScratchFullSpec)) is CountingManager  # kept
    Registry.register_role_manager("scratch_role", CountingManager)
    with pytest.raises(KVCacheSpecValueError, match="group role 'scratch_role'"):
        Registry.register_role_manager("scratch_role", FullAttentionManager)
    with pytest.raises(KVCacheSpecValueError, match="role=3"):
        Registry.register_role_manager(3, CountingManager)


def test_check_names_the_layer_of_an_unknown_spec() -> None:
    Registry.check_kv_cache_spec_registry({"a": spec(), "b": spec(MLAAttentionSpec)})
    with pytest.raises(ValueError, match="layer b"):
        Registry.check_kv_cache_spec_registry({"a": spec(), "b": object()})


def test_a_registration_in_vllms_registry_reaches_kvcache() -> None:
    """vLLM code registering a custom spec with a kvcache manager class in vLLM's own
    ``KVCacheSpecRegistry`` gets that manager from kvcache; vLLM's own spec classes
    keep kvcache's built-in managers."""
    registry = pytest.importorskip("vllm.v1.kv_cache_spec_registry")
    vllm_specs = pytest.importorskip("vllm.v1.kv_cache_interface")

    @dataclass(frozen=True, kw_only=True)
    class VllmCustomSpec(vllm_specs.FullAttentionSpec):  # type: ignore[misc,name-defined]
        pass

    table = registry._REGISTRY_KVCACHESPEC_LIST
    table[VllmCustomSpec] = registry.KVCacheSpecMetadata(
        VllmCustomSpec, CountingManager, vllm_specs.FullAttentionSpec
    )
    try:
        custom = VllmCustomSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
        assert Registry.get_manager_class(custom) is CountingManager
        config = KVCacheConfig(8, [], [KVCacheGroupSpec(["l0"], custom)])
        m = KVCacheManager(config, 32, 4, 4)
        assert type(m.coordinator.single_type_managers[0]) is CountingManager
        plain = vllm_specs.FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8,
                                             dtype="float16")
        assert Registry.get_manager_class(plain) is FullAttentionManager
    finally:
        del table[VllmCustomSpec]
