"""Coordinators: drive one single-type manager per KV-cache group over one pool.

``get_kv_cache_coordinator`` picks, as vLLM 0.25.1 does: no prefix caching ->
``KVCacheCoordinatorNoPrefixCache``; one group -> ``UnitaryKVCacheCoordinator``;
several groups -> ``HybridKVCacheCoordinator``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from mypy_extensions import mypyc_attr

from kvcache import kv_cache_math
from kvcache.block_pool import BlockPool
from kvcache.kv_cache_interface import (
    ContextParallelError,
    KVCacheConfig,
    KVCacheSpec,
    is_dcp_sharded,
    is_prefix_cacheable,
    is_spec_kind,
    needs_kv_cache_zeroing,
)
from kvcache.kv_cache_math import cdiv
from kvcache.kv_cache_utils import (
    BlockHash,
    BlockHashList,
    BlockHashListWithBlockSize,
    KVCacheBlock,
    trim_null_head,
)
from kvcache.kv_events import built_from_vllm
from kvcache.profile import Profile, resolve_profile
from kvcache.single_type_kv_cache_manager import (
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
)

if TYPE_CHECKING:
    from kvcache.request import Request


RETENTION_ENV = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"
#: Default of ``prefix_cache_retention_interval``: read ``RETENTION_ENV`` at construction.
RETENTION_FROM_ENV = "env"


def prefix_cache_retention_interval_from_env() -> int | None:
    """``VLLM_PREFIX_CACHE_RETENTION_INTERVAL`` as vLLM 0.25.1 reads it: unset -> None
    (dense caching), else ``int(value)``.

    Raises:
        ValueError: the variable is set but is not an integer.
    """
    value = os.environ.get(RETENTION_ENV)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{RETENTION_ENV}={value!r} is not an integer") from None


def has_windowed_group(kv_cache_config: KVCacheConfig) -> bool:
    """Whether a group is sliding-window or Mamba: the kinds retention thins out."""
    return any(
        is_spec_kind(g.kv_cache_spec, "SlidingWindowSpec", "MambaSpec")
        for g in kv_cache_config.kv_cache_groups
    )


def resolve_prefix_cache_retention_interval(
    prefix_cache_retention_interval: int | str | None,
    scheduler_block_size: int,
    kv_cache_config: KVCacheConfig,
    zero_without_window: bool = False,
) -> int | None:
    """The retention interval a coordinator uses, checked as vLLM 0.25.1 checks it.

    ``RETENTION_FROM_ENV`` reads the environment (vLLM 0.25.1's only source); None
    keeps dense caching; 0 keeps only the latest replay boundaries; a positive
    multiple of ``scheduler_block_size`` keeps one checkpoint per that many tokens.
    It thins sliding-window and Mamba groups only, so a model without one is
    refused; with ``zero_without_window`` (the ``retention_zero_without_window``
    switch, vLLM 0.33.0) 0 is accepted there, and changes nothing.

    Raises:
        ValueError: not an int; no sliding-window or Mamba group; negative or not a
            multiple of ``scheduler_block_size`` (vLLM raises ValueError too).
    """
    name = "prefix_cache_retention_interval"
    interval: object = prefix_cache_retention_interval
    if interval == RETENTION_FROM_ENV:
        name = RETENTION_ENV
        interval = prefix_cache_retention_interval_from_env()
    if interval is None:
        return None
    if isinstance(interval, bool) or not isinstance(interval, int):
        raise ValueError(
            f"{name}={interval!r}: expected an int, None or {RETENTION_FROM_ENV!r}"
        )
    if not has_windowed_group(kv_cache_config):
        if zero_without_window:
            if interval == 0:
                return 0
            raise ValueError(
                f"{name}={interval} is set but this model has no sliding-window or Mamba "
                "KV cache group, so retention has no effect; set it to 0 (it only "
                "applies to sliding-window and Mamba attention)"
            )
        raise ValueError(
            f"{name}={interval} is set but no KV-cache group is sliding-window or Mamba, "
            "the only kinds whose cached blocks it thins out; unset it"
        )
    if interval < 0 or interval % scheduler_block_size != 0:
        raise ValueError(
            f"{name}={interval} must be non-negative and a multiple of "
            f"scheduler_block_size={scheduler_block_size}"
        )
    return interval


def _finds_fine_grained_hits(manager_cls: type[SingleTypeKVCacheManager]) -> bool:
    """Whether a group of this manager class can find hits ending inside a block
    (vLLM 0.33.0's ``supports_fine_grained_hash_lookup``: full attention and its
    variants, and Mamba)."""
    return manager_cls.supports_fine_grained_hash_lookup


def partial_hash_hits_enabled(
    kv_cache_groups: Sequence[Any],
    hash_block_size: int,
    dcp_world_size: int = 1,
    manager_classes: Sequence[type[SingleTypeKVCacheManager]] | None = None,
) -> bool:
    """Whether a layout gets fine-grained (sub-block) prefix hits under vLLM 0.33.0
    (switch ``mamba_fine_grained_hits``; vLLM 0.33.0's helper of the same name).

    A Mamba 'align' layer's block must be larger than the hash block (under
    ``dcp_world_size > 1`` at least the hash block: the dcp-scaled attention blocks
    are larger than it). Given the groups' ``manager_classes``, every other
    prefix-caching group must also find hits ending inside a block, or be hashed at
    its own (dcp-scaled) block size; a group outside prefix caching (a ring buffer)
    takes no part.
    """

    def layers(spec: Any) -> list[Any]:
        inner = getattr(spec, "kv_cache_specs", None)
        return list(inner.values()) if isinstance(inner, dict) else [spec]

    if not any(
        is_spec_kind(layer, "MambaSpec")
        and layer.mamba_cache_mode == "align"
        and (
            layer.block_size > hash_block_size
            or (dcp_world_size > 1 and layer.block_size == hash_block_size)
        )
        for group in kv_cache_groups
        for layer in layers(group.kv_cache_spec)
    ):
        return False
    if manager_classes is None:
        return True
    for group, manager_cls in zip(kv_cache_groups, manager_classes, strict=True):
        spec = group.kv_cache_spec
        block_size = spec.block_size * (dcp_world_size if is_dcp_sharded(spec) else 1)
        if (
            is_prefix_cacheable(spec)
            and not _finds_fine_grained_hits(manager_cls)
            and block_size != hash_block_size
        ):
            return False
    return True


def _is_full(spec: KVCacheSpec) -> bool:
    """Whether ``spec`` is full attention (kvcache's or vLLM's class, or a subclass:
    MLA and the other full-attention variants count, as in vLLM's isinstance test)."""
    return is_spec_kind(spec, "FullAttentionSpec")


def group_world_sizes(
    kv_cache_spec: KVCacheSpec,
    dcp_world_size: int,
    pcp_world_size: int,
    dcp_sharded_geometry: bool,
    dcp_full_attention_only: bool = False,
) -> tuple[int, int]:
    """The ``(dcp, pcp)`` world sizes one group's manager takes.

    0.25.1 gives every group both. Under ``dcp_sharded_geometry`` (0.26.0) only a
    spec whose blocks are sharded over the ranks (``is_dcp_sharded``) takes them;
    any other group (Mamba, a replicated draft) keeps ``(1, 1)``. Under
    ``dcp_full_attention_only`` (0.29.0-0.30.0: the profile's switch, less
    ``dcp_sharded_field``) only full attention and its subclasses take them, with or
    without that geometry.
    """
    if dcp_full_attention_only:
        if not _is_full(kv_cache_spec):
            return 1, 1
    elif dcp_sharded_geometry and not is_dcp_sharded(kv_cache_spec):
        return 1, 1
    return dcp_world_size, pcp_world_size


@mypyc_attr(allow_interpreted_subclasses=True)
class KVCacheCoordinator:
    """Fans each manager-level operation out to every group's manager.

    Args:
        kv_cache_config: Pool size and groups.
        max_model_len: Longest sequence.
        max_num_batched_tokens: Token budget per step (sizes admission caps).
        use_eagle: Whether EAGLE drafting needs the last hit block recomputed.
        enable_caching: Whether prefix caching is on.
        enable_kv_cache_events: Whether the pool queues KV events.
        dcp_world_size: Decode context parallel size (each group's block spans
            ``block_size * dcp * pcp`` tokens; one group only under caching).
        pcp_world_size: Prefill context parallel size (likewise).
        scheduler_block_size: Scheduling granularity, a multiple of every group's
            block size and of ``hash_block_size``.
        hash_block_size: Granularity of request block hashes.
        metrics_collector: Handed to the ``BlockPool`` (residency metrics), or None.
        prefix_cache_retention_interval: Sparse caching of sliding-window and Mamba
            groups (``resolve_prefix_cache_retention_interval``); by default read from
            ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``, as vLLM does.
        profile: Keyword only: the vLLM release to follow (``kvcache.profile``;
            None: the default release), handed on to the pool, which every group's
            manager is built over. The coordinator reads its own switches under
            their names: ``pcp_not_scaled`` (a block spans ``block_size * dcp``
            tokens), ``dcp_sharded_geometry`` (only sharded specs take the world
            sizes, ``group_world_sizes``, and several caching groups accept context
            parallelism by 0.33.0's rules), ``pop_drops_null_head``,
            ``trim_every_full_group``, ``eagle_peek_to_hashed_length``,
            ``mamba_no_eagle_margin``, ``retention_replay_boundaries``; and at
            construction ``eagle_master_switch`` (without ``use_eagle`` no group is
            an EAGLE group), ``mamba_align_only``, ``mamba_prompt_tail_state`` and,
            in hybrid layouts, ``mamba_fine_grained_hits``.

    Raises:
        AssertionError: a Mamba group caching outside 'align' mode under
            ``mamba_align_only`` (vLLM 0.33.0 asserts too).
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        scheduler_block_size: int,
        hash_block_size: int,
        metrics_collector: Any = None,
        *,
        prefix_cache_retention_interval: int | str | None = RETENTION_FROM_ENV,
        profile: Profile | None = None,
    ) -> None:
        groups = kv_cache_config.kv_cache_groups
        if scheduler_block_size % hash_block_size != 0 or any(
            scheduler_block_size % g.kv_cache_spec.block_size != 0 for g in groups
        ):
            raise ValueError(
                f"scheduler_block_size={scheduler_block_size} must be a multiple of "
                f"hash_block_size={hash_block_size} and of every group's block size "
                f"{[g.kv_cache_spec.block_size for g in groups]}"
            )
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.scheduler_block_size = scheduler_block_size
        profile = resolve_profile(profile)
        self.profile = profile
        self.block_pool = BlockPool(
            num_gpu_blocks=kv_cache_config.num_blocks,
            enable_caching=enable_caching,
            hash_block_size=hash_block_size,
            enable_kv_cache_events=enable_kv_cache_events,
            metrics_collector=metrics_collector,
            vllm_events=built_from_vllm(kv_cache_config),  # vLLM's config: vLLM's events
            profile=profile,
        )
        self.eagle_group_ids = {i for i, g in enumerate(groups) if g.is_eagle_group}
        if use_eagle and not self.eagle_group_ids:
            # No group is marked: treat them all as EAGLE groups.
            self.eagle_group_ids = set(range(len(groups)))
        elif profile.eagle_master_switch and not use_eagle:
            # The groups' marks count only under use_eagle.
            self.eagle_group_ids = set()
        self.pcp_not_scaled = profile.pcp_not_scaled
        self.dcp_sharded_geometry = profile.dcp_sharded_geometry
        # 0.29.0-0.30.0 scale only full-attention groups (0.31.0's dcp_sharded field
        # ends it).
        self.dcp_full_attention_only = (
            profile.dcp_full_attention_only and not profile.dcp_sharded_field
        )
        # Whether fresh blocks are reported for zeroing depends on the layout too
        # (vLLM 0.33.0's KVCacheConfig.needs_kv_cache_zeroing): each manager is told.
        self.needs_kv_cache_zeroing = needs_kv_cache_zeroing(kv_cache_config)
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            self._build_manager(
                g.kv_cache_spec,
                i,
                max_num_batched_tokens,
                max_model_len,
                enable_caching,
                dcp_world_size,
                pcp_world_size,
                scheduler_block_size,
                getattr(g, "role", None),  # vLLM 0.33.0's KVCacheGroupSpec.role
            )
            for i, g in enumerate(groups)
        )
        # Each group's block size in tokens (vLLM 0.33.0's name).
        self.group_block_sizes = tuple(m.block_size for m in self.single_type_managers)
        # The managers whose blocks are cached: a group outside prefix caching (its
        # spec says so: a ring buffer, 0.33.0's bounded-replay sliding window) keys
        # nothing, as in vLLM 0.33.0 (its hit is empty, its hash block may not fit).
        self.caching_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            m for m in self.single_type_managers if is_prefix_cacheable(m.kv_cache_spec)
        )
        self.retention_interval = resolve_prefix_cache_retention_interval(
            prefix_cache_retention_interval, scheduler_block_size, kv_cache_config
        )
        self.pop_drops_null_head = profile.pop_drops_null_head
        self.trim_every_full_group = profile.trim_every_full_group
        self.eagle_peek_to_hashed_length = profile.eagle_peek_to_hashed_length
        self.mamba_no_eagle_margin = profile.mamba_no_eagle_margin
        self.retention_replay_boundaries = profile.retention_replay_boundaries
        # mamba_fine_grained_hits in effect (vLLM 0.33.0's name; hybrid layouts only).
        self.enable_partial_hash_hits = False
        self._check_mamba_groups(use_eagle)
        # Computed tokens a multi-module drafter re-prefills, so not cached yet (vLLM
        # 0.33.0's num_prefill_lookahead - 1; 0 in 0.25.1), set by the KVCacheManager.
        self.num_reprefillable_tokens = 0
        # Precomputed dispatch for the per-call loops.
        self._is_cross = tuple(
            isinstance(m, CrossAttentionManager) for m in self.single_type_managers
        )
        self._in_0_33_order = tuple(
            m.counts_in_0_33_order for m in self.single_type_managers
        )
        self._skipping_managers = tuple(
            m for m in self.single_type_managers if not m.never_skips_tokens
        )
        #: Whether some group frees blocks no future token attends to (else
        #: ``remove_skipped_blocks`` is a no-op a caller may leave out).
        self.skips_tokens = bool(self._skipping_managers)

    def _build_manager(
        self,
        kv_cache_spec: KVCacheSpec,
        kv_cache_group_id: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_caching: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        scheduler_block_size: int,
        role: Any,
    ) -> SingleTypeKVCacheManager:
        """One group's manager, with that group's context-parallel geometry: its world
        sizes from ``group_world_sizes``; under ``pcp_not_scaled`` the block is
        ``block_size * dcp`` tokens while the manager still reports its pcp size."""
        dcp, pcp = group_world_sizes(
            kv_cache_spec,
            dcp_world_size,
            pcp_world_size,
            self.dcp_sharded_geometry,
            self.dcp_full_attention_only,
        )
        manager = get_manager_for_kv_cache_spec(
            kv_cache_spec=kv_cache_spec,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            role=role,
            block_pool=self.block_pool,
            enable_caching=enable_caching,
            kv_cache_group_id=kv_cache_group_id,
            dcp_world_size=dcp,
            pcp_world_size=1 if self.pcp_not_scaled else pcp,
            scheduler_block_size=scheduler_block_size,
            needs_kv_cache_zeroing=self.needs_kv_cache_zeroing,
        )
        manager.pcp_world_size = pcp
        return manager

    def _check_mamba_groups(self, use_eagle: bool) -> None:
        """The release's Mamba rules that depend on the whole layout: refuse a Mamba
        group caching outside 'align' under ``mamba_align_only``; under
        ``mamba_eagle_state_drop`` with ``use_eagle`` the prompt-tail state and the
        prefill checkpoints drop one hash block, as EAGLE's replay does (vLLM's
        coordinator sets the managers' ``drop_eagle_checkpoint_block`` likewise from
        0.30.0).

        Raises:
            AssertionError: a Mamba group in mode 'all' or 'none' with caching on
                under ``mamba_align_only`` (vLLM 0.33.0 asserts too).
        """
        profile = self.profile
        for manager in self.single_type_managers:
            if not isinstance(manager, MambaManager):
                continue
            mode = manager.mamba_cache_mode
            if profile.mamba_align_only and manager.enable_caching and mode != "align":
                raise AssertionError(
                    f"mamba_cache_mode={mode!r} with prefix caching on: under "
                    f"{profile!r} Mamba groups cache only in 'align' mode"
                )
            manager.drop_eagle_checkpoint_block = profile.mamba_eagle_state_drop and use_eagle

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        num_local_computed_tokens: int = 0,
        prefill_end: int = 0,
    ) -> int:
        """Blocks all groups together need from the pool for ``num_tokens`` slots
        (cross-attention groups: for ``num_encoder_tokens``, allocated once).
        ``num_local_computed_tokens`` (computed plus hit tokens) tells the managers
        whether a hit ends inside a block (``partial_hit_copy_on_write``), and a
        HiSparse hot group whether the request resumes a host prefix.
        ``prefill_end`` (where the request's prefill ends; 0: anywhere) limits Mamba
        prefill checkpoints to the chunk reaching it, under latest-only retention
        (an interval of 0) only: denser retention publishes every chunk's state."""
        if prefill_end and self.retention_interval != 0:
            prefill_end = 0
        total = 0
        for i, manager in enumerate(self.single_type_managers):
            if self._is_cross[i]:
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_encoder_tokens, (), 0, num_encoder_tokens, apply_admission_cap
                )
            elif self._in_0_33_order[i]:  # a HiSparse kind: vLLM 0.33.0's order
                # NOTE: a Python-level call (getattr): a native call would pass the
                # arguments by the compiled base class's order.
                count = getattr(manager, "get_num_blocks_to_allocate")  # noqa: B009
                counted: int = count(
                    request_id,
                    num_tokens,
                    new_computed_blocks[i],
                    total_computed_tokens,
                    num_local_computed_tokens,
                    num_tokens_main_model,
                    apply_admission_cap,
                    prefill_end,
                )
                total += counted
            else:
                total += manager.get_num_blocks_to_allocate(
                    request_id,
                    num_tokens,
                    new_computed_blocks[i],
                    total_computed_tokens,
                    num_tokens_main_model,
                    apply_admission_cap,
                    num_local_computed_tokens,
                    prefill_end,
                )
        return total

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        skip_zeroing_group_ids: Sequence[int] = (),
    ) -> None:
        """Add a new request's hits to every group, then allocate external blocks
        (not reported for zeroing in ``skip_zeroing_group_ids``: an async load
        writes them).

        Two phases, as vLLM: every group touches its hits before any group takes
        blocks for external tokens, so one group cannot evict another's hits.
        A request that is already tracked is left alone (it has no new hits).
        """
        managers = self.single_type_managers
        if any(request_id in m.num_cached_block for m in managers):
            if any(len(blocks) for blocks in new_computed_blocks):
                raise ValueError(f"request {request_id!r} is running: it cannot take prefix hits")
            return
        for i, manager in enumerate(managers):
            manager.add_local_computed_blocks(
                request_id,
                new_computed_blocks[i],
                num_local_computed_tokens,
                num_external_computed_tokens,
            )
        if num_external_computed_tokens > 0:
            for i, manager in enumerate(managers):
                manager.allocate_external_computed_blocks(
                    request_id,
                    num_local_computed_tokens,
                    num_external_computed_tokens,
                    i not in skip_zeroing_group_ids,
                )

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int = 0,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Give the request ``num_tokens`` slots in every group; return new blocks."""
        # One generator over the managers' tuple: compiled, it fills a tuple of
        # that length directly (no list to build, convert and drop).
        return tuple(
            manager.allocate_new_blocks(
                request_id,
                num_encoder_tokens if isinstance(manager, CrossAttentionManager) else num_tokens,
                num_tokens_main_model,
            )
            for manager in self.single_type_managers
        )

    def replay_boundaries(self, num_prompt_tokens: int) -> tuple[int, ...]:
        """Token positions where a replay of a ``num_prompt_tokens`` prompt resumes,
        whose tails sparse retention keeps in every group: 0.25.1's one position,
        ``num_prompt_tokens - 1``, or, with the ``retention_replay_boundaries`` switch,
        vLLM 0.33.0's (``kv_cache_math.replay_boundaries``: below the EAGLE drop for
        a resend and for a longer sibling when any group is an EAGLE group)."""
        if self.retention_replay_boundaries:
            return kv_cache_math.replay_boundaries(
                num_prompt_tokens, self.scheduler_block_size, bool(self.eagle_group_ids)
            )
        return (num_prompt_tokens - 1,)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache every group's full blocks within the first ``num_computed_tokens``
        (less the ``num_reprefillable_tokens``, whose KV is not final)."""
        if self.num_reprefillable_tokens:
            num_computed_tokens = max(0, num_computed_tokens - self.num_reprefillable_tokens)
        retention_interval = self.retention_interval
        boundaries = None
        if retention_interval is not None:
            boundaries = self.replay_boundaries(request.num_prompt_tokens)
        for manager in self.caching_managers:
            manager.cache_blocks(request, num_computed_tokens, retention_interval, boundaries)

    def free(self, request_id: str) -> None:
        """Release the request's blocks in every group."""
        for manager in self.single_type_managers:
            manager.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request everywhere; return its blocks group by group, in
        allocation order, for the caller to free (tail first)."""
        blocks: list[KVCacheBlock] = []
        for manager in self.single_type_managers:
            group_blocks = manager.pop_blocks_for_free(request_id)
            if self.pop_drops_null_head:
                group_blocks = trim_null_head(group_blocks)
            blocks.extend(group_blocks)
        return blocks

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, leading blocks shared by every request holding blocks."""
        return [
            m.get_num_common_prefix_blocks(running_request_id) for m in self.single_type_managers
        ]

    def remove_skipped_blocks(
        self, request_id: str, total_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Free, in every group, blocks no future token attends to."""
        for manager in self._skipping_managers:
            manager.remove_skipped_blocks(request_id, total_computed_tokens, num_prompt_tokens)

    def emit_cached_block_events(
        self, request: Request, computed_blocks: Sequence[Sequence[KVCacheBlock]]
    ) -> None:
        """Queue a ``BlockStored`` for each group's hit blocks (the ``full_report_mode``
        switch: vLLM 0.33.0's "full" KV-event report mode), at the group spec's
        block size; groups without hits queue none."""
        for group_id, group_blocks in enumerate(computed_blocks):
            if group_blocks:
                self.single_type_managers[group_id].block_pool.emit_cached_block_events(
                    request,
                    len(group_blocks),
                    self.kv_cache_config.kv_cache_groups[group_id].kv_cache_spec.block_size,
                    group_id,
                )

    def reset_prefix_cache(self) -> bool:
        """Reset the prefix cache of every pool the groups use (the shared pool; a
        HiSparse source's host pool too): True if every reset succeeded."""
        pools: list[BlockPool] = [self.block_pool]
        for manager in self.single_type_managers:
            if manager.block_pool is not self.block_pool and manager.block_pool not in pools:
                pools.append(manager.block_pool)
        results = [pool.reset_prefix_cache() for pool in pools]
        return all(results)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        """The request's block list in every group ([] when it has none)."""
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers)

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Hit blocks per group and the hit length in tokens."""
        raise NotImplementedError

    def new_step_starts(self) -> None:
        """Tell every group a scheduler step begins."""
        for manager in self.single_type_managers:
            manager.new_step_starts()



@mypyc_attr(allow_interpreted_subclasses=True)
class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Coordinator without prefix caching: any number of groups, never a hit."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        use_eagle: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        scheduler_block_size: int,
        hash_block_size: int,
        metrics_collector: Any = None,
        *,
        prefix_cache_retention_interval: int | str | None = RETENTION_FROM_ENV,
        profile: Profile | None = None,
    ) -> None:
        super().__init__(
            kv_cache_config,
            max_model_len,
            max_num_batched_tokens,
            use_eagle,
            False,
            enable_kv_cache_events,
            dcp_world_size,
            pcp_world_size,
            scheduler_block_size,
            hash_block_size,
            metrics_collector,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
            profile=profile,
        )
        self.num_single_type_manager = len(self.single_type_managers)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Always zeros: nothing is shared without prefix caching."""
        return [0] * self.num_single_type_manager

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Never a hit."""
        return tuple([] for _ in range(self.num_single_type_manager)), 0


@mypyc_attr(allow_interpreted_subclasses=True)
class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """Coordinator for a model with exactly one KV-cache group."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        scheduler_block_size: int,
        hash_block_size: int,
        metrics_collector: Any = None,
        *,
        prefix_cache_retention_interval: int | str | None = RETENTION_FROM_ENV,
        profile: Profile | None = None,
    ) -> None:
        super().__init__(
            kv_cache_config,
            max_model_len,
            max_num_batched_tokens,
            use_eagle,
            enable_caching,
            enable_kv_cache_events,
            dcp_world_size,
            pcp_world_size,
            scheduler_block_size,
            hash_block_size,
            metrics_collector,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
            profile=profile,
        )
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError(
                "UnitaryKVCacheCoordinator needs exactly one KV-cache group, got "
                f"{len(kv_cache_config.kv_cache_groups)}"
            )
        self.kv_cache_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        manager = self.single_type_managers[0]
        # The group's own dcp size (under dcp_sharded_geometry 1 for a replicated
        # spec); the pcp size as given, which the lookup hands to the kind's finder.
        self.dcp_world_size = manager.dcp_world_size
        self.pcp_world_size = pcp_world_size
        # A block spans block_size * dcp * pcp tokens (hits, hashes and alignment);
        # block_size * dcp under pcp_not_scaled.
        self.block_size = manager.block_size
        if enable_caching and hash_block_size != self.block_size:
            message = (
                f"hash_block_size={hash_block_size} must equal the block size "
                f"{self.block_size} of the only KV-cache group (its spec's block size "
                f"{self.kv_cache_spec.block_size} times dcp_world_size={dcp_world_size} "
                f"and pcp_world_size={pcp_world_size}"
                + (", which does not scale blocks)" if self.pcp_not_scaled else ")")
            )
            if self.dcp_sharded_geometry:
                raise AssertionError(message)  # vLLM 0.33.0 asserts
            raise ValueError(message)
        manager.use_eagle = 0 in self.eagle_group_ids
        self._manager_cls = type(manager)
        # Full attention reads blocks of block_size * dcp * pcp tokens; under
        # pcp_not_scaled its finder gets pcp 1 (0.33.0's ignores it), the other
        # kinds' finders still get the pcp size they refuse.
        self._lookup_pcp_world_size = (
            1
            if self.pcp_not_scaled and issubclass(self._manager_cls, FullAttentionManager)
            else pcp_world_size
        )
        self._drop_eagle_block = 0 in self.eagle_group_ids
        self._group_ids = [0]

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The single group's longest hit, aligned to its block size."""
        # Positional: a call through a class object is a Python-level call, and
        # keyword arguments cost a parse per call on the compiled build.
        hit_blocks = self._manager_cls.find_longest_cache_hit(
            block_hashes,  # block_hashes
            max_cache_hit_length,  # max_length
            self._group_ids,  # kv_cache_group_ids
            self.block_pool,  # block_pool
            self.kv_cache_spec,  # kv_cache_spec
            self._drop_eagle_block,  # drop_eagle_block
            self.block_size,  # alignment_tokens
            self.dcp_world_size,  # dcp_world_size
            self._lookup_pcp_world_size,  # pcp_world_size
        )
        return hit_blocks, len(hit_blocks[0]) * self.block_size


def check_hybrid_context_parallel(
    kv_cache_config: KVCacheConfig, dcp_world_size: int, pcp_world_size: int
) -> None:
    """vLLM 0.33.0's rule for context parallelism beside several prefix-caching
    groups (``dcp_sharded_geometry``): under dcp every group is full attention or
    replicated (not dcp-sharded: Mamba, a replicated draft); under pcp every group
    is full attention or a replicated attention group.

    Raises:
        AssertionError: naming the first group that breaks it (vLLM asserts).
    """
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        full = _is_full(spec)
        replicated = not is_dcp_sharded(spec)
        if pcp_world_size > 1 and not (
            full or (replicated and is_spec_kind(spec, "AttentionSpec"))
        ):
            raise AssertionError(
                f"pcp_world_size={pcp_world_size} with several prefix-caching groups: "
                f"group {i} ({type(spec).__name__}) is neither full attention nor a "
                "replicated attention group"
            )
        if dcp_world_size > 1 and not (full or replicated):
            raise AssertionError(
                f"dcp_world_size={dcp_world_size} with several prefix-caching groups: "
                f"group {i} ({type(spec).__name__}) is neither full attention nor "
                "replicated (Mamba, a replicated draft)"
            )


class SpecGroup(NamedTuple):
    """KV-cache groups with equal specs, searched for hits together."""

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]
    use_eagle: bool


@mypyc_attr(allow_interpreted_subclasses=True)
class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Coordinator for models mixing KV-cache kinds (e.g. full + sliding window).

    Groups with equal specs form one ``SpecGroup``; full attention is searched
    first. A hit must be valid for every kind at once, found as a fixed point:
    each kind accepts the candidate length or shrinks it, until none shrinks.
    Hits and cached prefixes are multiples of ``scheduler_block_size``.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        scheduler_block_size: int,
        hash_block_size: int,
        metrics_collector: Any = None,
        *,
        prefix_cache_retention_interval: int | str | None = RETENTION_FROM_ENV,
        profile: Profile | None = None,
    ) -> None:
        super().__init__(
            kv_cache_config,
            max_model_len,
            max_num_batched_tokens,
            use_eagle,
            enable_caching,
            enable_kv_cache_events,
            dcp_world_size,
            pcp_world_size,
            scheduler_block_size,
            hash_block_size,
            metrics_collector,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
            profile=profile,
        )
        if self.dcp_sharded_geometry:
            check_hybrid_context_parallel(kv_cache_config, dcp_world_size, pcp_world_size)
        elif dcp_world_size != 1 or pcp_world_size != 1:
            raise ContextParallelError(
                "several KV-cache groups with prefix caching do not support context "
                f"parallelism (dcp_world_size={dcp_world_size}, "
                f"pcp_world_size={pcp_world_size}); vLLM 0.25.1 asserts the same"
            )
        self.dcp_world_size = dcp_world_size
        self.hash_block_size = hash_block_size
        # Groups outside prefix caching (ring buffers) are scratch: not hashed, so
        # their block size need not be a multiple of the hash block.
        sizes = [
            m.block_size
            for g, m in zip(kv_cache_config.kv_cache_groups, self.single_type_managers, strict=True)
            if is_prefix_cacheable(g.kv_cache_spec)
        ]
        if any(size % hash_block_size for size in sizes):
            raise ValueError(
                f"every group's block size {sizes} must be a multiple of "
                f"hash_block_size={hash_block_size}"
            )
        self.num_uncached_common_prefix_tokens = 0
        self.verify_and_split_kv_cache_groups()
        if self.profile.mamba_fine_grained_hits:
            self.enable_fine_grained_hits()

    @property
    def _cache_hit_alignment_tokens(self) -> int:
        """Where hits end: the hash block with fine-grained hits, else the scheduler
        block (vLLM 0.33.0's private name; its tests read it)."""
        return self.hash_block_size if self.enable_partial_hash_hits else self.scheduler_block_size

    def enable_fine_grained_hits(self) -> bool:
        """Turn on sub-block hits where vLLM 0.33.0 does (``mamba_fine_grained_hits``):
        a Mamba 'align' group's block is larger than the hash block (under
        ``dcp_world_size > 1`` at least the hash block), and every other
        prefix-caching group is full attention, Mamba, or hashed at its own block size. Hits then
        land on hash-block boundaries (every manager's ``cache_hit_alignment_tokens``)
        and ``cache_blocks`` caches unrounded token counts. Before 0.29.0
        (``fine_grained_hits_under_dcp`` off) ``dcp_world_size > 1`` turns them off.

        Returns:
            Whether fine-grained hits are on.
        """
        managers = self.single_type_managers
        if self.dcp_world_size > 1 and not self.profile.fine_grained_hits_under_dcp:
            return False  # 0.26.0-0.28.0: context parallelism turns them off
        if not partial_hash_hits_enabled(
            self.kv_cache_config.kv_cache_groups,
            self.hash_block_size,
            self.dcp_world_size,
            [type(m) for m in managers],
        ):
            return False
        hbs = self.hash_block_size
        self.enable_partial_hash_hits = True
        for manager in self.single_type_managers:
            manager.cache_hit_alignment_tokens = hbs
        return True

    def verify_and_split_kv_cache_groups(self) -> None:
        """Bundle groups with equal specs and order them full attention first.

        A group outside prefix caching (a ring buffer: ``is_prefix_cacheable`` False)
        joins no bundle: it is never searched, its hit is always empty. It still
        counts as a distinct spec for the two-spec requirement.
        """
        self.attention_groups: list[SpecGroup] = []
        scratch_specs: list[KVCacheSpec] = []
        for i, g in enumerate(self.kv_cache_config.kv_cache_groups):
            if not is_prefix_cacheable(g.kv_cache_spec):
                if g.kv_cache_spec not in scratch_specs:
                    scratch_specs.append(g.kv_cache_spec)
                continue
            manager_cls = type(self.single_type_managers[i])
            use_eagle = i in self.eagle_group_ids
            for idx, group in enumerate(self.attention_groups):
                # Same spec and manager class (a group role, such as the HiSparse
                # source, may give equal specs different managers and pools).
                if group.spec == g.kv_cache_spec and group.manager_cls is manager_cls:
                    group.group_ids.append(i)
                    if use_eagle and not group.use_eagle:
                        self.attention_groups[idx] = group._replace(use_eagle=True)
                    break
            else:
                self.attention_groups.append(
                    SpecGroup(g.kv_cache_spec, [i], manager_cls, use_eagle)
                )
        if len(self.attention_groups) + len(scratch_specs) < 2:
            raise ValueError(
                "HybridKVCacheCoordinator needs at least two distinct KV-cache specs; "
                f"got {len(self.attention_groups) + len(scratch_specs)}"
            )
        if not self.attention_groups:
            raise ValueError(
                "HybridKVCacheCoordinator needs at least one group that takes part in "
                "prefix caching (every group is a ring buffer); vLLM 0.33.0 asserts"
            )
        # Full attention's cheap left-to-right scan bounds the others' searches.
        self.attention_groups.sort(key=lambda g: not _is_full(g.spec))
        # The dense reference of per-group lookups (vLLM 0.33.0's name): the first
        # full-attention group, None without one. Its hits are prefix-closed, so a
        # longer per-group hit elsewhere means its own tail was evicted.
        first = self.attention_groups[0]
        self.full_attention_group_id: int | None = (
            first.group_ids[0] if _is_full(first.spec) else None
        )
        for group in self.attention_groups:
            if group.use_eagle:
                for gid in group.group_ids:
                    self.single_type_managers[gid].use_eagle = True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache up to the last ``scheduler_block_size`` boundary (hits can only end
        there); EAGLE groups may also cache the block just past it. With fine-grained
        hits nothing is rounded: every group caches all ``num_computed_tokens`` (an
        EAGLE group less the ``num_reprefillable_tokens``)."""
        retention_interval = self.retention_interval
        boundaries = None
        if retention_interval is not None:
            boundaries = self.replay_boundaries(request.num_prompt_tokens)
        alignment = 1 if self.enable_partial_hash_hits else self.scheduler_block_size
        for manager in self.caching_managers:
            num_tokens = kv_cache_math.num_tokens_to_cache(
                num_computed_tokens,
                alignment,
                manager.block_size,
                manager.use_eagle,
                self.num_reprefillable_tokens,
            )
            manager.cache_blocks(request, num_tokens, retention_interval, boundaries)

    def _block_hashes_for(self, block_hashes: list[BlockHash], block_size: int) -> BlockHashList:
        """The request's hashes viewed at a group's block size (in tokens)."""
        if block_size == self.hash_block_size:
            return block_hashes
        return BlockHashListWithBlockSize(block_hashes, self.hash_block_size, block_size)

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Longest hit valid for every kind (fixed point, see the class docstring).

        Full attention is searched once and then only trimmed (its hits are
        prefix-closed). An EAGLE kind searches one block further and drops it,
        once per candidate length. With exactly full attention plus one other
        kind, one pass suffices. With fine-grained hits (``enable_partial_hash_hits``)
        lengths are multiples of the hash block: full attention and Mamba groups
        with larger blocks find hits ending inside a block, and an EAGLE one
        looks one hash block further, not one block.

        Returns:
            ``(hit blocks per group, hit length in tokens)``; also sets
            ``num_uncached_common_prefix_tokens`` (how much longer the best
            single-kind hit was).
        """
        hit_length = max_cache_hit_length
        longest_hit_length = 0
        hit_blocks_by_group: list[list[KVCacheBlock] | None] = [None] * len(
            self.kv_cache_config.kv_cache_groups
        )
        is_simple_hybrid = len(self.attention_groups) == 2 and _is_full(
            self.attention_groups[0].spec
        )
        eagle_verified: set[int] = set()
        fine = self.enable_partial_hash_hits
        hbs = self.hash_block_size
        alignment = self._cache_hit_alignment_tokens
        while True:
            curr_hit_length = hit_length
            for idx, (spec, group_ids, manager_cls, use_eagle) in enumerate(self.attention_groups):
                # The group's block in tokens: its spec's, times dcp for a sharded
                # group under context parallelism (dcp_sharded_geometry).
                manager = self.single_type_managers[group_ids[0]]
                block_size = manager.block_size
                if (
                    _is_full(spec)
                    and hit_blocks_by_group[group_ids[0]] is not None
                ):
                    if not fine:  # fine: the candidate is within the full hit already
                        curr_hit_length = curr_hit_length // block_size * block_size
                    continue
                drop_eagle_block = use_eagle and idx not in eagle_verified
                sub_block = fine and block_size > hbs and _finds_fine_grained_hits(manager_cls)
                max_length = curr_hit_length
                if drop_eagle_block and not (
                    self.mamba_no_eagle_margin and is_spec_kind(spec, "MambaSpec")
                ):  # 0.33.0: no peek past the candidate for Mamba (its finder never drops)
                    margin = hbs if sub_block else block_size
                    max_length = min(curr_hit_length + margin, max_cache_hit_length)
                    if self.eagle_peek_to_hashed_length:
                        max_length = min(
                            curr_hit_length + margin,
                            len(block_hashes) * self.hash_block_size,
                        )
                if sub_block:
                    # A dcp-sharded full-attention group is searched at its own
                    # (dcp-scaled) block: its spec with the manager's block size.
                    lookup_spec = (
                        spec
                        if block_size == spec.block_size
                        else spec.copy_with_new_block_size(block_size)
                    )
                    hit_blocks, new_hit_length = manager_cls.find_fine_grained_hit(
                        block_hashes,
                        max_length,
                        group_ids,
                        manager.block_pool,
                        lookup_spec,
                        drop_eagle_block,
                        hbs,
                    )
                else:
                    hit_blocks = manager_cls.find_longest_cache_hit(  # positional, as above
                        self._block_hashes_for(block_hashes, block_size),  # block_hashes
                        max_length,  # max_length
                        group_ids,  # kv_cache_group_ids
                        manager.block_pool,  # block_pool (a HiSparse source's: the host's)
                        spec,  # kv_cache_spec
                        drop_eagle_block,  # drop_eagle_block
                        alignment,  # alignment_tokens
                        manager.dcp_world_size,  # dcp_world_size
                    )
                    new_hit_length = len(hit_blocks[0]) * block_size
                if drop_eagle_block:
                    eagle_verified.add(idx)
                elif new_hit_length < curr_hit_length:
                    eagle_verified.clear()  # a shorter candidate must be re-verified
                curr_hit_length = new_hit_length
                for group_id, blocks in zip(group_ids, hit_blocks, strict=True):
                    hit_blocks_by_group[group_id] = blocks
                longest_hit_length = max(longest_hit_length, curr_hit_length)
            if curr_hit_length >= hit_length:
                break
            hit_length = curr_hit_length
            if is_simple_hybrid:
                break
        first = self.attention_groups[0]
        first_manager = self.single_type_managers[first.group_ids[0]]
        if _is_full(first.spec) and not first_manager.retains_longer_hit:
            first_block_size = self.single_type_managers[first.group_ids[0]].block_size
            num_blocks = hit_length // first_block_size
            if fine:  # the hit may end inside the last block
                num_blocks = cdiv(hit_length, first_block_size)
            for group_id in first.group_ids:
                full_blocks = hit_blocks_by_group[group_id]
                if full_blocks is not None:
                    del full_blocks[num_blocks:]
        if self.trim_every_full_group:
            self._trim_full_groups(hit_blocks_by_group, hit_length)
        self.num_uncached_common_prefix_tokens = longest_hit_length - hit_length
        return tuple(b if b is not None else [] for b in hit_blocks_by_group), hit_length

    def _trim_full_groups(
        self, hit_blocks_by_group: list[list[KVCacheBlock] | None], hit_length: int
    ) -> None:
        """Cut every full-attention group's hits to ``hit_length`` tokens
        (``trim_every_full_group``; 0.25.1 trims the first kind's groups only)."""
        for group in self.attention_groups:
            manager = self.single_type_managers[group.group_ids[0]]
            if not _is_full(group.spec) or manager.retains_longer_hit:
                continue
            group_block_size = self.single_type_managers[group.group_ids[0]].block_size
            num_blocks = hit_length // group_block_size
            if self.enable_partial_hash_hits:
                num_blocks = cdiv(hit_length, group_block_size)
            for group_id in group.group_ids:
                full_blocks = hit_blocks_by_group[group_id]
                if full_blocks is not None:
                    del full_blocks[num_blocks:]

    def find_longest_cache_hit_per_group(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], tuple[int, ...]]:
        """Each kind's own longest hit, without agreeing on one length.

        With fine-grained hits (``enable_partial_hash_hits``) a kind's hit ends on a
        hash-block boundary, inside a block for full attention and Mamba groups with
        larger blocks, and its length is the hit's, not its blocks'. Under
        ``eagle_peek_to_hashed_length`` an EAGLE kind other than Mamba first looks one
        block (fine-grained: one hash block) further, up to the hashed tokens, before
        its finder drops that block; 0.25.1 looks no further.
        """
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        hit_blocks: list[list[KVCacheBlock]] = [[] for _ in range(num_groups)]
        hit_lengths = [0] * num_groups
        fine = self.enable_partial_hash_hits
        hbs = self.hash_block_size
        alignment = self._cache_hit_alignment_tokens
        for spec, group_ids, manager_cls, use_eagle in self.attention_groups:
            manager = self.single_type_managers[group_ids[0]]
            block_size = manager.block_size
            sub_block = fine and block_size > hbs and _finds_fine_grained_hits(manager_cls)
            max_length = max_cache_hit_length
            if (
                use_eagle
                and self.eagle_peek_to_hashed_length
                and not is_spec_kind(spec, "MambaSpec")
            ):
                margin = hbs if sub_block else block_size
                max_length = min(max_length + margin, len(block_hashes) * hbs)
            if sub_block:
                lookup_spec = (
                    spec
                    if block_size == spec.block_size
                    else spec.copy_with_new_block_size(block_size)
                )
                blocks, group_hit = manager_cls.find_fine_grained_hit(
                    block_hashes, max_length, group_ids, manager.block_pool, lookup_spec,
                    use_eagle, hbs,
                )  # fmt: skip
            else:
                blocks = manager_cls.find_longest_cache_hit(  # positional, as above
                    self._block_hashes_for(block_hashes, block_size),  # block_hashes
                    max_length,  # max_length
                    group_ids,  # kv_cache_group_ids
                    manager.block_pool,  # block_pool
                    spec,  # kv_cache_spec
                    use_eagle,  # drop_eagle_block
                    alignment,  # alignment_tokens
                    manager.dcp_world_size,  # dcp_world_size
                )
                group_hit = len(blocks[0]) * block_size
            for gid, group_blocks in zip(group_ids, blocks, strict=True):
                hit_blocks[gid] = group_blocks
                hit_lengths[gid] = group_hit
        return tuple(hit_blocks), tuple(hit_lengths)


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    max_num_batched_tokens: int,
    use_eagle: bool,
    enable_caching: bool,
    enable_kv_cache_events: bool,
    dcp_world_size: int,
    pcp_world_size: int,
    scheduler_block_size: int,
    hash_block_size: int,
    metrics_collector: Any = None,
    *,
    prefix_cache_retention_interval: int | str | None = RETENTION_FROM_ENV,
    profile: Profile | None = None,
) -> KVCacheCoordinator:
    """Pick the coordinator for this config (see the module docstring).

    Raises:
        NotImplementedError: for cross-attention groups with prefix caching on
            (vLLM accepts the config but fails on the first hit search).
    """
    if enable_caching and any(
        is_spec_kind(g.kv_cache_spec, "CrossAttentionSpec") for g in kv_cache_config.kv_cache_groups
    ):
        raise NotImplementedError(
            "cross-attention groups need enable_caching=False: their blocks are never cached"
        )
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(
            kv_cache_config,
            max_model_len,
            max_num_batched_tokens,
            use_eagle,
            enable_kv_cache_events,
            dcp_world_size,
            pcp_world_size,
            scheduler_block_size,
            hash_block_size,
            metrics_collector,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
            profile=profile,
        )
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(
            kv_cache_config,
            max_model_len,
            max_num_batched_tokens,
            use_eagle,
            enable_caching,
            enable_kv_cache_events,
            dcp_world_size,
            pcp_world_size,
            scheduler_block_size,
            hash_block_size,
            metrics_collector,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
            profile=profile,
        )
    return HybridKVCacheCoordinator(
        kv_cache_config,
        max_model_len,
        max_num_batched_tokens,
        use_eagle,
        enable_caching,
        enable_kv_cache_events,
        dcp_world_size,
        pcp_world_size,
        scheduler_block_size,
        hash_block_size,
        metrics_collector,
        prefix_cache_retention_interval=prefix_cache_retention_interval,
        profile=profile,
    )
