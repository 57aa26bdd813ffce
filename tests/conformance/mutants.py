"""kvcache with one realistic bug each, plugged in as third-party manager factories.

Each class has ``KVCacheManager``'s constructor signature, so
``conformance.mutants:FreeInAllocationOrder`` is an implementation name like any
other (``kvcache.kit.sides.resolve_adapter``): the harness must catch each.
"""

from __future__ import annotations

from typing import Any

import kvcache
from kvcache.kit.config import ManagerConfig
from kvcache.kit.sides import ProfileAdapter


class FreeInAllocationOrder(kvcache.KVCacheManager):
    """Bug: ``free`` releases blocks head first, so a chain's head is evicted first."""

    def free(self, request: Any) -> None:
        self.block_pool.free_blocks(self.pop_blocks_for_free(request))


class IgnoresWatermark(kvcache.KVCacheManager):
    """Bug: admissions never keep the watermark free."""

    def allocate_slots(self, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        kwargs["has_scheduled_reqs"] = False
        return super().allocate_slots(request, num_new_tokens, *args, **kwargs)


class StatsCountPreemptedAsNew(kvcache.KVCacheManager):
    """Bug: a preempted request's lookup is counted as a new request's."""

    def get_computed_blocks(self, request: Any) -> Any:
        num_preemptions = request.num_preemptions
        request.num_preemptions = 0
        try:
            return super().get_computed_blocks(request)
        finally:
            request.num_preemptions = num_preemptions


class IgnoresRetentionInterval(kvcache.KVCacheManager):
    """Bug: a drop-in that never reads ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``, so
    sliding-window and Mamba groups cache densely where vLLM caches sparsely."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs, prefix_cache_retention_interval=None)


class OneReplayBoundary(ProfileAdapter):
    """Bug: kvcache's 0.33.0 drop-in with 0.25.1's single replay boundary under sparse
    retention (``retention_replay_boundaries`` off): with EAGLE it keeps the window
    tail above the post-drop position, where 0.33.0 keeps the tails below a resend's
    and a longer sibling's. Used as ``conformance.mutants:OneReplayBoundary``."""

    def __init__(self) -> None:
        super().__init__("kvcache-0.33-one-replay-boundary", "kvcache.vllm_0_33", "0.33")

    def build_manager(self, config: ManagerConfig) -> Any:
        manager = super().build_manager(config)
        manager.coordinator.retention_replay_boundaries = False
        return manager


class NoJunctionTails(ProfileAdapter):
    """Bug: kvcache's 0.33.0 drop-in whose groups ignore the request's shared-prefix
    boundary under sparse retention (``shared_prefix_junctions`` off in the managers),
    so the tail before a shared prefix's junction is not kept. Used as
    ``conformance.mutants:NoJunctionTails``."""

    def __init__(self) -> None:
        super().__init__("kvcache-0.33-no-junction-tails", "kvcache.vllm_0_33", "0.33")

    def build_manager(self, config: ManagerConfig) -> Any:
        manager = super().build_manager(config)
        for group_manager in manager.coordinator.single_type_managers:
            group_manager.shared_prefix_junctions = False
        return manager


class PlainConnectorLookup(ProfileAdapter):
    """Bug: kvcache's 0.33.0 drop-in whose connector lookup is the plain one beside
    Mamba too (``get_computed_blocks`` and never diverged), as before the lookup was
    modelled. Used as ``conformance.mutants:PlainConnectorLookup``."""

    def __init__(self) -> None:
        super().__init__("kvcache-0.33-plain-connector-lookup", "kvcache.vllm_0_33", "0.33")

    def get_computed_blocks_for_connector(
        self, manager: Any, request: Any
    ) -> tuple[Any, int, int, bool]:
        blocks, num_hit_tokens, boundary = manager.get_computed_blocks(request)
        request.shared_prefix_boundary = int(boundary)
        return blocks, int(num_hit_tokens), int(boundary), False


class NoConnectorFallback(ProfileAdapter):
    """Bug: kvcache's 0.33.0 drop-in whose connector lookup keeps the per-group hits
    when a group hit deeper than full attention (no fall back to
    ``get_computed_blocks``). Used as ``conformance.mutants:NoConnectorFallback``."""

    def __init__(self) -> None:
        super().__init__("kvcache-0.33-no-connector-fallback", "kvcache.vllm_0_33", "0.33")

    def get_computed_blocks_for_connector(
        self, manager: Any, request: Any
    ) -> tuple[Any, int, int, bool]:
        full_group_id = getattr(manager.coordinator, "full_attention_group_id", None)
        if (
            full_group_id is None
            or not manager.kv_cache_config.has_mamba_layers
            or not manager.prefix_cache_lookup_enabled(request)
        ):
            return super().get_computed_blocks_for_connector(manager, request)
        hits, lengths = manager.coordinator.find_longest_cache_hit_per_group(
            request.block_hashes, request.num_tokens - 1
        )
        request.shared_prefix_boundary = 0
        num_local = lengths[full_group_id]
        return manager.create_kv_cache_blocks(hits), num_local, 0, min(lengths) < num_local


class _SkipZeroingIgnored:
    """A manager that drops ``allocate_slots``' ``skip_zeroing_group_ids`` and passes
    everything else through (works on the compiled build too)."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def allocate_slots(self, *args: Any, skip_zeroing_group_ids: Any = (), **kwargs: Any) -> Any:
        return self._manager.allocate_slots(*args, **kwargs)


class IgnoresSkipZeroing(ProfileAdapter):
    """Bug: kvcache's 0.33.0 drop-in that reports an async load's blocks for zeroing
    although the load writes them (``skip_zeroing_group_ids`` ignored). Used as
    ``conformance.mutants:IgnoresSkipZeroing``."""

    def __init__(self) -> None:
        super().__init__("kvcache-0.33-ignores-skip-zeroing", "kvcache.vllm_0_33", "0.33")

    def build_manager(self, config: ManagerConfig) -> Any:
        return _SkipZeroingIgnored(super().build_manager(config))
