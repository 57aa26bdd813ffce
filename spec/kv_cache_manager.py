"""The request-level KV-cache manager (vLLM 0.25.1's API, blocks as int ids): one
flow over the groups' managers (one per KV-cache group, each following its kind's
row), sharing one block pool. There is no coordinator layer: the hit search, the
admission count and caching loop over the groups here."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, overload

from . import effectiveness, pure
from .block_pool import BlockPool
from .profile import Profile, resolve_profile
from .pure import cdiv
from .releases import NO_CONTEXT_PARALLEL
from .single_type_kv_cache_manager import (
    HISPARSE_RESIDENT,
    MAMBA_ALIGN,
    Hits,
    KindRules,
    SingleTypeKVCacheManager,
    check_no_hits,
    find_fine_grained_hit,
    find_longest_cache_hit,
    get_manager_for_kv_cache_spec,
)
from .vocab import (
    NULL_BLOCK,
    BlockStored,
    KVCacheConfig,
    KVCacheEvent,
    KVCacheSpec,
    PrefixCacheStats,
    Request,
    cacheable,
    coarsen,
    event_kind,
    event_sliding_window,
    is_a,
    needs_kv_cache_zeroing,
    pool_key,
    prefill_checkpoint_fields,
)

WATERMARKED = ("WAITING", "PREEMPTED")
"""Statuses (by name) whose admission keeps the watermark free."""


def group_role(group: object) -> str | None:
    """A group's role (vLLM 0.33.0's ``KVCacheGroupSpec.role``, an enum or its value;
    None for groups without one)."""
    role = getattr(group, "role", None)
    return getattr(role, "value", role)


@dataclass
class KVCacheBlocks:
    """Block ids per KV-cache group (``blocks[g][i]``), as handed to the scheduler;
    ``block_pool`` lets the unhashed-id queries read the current hashes."""

    blocks: tuple[Sequence[int], ...]
    block_pool: BlockPool | None = field(default=None, compare=False, repr=False)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        """Concatenate group by group."""
        pairs = zip(self.blocks, other.blocks, strict=False)
        return KVCacheBlocks(tuple(list(itertools.chain(a, b)) for a, b in pairs),
                             self.block_pool or other.block_pool)

    @overload
    def get_block_ids(self, allow_none: Literal[False] = False) -> tuple[list[int], ...]: ...

    @overload
    def get_block_ids(self, allow_none: Literal[True]) -> tuple[list[int], ...] | None: ...

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """Fresh lists of ids per group; None instead of all-empty when ``allow_none``."""
        if allow_none and all(len(group) == 0 for group in self.blocks):
            return None
        return tuple(list(group) for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the only group's uncached blocks (null included); ValueError if not 1 group."""
        if len(self.blocks) != 1:
            raise ValueError(f"get_unhashed_block_ids needs 1 group, got {len(self.blocks)}")
        assert self.block_pool is not None
        return [b for b in self.blocks[0] if b not in self.block_pool.block_hash]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        """Per group, ids of blocks that are neither cached nor the null block."""
        assert self.block_pool is not None
        hashed = self.block_pool.block_hash
        return [[b for b in g if b not in hashed and b != NULL_BLOCK] for g in self.blocks]

    def new_empty(self) -> KVCacheBlocks:
        """An empty instance with as many groups."""
        return KVCacheBlocks(tuple(() for _ in self.blocks), self.block_pool)


class KVCacheManager:
    """Allocates, caches and frees the KV-cache blocks of requests, per vLLM 0.25.1.

    State lives in ``block_pool`` (free queue, ref counts, prefix cache) and in the
    groups' managers, ``single_type_managers`` (block tables); ``abstract_state`` shows
    it all.

    Beyond vLLM's arguments, two engine settings vLLM gives its request hasher: the spec
    hashes requests itself with ``caching_hash_algo`` (sha256, sha256_cbor, xxhash,
    xxhash_cbor), the chain seeded by ``hash_seed`` (None: ``PYTHONHASHSEED``). vLLM
    reads the retention interval from its environment; the spec is told it
    (``prefix_cache_retention_interval``): None caches densely, 0 only at the prompt's
    replay boundary, a multiple of ``scheduler_block_size`` there and at each of its
    multiples; it thins out what sliding-window and Mamba groups cache.

    Groups flagged ``is_eagle_group`` drop their last hit block; when none is flagged,
    ``use_eagle`` flags them all. Cross-attention groups are sized by the encoder tokens.
    Context parallelism (``dcp_world_size`` * ``pcp_world_size`` ranks) spreads a
    block's tokens over the ranks, so to a group a block spans its spec's block size
    times the group's context-parallel size: dcp * pcp in 0.25.1; in 0.33.0 pcp no
    longer counts (``pcp_not_scaled``) and only sharded specs count at all
    (``dcp_sharded_geometry``). ``num_hash_lookahead_tokens`` and
    ``num_prefill_lookahead`` are 0.33.0's lookahead arguments (0: none): the pool's
    hashes cover that many tokens after each block, and caching leaves out the last
    ``num_prefill_lookahead - 1`` computed tokens.

    Invariants (``check_invariants``), besides the pool's and the managers':
      - every id in a table or in ``new_block_ids`` is a valid block id (and not 0 in
        ``new_block_ids``);
      - a non-null block is held by one group only (a hit shares it within its group),
        and its ref count is at least the number of table entries holding it; more only
        for blocks from ``pop_blocks_for_free`` the caller has not freed yet.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int,
                 scheduler_block_size: int, hash_block_size: int,
                 max_num_batched_tokens: int | None = None, enable_caching: bool = True,
                 use_eagle: bool = False, log_stats: bool = False,
                 enable_kv_cache_events: bool = False, dcp_world_size: int = 1,
                 pcp_world_size: int = 1, metrics_collector: Any = None,
                 watermark: float = 0.0, *, caching_hash_algo: str = "sha256",
                 hash_seed: str | None = None,
                 prefix_cache_retention_interval: int | None = None,
                 profile: Profile | str | None = None, num_hash_lookahead_tokens: int = 0,
                 num_prefill_lookahead: int = 0) -> None:
        self.profile = p = resolve_profile(profile)  # spec/profile.py, spec/releases.py
        groups = kv_cache_config.kv_cache_groups
        for i, g in enumerate(groups):  # what the release admits
            spec, role = g.kv_cache_spec, group_role(g)
            if not p.rules.circular_buffer_groups(spec):
                raise NotImplementedError("a CircularBufferSpec group (a vLLM 0.33.0 kind) "
                                          f"under profile {p.release}")
            if not p.rules.tq_spec_removed(spec):
                raise NotImplementedError(f"a TQFullAttentionSpec group (group {i}) under "
                                          f"profile {p.release}: vLLM 0.28.0 removed it")
            if not p.rules.hisparse_groups(spec, role):
                what = f"role {role!r}" if role == "hisparse_source" else type(spec).__name__
                raise NotImplementedError(f"{what} (group {i}) is not supported under "
                                          f"profile {p.release}: HiSparse is vLLM 0.33.0's")
            blocks, alignment = prefill_checkpoint_fields(spec)
            if (blocks or alignment is not None) and p.rules.mamba_prefill_checkpoints(
                    spec) is None:
                raise ValueError(f"num_prefill_checkpoint_blocks={blocks}, prefill_checkpoint_"
                                 f"alignment={alignment}: Mamba prefill checkpoints are vLLM "
                                 f"0.33.0's; profile {p.release} has no such fields")
        # 0.33.0's lookahead hashing and prefill lookahead (0: none; a bool hash
        # lookahead counts as 0 / 1, as vLLM does arithmetic with it).
        for name, value in (("num_hash_lookahead_tokens", num_hash_lookahead_tokens),
                            ("num_prefill_lookahead", num_prefill_lookahead)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        for name, value, since, admits in (
                ("num_hash_lookahead_tokens", num_hash_lookahead_tokens, "0.33.0",
                 p.rules.lookahead_arguments(num_hash_lookahead_tokens)),
                ("num_prefill_lookahead", num_prefill_lookahead, "0.28.0",
                 p.rules.lookahead_arguments(num_prefill_lookahead)
                 or p.rules.prefill_lookahead_argument(num_prefill_lookahead))):
            if not admits:
                raise ValueError(f"{name}={value}: this lookahead is vLLM {since}'s; profile "
                                 f"{p.release} has no such argument")
        if isinstance(num_prefill_lookahead, bool):
            raise ValueError(f"num_prefill_lookahead must be a non-negative int, got "
                             f"{num_prefill_lookahead!r}")
        eagle = use_eagle or any(g.is_eagle_group for g in kv_cache_config.kv_cache_groups)
        if enable_caching and eagle and num_prefill_lookahead > scheduler_block_size:
            raise ValueError(f"num_prefill_lookahead={num_prefill_lookahead} with prefix caching "
                             f"and an EAGLE group needs scheduler_block_size="
                             f"{scheduler_block_size} to be at least as large")
        for name, size in (("dcp_world_size", dcp_world_size), ("pcp_world_size", pcp_world_size)):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be a positive int, got {size!r}")
        if metrics_collector is not None:
            raise NotImplementedError("metrics_collector is not modelled by the spec")
        self.max_model_len = max_model_len
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.prefix_cache_stats = p.rules.stats_hits_by_source() if log_stats else None
        if scheduler_block_size % hash_block_size or any(
                scheduler_block_size % g.kv_cache_spec.block_size for g in groups):
            raise ValueError(f"scheduler_block_size={scheduler_block_size} must be a multiple of "
                             f"hash_block_size={hash_block_size} and of each group's block size")
        self.kv_cache_config = kv_cache_config
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching, hash_block_size,
                                    enable_kv_cache_events, None, caching_hash_algo, hash_seed,
                                    profile=p,
                                    num_hash_lookahead_tokens=int(num_hash_lookahead_tokens))
        self.eagle_group_ids = {i for i, g in enumerate(groups) if g.is_eagle_group}
        if use_eagle and not self.eagle_group_ids:
            self.eagle_group_ids = set(range(len(groups)))
        self.eagle_group_ids = p.rules.eagle_master_switch(self.eagle_group_ids, use_eagle)
        self.dcp_world_size, self.pcp_world_size = dcp_world_size, pcp_world_size
        scale = p.rules.pcp_not_scaled(dcp_world_size, pcp_world_size)
        geometry = p.rules.dcp_sharded_geometry
        full_only = p.rules.dcp_full_attention_only
        scales = geometry.scales if full_only is None or p.rules.dcp_sharded_field else full_only
        context_parallel = [scale if scales(g.kv_cache_spec) else 1 for g in groups]
        if enable_caching and len(groups) > 1:
            geometry.check_hybrid([g.kv_cache_spec for g in groups], dcp_world_size,
                                  pcp_world_size)
        elif enable_caching and max(*context_parallel, pcp_world_size) > 1 and not is_a(
                groups[0].kv_cache_spec, "FullAttentionSpec"):
            raise NotImplementedError(NO_CONTEXT_PARALLEL)
        self.num_reprefillable_tokens = max(0, num_prefill_lookahead - 1)
        zeroing = needs_kv_cache_zeroing(kv_cache_config)
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(g.kv_cache_spec, max_num_batched_tokens, max_model_len,
                                          self.block_pool, enable_caching, i, scheduler_block_size,
                                          context_parallel[i], group_role(g), profile=p,
                                          needs_kv_cache_zeroing=zeroing, use_eagle=use_eagle)
            for i, g in enumerate(groups))
        self.retention_interval = prefix_cache_retention_interval
        windowed = any(is_a(g.kv_cache_spec, "SlidingWindowSpec")
                       or is_a(g.kv_cache_spec, "MambaSpec") for g in groups)
        interval = self.retention_interval
        if interval is not None and p.rules.retention_zero_without_window(interval, windowed):
            self._check_retention_interval(interval, windowed)
        for m in self.single_type_managers:  # (vLLM: each manager asserts as it is built)
            if enable_caching and not p.rules.mamba_align_only(m.kv_cache_spec):
                mode = m.kv_cache_spec.mamba_cache_mode
                raise AssertionError(f"mamba_cache_mode={mode!r} with prefix caching on: "
                                     "this release caches Mamba only in 'align'")
        self.fine_grained = False  # mamba_fine_grained_hits in effect (hybrid only)
        self.num_uncached_common_prefix_tokens = 0  # set by each hit search
        self._init_groups()
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        # vLLM 0.33.0: groups whose hits outlive the common hit (the HiSparse source);
        # allocate_slots keeps of theirs what the new hits and external tokens cover.
        self.retained_hit_group_ids = tuple(
            i for i, m in enumerate(self.single_type_managers)
            if m.rules.retains_longer_hit)
        if not watermark >= 0.0:
            raise ValueError(f"watermark must be non-negative, got {watermark!r}")
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.kv_cache_event_metadata = tuple(
            (event_kind(g.kv_cache_spec), event_sliding_window(g.kv_cache_spec))
            for g in kv_cache_config.kv_cache_groups)
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups)), self.block_pool)

    def _check_retention_interval(self, interval: int, windowed: bool) -> None:
        """vLLM's checks: a windowed group to thin out, and a non-negative multiple of
        ``scheduler_block_size`` (hits end only on those)."""
        if not windowed:
            raise ValueError(f"prefix_cache_retention_interval={interval} needs a sliding-window "
                             "or Mamba group")
        if interval < 0 or interval % self.scheduler_block_size:
            raise ValueError(f"prefix_cache_retention_interval={interval} must be non-negative "
                             f"and a multiple of scheduler_block_size={self.scheduler_block_size}")

    def _init_groups(self) -> None:
        """The groups a lookup searches (``attention_groups``: equal specs bundled, full
        attention first) and each group's EAGLE flag; caching off searches none.

        One group is looked up as vLLM's single-group coordinator does (rule
        ``one-group``): hashed at its own block size, searched even outside prefix
        caching (a ring's search finds nothing). Several groups need at least two
        distinct specs, hashed at a common finer ``hash_block_size`` that divides
        every block size of a caching group (larger blocks read it through
        ``vocab.coarsen``); a ring buffer (vLLM 0.33.0) is never searched but counts
        as a distinct spec."""
        self.attention_groups: list[SpecGroup] = []
        if not self.enable_caching:
            return
        groups = self.kv_cache_config.kv_cache_groups
        managers = self.single_type_managers
        if len(groups) == 1:
            m = managers[0]
            if self.hash_block_size != m.block_size:
                message = (f"hash_block_size={self.hash_block_size} must equal the block size "
                           f"{m.block_size} of the only group")
                raise self.profile.rules.dcp_sharded_geometry.refusal(message)
            self.attention_groups.append(SpecGroup(
                lookup_spec(groups[0].kv_cache_spec, m), [0], m.rules, 0 in self.eagle_group_ids))
        else:
            self._bundle_groups()
        for sg in self.attention_groups:
            for group_id in sg.group_ids:
                managers[group_id].use_eagle = sg.use_eagle
        if len(groups) > 1:
            self.profile.rules.mamba_fine_grained_hits(self)

    def _bundle_groups(self) -> None:
        """Several groups: the hybrid layout's checks, and its caching groups bundled by
        equal spec (and kind) into ``attention_groups``, full attention first."""
        # A ring buffer (vLLM 0.33.0) takes no part in prefix caching: not hashed, never
        # searched (its hit stays empty); it still counts as a distinct spec.
        groups = self.kv_cache_config.kv_cache_groups
        if any(m.block_size % self.hash_block_size
               for g, m in zip(groups, self.single_type_managers, strict=True)
               if cacheable(g.kv_cache_spec)):
            raise ValueError(f"hash_block_size={self.hash_block_size} must divide every block size")
        scratch = [g.kv_cache_spec for g in groups if not cacheable(g.kv_cache_spec)]
        num_scratch = len([s for i, s in enumerate(scratch) if s not in scratch[:i]])
        for i, (g, m) in enumerate(zip(groups, self.single_type_managers, strict=True)):
            if not cacheable(g.kv_cache_spec):
                continue
            use_eagle = i in self.eagle_group_ids
            for idx, sg in enumerate(self.attention_groups):
                # equal specs of different kinds (a HiSparse source and its indexer
                # group) search different pools: not bundled
                if groups[sg.group_ids[0]].kv_cache_spec == g.kv_cache_spec and (
                        sg.rules is m.rules):
                    sg.group_ids.append(i)
                    self.attention_groups[idx] = sg._replace(use_eagle=sg.use_eagle or use_eagle)
                    break
            else:
                self.attention_groups.append(
                    SpecGroup(lookup_spec(g.kv_cache_spec, m), [i], m.rules, use_eagle))
        if len(self.attention_groups) + num_scratch < 2:
            raise ValueError(f"{len(groups)} KV-cache groups need >= 2 distinct specs with caching")
        if not self.attention_groups:
            raise ValueError("every KV-cache group is a ring buffer: nothing to look up")
        self.attention_groups.sort(key=lambda sg: not is_a(sg.spec, "FullAttentionSpec"))

    def enable_fine_grained_hits(self) -> None:
        """mamba_fine_grained_hits: hits end on hash-block boundaries when a Mamba 'align'
        group's block is larger than the hash block (under dcp, at least the hash block:
        the dcp-scaled attention blocks are larger) and every other group is full
        attention (or a variant), Mamba, or hashed at its own block size (a ring buffer,
        outside prefix caching, takes no part); under dcp only from 0.29.0
        (``fine_grained_hits_under_dcp``)."""
        hbs = self.hash_block_size
        if not self.profile.rules.fine_grained_hits_under_dcp(self.dcp_world_size):
            return
        if any(m.rules is MAMBA_ALIGN
               and (m.block_size > hbs or (self.dcp_world_size > 1 and m.block_size == hbs))
               for m in self.single_type_managers) and all(
                m.rules.fine_hit is not None or m.block_size == hbs
                or not cacheable(m.kv_cache_spec) for m in self.single_type_managers):
            self.fine_grained = True
            for m in self.single_type_managers:
                m.cache_hit_alignment_tokens = hbs

    @property
    def usage(self) -> float:
        """Fraction of non-null blocks in use."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Return the hit stats gathered so far and start new ones (None unless log_stats)."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = self.profile.rules.stats_hits_by_source()
        return stats

    def effectiveness_lookup(self, request: Request) -> effectiveness.Lookup | None:
        """The lookup of ``request`` now as ``spec.effectiveness`` judges it: each group's
        resume row and the token boundaries at which the pool holds this request's key
        for it. None for layouts the rows do not cover (HiSparse)."""
        managers = self.single_type_managers
        groups = []
        for m in managers:
            kind = m.rules.resume
            if kind is None or len(self.pools()) > 1:
                return None
            spec = m.kv_cache_spec
            span = getattr(spec, "sliding_window", None) or getattr(
                spec, "attention_chunk_size", None) or 0
            groups.append(effectiveness.Group(kind, m.block_size, span, m.use_eagle))
        pool, h = self.block_pool, self.block_pool.hash_block_size
        hashes = pool.block_hashes(request)
        fine = self.fine_grained
        return effectiveness.Lookup(
            groups=tuple(groups),
            cached=tuple(
                frozenset((i + 1) * h for i, digest in enumerate(hashes)
                          if pool_key(digest, g) in pool.cached)
                for g in range(len(managers))),
            num_tokens=request.num_tokens,
            hashed_tokens=len(hashes) * h,
            hash_block=h,
            alignment=h if fine else self.scheduler_block_size,
            caching=self.enable_caching,
            skips_reading=request.skip_reading_prefix_cache,
            eagle_step=tuple(h if fine else m.block_size for m in managers),
        )

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The request's longest cached prefix: its blocks and length in tokens. At most
        ``num_tokens - 1`` tokens hit: the last one is recomputed for its logits."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        hits, num_hit_tokens = self.find_longest_cache_hit(
            self.block_pool.block_hashes(request), request.num_tokens - 1)
        if self.prefix_cache_stats is not None:
            self.profile.rules.stats_at_admission.lookup(
                self.prefix_cache_stats, request.num_tokens, num_hit_tokens,
                request.num_preemptions > 0)
        if num_hit_tokens > 0 and self.profile.rules.full_report_mode(request):
            for group_id, group_hits in enumerate(hits):  # tell subscribers of the hits too
                if group_hits:
                    self.block_pool.emit_cached_block_events(
                        request, len(group_hits),
                        self.kv_cache_config.kv_cache_groups[group_id].kv_cache_spec.block_size,
                        group_id)
        return self.create_kv_cache_blocks(hits), num_hit_tokens

    def shared_prefix_boundary(self, request: Request, num_hit_tokens: int) -> int:
        """shared_prefix_junctions (0.33.0's third lookup value), right after the
        request's lookup hit ``num_hit_tokens``: where the longest single-kind hit
        ended when it is longer than the common hit, else 0 (always 0 under 0.25.1,
        and for a lookup that did not run)."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return 0
        uncached = self.num_uncached_common_prefix_tokens
        return self.profile.rules.shared_prefix_junctions(
            num_hit_tokens + uncached if uncached else 0)

    def get_computed_blocks_for_connector(self, request: Request
                                          ) -> tuple[KVCacheBlocks, int, int, bool]:
        """0.33.0's lookup for a KV connector that takes divergent hybrid hits:
        (blocks, local hit tokens, shared-prefix boundary, hit_diverged).

        In a hybrid layout with a Mamba group whose first spec is full attention each
        spec is looked up alone. A group hitting deeper than the first full-attention
        group means that group lost its tail: then the plain lookup, not diverged.
        Else the full-attention hit is the local hit, with each group's own hits,
        boundary 0, diverged when any group hit less (a Mamba state evicted; a ring
        buffer is never looked up, so always). Any other layout: the plain lookup, not
        diverged. Records nothing (stats come at admission, no "full" report events)."""
        groups = self.kv_cache_config.kv_cache_groups
        if self.enable_caching and len(groups) > 1 and any(
                is_a(g.kv_cache_spec, "MambaSpec") for g in groups):
            first = self.attention_groups[0]
            if is_a(first.spec, "FullAttentionSpec"):
                if not self.enable_caching or request.skip_reading_prefix_cache:
                    return self.empty_kv_cache_blocks, 0, 0, False
                hits, lengths = self.find_longest_cache_hit_per_group(
                    self.block_pool.block_hashes(request), request.num_tokens - 1)
                num_local = lengths[first.group_ids[0]]
                if max(lengths) <= num_local:  # else full attention lost its tail
                    return self.create_kv_cache_blocks(hits), num_local, 0, min(lengths) < num_local
        blocks, num_hit_tokens = self.get_computed_blocks(request)
        return blocks, num_hit_tokens, self.shared_prefix_boundary(request, num_hit_tokens), False

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """stats_at_admission: the scheduler counts an admitted request's lookup here
        (nothing before 0.27.0, whose lookup counted it, without log_stats, caching, or
        for a request that skipped the cache)."""
        if (self.prefix_cache_stats is None or not self.enable_caching
                or request.skip_reading_prefix_cache):
            return
        self.profile.rules.stats_at_admission.admission(
            self.prefix_cache_stats, request.num_tokens, num_hits, request.num_preemptions > 0)

    def _hashes_for(self, block_hashes: list[bytes], spec: KVCacheSpec) -> list[bytes]:
        """The request's hashes at the spec's block size."""
        if spec.block_size == self.hash_block_size:
            return block_hashes
        return coarsen(block_hashes, self.hash_block_size, spec.block_size)

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_cache_hit_length: int
                               ) -> tuple[Hits, int]:
        """Per-group hit blocks and the hit length in tokens: shrink a candidate length
        until every spec accepts it (a fixed point); caching off: no hit.

        One group (rule ``one-group``) is searched once, its hits aligned to its own
        block, an EAGLE group never looking past ``max_cache_hit_length``.

        Full attention is searched once, then only rounded down to its block size; with
        one other spec a single round suffices. An EAGLE spec searches one block further
        and drops it, once per candidate length. Only the first spec's hits are trimmed
        to the final length, as in vLLM (0.33.0: every full-attention spec's), but not
        a group that ``retains_longer_hit`` (the HiSparse source): each spec is searched
        in its manager's pool. Sets ``num_uncached_common_prefix_tokens``: how much
        longer the longest single-spec hit was. With fine-grained hits lengths are
        multiples of the hash block: full attention and Mamba with larger blocks find hits
        ending inside a block, and their EAGLE look-ahead is one hash block.
        """
        if not self.enable_caching:
            return tuple([] for _ in self.single_type_managers), 0
        hit_blocks: list[list[int] | None] = [None] * len(self.single_type_managers)
        hit_length, longest_hit_length = max_cache_hit_length, 0
        one_group = len(self.single_type_managers) == 1
        single_round = one_group or (len(self.attention_groups) == 2 and is_a(
            self.attention_groups[0].spec, "FullAttentionSpec"))
        eagle_verified: set[int] = set()  # specs whose EAGLE drop holds at the current length
        hbs = self.hash_block_size
        while True:
            curr_length = hit_length
            for idx, (spec, group_ids, rules, use_eagle) in enumerate(self.attention_groups):
                if is_a(spec, "FullAttentionSpec") and hit_blocks[group_ids[0]] is not None:
                    if not self.fine_grained:  # (fine: within the full hit already)
                        curr_length = curr_length // spec.block_size * spec.block_size
                    continue
                drop_eagle_block = use_eagle and idx not in eagle_verified
                max_length = curr_length
                if drop_eagle_block and self.profile.rules.mamba_no_eagle_margin(spec):
                    limit = max_cache_hit_length if one_group else (
                        self.profile.rules.eagle_peek_to_hashed_length(
                            len(block_hashes) * hbs, max_cache_hit_length))
                    max_length = min(curr_length + self._eagle_step(spec, rules), limit)
                hits, new_length = self._search(
                    self.attention_groups[idx], block_hashes, max_length, drop_eagle_block,
                    spec.block_size if one_group else None)
                if drop_eagle_block:
                    eagle_verified.add(idx)
                elif new_length < curr_length:
                    eagle_verified.clear()
                curr_length = new_length
                for group_id, blocks in zip(group_ids, hits, strict=True):
                    hit_blocks[group_id] = blocks
                longest_hit_length = max(longest_hit_length, curr_length)
            if curr_length >= hit_length:
                break
            hit_length = curr_length
            if single_round:
                break
        # The first spec's hits are trimmed; 0.33.0: every full-attention spec's.
        trimmed = self.attention_groups[:self.profile.rules.trim_every_full_group]
        for sg in trimmed:
            if is_a(sg.spec, "FullAttentionSpec") and not sg.rules.retains_longer_hit:
                for group_id in sg.group_ids:
                    if (full_hits := hit_blocks[group_id]) is not None:
                        del full_hits[self._num_hit_blocks(hit_length, sg.spec.block_size):]
        self.num_uncached_common_prefix_tokens = longest_hit_length - hit_length
        return tuple(b if b is not None else [] for b in hit_blocks), hit_length

    def _sub_block(self, spec: KVCacheSpec, rules: KindRules) -> bool:
        """Whether the spec's hits may end inside its blocks: fine-grained hits, blocks
        larger than the hash block, a kind with a fine-grained search."""
        return (self.fine_grained and spec.block_size > self.hash_block_size
                and rules.fine_hit is not None)

    def _eagle_step(self, spec: KVCacheSpec, rules: KindRules) -> int:
        """How far an EAGLE search looks past its candidate: a block, or a hash block
        where the spec's hits end inside a block."""
        return self.hash_block_size if self._sub_block(spec, rules) else spec.block_size

    def _search(self, sg: SpecGroup, block_hashes: list[bytes], max_length: int,
                drop_eagle_block: bool, alignment: int | None) -> tuple[Hits, int]:
        """One spec's hits and their length in tokens: its kind's search, ending inside a
        block where fine-grained hits allow; ``alignment`` None: the scheduler block,
        or the hash block with fine-grained hits."""
        spec, group_ids, rules, _ = sg
        pool = self.single_type_managers[group_ids[0]].block_pool
        if self._sub_block(spec, rules):
            return find_fine_grained_hit(rules, block_hashes, max_length, group_ids, pool,
                                         spec, drop_eagle_block, self.hash_block_size)
        if alignment is None:
            alignment = self.hash_block_size if self.fine_grained else self.scheduler_block_size
        hits = find_longest_cache_hit(rules, self._hashes_for(block_hashes, spec), max_length,
                                      group_ids, pool, spec, drop_eagle_block, alignment)
        return hits, len(hits[0]) * spec.block_size

    def _num_hit_blocks(self, hit_length: int, block_size: int) -> int:
        """Blocks a hit of ``hit_length`` tokens keeps (fine-grained: also the block it
        ends inside)."""
        return pure.cdiv(hit_length, block_size) if self.fine_grained else hit_length // block_size

    def find_longest_cache_hit_per_group(self, block_hashes: list[bytes],
                                         max_cache_hit_length: int
                                         ) -> tuple[Hits, tuple[int, ...]]:
        """Each spec's own longest hit (no common length), with its length per group.
        With fine-grained hits a hit ends on a hash-block boundary (inside a block for
        full attention and Mamba with larger blocks); an EAGLE spec other than Mamba first
        looks one block (fine-grained: one hash block) further, as far as the release's
        ``eagle_peek_to_hashed_length`` rule lets it."""
        hit_blocks: list[list[int]] = [[] for _ in self.single_type_managers]
        hit_lengths = [0] * len(self.single_type_managers)
        for sg in self.attention_groups:
            spec, group_ids, rules, use_eagle = sg
            max_length = max_cache_hit_length
            if use_eagle and not is_a(spec, "MambaSpec"):  # (0.25.1: no peek, limit is max)
                max_length = min(max_length + self._eagle_step(spec, rules),
                                 self.profile.rules.eagle_peek_to_hashed_length(
                                     len(block_hashes) * self.hash_block_size, max_length))
            hits, length = self._search(sg, block_hashes, max_length, use_eagle, None)
            for group_id, blocks in zip(group_ids, hits, strict=True):
                hit_blocks[group_id] = blocks
                hit_lengths[group_id] = length
        return tuple(hit_blocks), tuple(hit_lengths)


    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, num_encoder_tokens: int = 0,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: Sequence[int] = ()) -> KVCacheBlocks | None:
        """Add prefix hits, external tokens and ``num_new_tokens`` (+ lookahead) slots;
        cache the full blocks among the request's known tokens unless ``delay_cache_blocks``.
        The groups in ``skip_zeroing_group_ids`` (0.33.0: an async load writes them)
        report no block for the external tokens for zeroing.

        Returns the new blocks, or None when the free blocks minus ``reserved_blocks`` cannot
        cover them plus the watermark (out-of-window blocks may be freed all the same).
        ValueError if there are no new and no external tokens, or for a skipped group id
        that names no group.
        """
        num_groups = len(self.single_type_managers)
        for group_id in skip_zeroing_group_ids:
            if type(group_id) is not int or not 0 <= group_id < num_groups:
                raise ValueError(f"skip_zeroing_group_ids: {group_id!r} is no group id "
                                 f"(there are {num_groups})")
        adopts = self.profile.rules.adopt_computed_without_new_tokens(num_new_computed_tokens)
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and not adopts:
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no external computed tokens")
        rid = request.request_id
        hits = (self.empty_kv_cache_blocks if new_computed_blocks is None
                else new_computed_blocks).blocks
        if new_computed_blocks is not None and self.retained_hit_group_ids:
            # NOTE: as in vLLM, a new tuple even for the empty instance: a new request
            # then always adopts (its managers' add_local_computed_blocks run).
            managers, reused = self.single_type_managers, (
                num_new_computed_tokens + num_external_computed_tokens)
            hits = tuple(list(h[:cdiv(reused, managers[g].block_size)])
                         if g in self.retained_hit_group_ids else h
                         for g, h in enumerate(hits))
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        num_computed = num_local_computed + num_external_computed_tokens
        total_computed = min(num_computed, self.max_model_len)
        watermark_blocks = 0
        if has_scheduled_reqs and request.status.name in WATERMARKED:
            watermark_blocks = self.watermark_blocks
        # Where the prefill ends (for Mamba's prefill checkpoints): the prompt, or, for a
        # resumed request, every token but the last.
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if full_sequence_must_fit:
            num_full = min(request.num_tokens, self.max_model_len)
            num_needed = self.get_num_blocks_to_allocate(
                rid, num_full, hits, num_encoder_tokens, total_computed, num_full, True,
                num_local_computed, prefill_end)
            if not pure.admits(num_needed, self.block_pool.get_num_free_blocks(), 0,
                               watermark_blocks):
                return None
        num_tokens_main_model = total_computed + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens,
                                   self.max_model_len)
        # Free out-of-window blocks first (even if we then refuse) so fewer get evicted.
        processed = self.profile.rules.free_on_processed_tokens(total_computed, request)
        self.remove_skipped_blocks(rid, processed, request.num_prompt_tokens)
        num_needed = self.get_num_blocks_to_allocate(
            rid, num_tokens_need_slot, hits, num_encoder_tokens, num_computed,
            num_tokens_main_model, False, num_local_computed, prefill_end)
        if not pure.admits(num_needed, self.block_pool.get_num_free_blocks(), reserved_blocks,
                           watermark_blocks):
            return None
        # NOTE: an identity test, as in vLLM: a distinct empty KVCacheBlocks does add.
        if hits is not self.empty_kv_cache_blocks.blocks or num_external_computed_tokens > 0:
            self.allocate_new_computed_blocks(rid, hits, num_local_computed,
                                              num_external_computed_tokens,
                                              skip_zeroing_group_ids)
        new_blocks = self.allocate_new_blocks(rid, num_tokens_need_slot, num_tokens_main_model,
                                              num_encoder_tokens)
        if self.enable_caching and not delay_cache_blocks:
            # Draft tokens beyond request.num_tokens may be rejected: never cache them.
            self.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return self.create_kv_cache_blocks(new_blocks)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: tuple[Sequence[int], ...],
                                   num_encoder_tokens: int, total_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   num_local_computed_tokens: int = 0, prefill_end: int = 0
                                   ) -> int:
        """Free blocks needed across all groups (see the managers' method). Mamba's
        prefill checkpoints wait for the chunk reaching ``prefill_end`` only when
        retention keeps just the latest state (interval 0); otherwise any chunk may leave
        one (``prefill_end`` 0)."""
        if self.retention_interval != 0:
            prefill_end = 0
        num_blocks = 0
        for i, m in enumerate(self.single_type_managers):
            if m.rules.encoder:
                num_blocks += m.get_num_blocks_to_allocate(
                    request_id, num_encoder_tokens, [], 0, num_encoder_tokens, apply_admission_cap)
            else:
                num_blocks += m.get_num_blocks_to_allocate(
                    request_id, num_tokens, new_computed_blocks[i], total_computed_tokens,
                    num_tokens_main_model, apply_admission_cap, num_local_computed_tokens,
                    prefill_end)
        return num_blocks

    def allocate_new_computed_blocks(self, request_id: str,
                                     new_computed_blocks: tuple[Sequence[int], ...],
                                     num_local_computed_tokens: int,
                                     num_external_computed_tokens: int,
                                     skip_zeroing_group_ids: Sequence[int] = ()) -> None:
        """Give a new request its hits, then blocks for its external tokens (a no-op for a
        running one). Every group touches its hits before any group allocates, so one
        group's allocation cannot evict another's hits. The groups in
        ``skip_zeroing_group_ids`` report no external-token block for zeroing."""
        if any(request_id in m.num_cached_block for m in self.single_type_managers):
            for blocks in new_computed_blocks:
                check_no_hits(request_id, blocks)
            return
        for i, m in enumerate(self.single_type_managers):
            m.add_local_computed_blocks(request_id, new_computed_blocks[i],
                                        num_local_computed_tokens, num_external_computed_tokens)
        if num_external_computed_tokens > 0:
            for i, m in enumerate(self.single_type_managers):
                m.allocate_external_computed_blocks(request_id, num_local_computed_tokens,
                                                    num_external_computed_tokens,
                                                    i not in skip_zeroing_group_ids)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int,
                            num_encoder_tokens: int = 0) -> tuple[list[int], ...]:
        """Give the request ``num_tokens`` slots in every group; return the new ids."""
        return tuple(m.allocate_new_blocks(
            request_id, num_encoder_tokens if m.rules.encoder else num_tokens,
            num_tokens_main_model) for m in self.single_type_managers)

    def replay_boundaries(self, num_prompt_tokens: int) -> tuple[int, ...]:
        """Where replays of the prompt resume, whose tails sparse retention keeps (the
        release's ``retention_replay_boundaries`` rule)."""
        return self.profile.rules.retention_replay_boundaries(
            num_prompt_tokens, self.scheduler_block_size, bool(self.eagle_group_ids))

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first in each group."""
        for m in self.single_type_managers:
            m.free(request.request_id)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Free the blocks attention no longer reads, in every group."""
        for m in self.single_type_managers:
            m.remove_skipped_blocks(request_id, total_computed_tokens, num_prompt_tokens)

    def pop_blocks_for_free(self, request: Request) -> list[int]:
        """Forget the request; the caller frees the returned ids later, in reverse.
        NotImplementedError with a HiSparse host pool: its ids overlap the shared
        pool's (vLLM's blocks carry their pool, ints do not); pop and free each group's
        blocks through its manager and pool instead."""
        if len(self.pools()) > 1:
            raise NotImplementedError("pop_blocks_for_free with a HiSparse host pool: pop and "
                                      "free each group's blocks through its own pool")
        popped = self.profile.rules.pop_drops_null_head
        return [b for m in self.single_type_managers
                for b in popped(m.pop_blocks_for_free(request.request_id))]

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop the given blocks from the prefix cache (see ``BlockPool.evict_blocks``)."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; False (no change) while any block is in use."""
        if not all([pool.reset_prefix_cache() for pool in self.pools()]):  # each is tried
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, leading blocks of the request held by every request with a table."""
        if not self.enable_caching:  # no lookup: no table entry is created
            return [0] * self.num_kv_cache_groups
        count = self.profile.rules.cascade_always_zero
        return [count(m, running_request_id) for m in self.single_type_managers]

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the pool's events, labelling each BlockStored with its group's kind."""
        events = self.block_pool.take_events()
        for event in events:
            if (isinstance(event, BlockStored) and event.group_idx is not None
                    and 0 <= event.group_idx < len(self.kv_cache_event_metadata)):
                kind, window = self.kv_cache_event_metadata[event.group_idx]
                event.kv_cache_spec_kind = kind
                event.kv_cache_spec_sliding_window = window
        return events

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks (live tables, as vLLM shares them)."""
        return self.create_kv_cache_blocks(
            tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Copies of the request's block tables."""
        return self.get_blocks(request_id).get_block_ids()

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int
                                          ) -> tuple[list[int], ...]:
        """Per group, the blocks covering the first ``num_computed_tokens`` tokens
        (whole tables for Mamba and cross attention, whose blocks are not per token)."""
        clipped = []
        groups, tables = self.kv_cache_config.kv_cache_groups, self.get_block_ids(request_id)
        for g, ids in zip(groups, tables, strict=False):
            s = g.kv_cache_spec
            per_token = is_a(s, "AttentionSpec") and not is_a(s, "CrossAttentionSpec")
            clipped.append(ids[:cdiv(num_computed_tokens, s.block_size)] if per_token else ids)
        return tuple(clipped)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the full blocks among the first ``num_computed_tokens`` tokens but the
        last ``num_reprefillable_tokens`` (0.33.0's prefill lookahead: a multi-module
        drafter computes them again). Several groups cache up to the last
        ``scheduler_block_size`` boundary (EAGLE groups one block further, since their
        hits look one block past a boundary; they alone leave out the re-prefilled
        tokens); with fine-grained hits nothing is rounded. One group caches every full
        block (rule ``one-group``). Nothing with caching off."""
        if not self.enable_caching:
            return
        boundaries = self.replay_boundaries(request.num_prompt_tokens)
        alignment = 1 if self.fine_grained else self.scheduler_block_size
        one_group = max(0, num_computed_tokens - self.num_reprefillable_tokens)
        for m in self.single_type_managers:
            if cacheable(m.kv_cache_spec):  # a group outside prefix caching keys nothing
                m.cache_blocks(request, one_group if len(self.single_type_managers) == 1
                               else pure.num_tokens_to_cache(
                                   num_computed_tokens, alignment, m.block_size, m.use_eagle,
                                   self.num_reprefillable_tokens),
                               self.retention_interval, boundaries)

    def create_kv_cache_blocks(self, blocks: tuple[list[int], ...]) -> KVCacheBlocks:
        """Wrap per-group ids; the shared empty instance when all groups are empty."""
        return KVCacheBlocks(blocks, self.block_pool) if any(blocks) else self.empty_kv_cache_blocks

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Report the request's blocks from ``start_token`` on for zeroing again, in the
        groups that report new blocks (0.33.0: blocks a failed async load left
        unwritten). ValueError unless ``start_token`` is a multiple of each such group's
        block size (zeroing a block's valid prefix would lose it)."""
        managers = [m for m in self.single_type_managers if m.reports_new_blocks()]
        for m in managers:
            if start_token % m.block_size:
                raise ValueError(f"start_token={start_token} is not a multiple of group "
                                 f"{m.kv_cache_group_id}'s block size {m.block_size}")
        for m in managers:
            m.new_block_ids += m.req_to_blocks.get(request_id, [])[start_token // m.block_size:]

    def take_new_block_ids(self) -> list[int]:
        """Drain the ids allocated since the last call, group after group."""
        return [b for m in self.single_type_managers for b in m.take_new_block_ids()]

    def take_kv_cache_block_copies(self) -> tuple[list[tuple[int, int]], list[int]]:
        """Drain the copy-on-write copies queued since the last call, group after group:
        the (source, copy) id pairs, and the blocks they keep held (source then copy per
        pair), which the caller frees once the copies have run (0.33.0's scheduler)."""
        pairs = [p for m in self.single_type_managers
                 for p in m.take_pending_cow_copies()]
        return pairs, [block for pair in pairs for block in pair]

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Drain the Mamba 'align' states offered to a KV connector since the last call
        (0.33.0, ``mamba_prefill_checkpoints``): per request, (group, block, tokens the
        state covers), group after group, in the order they were cached."""
        offloads: dict[str, list[tuple[int, int, int]]] = {}
        for m in self.single_type_managers:
            for rid, group, block, num_tokens in m.take_boundary_state_offers():
                offloads.setdefault(rid, []).append((group, block, num_tokens))
        return offloads

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """A finishing request's own prompt-tail states inside a block that no later
        token was written into, (group, block, tokens) per Mamba group, each once."""
        in_flight = getattr(request, "num_in_flight_tokens", 0) or 0
        tails = [m.finalize_partial_tail(request.request_id, request.num_computed_tokens,
                                         in_flight)
                 for m in self.single_type_managers]
        return [tail for tail in tails if tail is not None]

    def new_step_starts(self) -> None:
        """Tell the managers a scheduler step begins."""
        for m in self.single_type_managers:
            m.new_step_starts()

    def abstract_state(self) -> dict[str, Any]:
        """The whole state as plain data, in the format of docs/contract.md."""
        pool, managers = self.block_pool, self.single_type_managers
        return {
            "num_blocks": pool.num_gpu_blocks,
            "free_queue": list(pool.free_queue),
            "ref_cnt": {b: c for b, c in enumerate(pool.ref_cnt) if b != NULL_BLOCK and c != 0},
            "block_hash": dict(pool.block_hash),
            "cached": {key: list(ids) for key, ids in pool.cached.items()},
            "req_to_blocks": [{r: list(ids) for r, ids in m.req_to_blocks.items()}
                              for m in managers],
            "num_cached_block": [dict(m.num_cached_block) for m in managers],
            "new_block_ids": [list(m.new_block_ids) for m in managers],
        }

    def check_invariants(self) -> None:
        """Assert the invariants of the class docstring."""
        for pool in self.pools():
            pool.check_invariants()
            holders: Counter[int] = Counter()
            group_of: dict[int, int] = {}
            for g, m in enumerate(self.single_type_managers):
                if m.block_pool is not pool:
                    continue
                m.check_invariants()
                if m.rules is HISPARSE_RESIDENT:
                    continue  # its table may name blocks reused since (see the class)
                assert all(0 < b < pool.num_gpu_blocks for b in m.new_block_ids)
                for ids in m.req_to_blocks.values():
                    assert all(0 <= b < pool.num_gpu_blocks for b in ids)
                    for b in ids:
                        if b != NULL_BLOCK:
                            assert group_of.setdefault(b, g) == g, f"block {b} in two groups"
                            holders[b] += 1
            for b, count in holders.items():
                assert pool.ref_cnt[b] >= count, f"block {b}: ref_cnt {pool.ref_cnt[b]} < {count}"

    def pools(self) -> list[BlockPool]:
        """Every pool the groups use, the shared one first (a HiSparse source's host
        pool is its own)."""
        pools = [self.block_pool]
        for m in self.single_type_managers:
            if all(m.block_pool is not p for p in pools):
                pools.append(m.block_pool)
        return pools


class SpecGroup(NamedTuple):
    """Groups with equal specs (and kind), searched together; EAGLE if any member is."""

    spec: KVCacheSpec
    group_ids: list[int]
    rules: KindRules
    use_eagle: bool


def lookup_spec(kv_cache_spec: KVCacheSpec, manager: SingleTypeKVCacheManager) -> KVCacheSpec:
    """The spec a group is searched by: blocks of its manager's size (the spec's, or
    its context-parallel multiple)."""
    if manager.block_size == kv_cache_spec.block_size:
        return kv_cache_spec
    return kv_cache_spec.copy_with_new_block_size(manager.block_size)
