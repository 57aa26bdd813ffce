"""The scheduler-facing KV-cache manager (vLLM 0.25.1's ``KVCacheManager`` API)."""

from __future__ import annotations

import functools
import itertools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, cast, overload

from mypy_extensions import mypyc_attr

from kvcache.kv_cache_coordinator import (
    RETENTION_FROM_ENV,
    get_kv_cache_coordinator,
    has_windowed_group,
    resolve_prefix_cache_retention_interval,
)
from kvcache.kv_cache_interface import (
    HISPARSE_SOURCE_ROLE,
    HISPARSE_SPEC_KINDS,
    KVCacheBlockCopy,
    KVCacheConfig,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
    is_spec_kind,
    spec_exact_class_name,
)
from kvcache.kv_cache_math import admits, cdiv
from kvcache.kv_cache_utils import KVCacheBlock, check_num_hash_lookahead_tokens
from kvcache.kv_events import BlockStored, KVCacheEvent
from kvcache.metrics import PrefixCacheStats, PrefixCacheStatsBySource
from kvcache.profile import Profile, resolve_profile
from kvcache.request import Request, RequestStatus

logger = logging.getLogger(__name__)

_WATERMARKED: Final = (RequestStatus.WAITING, RequestStatus.PREEMPTED)

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

        try:
            setattr(owner, name, checked)
        except AttributeError as exc:  # a compiled (mypyc) instance has fixed methods
            raise RuntimeError(
                "enable_self_check needs the pure-Python build: set KVCACHE_PURE=1 (or "
                f"{SELF_CHECK_ENV}=1) before importing kvcache"
            ) from exc

    for name in _CHECKED_METHODS:
        wrap(manager, name)
    wrap(manager.block_pool, "free_blocks")


@mypyc_attr(allow_interpreted_subclasses=True)
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
    def get_block_ids(
        self, allow_none: Literal[False] = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...]: ...

    @overload
    def get_block_ids(
        self, allow_none: Literal[True] = True, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None: ...

    def get_block_ids(
        self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None:
        """Block ids per group; with ``allow_none``, None when every group is empty.

        ``group_ids`` (vLLM 0.33.0's argument) selects the groups, in that order;
        None (the default, and 0.25.1's only form) takes every group.
        """
        groups = self.blocks if group_ids is None else self._select_groups(group_ids)
        if allow_none and all(len(group) == 0 for group in groups):
            return None
        return tuple([block.block_id for block in group] for group in groups)

    def _select_groups(self, group_ids: Sequence[int]) -> tuple[Sequence[KVCacheBlock], ...]:
        """The groups ``group_ids`` names (ValueError naming a bad id)."""
        for group_id in group_ids:
            if not isinstance(group_id, int) or not 0 <= group_id < len(self.blocks):
                raise ValueError(
                    f"group_ids: {group_id!r} is no group id (there are {len(self.blocks)})"
                )
        return tuple(self.blocks[group_id] for group_id in group_ids)

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


def _refuse_lookahead(hash_lookahead: int, prefill_lookahead: int, profile: Profile) -> None:
    """Refuse lookahead arguments a release without them never takes: vLLM 0.25.1's
    manager has neither parameter, 0.28.0's takes ``num_prefill_lookahead``
    (``prefill_lookahead_argument``), 0.33.0's ``num_hash_lookahead_tokens`` too
    (``lookahead_arguments``)."""
    for name, value, since, taken in (
        ("num_hash_lookahead_tokens", hash_lookahead, "0.33.0", profile.lookahead_arguments),
        ("num_prefill_lookahead", prefill_lookahead, "0.28.0",
         profile.lookahead_arguments or profile.prefill_lookahead_argument),
    ):
        if value and not taken:
            raise ValueError(
                f"{name}={value}: this lookahead is vLLM {since}'s; profile "
                f"{profile.release} has no such argument (use Profile('0.33.0') or "
                "kvcache.vllm_0_33)"
            )


def _refuse_circular_buffer_groups(kv_cache_config: KVCacheConfig, profile: Profile) -> None:
    """Refuse a ring-buffer group under a profile without ``circular_buffer_groups``
    (vLLM 0.25.1 has no ``CircularBufferSpec``, so no manager for one).

    Raises:
        NotImplementedError: naming the group and the profile.
    """
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        if is_spec_kind(group.kv_cache_spec, "CircularBufferSpec"):
            raise NotImplementedError(
                f"kv_cache_spec of type {type(group.kv_cache_spec).__name__} (group "
                f"{group_id}) is not supported under {profile!r}: CircularBufferSpec "
                "is a vLLM 0.33.0 kind (kvcache.vllm_0_33)"
            )


def _refuse_tq_groups(kv_cache_config: KVCacheConfig, profile: Profile) -> None:
    """Refuse a TurboQuant group under a profile with ``tq_spec_removed`` (vLLM 0.28.0
    dropped ``TQFullAttentionSpec``: no layout has one there).

    Raises:
        NotImplementedError: naming the group and the profile.
    """
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        if spec_exact_class_name(group.kv_cache_spec) == "TQFullAttentionSpec":
            raise NotImplementedError(
                f"kv_cache_spec of type TQFullAttentionSpec (group {group_id}) is not "
                f"supported under {profile!r}: vLLM 0.28.0 removed it"
            )


def _refuse_hisparse_groups(kv_cache_config: KVCacheConfig, profile: Profile) -> None:
    """Refuse a HiSparse group under a profile without ``hisparse_groups`` (vLLM
    0.25.1 has no HiSparse specs, roles or managers).

    Raises:
        NotImplementedError: naming the group, its spec class or role, and the profile.
    """
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        role = getattr(group, "role", None)
        if is_spec_kind(group.kv_cache_spec, *HISPARSE_SPEC_KINDS):
            what = f"kv_cache_spec of type {type(group.kv_cache_spec).__name__}"
        elif getattr(role, "value", role) == HISPARSE_SOURCE_ROLE:
            what = f"role {HISPARSE_SOURCE_ROLE!r}"
        else:
            continue
        raise NotImplementedError(
            f"{what} (group {group_id}) is not supported under {profile!r}: HiSparse "
            "is a vLLM 0.33.0 layout (kvcache.vllm_0_33)"
        )


def _refuse_checkpoint_fields(kv_cache_config: KVCacheConfig, profile: Profile) -> None:
    """Refuse a Mamba spec with prefill checkpoint fields set under a profile without
    ``mamba_prefill_checkpoints`` (vLLM 0.25.1's ``MambaSpec`` has neither field, so
    such a layout cannot exist there; ignoring the fields would be a silent guess).

    Raises:
        ValueError: naming the group, the fields' values and the profile.
    """
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        blocks = getattr(group.kv_cache_spec, "num_prefill_checkpoint_blocks", 0)
        alignment = getattr(group.kv_cache_spec, "prefill_checkpoint_alignment", None)
        if blocks or alignment is not None:
            raise ValueError(
                f"num_prefill_checkpoint_blocks={blocks!r}, prefill_checkpoint_alignment="
                f"{alignment!r} (group {group_id}) are not supported under {profile!r}: "
                "Mamba prefill checkpoints are vLLM 0.33.0's (kvcache.vllm_0_33)"
            )


# Subclassing KVCacheManager is the documented way to plug in a variant (docs/kit.md,
# "Check your own implementation"): allowed on the compiled build too.
@mypyc_attr(allow_interpreted_subclasses=True)
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
        dcp_world_size: Decode context parallel size: each rank stores a share
            of every block, so a block spans ``block_size * dcp * pcp`` tokens
            (``scheduler_block_size`` and ``hash_block_size`` are that size).
            With several KV-cache groups only without prefix caching.
            Under ``Profile("0.33.0")`` the geometry is per group and pcp does not
            scale blocks (the ``pcp_not_scaled`` and ``dcp_sharded_geometry``
            switches): a sharded group's block spans ``block_size * dcp`` tokens,
            a replicated one's (Mamba) ``block_size``.
        pcp_world_size: Prefill context parallel size (likewise).
        metrics_collector: A ``KVCacheMetricsCollector`` (kvcache's or vLLM's) for
            sampled block residency figures, handed to the ``BlockPool``; or None.
        watermark: Fraction of the pool kept free when admitting waiting or
            preempted requests while others are scheduled.
        prefix_cache_retention_interval: Keyword only, not in vLLM's signature
            (vLLM 0.25.1 reads ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL`` when the
            coordinator is built, and so does the default ``"env"``). None: dense
            caching; 0: sliding-window and Mamba groups keep only the tail at the
            prompt's replay boundary; k * scheduler_block_size: also one per k
            scheduler blocks. ValueError for other values, or without a
            sliding-window or Mamba group.
        profile: The vLLM release to behave like (``kvcache.profile``): a
            ``Profile``, a release string, or None for ``Profile("0.25.1")``.
            ``kvcache.vllm_0_33`` builds managers with ``Profile("0.33.0")``.
        num_hash_lookahead_tokens: Keyword only; vLLM 0.33.0's lookahead hashing
            (0: none, as 0.25.1). The requests' hasher covers that many tokens after
            each block (``get_request_block_hasher``); the manager's events report
            them (``lookahead_token_ids``) and key that window, and a Mamba state
            is cached at the prompt's last boundary whose lookahead exists. A bool
            counts as 0 / 1, as in vLLM.
        num_prefill_lookahead: Keyword only; vLLM 0.33.0's prefill lookahead of a
            multi-module drafter (0: none). It re-prefills the last
            ``num_prefill_lookahead - 1`` computed tokens, which are therefore not
            cached yet; with caching and an EAGLE group the scheduler block must
            hold at least ``num_prefill_lookahead`` tokens (ValueError otherwise).
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
        *,
        prefix_cache_retention_interval: int | str | None = RETENTION_FROM_ENV,
        profile: Profile | str | None = None,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
    ) -> None:
        self.profile = resolve_profile(profile)
        if not self.profile.circular_buffer_groups:
            _refuse_circular_buffer_groups(kv_cache_config, self.profile)
        if not self.profile.hisparse_groups:
            _refuse_hisparse_groups(kv_cache_config, self.profile)
        if self.profile.tq_spec_removed:
            _refuse_tq_groups(kv_cache_config, self.profile)
        if not self.profile.mamba_prefill_checkpoints:
            _refuse_checkpoint_fields(kv_cache_config, self.profile)
        self.num_hash_lookahead_tokens = check_num_hash_lookahead_tokens(num_hash_lookahead_tokens)
        if (
            not isinstance(num_prefill_lookahead, int)
            or isinstance(num_prefill_lookahead, bool)
            or num_prefill_lookahead < 0
        ):
            raise ValueError(
                f"num_prefill_lookahead must be a non-negative int, got {num_prefill_lookahead!r}"
            )
        self.num_prefill_lookahead = num_prefill_lookahead
        _refuse_lookahead(self.num_hash_lookahead_tokens, num_prefill_lookahead, self.profile)
        if (
            num_prefill_lookahead > scheduler_block_size
            and enable_caching
            and (use_eagle or any(g.is_eagle_group for g in kv_cache_config.kv_cache_groups))
        ):
            raise ValueError(
                f"num_prefill_lookahead={num_prefill_lookahead} with prefix caching and an "
                f"EAGLE group needs scheduler_block_size={scheduler_block_size} to be at "
                "least as large"
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
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats = self._new_stats() if log_stats else None
        zero_retention_ignored = False
        if self.profile.retention_zero_without_window:
            # 0.33.0 accepts 0 without a windowed group: resolve and check here, and
            # give the coordinator None then (its 0.25.1 check refuses any interval).
            prefix_cache_retention_interval = resolve_prefix_cache_retention_interval(
                prefix_cache_retention_interval,
                scheduler_block_size,
                kv_cache_config,
                zero_without_window=True,
            )
            if prefix_cache_retention_interval == 0 and not has_windowed_group(
                kv_cache_config
            ):
                zero_retention_ignored = True
                prefix_cache_retention_interval = None
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
            metrics_collector=metrics_collector,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
            profile=self.profile,
        )
        if zero_retention_ignored:
            self.coordinator.retention_interval = 0  # only full / chunked groups: no effect
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.block_pool = self.coordinator.block_pool
        # Groups keeping a longer hit than the hybrid one (vLLM 0.33.0's name: the
        # HiSparse source); allocate_slots cuts theirs to the hits it adopts.
        self.retained_hit_group_ids = tuple(
            m.kv_cache_group_id for m in self.coordinator.single_type_managers
            if m.retains_longer_hit
        )
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
        self._owners: dict[str, Request] = {}
        # Groups whose external-token blocks an async load writes, so they are not
        # reported for zeroing: vLLM 0.33.0's allocate_slots(skip_zeroing_group_ids=),
        # set by the drop-in (kvcache.vllm_0_33) for one call.
        self.skip_zeroing_group_ids: tuple[int, ...] = ()
        self.stats_at_admission = self.profile.stats_at_admission
        self.full_report_mode = self.profile.full_report_mode
        self.adopt_computed_without_new_tokens = self.profile.adopt_computed_without_new_tokens
        self.free_on_processed_tokens = self.profile.free_on_processed_tokens
        self.cascade_always_zero = self.profile.cascade_always_zero
        self.mamba_prefill_checkpoints = self.profile.mamba_prefill_checkpoints
        self.block_pool.num_hash_lookahead_tokens = self.num_hash_lookahead_tokens
        self.coordinator.num_reprefillable_tokens = max(0, num_prefill_lookahead - 1)
        if os.environ.get(SELF_CHECK_ENV, "0") not in ("", "0"):
            enable_self_check(self)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use (0.0 to 1.0)."""
        return self.block_pool.get_usage()

    def _new_stats(self) -> PrefixCacheStats:
        """Empty stats of the release's class (``stats_hits_by_source``: with the hits
        per tier)."""
        if self.profile.stats_hits_by_source:
            return PrefixCacheStatsBySource()
        return PrefixCacheStats()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Return the stats gathered since the last call and start new ones
        (None unless ``log_stats``)."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = self._new_stats()
        return stats

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """The copy-on-write copies queued since the last call (``partial_hit_copy_on_write``,
        vLLM 0.30.0 on: a hit or a Mamba prompt-tail state ending inside a block), and
        the blocks they keep held, source then copy per pair: the caller frees those
        once the copies have run. Empty under a profile without the switch."""
        pairs = [
            pair
            for manager in self.coordinator.single_type_managers
            for pair in manager.take_pending_cow_copies()
        ]
        copies = [KVCacheBlockCopy(src.block_id, dst.block_id) for src, dst in pairs]
        return copies, [block for pair in pairs for block in pair]

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        """Whether a local prefix-cache lookup runs for ``request`` (caching on, and the
        request does not skip reading the cache)."""
        return self.enable_caching and not request.skip_reading_prefix_cache

    def shared_prefix_boundary(self, request: Request, num_hit_tokens: int) -> int:
        """The shared-prefix boundary of the lookup that just hit ``num_hit_tokens`` for
        ``request`` (``shared_prefix_junctions``, the third value of 0.26.0's lookup):
        where the longest single-kind hit of a hybrid lookup ended, when it is longer
        than the common hit (a shared prefix a sparse-retention group has not cached
        yet); else 0, and 0 without the switch or for a request that skipped the
        lookup. The scheduler keeps it as ``request.shared_prefix_boundary``, whose
        tail sparse retention then keeps."""
        if not self.profile.shared_prefix_junctions or not self.prefix_cache_lookup_enabled(
            request
        ):
            return 0
        num_uncached: int = getattr(self.coordinator, "num_uncached_common_prefix_tokens", 0)
        return num_hit_tokens + num_uncached if num_uncached else 0

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count an admitted request's lookup that hit ``num_hits`` tokens: under
        ``stats_at_admission`` (vLLM 0.27.0 on) the scheduler calls this once the
        request's allocation succeeded, and the lookup counts nothing. No-op without
        ``log_stats``, without that switch (the lookup counted it), or for a request
        that skipped the lookup."""
        if (self.prefix_cache_stats is None or not self.stats_at_admission
                or not self.prefix_cache_lookup_enabled(request)):  # fmt: skip
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of a request that is not running yet.

        The hit never covers the last token (its logits must be computed), so it
        is capped at ``num_tokens - 1`` (or at ``max_cache_hit_length``, vLLM
        0.33.0's argument) and then rounded down to whole blocks.

        Returns:
            ``(hit blocks, number of hit tokens)``; the blocks are not yet touched.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        computed_blocks, num_new_computed_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, self.hit_length_bound(request, max_cache_hit_length)
        )
        if (
            num_new_computed_tokens > 0
            and self.full_report_mode
            and self.block_pool.enable_kv_cache_events
            and getattr(request, "kv_cache_report_mode", "incremental") == "full"
        ):
            # The hit blocks reported as stored again (vLLM 0.28.0's "full" report
            # mode, a request field kvcache's Request does not declare).
            self.coordinator.emit_cached_block_events(request, computed_blocks)
        if self.prefix_cache_stats is not None and not self.stats_at_admission:
            self.prefix_cache_stats.record(
                num_tokens=request.num_tokens,
                num_hits=num_new_computed_tokens,
                preempted=request.num_preemptions > 0,
            )
        return self.create_kv_cache_blocks(computed_blocks), num_new_computed_tokens

    def hit_length_bound(self, request: Request, max_cache_hit_length: int | None) -> int:
        """The most tokens a lookup of ``request`` may hit: ``max_cache_hit_length``, or
        ``num_tokens - 1`` without it (the last token is recomputed for its logits).

        Raises:
            ValueError: for a ``max_cache_hit_length`` that is no non-negative int.
        """
        if max_cache_hit_length is None:
            return request.num_tokens - 1
        if not isinstance(max_cache_hit_length, int) or max_cache_hit_length < 0:
            raise ValueError(
                f"max_cache_hit_length must be a non-negative int, got {max_cache_hit_length!r}"
            )
        return max_cache_hit_length

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
        # NOTE: the request is an interpreted object (kvcache's or vLLM's Request),
        # each attribute read a dictionary lookup: every field is read once.
        request_id = request.request_id
        num_computed_tokens = request.num_computed_tokens
        if (
            num_new_tokens == 0
            and num_external_computed_tokens == 0
            and (num_new_computed_tokens == 0 or not self.adopt_computed_without_new_tokens)
        ):
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no external "
                f"computed tokens (request {request_id!r})"
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
            or num_computed_tokens
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
        owner = self._owners.get(request_id)
        if owner is not request:
            if owner is not None:
                raise ValueError(
                    f"request_id {request_id!r} is already held by another Request "
                    "object (duplicate request id); free the first one before reusing its id"
                )
            self._owners[request_id] = request
        if new_computed_blocks is not None:
            new_computed_block_list = new_computed_blocks.blocks
            if self.retained_hit_group_ids:
                # NOTE: a new tuple even for the shared empty instance, as in vLLM
                # 0.33.0: a new request then always adopts (its managers'
                # add_local_computed_blocks run: a HiSparse hot group without
                # resident groups asks for its region there, a resident group
                # commits its 0 host pages).
                new_computed_block_list = self._cut_retained_hits(
                    new_computed_block_list,
                    num_new_computed_tokens + num_external_computed_tokens,
                )
        else:
            new_computed_block_list = self.empty_kv_cache_blocks.blocks
        coordinator = self.coordinator
        free_queue = self.block_pool.free_block_queue

        num_local_computed_tokens = num_computed_tokens + num_new_computed_tokens
        total_computed_tokens = min(
            num_local_computed_tokens + num_external_computed_tokens, self.max_model_len
        )
        watermark_blocks = self.watermark_blocks
        if watermark_blocks and not (has_scheduled_reqs and request.status in _WATERMARKED):
            watermark_blocks = 0
        # Where the prefill ends (a resumed request replays its output tokens too):
        # Mamba prefill checkpoints reserve a block only on the chunk reaching it.
        prefill_end = 0
        if self.mamba_prefill_checkpoints:
            prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if full_sequence_must_fit:
            full_num_tokens = min(request.num_tokens, self.max_model_len)
            num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate(
                request_id=request_id,
                num_tokens=full_num_tokens,
                new_computed_blocks=new_computed_block_list,
                num_encoder_tokens=num_encoder_tokens,
                total_computed_tokens=total_computed_tokens,
                num_tokens_main_model=full_num_tokens,
                apply_admission_cap=True,
                num_local_computed_tokens=num_local_computed_tokens,
                prefill_end=prefill_end,
            )
            if not admits(num_blocks_to_allocate, free_queue.num_free_blocks, 0, watermark_blocks):
                return None

        num_tokens_main_model = total_computed_tokens + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens, self.max_model_len)
        # Freeing out-of-window blocks first means fewer cached blocks get evicted;
        # it happens even if the allocation then fails.
        if coordinator.skips_tokens:
            coordinator.remove_skipped_blocks(
                request_id,
                self._processed_tokens(request, total_computed_tokens)
                if self.free_on_processed_tokens
                else total_computed_tokens,
                request.num_prompt_tokens,
            )
        num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate(
            request_id=request_id,
            num_tokens=num_tokens_need_slot,
            new_computed_blocks=new_computed_block_list,
            num_encoder_tokens=num_encoder_tokens,
            total_computed_tokens=num_local_computed_tokens + num_external_computed_tokens,
            num_tokens_main_model=num_tokens_main_model,
            num_local_computed_tokens=num_local_computed_tokens,
            prefill_end=prefill_end,
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
                request_id=request_id,
                new_computed_blocks=new_computed_block_list,
                num_local_computed_tokens=num_local_computed_tokens,
                num_external_computed_tokens=num_external_computed_tokens,
                skip_zeroing_group_ids=self.skip_zeroing_group_ids,
            )
        new_blocks = coordinator.allocate_new_blocks(
            request_id, num_tokens_need_slot, num_tokens_main_model, num_encoder_tokens
        )
        if self.enable_caching and not delay_cache_blocks:
            # Only committed tokens are cached: draft tokens past num_tokens may be rejected.
            coordinator.cache_blocks(
                request, min(total_computed_tokens + num_new_tokens, request.num_tokens)
            )
        return self.create_kv_cache_blocks(new_blocks)

    def _cut_retained_hits(
        self, blocks: tuple[Sequence[KVCacheBlock], ...], num_reused_tokens: int
    ) -> tuple[Sequence[KVCacheBlock], ...]:
        """``blocks`` with each retained-hit group's hits cut to the blocks that the
        ``num_reused_tokens`` (new local hits plus external tokens) reach into."""
        groups = list(blocks)
        managers = self.coordinator.single_type_managers
        for group_id in self.retained_hit_group_ids:
            num_blocks = cdiv(num_reused_tokens, managers[group_id].block_size)
            groups[group_id] = groups[group_id][:num_blocks]
        return tuple(groups)

    def _processed_tokens(self, request: Request, total_computed_tokens: int) -> int:
        """Computed tokens whose forward pass is done (``free_on_processed_tokens``):
        the total less the request's in-flight tokens (vLLM 0.33.0's
        ``Request.num_in_flight_tokens``; 0 for a request without it)."""
        in_flight: int = getattr(request, "num_in_flight_tokens", 0) or 0
        return max(0, total_computed_tokens - in_flight)

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
        if not self.coordinator.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, leading blocks of ``running_request_id`` held by every request
        that holds blocks (which may include requests not scheduled this step).

        Zeros without looking at the request under ``cascade_always_zero``."""
        if self.cascade_always_zero:
            return [0] * self.num_kv_cache_groups
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def take_events(self) -> list[KVCacheEvent]:
        """Drain queued KV events, labelling ``BlockStored`` with its group's kind.

        An event whose ``group_idx`` names no group is returned unlabelled, with
        vLLM's warning on ``logger``.
        """
        events = self.block_pool.take_events()
        metadata = self.kv_cache_event_metadata
        for any_event in events:
            # By class name: a pool built from vLLM's objects emits vLLM's events.
            if type(any_event).__name__ != "BlockStored":
                continue
            event = cast(BlockStored, any_event)
            if event.group_idx is None:
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
        for group in blocks:  # a loop, not any(): no call through the builtins
            if group:
                return KVCacheBlocks(blocks)
        return self.empty_kv_cache_blocks

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
