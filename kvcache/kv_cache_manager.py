"""The scheduler-facing KV-cache manager (vLLM 0.25.1's ``KVCacheManager`` API)."""

from __future__ import annotations

import functools
import itertools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast, overload

from kvcache.kv_cache_coordinator import HybridKVCacheCoordinator, get_kv_cache_coordinator
from kvcache.kv_cache_interface import (
    KVCacheConfig,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
    is_spec_kind,
)
from kvcache.kv_cache_math import admits
from kvcache.kv_cache_utils import KVCacheBlock
from kvcache.kv_events import BlockStored, KVCacheEvent
from kvcache.metrics import PrefixCacheStats
from kvcache.request import Request, RequestStatus
from kvcache.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    cdiv,
)

logger = logging.getLogger(__name__)

_WATERMARKED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)

SELF_CHECK_ENV = "KVCACHE_SELF_CHECK"
"""Set to 1 to check every invariant after every manager call (slow; for debugging)."""

_CHECKED_METHODS = (
    "get_computed_blocks", "allocate_slots", "free", "remove_skipped_blocks",
    "pop_blocks_for_free", "evict_blocks", "reset_prefix_cache", "cache_blocks",
    "take_events", "take_new_block_ids", "new_step_starts", "get_num_common_prefix_blocks",
)  # fmt: skip


def enable_self_check(manager: KVCacheManager) -> None:
    """Make ``manager`` run ``check_invariants()`` after each public call (and after
    ``block_pool.free_blocks``), raising ``AssertionError`` naming the call that
    broke an invariant. Costs O(pool size) per call: for debugging a scheduler,
    not for production. Also enabled by ``KVCACHE_SELF_CHECK=1`` at construction.
    """

    def wrap(owner: Any, name: str) -> None:
        method = getattr(owner, name)

        @functools.wraps(method)
        def checked(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            finally:
                try:
                    manager.check_invariants()
                except AssertionError as exc:
                    raise AssertionError(f"invariant broken after {name}(): {exc}") from exc

        setattr(owner, name, checked)

    for name in _CHECKED_METHODS:
        wrap(manager, name)
    wrap(manager.block_pool, "free_blocks")


@dataclass
class KVCacheBlocks:
    """Blocks handed to the scheduler: ``blocks[g][i]`` is block ``i`` of group ``g``.

    The manager reuses one immutable empty instance (``empty_kv_cache_blocks``)
    for "no blocks"; ``allocate_slots`` recognises it by identity.
    """

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        """Concatenate group by group."""
        return KVCacheBlocks(
            tuple(
                list(itertools.chain(a, b)) for a, b in zip(self.blocks, other.blocks, strict=False)
            )
        )

    @overload
    def get_block_ids(self, allow_none: Literal[False] = False) -> tuple[list[int], ...]: ...

    @overload
    def get_block_ids(self, allow_none: Literal[True] = True) -> tuple[list[int], ...] | None: ...

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """Block ids per group; with ``allow_none``, None when every group is empty."""
        if allow_none and all(len(group) == 0 for group in self.blocks):
            return None
        return tuple([block.block_id for block in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of blocks without a hash (single-group configs only)."""
        if len(self.blocks) != 1:
            raise ValueError(f"get_unhashed_block_ids needs one group, got {len(self.blocks)}")
        return [block.block_id for block in self.blocks[0] if block.block_hash is None]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        """Per group, ids of blocks without a hash, null blocks left out."""
        return [
            [b.block_id for b in group if b.block_hash is None and not b.is_null]
            for group in self.blocks
        ]

    def new_empty(self) -> KVCacheBlocks:
        """A new instance with the same number of groups and no blocks."""
        return KVCacheBlocks(tuple(() for _ in range(len(self.blocks))))


class KVCacheManager:
    """Finds cached prefixes, reserves slots and releases blocks for requests.

    Args:
        kv_cache_config: Pool size and KV-cache groups.
        max_model_len: Longest sequence; slot counts are capped by it.
        scheduler_block_size: Scheduling granularity.
        hash_block_size: Granularity of ``Request.block_hashes``.
        max_num_batched_tokens: Per-step token budget (default: max_model_len).
        enable_caching: Prefix caching on/off.
        use_eagle: Recompute the last hit block for EAGLE drafting.
        log_stats: Keep ``PrefixCacheStats``.
        enable_kv_cache_events: Queue KV events for ``take_events``.
        dcp_world_size: Must be 1.
        pcp_world_size: Must be 1.
        metrics_collector: Must be None (block residency metrics are not supported).
        watermark: Fraction of the pool kept free when admitting waiting or
            preempted requests while others are scheduled.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_num_batched_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any = None,
        watermark: float = 0.0,
    ) -> None:
        if metrics_collector is not None:
            raise NotImplementedError(
                f"metrics_collector={metrics_collector!r}: block residency metrics are not "
                "supported by kvcache; pass None"
            )
        if not isinstance(max_model_len, int) or max_model_len <= 0:
            raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
        if not watermark >= 0.0:
            raise ValueError(f"watermark must be non-negative, got {watermark!r}")
        self.max_model_len = max_model_len
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max_model_len
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = None
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config=kv_cache_config,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            use_eagle=use_eagle,
            enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
        )
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.block_pool = self.coordinator.block_pool
        self.kv_cache_config = kv_cache_config
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.kv_cache_event_metadata = tuple(
            (
                get_kv_cache_spec_kind(g.kv_cache_spec).value,
                get_kv_cache_spec_sliding_window(g.kv_cache_spec),
            )
            for g in kv_cache_config.kv_cache_groups
        )
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )
        # NOTE: one full-attention group (the common deployment) gets an inlined
        # path for running requests in allocate_slots; see _allocate_running_full.
        managers = self.coordinator.single_type_managers
        self._fast_manager: FullAttentionManager | None = (
            managers[0]
            if len(managers) == 1 and type(managers[0]) is FullAttentionManager
            else None
        )
        # Other layouts without cross attention get a less specialised inlined path.
        self._fast_any = not any(isinstance(m, CrossAttentionManager) for m in managers)
        self._simple_managers = tuple(
            type(m) in (FullAttentionManager, SlidingWindowManager, ChunkedLocalAttentionManager)
            for m in managers
        )
        self._mamba_align = tuple(
            isinstance(m, MambaManager) and m.mamba_cache_mode == "align" for m in managers
        )
        # Per group for _allocate_running_any: 0 simple kind, 1 align-mode Mamba, 2 other.
        self._group_plan = tuple(
            (0 if simple else 1 if align else 2, m)
            for m, simple, align in zip(
                managers, self._simple_managers, self._mamba_align, strict=True
            )
        )
        # Per skipping group, how allocate_slots' fast path tests for "nothing to
        # remove" before calling remove_skipped_blocks: True for align-mode Mamba,
        # False for kinds using the base removal (sliding window, chunked local),
        # None (always call) for anything else, e.g. a subclass with its own removal.
        def skip_test(m: SingleTypeKVCacheManager) -> bool | None:
            removal = type(m).remove_skipped_blocks
            if removal is SingleTypeKVCacheManager.remove_skipped_blocks:
                return False
            if removal is MambaManager.remove_skipped_blocks:
                return cast(MambaManager, m).mamba_cache_mode == "align" or None
            return None

        self._skip_plan = tuple((m, skip_test(m)) for m in self.coordinator._skipping_managers)
        self._aligned_caching = isinstance(self.coordinator, HybridKVCacheCoordinator)
        self._owners: dict[str, Request] = {}
        if os.environ.get(SELF_CHECK_ENV, "0") not in ("", "0"):
            enable_self_check(self)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use (0.0 to 1.0)."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Return the stats gathered since the last call and start new ones
        (None unless ``log_stats``)."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of a request that is not running yet.

        The hit never covers the last token (its logits must be computed), so it
        is capped at ``num_tokens - 1`` and then rounded down to whole blocks.

        Returns:
            ``(hit blocks, number of hit tokens)``; the blocks are not yet touched.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        computed_blocks, num_new_computed_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.record(
                num_tokens=request.num_tokens,
                num_hits=num_new_computed_tokens,
                preempted=request.num_preemptions > 0,
            )
        return self.create_kv_cache_blocks(computed_blocks), num_new_computed_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
    ) -> KVCacheBlocks | None:
        """Reserve slots for the request's next tokens, or return None if they do not fit.

        Token ranges of the request (left to right)::

            | computed | new hits | external | new tokens | lookahead |
            |<-- already have KV ----------->|<-- compute this step -->|
                       |<-- need blocks (hits touched, rest allocated) ->|
                       |<-- cached after this call, up to num_tokens -->|

        Args:
            request: The request.
            num_new_tokens: Tokens to compute this step (draft tokens included).
            num_new_computed_tokens: Tokens covered by ``new_computed_blocks``.
            new_computed_blocks: Hits from ``get_computed_blocks`` (None: none).
            num_lookahead_tokens: Extra slots for speculative tokens.
            num_external_computed_tokens: Tokens a KV connector provides.
            delay_cache_blocks: Do not cache blocks yet (KV still in transfer).
            num_encoder_tokens: Encoder tokens (cross-attention groups only).
            full_sequence_must_fit: Fail unless the whole sequence would fit.
            reserved_blocks: Free blocks to leave for other in-flight requests.
            has_scheduled_reqs: Whether other requests run this step (enables the
                watermark for waiting/preempted requests).

        Returns:
            The newly allocated blocks (the manager's empty instance if none), or
            None when the pool cannot supply them; then nothing but skipped-block
            removal has happened.

        Raises:
            ValueError: if there is nothing to allocate for (no new and no
                external tokens), a count is negative, the tokens would pass
                ``max_model_len``, or ``new_computed_blocks`` has the wrong
                number of groups. Nothing changes then.
        """
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no external "
                f"computed tokens (request {request.request_id!r})"
            )
        # NOTE: one combined test keeps validation off the hot path's cost; the
        # helper builds the message only when something is wrong.
        if (
            num_new_tokens < 0
            or num_new_computed_tokens < 0
            or num_lookahead_tokens < 0
            or num_external_computed_tokens < 0
            or num_encoder_tokens < 0
            or reserved_blocks < 0
            or request.num_computed_tokens
            + num_new_computed_tokens
            + num_external_computed_tokens
            + num_new_tokens
            > self.max_model_len
        ):
            self._reject_allocate_args(
                request,
                num_new_tokens=num_new_tokens,
                num_new_computed_tokens=num_new_computed_tokens,
                num_lookahead_tokens=num_lookahead_tokens,
                num_external_computed_tokens=num_external_computed_tokens,
                num_encoder_tokens=num_encoder_tokens,
                reserved_blocks=reserved_blocks,
            )
        if new_computed_blocks is not None and len(new_computed_blocks.blocks) != len(
            self.empty_kv_cache_blocks.blocks
        ):
            raise ValueError(
                f"new_computed_blocks has {len(new_computed_blocks.blocks)} groups, the "
                f"manager {self.num_kv_cache_groups}"
            )
        # One Request object per id until it is freed: a second object with a live
        # id would silently share the first one's block table.
        owner = self._owners.get(request.request_id)
        if owner is not request:
            if owner is not None:
                raise ValueError(
                    f"request_id {request.request_id!r} is already held by another Request "
                    "object (duplicate request id); free the first one before reusing its id"
                )
            self._owners[request.request_id] = request
        if (
            self._fast_any
            and num_external_computed_tokens == 0
            and not full_sequence_must_fit
            and (
                new_computed_blocks is None
                or new_computed_blocks.blocks is self.empty_kv_cache_blocks.blocks
            )
            and num_new_computed_tokens == 0
        ):
            return (
                self._allocate_running_full
                if self._fast_manager is not None
                else self._allocate_running_any
            )(
                request,
                num_new_tokens,
                num_lookahead_tokens,
                delay_cache_blocks,
                reserved_blocks,
                has_scheduled_reqs,
            )
        if new_computed_blocks is not None:
            new_computed_block_list = new_computed_blocks.blocks
        else:
            new_computed_block_list = self.empty_kv_cache_blocks.blocks
        coordinator = self.coordinator
        free_queue = self.block_pool.free_block_queue

        num_local_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        total_computed_tokens = min(
            num_local_computed_tokens + num_external_computed_tokens, self.max_model_len
        )
        watermark_blocks = (
            self.watermark_blocks if has_scheduled_reqs and request.status in _WATERMARKED else 0
        )
        if full_sequence_must_fit:
            full_num_tokens = min(request.num_tokens, self.max_model_len)
            num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate(
                request_id=request.request_id,
                num_tokens=full_num_tokens,
                new_computed_blocks=new_computed_block_list,
                num_encoder_tokens=num_encoder_tokens,
                total_computed_tokens=total_computed_tokens,
                num_tokens_main_model=full_num_tokens,
                apply_admission_cap=True,
            )
            if not admits(num_blocks_to_allocate, free_queue.num_free_blocks, 0, watermark_blocks):
                return None

        num_tokens_main_model = total_computed_tokens + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens, self.max_model_len)
        # Freeing out-of-window blocks first means fewer cached blocks get evicted;
        # it happens even if the allocation then fails.
        coordinator.remove_skipped_blocks(
            request.request_id, total_computed_tokens, request.num_prompt_tokens
        )
        num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate(
            request_id=request.request_id,
            num_tokens=num_tokens_need_slot,
            new_computed_blocks=new_computed_block_list,
            num_encoder_tokens=num_encoder_tokens,
            total_computed_tokens=num_local_computed_tokens + num_external_computed_tokens,
            num_tokens_main_model=num_tokens_main_model,
        )
        num_free = free_queue.num_free_blocks
        if not admits(num_blocks_to_allocate, num_free, reserved_blocks, watermark_blocks):
            return None

        # NOTE: "no hits" is told apart by identity with the shared empty
        # instance: any other KVCacheBlocks, even an empty one, registers the
        # request's (possibly empty) hits, as vLLM does.
        if (
            new_computed_block_list is not self.empty_kv_cache_blocks.blocks
            or num_external_computed_tokens > 0
        ):
            coordinator.allocate_new_computed_blocks(
                request_id=request.request_id,
                new_computed_blocks=new_computed_block_list,
                num_local_computed_tokens=num_local_computed_tokens,
                num_external_computed_tokens=num_external_computed_tokens,
            )
        new_blocks = coordinator.allocate_new_blocks(
            request.request_id, num_tokens_need_slot, num_tokens_main_model, num_encoder_tokens
        )
        if self.enable_caching and not delay_cache_blocks:
            # Only committed tokens are cached: draft tokens past num_tokens may be rejected.
            coordinator.cache_blocks(
                request, min(total_computed_tokens + num_new_tokens, request.num_tokens)
            )
        return self.create_kv_cache_blocks(new_blocks)

    def _reject_allocate_args(self, request: Request, **counts: int) -> None:
        """Raise the ValueError for bad ``allocate_slots`` counts (see there)."""
        for name, value in counts.items():
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        total = request.num_computed_tokens + sum(
            counts[k]
            for k in ("num_new_computed_tokens", "num_external_computed_tokens", "num_new_tokens")
        )
        raise ValueError(
            f"request {request.request_id!r} would reach {total} tokens "
            f"(num_computed_tokens={request.num_computed_tokens} + new hits "
            f"{counts['num_new_computed_tokens']} + external "
            f"{counts['num_external_computed_tokens']} + num_new_tokens "
            f"{counts['num_new_tokens']}), beyond max_model_len={self.max_model_len}"
        )

    def _allocate_running_full(
        self,
        request: Request,
        num_new_tokens: int,
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
        reserved_blocks: int,
        has_scheduled_reqs: bool,
    ) -> KVCacheBlocks | None:
        """``allocate_slots`` for one full-attention group with no new hits and no
        external tokens (decode steps and later prefill chunks), inlined.

        Same results and state changes as the general path: full attention skips
        nothing, registers no hits, and needs ``cdiv(tokens, block_size)`` blocks.
        """
        manager = self._fast_manager
        assert manager is not None
        request_id = request.request_id
        block_size = manager.block_size
        max_model_len = self.max_model_len
        total_computed_tokens = request.num_computed_tokens
        if total_computed_tokens > max_model_len:
            total_computed_tokens = max_model_len
        num_tokens_need_slot = total_computed_tokens + num_new_tokens + num_lookahead_tokens
        if num_tokens_need_slot > max_model_len:
            num_tokens_need_slot = max_model_len
        req_to_blocks = manager.req_to_blocks
        req_blocks = req_to_blocks.get(request_id)
        num_new_blocks = -(num_tokens_need_slot // -block_size) - (
            len(req_blocks) if req_blocks is not None else 0
        )
        required = num_new_blocks if num_new_blocks > 0 else 0
        if has_scheduled_reqs and self.watermark_blocks and request.status in _WATERMARKED:
            required += self.watermark_blocks
        pool = self.block_pool
        if required > pool.free_block_queue.num_free_blocks - reserved_blocks:
            return None
        if req_blocks is None:
            # Created only on success, where vLLM's allocate_new_blocks creates it.
            req_blocks = req_to_blocks[request_id]
        new_blocks: list[KVCacheBlock] = []
        if num_new_blocks > 0:
            new_blocks = pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
            manager.new_block_ids.extend([b.block_id for b in new_blocks])
        if self.enable_caching and not delay_cache_blocks:
            num_tokens_to_cache = total_computed_tokens + num_new_tokens
            if num_tokens_to_cache > request.num_tokens:
                num_tokens_to_cache = request.num_tokens
            num_full_blocks = num_tokens_to_cache // block_size
            num_cached_blocks = manager.num_cached_block.get(request_id, 0)
            if num_cached_blocks < num_full_blocks:
                pool.cache_full_blocks(
                    request,
                    req_blocks,
                    num_cached_blocks,
                    num_full_blocks,
                    block_size,
                    manager.kv_cache_group_id,
                )
                manager.num_cached_block[request_id] = num_full_blocks
        if new_blocks:
            return KVCacheBlocks((new_blocks,))
        return self.empty_kv_cache_blocks

    def _allocate_running_any(
        self,
        request: Request,
        num_new_tokens: int,
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
        reserved_blocks: int,
        has_scheduled_reqs: bool,
    ) -> KVCacheBlocks | None:
        """``allocate_slots`` with no new hits and no external tokens for any layout
        without cross attention: the coordinator's steps, with the common
        per-group cases (block counting, allocation, the "nothing new to cache"
        test) inlined for full, sliding-window and chunked-local groups.
        """
        coordinator = self.coordinator
        managers = coordinator.single_type_managers
        request_id = request.request_id
        max_model_len = self.max_model_len
        num_computed_tokens = request.num_computed_tokens
        # (Conditional expressions rather than min/max: this runs every decode step.)
        total_computed_tokens = (
            num_computed_tokens if num_computed_tokens < max_model_len else max_model_len
        )
        num_tokens_main_model = total_computed_tokens + num_new_tokens
        num_tokens_need_slot = num_tokens_main_model + num_lookahead_tokens
        if num_tokens_need_slot > max_model_len:
            num_tokens_need_slot = max_model_len
        for manager, align in self._skip_plan:
            if align:
                # Align-mode Mamba: return early when its removal would free
                # nothing (the last skipped position and the previous state
                # are already null), the case of most decode steps.
                mamba = cast(MambaManager, manager)
                null = mamba._null_block
                bs = mamba.block_size
                n_computed = total_computed_tokens - mamba.num_speculative_blocks
                if n_computed < 0:
                    n_computed = 0
                if n_computed > 1:
                    table = mamba.req_to_blocks[request_id]  # creates an entry, as the call does
                    stop = (n_computed - 1) // bs
                    if stop > len(table):
                        stop = len(table)
                    if stop > 0 and table[stop - 1] is not null:
                        mamba.remove_skipped_blocks(
                            request_id, total_computed_tokens, request.num_prompt_tokens
                        )
                        continue
                idx = mamba.last_state_block_idx.get(request_id)
                if (
                    idx is not None
                    and idx < -(n_computed // -bs) - 1
                    and mamba.req_to_blocks[request_id][idx] is not null
                ):
                    mamba.remove_skipped_blocks(
                        request_id, total_computed_tokens, request.num_prompt_tokens
                    )
            elif align is None:
                manager.remove_skipped_blocks(
                    request_id, total_computed_tokens, request.num_prompt_tokens
                )
            else:
                # Sliding window / chunked local: the base removal, called only
                # when the last skipped position still holds a live block.
                num_skipped = manager.get_num_skipped_tokens(total_computed_tokens)
                if num_skipped > 0:
                    table = manager.req_to_blocks[request_id]  # creates an entry, as the call does
                    stop = num_skipped // manager.block_size
                    if stop > len(table):
                        stop = len(table)
                    if stop > 0 and table[stop - 1] is not manager._null_block:
                        manager.remove_skipped_blocks(
                            request_id, total_computed_tokens, request.num_prompt_tokens
                        )
        required = 0
        empty: tuple[KVCacheBlock, ...] = ()
        # Per group, what the allocation step does: a count of blocks to take
        # (simple kinds), 0 for nothing (align-mode Mamba with a long-enough
        # table), or None to call the manager's own allocate_new_blocks.
        plan: list[int | None] = []
        for kind, manager in self._group_plan:
            if kind == 0 and request_id in manager.num_cached_block:
                blocks = manager.req_to_blocks.get(request_id)
                n = -(num_tokens_need_slot // -manager.block_size) - (
                    len(blocks) if blocks is not None else 0
                )
                if n > 0:
                    required += n
                plan.append(n if n > 0 else 0)
            elif (
                kind == 1
                and request_id in manager._allocated_block_reqs  # type: ignore[attr-defined]
                and request_id in manager.req_to_blocks
            ):
                # A running align request counts its (possibly negative) shortfall,
                # as vLLM's formula does, or the one new state block it takes.
                n = (
                    -(num_tokens_main_model // -manager.block_size)
                    + manager.num_speculative_blocks  # type: ignore[attr-defined]
                    - len(manager.req_to_blocks[request_id])
                )
                if n <= 0:
                    required += n
                    plan.append(0)
                else:
                    required += 1
                    plan.append(None)
            else:
                required += manager.get_num_blocks_to_allocate(
                    request_id,
                    num_tokens_need_slot,
                    empty,
                    num_computed_tokens,
                    num_tokens_main_model,
                    False,
                )
                plan.append(-1 if kind == 0 else None)
        if has_scheduled_reqs and self.watermark_blocks and request.status in _WATERMARKED:
            required += self.watermark_blocks
        pool = self.block_pool
        if required > pool.free_block_queue.num_free_blocks - reserved_blocks:
            return None
        new_blocks_by_group: list[list[KVCacheBlock]] = []
        any_new = False
        for (kind, manager), count in zip(self._group_plan, plan, strict=True):
            if count is None:
                new_blocks = manager.allocate_new_blocks(
                    request_id, num_tokens_need_slot, num_tokens_main_model
                )
                any_new = any_new or bool(new_blocks)
            elif kind == 0:
                req_blocks = manager.req_to_blocks[request_id]
                if count < 0:  # not tracked before this call: count against the table now
                    count = -(num_tokens_need_slot // -manager.block_size) - len(req_blocks)
                if count > 0:
                    new_blocks = pool.get_new_blocks(count)
                    req_blocks.extend(new_blocks)
                    if manager._tracks_new_block_ids:
                        manager.new_block_ids.extend([b.block_id for b in new_blocks])
                    any_new = True
                else:
                    new_blocks = []
            else:
                new_blocks = []
            new_blocks_by_group.append(new_blocks)
        if self.enable_caching and not delay_cache_blocks:
            num_tokens_to_cache = request.num_tokens
            if num_tokens_main_model < num_tokens_to_cache:
                num_tokens_to_cache = num_tokens_main_model
            if self._aligned_caching:
                step = coordinator.scheduler_block_size
                aligned = num_tokens_to_cache // step * step
                for manager in managers:
                    n = aligned
                    if manager.use_eagle and aligned > 0:
                        n = min(num_tokens_to_cache, aligned + manager.block_size)
                    # Same early exit as cache_blocks, without the call.
                    if n // manager.block_size > manager.num_cached_block.get(request_id, 0):
                        manager.cache_blocks(request, n, coordinator.retention_interval)
            else:
                for manager in managers:
                    if num_tokens_to_cache // manager.block_size > manager.num_cached_block.get(
                        request_id, 0
                    ):
                        manager.cache_blocks(
                            request, num_tokens_to_cache, coordinator.retention_interval
                        )
        if any_new:
            return KVCacheBlocks(tuple(new_blocks_by_group))
        return self.empty_kv_cache_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (tails are evicted first).

        Freeing a request that holds nothing (e.g. aborted before its first
        allocation) is a no-op, as in vLLM.
        """
        self.coordinator.free(request.request_id)
        if self._owners.get(request.request_id) is request:
            del self._owners[request.request_id]

    def remove_skipped_blocks(
        self, request_id: str, total_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Free blocks no future token attends to and put the null block in their place."""
        self.coordinator.remove_skipped_blocks(request_id, total_computed_tokens, num_prompt_tokens)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Forget the request and return its blocks in allocation order; the caller
        must later ``block_pool.free_blocks`` them in reverse order."""
        if self._owners.get(request.request_id) is request:
            del self._owners[request.request_id]
        return self.coordinator.pop_blocks_for_free(request.request_id)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop the given blocks from the prefix cache (e.g. a connector lost their KV)."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing changes) while blocks are in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, leading blocks of ``running_request_id`` held by every request
        that holds blocks (which may include requests not scheduled this step)."""
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def take_events(self) -> list[KVCacheEvent]:
        """Drain queued KV events, labelling ``BlockStored`` with its group's kind.

        An event whose ``group_idx`` names no group is returned unlabelled, with
        vLLM's warning on ``logger``.
        """
        events = self.block_pool.take_events()
        metadata = self.kv_cache_event_metadata
        for event in events:
            if not isinstance(event, BlockStored) or event.group_idx is None:
                continue
            if 0 <= event.group_idx < len(metadata):
                kind, window = metadata[event.group_idx]
                event.kv_cache_spec_kind = kind
                event.kv_cache_spec_sliding_window = window
            else:
                logger.warning("Group index `%s` not in KV cache metadata", event.group_idx)
        return events

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks in every group."""
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids in every group."""
        return self.get_blocks(request_id).get_block_ids()

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        """Block ids per group, clipped to the blocks covering ``num_computed_tokens``
        in self-attention groups (Mamba, cross-attention and encoder-only groups
        returned whole)."""
        clipped = []
        for group, ids in zip(
            self.kv_cache_config.kv_cache_groups, self.get_block_ids(request_id), strict=False
        ):
            spec = group.kv_cache_spec
            if is_spec_kind(spec, "AttentionSpec") and not is_spec_kind(
                spec, "CrossAttentionSpec", "EncoderOnlyAttentionSpec"
            ):
                ids = ids[: cdiv(num_computed_tokens, spec.block_size)]
            clipped.append(ids)
        return tuple(clipped)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's full blocks within ``num_computed_tokens`` (if caching)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def create_kv_cache_blocks(self, blocks: tuple[list[KVCacheBlock], ...]) -> KVCacheBlocks:
        """Wrap per-group lists; all empty -> the shared empty instance."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def take_new_block_ids(self) -> list[int]:
        """Return and clear ids newly allocated to full-attention groups (to zero them)."""
        ids: list[int] = []
        for manager in self.coordinator.single_type_managers:
            ids.extend(manager.take_new_block_ids())
        return ids

    def new_step_starts(self) -> None:
        """Tell the managers a scheduler step begins."""
        self.coordinator.new_step_starts()

    # ------------------------------------------------------------ test views

    def abstract_state(self) -> dict[str, Any]:
        """Implementation-independent state (format: docs/contract.md)."""
        pool = self.block_pool
        managers = self.coordinator.single_type_managers
        return {
            "num_blocks": pool.num_gpu_blocks,
            "free_queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            "ref_cnt": {b.block_id: b.ref_cnt for b in pool.blocks[1:] if b.ref_cnt != 0},
            "block_hash": {
                b.block_id: b.block_hash for b in pool.blocks if b.block_hash is not None
            },
            "cached": {
                key: [b.block_id for b in blocks]
                for key, blocks in pool.cached_block_hash_to_block.items()
            },
            "req_to_blocks": [
                {rid: [b.block_id for b in blocks] for rid, blocks in m.req_to_blocks.items()}
                for m in managers
            ],
            "num_cached_block": [dict(m.num_cached_block) for m in managers],
            "new_block_ids": [list(m.new_block_ids) for m in managers],
        }

    def check_invariants(self) -> None:
        """Assert pool and table invariants (O(pool + tables)): each non-null block's
        ref count is at least the table entries holding it (blocks returned by
        ``pop_blocks_for_free`` keep their counts until the caller frees them),
        and the pool's own invariants."""
        self.block_pool.check_invariants()
        holders = [0] * self.block_pool.num_gpu_blocks
        for manager in self.coordinator.single_type_managers:
            for blocks in manager.req_to_blocks.values():
                for block in blocks:
                    assert self.block_pool.blocks[block.block_id] is block
                    holders[block.block_id] += 1
        for block in self.block_pool.blocks[1:]:
            assert block.ref_cnt >= holders[block.block_id], (
                f"block {block.block_id}: ref_cnt={block.ref_cnt}, held {holders[block.block_id]}x"
            )
