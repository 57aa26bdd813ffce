"""Coordinators: fan each request-level operation out to the per-group managers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from . import pure
from .block_pool import BlockPool
from .profile import Profile
from .single_type_kv_cache_manager import (
    MAMBA,
    Hits,
    KindRules,
    SingleTypeKVCacheManager,
    check_no_hits,
    find_fine_grained_hit,
    find_longest_cache_hit,
    get_manager_for_kv_cache_spec,
)
from .vocab import (
    KVCacheConfig,
    KVCacheSpec,
    Request,
    cacheable,
    coarsen,
    is_a,
    is_dcp_sharded,
    needs_kv_cache_zeroing,
)


def group_role(group: object) -> str | None:
    """A group's role (vLLM 0.33.0's ``KVCacheGroupSpec.role``, an enum or its value;
    None for groups without one)."""
    role = getattr(group, "role", None)
    return getattr(role, "value", role)


class KVCacheCoordinator:
    """One block pool shared by one manager per KV-cache group.

    Groups flagged ``is_eagle_group`` drop their last hit block; when none is flagged,
    ``use_eagle`` flags them all. Cross-attention groups are sized by the encoder tokens.
    ``retention_interval`` (vLLM's ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``, given
    here explicitly) thins out what sliding-window and Mamba groups cache: None caches
    densely, 0 only at the prompt's replay boundary, a multiple of
    ``scheduler_block_size`` there and at each of its multiples.

    Context parallelism (``dcp_world_size`` * ``pcp_world_size`` ranks) spreads a
    block's tokens over the ranks, so to a manager a block spans its spec's block size
    times the group's ``context_parallel``: dcp * pcp in 0.25.1. In 0.33.0 pcp no
    longer counts (``pcp_not_scaled``) and only sharded specs count at all
    (``dcp_sharded_geometry``): Mamba and replicated drafts keep their block size.

    ``profile`` is the release whose switches the coordinator, its pool and its
    managers read, each under its own name (spec/profile.py).
    ``num_hash_lookahead_tokens`` and ``num_prefill_lookahead`` are 0.33.0's lookahead
    arguments (0: none): the pool's hashes cover that many tokens after each block, and
    caching leaves out the last ``num_prefill_lookahead - 1`` computed tokens.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int,
                 max_num_batched_tokens: int, use_eagle: bool, enable_caching: bool,
                 enable_kv_cache_events: bool, scheduler_block_size: int,
                 hash_block_size: int, caching_hash_algo: str = "sha256",
                 hash_seed: str | None = None, dcp_world_size: int = 1,
                 pcp_world_size: int = 1, *, prefix_cache_retention_interval: int | None = None,
                 profile: Profile | None = None, num_hash_lookahead_tokens: int = 0,
                 num_prefill_lookahead: int = 0) -> None:
        self.profile = p = Profile() if profile is None else profile
        groups = kv_cache_config.kv_cache_groups
        if scheduler_block_size % hash_block_size or any(
                scheduler_block_size % g.kv_cache_spec.block_size for g in groups):
            raise ValueError(f"scheduler_block_size={scheduler_block_size} must be a multiple of "
                             f"hash_block_size={hash_block_size} and of each group's block size")
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching, hash_block_size,
                                    enable_kv_cache_events, None, caching_hash_algo, hash_seed,
                                    profile=p, num_hash_lookahead_tokens=num_hash_lookahead_tokens)
        self.eagle_group_ids = {i for i, g in enumerate(groups) if g.is_eagle_group}
        if use_eagle and not self.eagle_group_ids:
            self.eagle_group_ids = set(range(len(groups)))
        if p.eagle_master_switch and not use_eagle:  # without use_eagle no group drops a block
            self.eagle_group_ids = set()
        self.dcp_world_size, self.pcp_world_size = dcp_world_size, pcp_world_size
        scale = dcp_world_size * (1 if p.pcp_not_scaled else pcp_world_size)
        context_parallel = [scale if not p.dcp_sharded_geometry
                            or is_dcp_sharded(g.kv_cache_spec) else 1 for g in groups]
        if enable_caching and len(groups) > 1 and p.dcp_sharded_geometry:
            self._check_hybrid_context_parallel()
        elif enable_caching and max(*context_parallel, pcp_world_size) > 1 and (
                len(groups) > 1 or not is_a(groups[0].kv_cache_spec, "FullAttentionSpec")):
            raise NotImplementedError("hybrid layouts and kinds other than full attention do "
                                      "not support context parallelism with prefix caching "
                                      "(vLLM asserts)")
        self.num_reprefillable_tokens = max(0, num_prefill_lookahead - 1)
        zeroing = needs_kv_cache_zeroing(kv_cache_config)
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(g.kv_cache_spec, max_num_batched_tokens, max_model_len,
                                          self.block_pool, enable_caching, i, scheduler_block_size,
                                          context_parallel[i], group_role(g), profile=p,
                                          needs_kv_cache_zeroing=zeroing, use_eagle=use_eagle)
            for i, g in enumerate(groups))
        self.retention_interval = prefix_cache_retention_interval
        # retention_zero_without_window (0.33.0): 0 is accepted, and ignored, without a
        # sliding-window or Mamba group (0.25.1 refuses any interval there).
        ignored_zero = (p.retention_zero_without_window and self.retention_interval == 0
                        and not any(is_a(g.kv_cache_spec, "SlidingWindowSpec")
                                    or is_a(g.kv_cache_spec, "MambaSpec") for g in groups))
        if self.retention_interval is not None and not ignored_zero:
            self._check_retention_interval(self.retention_interval)
        self.fine_grained = False  # mamba_fine_grained_hits in effect (hybrid only)
        self._init_groups()

    def _check_hybrid_context_parallel(self) -> None:
        """0.33.0's rule for several caching groups: under dcp each is full attention or
        replicated; under pcp each is full attention or a replicated attention group.
        AssertionError otherwise (vLLM asserts)."""
        for i, g in enumerate(self.kv_cache_config.kv_cache_groups):
            full, replicated = is_a(g.kv_cache_spec, "FullAttentionSpec"), not is_dcp_sharded(
                g.kv_cache_spec)
            if self.pcp_world_size > 1 and not (
                    full or (replicated and is_a(g.kv_cache_spec, "AttentionSpec"))):
                raise AssertionError(f"pcp_world_size={self.pcp_world_size}: group {i} is "
                                     "neither full attention nor replicated attention")
            if self.dcp_world_size > 1 and not (full or replicated):
                raise AssertionError(f"dcp_world_size={self.dcp_world_size}: group {i} is "
                                     "neither full attention nor replicated")

    def _check_retention_interval(self, interval: int) -> None:
        """vLLM's checks: a windowed group to thin out, and a non-negative multiple of
        ``scheduler_block_size`` (hits end only on those)."""
        if not any(is_a(g.kv_cache_spec, "SlidingWindowSpec") or is_a(g.kv_cache_spec, "MambaSpec")
                   for g in self.kv_cache_config.kv_cache_groups):
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
                geometry_0_33 = self.profile.pcp_not_scaled or self.profile.dcp_sharded_geometry
                raise AssertionError(message) if geometry_0_33 else ValueError(message)
            self.attention_groups.append(SpecGroup(
                lookup_spec(groups[0].kv_cache_spec, m), [0], m.rules, 0 in self.eagle_group_ids))
        else:
            self._bundle_groups()
        for sg in self.attention_groups:
            for group_id in sg.group_ids:
                managers[group_id].use_eagle = sg.use_eagle
        if len(groups) > 1 and self.profile.mamba_fine_grained_hits:
            self.enable_fine_grained_hits()

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
        """Where replays of the prompt resume, whose tails sparse retention keeps: one
        token short of the prompt, or (retention_replay_boundaries, 0.33.0) the EAGLE
        rule of ``pure.replay_boundaries`` when some group is an EAGLE group."""
        if self.profile.retention_replay_boundaries:
            return pure.replay_boundaries(num_prompt_tokens, self.scheduler_block_size,
                                          bool(self.eagle_group_ids))
        return (num_prompt_tokens - 1,)

    def free(self, request_id: str) -> None:
        """Release the request's blocks, group by group."""
        for m in self.single_type_managers:
            m.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[int]:
        """Forget the request; its blocks group after group, each in allocation order."""
        return [b for m in self.single_type_managers for b in m.pop_blocks_for_free(request_id)]

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, the leading blocks shared by every request with a table (caching
        off: 0 per group, and, unlike the managers, no table entry is created)."""
        if not self.enable_caching:
            return [0] * len(self.single_type_managers)
        return [m.get_num_common_prefix_blocks(running_request_id)
                for m in self.single_type_managers]

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Free the blocks attention no longer reads, in every group."""
        for m in self.single_type_managers:
            m.remove_skipped_blocks(request_id, total_computed_tokens, num_prompt_tokens)

    def pools(self) -> list[BlockPool]:
        """Every pool the groups use, the shared one first (a HiSparse source's host
        pool is its own)."""
        pools = [self.block_pool]
        for m in self.single_type_managers:
            if all(m.block_pool is not p for p in pools):
                pools.append(m.block_pool)
        return pools

    def reset_prefix_cache(self) -> bool:
        """Reset every pool's prefix cache (each is tried); True if all succeeded."""
        return all([pool.reset_prefix_cache() for pool in self.pools()])

    def get_blocks(self, request_id: str) -> tuple[list[int], ...]:
        """The request's tables (the live lists, as vLLM returns them); [] when unknown."""
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers)

    def new_step_starts(self) -> None:
        """Tell every manager a scheduler step begins."""
        for m in self.single_type_managers:
            m.new_step_starts()

    def enable_fine_grained_hits(self) -> None:
        """mamba_fine_grained_hits: hits end on hash-block boundaries when a Mamba 'align'
        group's block is larger than the hash block (under dcp, at least the hash block:
        the dcp-scaled attention blocks are larger) and every other group is full
        attention (or a variant), Mamba, or hashed at its own block size (a ring buffer,
        outside prefix caching, takes no part)."""
        hbs = self.hash_block_size
        if any(m.rules is MAMBA and m.kv_cache_spec.mamba_cache_mode == "align"
               and (m.block_size > hbs or (self.dcp_world_size > 1 and m.block_size == hbs))
               for m in self.single_type_managers) and all(
                m.rules.fine_hit is not None or m.block_size == hbs
                or not cacheable(m.kv_cache_spec) for m in self.single_type_managers):
            self.fine_grained = True
            for m in self.single_type_managers:
                m.cache_hit_alignment_tokens = hbs

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the full blocks among the first ``num_computed_tokens`` tokens but the
        last ``num_reprefillable_tokens`` (0.33.0's prefill lookahead: a multi-module
        drafter computes them again). Several groups cache up to the last
        ``scheduler_block_size`` boundary (EAGLE groups one block further, since their
        hits look one block past a boundary; they alone leave out the re-prefilled
        tokens); with fine-grained hits nothing is rounded. One group caches every full
        block (rule ``one-group``)."""
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
                # 0.33.0: no peek past the candidate for Mamba (its finder never drops)
                if drop_eagle_block and not (self.profile.mamba_no_eagle_margin
                                             and is_a(spec, "MambaSpec")):
                    peek = self.profile.eagle_peek_to_hashed_length and not one_group  # 0.33.0
                    max_length = min(curr_length + self._eagle_step(spec, rules),
                                     len(block_hashes) * hbs if peek else max_cache_hit_length)
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
        trimmed = self.attention_groups[:None if self.profile.trim_every_full_group else 1]
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
        full attention and Mamba with larger blocks); under eagle_peek_to_hashed_length
        an EAGLE spec other than Mamba first looks one block (fine-grained: one hash
        block) further, up to the hashed tokens (0.25.1: no further)."""
        hit_blocks: list[list[int]] = [[] for _ in self.single_type_managers]
        hit_lengths = [0] * len(self.single_type_managers)
        for sg in self.attention_groups:
            spec, group_ids, rules, use_eagle = sg
            max_length = max_cache_hit_length
            peek = use_eagle and self.profile.eagle_peek_to_hashed_length
            if peek and not is_a(spec, "MambaSpec"):
                max_length = min(max_length + self._eagle_step(spec, rules),
                                 len(block_hashes) * self.hash_block_size)
            hits, length = self._search(sg, block_hashes, max_length, use_eagle, None)
            for group_id, blocks in zip(group_ids, hits, strict=True):
                hit_blocks[group_id] = blocks
                hit_lengths[group_id] = length
        return tuple(hit_blocks), tuple(hit_lengths)


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
