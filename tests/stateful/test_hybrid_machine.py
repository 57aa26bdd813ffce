"""Model-based test of hybrid ``kvcache.KVCacheManager`` layouts against spec.

``HybridMachine`` is ``ManagerMachine`` (``test_manager_machine.py``: the same
scheduler rules, one per manager operation, and the same whole-state
comparison) with a layout drawn by its ``@initialize``: one to three KV-cache
groups from full attention, sliding window, chunked local attention, Mamba
(``none``/``all``/``align``, with speculative blocks), cross attention and
reference sliding window (R-SWA, with short prompts so decodes pass the window),
block sizes 1, 2, 4 (times 1 or 2 per group), EAGLE and per-group
``is_eagle_group`` flags, and, with a sliding-window or Mamba group, a prefix-cache
retention interval (None, 0 or k * scheduler_block_size). The managers get
``hash_block_size`` = GCD and ``scheduler_block_size`` = LCM of the group block
sizes, as vLLM's hybrid coordinator does.

The layout follows vLLM 0.25.1's rules (as ``/tmp/hd/spec_diff_ext.py``):
chunked local attention only with one block size and without EAGLE; cross
attention only with prefix caching off, and ``num_encoder_tokens`` passed to
every ``allocate_slots``; Mamba ``align`` only with prefill chunks ending at a
``scheduler_block_size`` multiple (the machine schedules whole prompts, and
computes connector tokens instead of loading them: Mamba align counts no blocks
for them yet takes some, so the pool can run dry mid-allocation, in vLLM too).

Hybrid invariants checked after every step, besides spec's and kvcache's own:

* no block id is held by two groups (the pool keys include the group id, so a
  cache hit never shares a block across groups): non-null ids are disjoint;
* skipped positions hold the null block, and only they: nulls are a prefix of
  every table, except Mamba ``align``, which nulls its old states in place, and
  R-SWA, which nulls the gap between the prompt and the decode window;
* ``get_num_blocks_to_allocate`` predicts what an admission takes: for a
  request holding no blocks, the free queue shrinks by exactly the predicted
  count (new blocks plus hit blocks touched off the free queue). It is checked
  only there: a running request first frees skipped blocks, a running
  Mamba-align request counts a non-positive shortfall, and Mamba align counts
  no blocks for connector tokens although the base class's
  ``allocate_external_computed_blocks`` takes them (all as vLLM 0.25.1,
  ``vllm/v1/core/single_type_kv_cache_manager.py`` ``MambaManager``).

``PROGRAMS`` are directed examples: situations the random search reaches only
now and then, each a fixed program of the machine's own rules replayed by
``test_hybrid_program`` (``programs.py``): one group's external blocks taken
after every group's hits, a later kind shortening an earlier kind's hit, a
sliding-window admission whose hits reach beyond the window's admission cap, an
align-mode Mamba request decoding past a cached state, an R-SWA request
decoding past its window.
"""

from __future__ import annotations

import math
from itertools import combinations
from typing import Any, ClassVar

import hypothesis.strategies as st
import pytest
from hypothesis import assume, event, note, settings
from hypothesis.stateful import initialize, invariant

from kvcache import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    Request,
    RequestStatus,
    RSWASpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    get_request_block_hasher,
    sha256,
)

from .programs import Seq, Step, replay, tokens
from .runner import run_machine
from .test_manager_machine import ManagerMachine

KINDS = ["full", "full", "swa", "swa", "chunk", "mamba", "cross", "rswa"]
MAMBA_MODES = ["none", "all", "align", "align"]
# Examples of the CI profile for this machine (it shares the step count).
CI_EXAMPLES = 400


def layer_spec(kind: str, block_size: int, index: int, options: dict[str, Any]) -> Any:
    heads = dict(num_kv_heads=1 + index, head_size=8, dtype="float16")
    options = dict(options)
    if options.pop("mla", False):  # NewKindsMachine's MLA variants of full / sliding window
        if kind == "full":
            return MLAAttentionSpec(block_size=block_size, **heads)
        return SlidingWindowMLASpec(block_size=block_size, **heads, **options)
    if kind == "full":
        return FullAttentionSpec(block_size=block_size, **heads)
    if kind == "swa":
        return SlidingWindowSpec(block_size=block_size, **heads, **options)
    if kind == "chunk":
        return ChunkedLocalAttentionSpec(block_size=block_size, **heads, **options)
    if kind == "cross":
        return CrossAttentionSpec(block_size=block_size, **heads)
    if kind == "rswa":
        return RSWASpec(block_size=block_size, **heads, **options)
    return MambaSpec(block_size=block_size, shapes=((2,),), dtypes=("float16",), **options)


class HybridMachine(ManagerMachine):
    """``ManagerMachine`` over a drawn hybrid layout, with the hybrid invariants."""

    counters: ClassVar[dict[str, int]] = {"steps": 0, "examples": 0}
    #: Draw issue 14's kinds too (MLA variants, context parallelism): off here, so
    #: this machine's examples stay as they were (``test_new_kinds_machine.py``).
    NEW_KINDS: ClassVar[bool] = False
    #: Draw vLLM 0.33.0's Mamba prefill checkpoint fields on 'align' groups: off here
    #: (0.25.1 has none), on under the 0.33.0 profile (``test_profile_machines.py``).
    CHECKPOINTS: ClassVar[bool] = False

    @initialize(
        # Small pools half the time: eviction (of hits too) needs a pool under pressure.
        num_blocks=st.one_of(st.integers(3, 10), st.integers(3, 40)),
        base_block_size=st.sampled_from([1, 2, 4]),
        watermark=st.sampled_from([0.0, 0.0, 0.1]),
        log_stats=st.booleans(),
        max_model_len=st.integers(8, 48),
        max_num_batched_tokens=st.integers(2, 48),
        data=st.data(),
    )
    def init_managers(
        self,
        num_blocks: int,
        base_block_size: int,
        watermark: float,
        log_stats: bool,
        max_model_len: int,
        max_num_batched_tokens: int,
        data: st.DataObject,
    ) -> None:
        self.counters["examples"] += 1
        if self.NEW_KINDS and data.draw(st.booleans(), label="context-parallel layout"):
            kinds = ["full"]
        else:
            kinds = data.draw(
                st.lists(st.sampled_from(KINDS), min_size=1, max_size=3), label="kinds"
            )
        has_chunk = "chunk" in kinds
        layout: list[tuple[str, int, dict[str, Any]]] = []
        for kind in kinds:
            block_size = base_block_size
            if not has_chunk and kind != "chunk":
                block_size *= data.draw(st.sampled_from([1, 1, 2]), label="block_factor")
            options: dict[str, Any] = {}
            if kind == "swa":
                options["sliding_window"] = data.draw(st.integers(1, 10), label="window")
            elif kind == "rswa":
                options["rswa_window"] = data.draw(st.integers(1, 3), label="rswa_window")
            elif kind == "chunk":
                options["attention_chunk_size"] = base_block_size * data.draw(
                    st.integers(1, 3), label="chunk_factor"
                )
            elif kind == "mamba":
                options["mamba_cache_mode"] = data.draw(st.sampled_from(MAMBA_MODES), label="mode")
                options["num_speculative_blocks"] = data.draw(
                    st.sampled_from([0, 0, 1, 2]), label="spec_blocks"
                )
                if self.CHECKPOINTS and options["mamba_cache_mode"] == "align":
                    blocks = data.draw(st.sampled_from([0, 1, 1, 2]), label="checkpoint_blocks")
                    if blocks:
                        options["num_prefill_checkpoint_blocks"] = blocks
                        options["prefill_checkpoint_alignment"] = data.draw(
                            st.sampled_from([None, 1, 1, 2]), label="checkpoint_alignment"
                        )
                    event("prefill checkpoint blocks", blocks)
            if self.NEW_KINDS and kind in ("full", "swa"):
                options["mla"] = data.draw(st.booleans(), label="mla")
            layout.append((kind, block_size, options))
        sizes = [b for _, b, _ in layout]
        # Context parallelism: one full-attention (or MLA) group, a block spanning
        # block_size * dcp * pcp tokens (vLLM refuses it elsewhere under caching).
        dcp = pcp = 1
        if self.NEW_KINDS and kinds == ["full"]:
            dcp = data.draw(st.sampled_from([1, 2, 2, 4]), label="dcp")
            pcp = data.draw(st.sampled_from([1, 1, 2]), label="pcp")
        scheduler_block_size = math.lcm(*sizes) * dcp * pcp
        hash_block_size = math.gcd(*sizes) * dcp * pcp
        has_cross = "cross" in kinds
        enable_caching = not has_cross and data.draw(
            st.sampled_from([False, True, True, True]), label="caching"
        )
        use_eagle = not has_chunk and data.draw(st.booleans(), label="use_eagle")
        eagle_flags = [
            not has_chunk and data.draw(st.sampled_from([False, False, True]), label="eagle_group")
            for _ in layout
        ]
        # Sparse retention, where vLLM allows it: None (dense), 0 or k scheduler blocks.
        retention = None
        if {"swa", "mamba"} & set(kinds):
            factor = data.draw(st.sampled_from([None, 0, 1, 2, 3]), label="retention")
            retention = None if factor is None else factor * scheduler_block_size
            event("retention", "dense" if factor is None else f"{factor} scheduler blocks")
        self.align = any(o.get("mamba_cache_mode") == "align" for _, _, o in layout)
        if "rswa" in kinds:  # room for decodes past the window (the gap needs them)
            num_blocks = max(num_blocks, data.draw(st.integers(12, 40), label="rswa_blocks"))
        # vLLM refuses to start unless the pool holds one max_model_len sequence.
        max_model_len = max(2, min(max_model_len, (num_blocks - 1) // len(layout) * min(sizes)))
        if self.align:
            max_num_batched_tokens = max_model_len  # whole prompts: chunks end aligned
        kwargs: dict[str, Any] = dict(
            max_model_len=max_model_len,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_caching=enable_caching,
            use_eagle=use_eagle,
            log_stats=log_stats,
            enable_kv_cache_events=True,
            watermark=watermark,
            prefix_cache_retention_interval=retention,
        )
        if dcp * pcp > 1:
            kwargs.update(dcp_world_size=dcp, pcp_world_size=pcp)
        if self.NEW_KINDS:
            event("context parallel", dcp * pcp)
            event("mla groups", sum(bool(o.get("mla")) for _, _, o in layout))
        note(f"layout={layout}, is_eagle_group={eagle_flags}")
        note(f"KVCacheManager(num_blocks={num_blocks}, {kwargs})")
        event("layout", "+".join(sorted(k + o.get("mamba_cache_mode", "") for k, _, o in layout)))

        def config() -> KVCacheConfig:
            groups = [
                KVCacheGroupSpec([f"layer.{i}"], layer_spec(kind, b, i, o), is_eagle_group=flag)
                for i, ((kind, b, o), flag) in enumerate(zip(layout, eagle_flags, strict=True))
            ]
            return KVCacheConfig(num_blocks, [], groups)

        spec_out: Any
        impl_out: Any
        try:
            spec_out = self.spec_manager_cls(config(), **kwargs)
        except Exception as error:
            spec_out = error
        try:
            impl_out = self.impl_manager_cls(config(), **kwargs)
        except Exception as error:
            impl_out = error
        if isinstance(spec_out, Exception) or isinstance(impl_out, Exception):
            assert type(spec_out) is type(impl_out), f"construction: {spec_out!r} vs {impl_out!r}"
            note(f"both refuse the layout: {spec_out!r}")
            assume(False)
        self.spec, self.impl = spec_out, impl_out
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = scheduler_block_size  # the unit of hits and of failed loads
        self.max_model_len = max_model_len
        self.token_budget = max_num_batched_tokens
        if "rswa" in kinds:  # short prompts, so decodes pass the window before the length cap
            self.max_prompt_len = max(1, min(max_model_len // 4, 2 * scheduler_block_size))
        self.has_cross = has_cross
        self.encoder_tokens: dict[str, int] = {}
        self.hasher = get_request_block_hasher(hash_block_size, sha256, **self.hasher_switches)
        for _ in range(data.draw(st.integers(1, 3), label="num_first_requests")):
            self.new_request(data)

    # ------------------------------------------------------------ layout-specific steps

    def new_request(self, data: st.DataObject) -> None:
        super().new_request(data)
        if self.has_cross:
            rid = f"r{self.next_id - 1}"
            self.encoder_tokens[rid] = data.draw(st.integers(1, 12), label="encoder_tokens")

    def draw_chunk(self, data: st.DataObject, num_wanted: int) -> int:
        if self.align:  # Mamba align: prefill chunks must end at an aligned position
            return min(num_wanted, self.token_budget)
        return super().draw_chunk(data, num_wanted)

    def admit(
        self, data: st.DataObject, request: Request, hits: Any, num_hits: int, mode: str
    ) -> bool:
        if self.align:  # no connector loads with Mamba align (see compare_allocation)
            mode = "sync"
        return super().admit(data, request, hits, num_hits, mode)

    def compare_allocation(self, request: Request, **kwargs: Any) -> bool:
        rid = request.request_id
        if self.has_cross:
            kwargs["num_encoder_tokens"] = self.encoder_tokens[rid]
        if self.align and kwargs.get("num_external_computed_tokens"):
            # Mamba align counts no blocks for connector tokens but takes them, so
            # the pool can run dry mid-allocation (vLLM too): compute them instead.
            kwargs["num_new_tokens"] += kwargs.pop("num_external_computed_tokens")
        holds_nothing = all(
            rid not in m.num_cached_block and not m.req_to_blocks.get(rid)
            for m in self.impl.coordinator.single_type_managers
        )
        predicted = self.predict_allocation(request, kwargs) if holds_nothing else None
        free_before = self.impl.block_pool.free_block_queue.num_free_blocks
        granted = super().compare_allocation(request, **kwargs)
        if granted and predicted is not None:
            taken = free_before - self.impl.block_pool.free_block_queue.num_free_blocks
            note(f"get_num_blocks_to_allocate -> {predicted}; allocation took {taken}")
            assert taken == predicted, f"predicted {predicted} blocks, allocation took {taken}"
            event("prediction checked")
        return granted

    def predict_allocation(self, request: Request, kwargs: dict[str, Any]) -> int:
        """get_num_blocks_to_allocate on both coordinators, as allocate_slots calls it."""
        spec_hits, impl_hits = kwargs.get("hits", (None, None))
        spec_hits = spec_hits if spec_hits is not None else self.spec.empty_kv_cache_blocks
        impl_hits = impl_hits if impl_hits is not None else self.impl.empty_kv_cache_blocks
        computed = (
            request.num_computed_tokens
            + kwargs.get("num_new_computed_tokens", 0)
            + kwargs.get("num_external_computed_tokens", 0)
        )
        main = min(computed, self.max_model_len) + kwargs.get("num_new_tokens", 0)
        arguments = dict(
            request_id=request.request_id,
            num_tokens=min(main + kwargs.get("num_lookahead_tokens", 0), self.max_model_len),
            num_encoder_tokens=kwargs.get("num_encoder_tokens", 0),
            total_computed_tokens=computed,
            num_tokens_main_model=main,
        )
        if self.CHECKPOINTS:  # where the prefill ends, as allocate_slots passes it (0.33.0)
            arguments["prefill_end"] = max(request.num_prompt_tokens, request.num_tokens - 1)
        spec_num = self.spec.get_num_blocks_to_allocate(
            new_computed_blocks=spec_hits.blocks, **arguments
        )
        impl_num = self.impl.coordinator.get_num_blocks_to_allocate(
            new_computed_blocks=impl_hits.blocks, **arguments
        )
        assert impl_num == spec_num
        return spec_num

    def fail_kv_load(self, data: st.DataObject, request: Request, num_hit_tokens: int) -> None:
        """``_update_requests_with_invalid_blocks``: from the first invalid
        (scheduler-sized) block on, every group's blocks may be evicted."""
        first_loaded = num_hit_tokens // self.block_size
        last_loaded = (request.num_computed_tokens - 1) // self.block_size
        if last_loaded < first_loaded:
            return
        first_invalid = data.draw(st.integers(first_loaded, last_loaded), label="first_invalid")
        request.num_computed_tokens = first_invalid * self.block_size
        tables = self.spec.get_block_ids(request.request_id)
        to_evict = {
            block
            for (_, block_size, _), table in zip(self.layout, tables, strict=True)
            for block in table[first_invalid * self.block_size // block_size :]
            if block
        }
        evict = data.draw(st.booleans(), label="fail_policy")
        note(f"kv load of {request.request_id} failed at block {first_invalid}, evict={evict}")
        if evict:
            note(f"evict_blocks({to_evict})")
            self.spec.evict_blocks(to_evict)
            self.impl.evict_blocks(to_evict)

    # ------------------------------------------------------------ the invariant

    @invariant()
    def states_agree(self) -> None:
        super().states_agree()
        tables = self.spec_state["req_to_blocks"]
        held = [{b for table in group.values() for b in table if b} for group in tables]
        for (i, a), (j, b) in combinations(enumerate(held), 2):
            assert not a & b, f"groups {i} and {j} both hold blocks {sorted(a & b)}"
        for (kind, _, options), group in zip(self.layout, tables, strict=True):
            if kind == "mamba" and options["mamba_cache_mode"] == "align":
                continue
            if kind == "rswa":  # the gap's nulls follow the prompt's blocks
                if any(0 in t[next((k for k, b in enumerate(t) if b), len(t)) :]
                       for t in group.values()):
                    event("rswa gap released")
                continue
            for rid, table in group.items():
                num_null = next((k for k, b in enumerate(table) if b), len(table))
                assert all(table[num_null:]), (
                    f"{kind} table of {rid} has null blocks after real ones: {table}"
                )


# ---------------------------------------------------------------- directed programs
# Situations that take several coordinated steps, which the random search meets
# only now and then (and which examples a derandomized budget runs changes with
# any edit of the machine): each one pinned down as a program of the machine's
# own rules (``programs.py``). Unscripted draws take their simplest value.


def start(
    num_blocks: int, block_size: int, kinds: list[str], token_budget: int = 48, **draws: Any
) -> Step:
    """init_managers with caching on, no watermark, the longest model the pool allows
    (``token_budget``: max_num_batched_tokens)."""
    args = dict(
        num_blocks=num_blocks,
        base_block_size=block_size,
        watermark=0.0,
        log_stats=False,
        max_model_len=48,
        max_num_batched_tokens=token_budget,
    )
    return Step("init_managers", args, {"kinds": kinds, "caching": True, **draws})


def admit(*rids: str, expect: Any = None, **draws: Any) -> Step:
    """get_computed_blocks admitting ``rids`` (the mode and chunk as ``draws`` say)."""
    considered = {f"consider {rid}": True for rid in rids}
    return Step("get_computed_blocks", {}, {**considered, **draws}, expect=expect)


def finish(rid: str, expect: Any = None) -> Step:
    """free(rid) with free(): every group's blocks, tail first, group by group."""
    args = dict(status=RequestStatus.FINISHED_STOPPED, how="free")
    return Step("free", args, {None: rid}, expect=expect)


def extend(prompt: list[int], tail: list[int]) -> Step:
    """add_request: ``prompt`` (an earlier request's, no extra keys) plus ``tail``."""
    family = (tuple(prompt), "", "", ())
    draws = {"share_prefix": True, "family": family, "repeat": False, "cut": len(prompt)}
    return Step("add_request", {}, {**draws, **tokens("tail", tail)})


def computed(rid: str, num_tokens: int) -> Any:
    """An expectation: request ``rid`` has ``num_tokens`` computed tokens."""
    return lambda m: m.requests[rid].num_computed_tokens == num_tokens


PROGRAMS: dict[str, list[Step]] = {
    # Two full-attention groups (block size 1, 10 free blocks). r0 and r1 fill
    # the pool; r0 ends first, so the queue starts with its blocks: group 0's
    # [2, 1], then group 1's [4, 3]. r2 extends r0's prompt with one connector
    # token: group 0 touches its hits [1, 2], and only then may any group take
    # an external block, or group 0 takes block 4, group 1's untouched hit.
    "one group's external blocks after every group's hits": [
        start(11, 1, ["full", "full"], num_first_requests=2, **tokens("tokens", [0, 0], [1, 1, 1])),
        admit("r0", "r1", mode="sync", whole=True),
        finish("r0"),
        finish("r1", expect=lambda m: m.spec_state["free_queue"][:4] == [2, 1, 4, 3]),
        extend([0, 0], [2, 2]),
        admit("r2", mode="sync", unusual=True, ext=1, whole=True, expect=computed("r2", 3)),
    ],
    # Two sliding windows (2 and 3 tokens, block size 1). Group 1 loses the block
    # of position 4: group 0 hits 4 tokens, group 1 only 3, and group 0 must be
    # searched again at 3 (its block of position 3, not 4).
    "a later kind shortens an earlier kind's hit": [
        start(13, 1, ["swa", "swa"], window=Seq(2, 3), **tokens("tokens", [0, 1, 2, 0])),
        admit("r0", mode="sync", whole=True),
        finish("r0"),
        Step("evict_blocks", {}, {"ids": [8]}),  # group 1's last block of r0
        extend([0, 1, 2, 0], [1]),
        admit("r1", mode="sync", whole=True, expect=computed("r1", 3)),
    ],
    # Full attention and a 2-token window (block size 1), 2 tokens a step: the
    # window's admission cap is 4 blocks. r0's 12-token prompt runs in 6 chunks and
    # is freed; r1 extends it by one token and hits all 12 tokens, 8 beyond the cap.
    # The cap bounds only the admission gate's count: the allocation itself takes
    # the blocks get_num_blocks_to_allocate predicts without it.
    "a window admission with hits beyond its cap": [
        start(31, 1, ["full", "swa"], token_budget=2, window=2,
              **tokens("tokens", [0, 1, 2] * 4)),
        admit("r0", mode="sync", whole=True),
        *[Step("allocate_slots", {}, {"schedule r0": True, "whole": True})] * 5,
        Step("decode", expect=computed("r0", 12)),
        finish("r0"),
        extend([0, 1, 2] * 4, [1]),
        admit("r1", mode="sync", whole=True, expect=computed("r1", 12)),
    ],
    # Full attention and align-mode Mamba (block size 2). r1 hits r0's cached
    # Mamba state (4 tokens), then decodes 5 tokens: each state block it has
    # passed (the hit's first) must be freed.
    # Full attention and a 3-token window (block size 2) with retention 0: of r0's
    # 8-token prompt the window caches only the block before the replay boundary
    # (6 = 7 rounded down), so r1, the same prompt plus a token, hits 6 tokens.
    "latest-only retention keeps the replay tail": [
        start(21, 2, ["full", "swa"], window=3, retention=0,
              **tokens("tokens", [0, 1, 2, 0, 1, 2, 0, 1])),
        admit("r0", mode="sync", whole=True),
        finish("r0"),
        extend([0, 1, 2, 0, 1, 2, 0, 1], [2]),
        admit("r1", mode="sync", whole=True, expect=computed("r1", 6)),
    ],
    # Mamba alone ("all" mode, block size 2), retention 2 blocks: of r0's 9-token
    # prompt the states after 4 and 8 tokens are cached (8 is also the replay
    # boundary), not those after 2 and 6; r1 (r0's first 7 tokens and another) hits 4.
    "Mamba retention keeps one state per interval": [
        start(21, 2, ["mamba"], mode="all", retention=2,
              **tokens("tokens", [0, 1, 2, 0, 1, 2, 0, 1, 2])),
        admit("r0", mode="sync", whole=True),
        Step("new_step_starts"),
        finish("r0"),
        extend([0, 1, 2, 0, 1, 2, 0], [0]),
        admit("r1", mode="sync", whole=True, expect=computed("r1", 4)),
    ],
    "align-mode Mamba decodes past a cached state": [
        start(13, 2, ["full", "mamba"], mode="align", **tokens("tokens", [0, 0, 0, 0])),
        admit("r0"),
        Step("new_step_starts"),  # r0's state is written: it may be hit now
        finish("r0"),
        extend([0, 0, 0, 0], [1]),
        admit("r1", expect=computed("r1", 4)),
        *[Step("allocate_slots", {}, {"schedule r1": True})] * 4,
        Step("decode", expect=computed("r1", 9)),
    ],
    # Full attention and R-SWA with a 2-token window (block size 2). r0's 3-token
    # prompt is computed, then it decodes a token a step. Scheduled with 8 tokens
    # computed, its R-SWA table nulls block 2 (tokens 4-5: the gap between the
    # prompt's last block, which also holds token 3, and the window, tokens 6-7);
    # with 7 computed nothing is released yet. Full attention keeps every block.
    "an R-SWA request decodes past its window": [
        start(21, 2, ["full", "rswa"], rswa_window=2, **tokens("tokens", [0, 1, 2])),
        admit("r0", mode="sync", whole=True),
        Step("decode"),
        *[Step("allocate_slots", {}, {"schedule r0": True}), Step("decode")] * 4,
        Step("allocate_slots", {}, {"schedule r0": True}, expect=lambda m: (
            all(m.spec_state["req_to_blocks"][1]["r0"])
        )),
        Step("decode"),
        Step("allocate_slots", {}, {"schedule r0": True}, expect=lambda m: (
            [bool(b) for b in m.spec_state["req_to_blocks"][1]["r0"][:4]]
            == [True, True, False, True] and all(m.spec_state["req_to_blocks"][0]["r0"])
        )),
    ],
}


def test_hybrid_machine(stateful_settings: settings, record_property: Any) -> None:
    """kvcache agrees with spec on hybrid layouts under the profile's budget."""
    run_machine(HybridMachine, stateful_settings, record_property, share=CI_EXAMPLES)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_hybrid_program(name: str) -> None:
    """kvcache agrees with spec on each directed program."""
    replay(HybridMachine, PROGRAMS[name])
