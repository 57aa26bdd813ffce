"""Model-based test of kvcache's R-SWA and sink managers against spec's (assumed
perfect), one group over its own pool, below the coordinator.

A sink group cannot be built by any coordinator (vLLM 0.25.1's constructor lacks
``scheduler_block_size``, docs/divergences.md), so ``HybridMachine`` only sees it
refused; here the managers are built directly, as vLLM's own tests build them.
The machine draws the kind (R-SWA with a window, or sink attention with a sink
length), the block size and the pool, then plays a scheduler's calls on one
group: ``get_num_blocks_to_allocate`` then ``allocate_new_blocks`` (both results
compared), ``remove_skipped_blocks`` with or without the prompt length,
``get_num_common_prefix_blocks`` and ``free``. The whole state (tables, free
queue in order, ref counts) is compared after every step. Caching is off: hits
and caching are full attention's for both kinds (``HybridMachine`` and the
conformance families cover them for R-SWA).
"""

from __future__ import annotations

from typing import Any, ClassVar

import hypothesis.strategies as st
from hypothesis import note, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import kvcache as K
from spec import single_type_kv_cache_manager as spec_managers
from spec.block_pool import BlockPool as SpecBlockPool

REQUEST_IDS = ["r0", "r1", "r2", "r3"]


class KindManagerMachine(RuleBasedStateMachine):
    """kvcache's ``RSWAManager`` / ``SinkFullAttentionManager`` against spec's."""

    counters: ClassVar[dict[str, int]] = {"steps": 0, "examples": 0}

    @initialize(
        kind=st.sampled_from(["rswa", "sink"]),
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(4, 24),
        data=st.data(),
    )
    def init_managers(self, kind: str, block_size: int, num_blocks: int, data: Any) -> None:
        self.counters["examples"] += 1
        attn = dict(block_size=block_size, num_kv_heads=1, head_size=8, dtype="float16")
        self.impl_pool = K.BlockPool(num_blocks, False, block_size)
        self.spec_pool = SpecBlockPool(num_blocks, False, block_size)
        if kind == "rswa":
            window = data.draw(st.integers(1, 4), label="rswa_window")
            layer = K.RSWASpec(**attn, rswa_window=window)
            self.impl: Any = K.RSWAManager(layer, self.impl_pool, False, 0, block_size)
            self.spec: Any = spec_managers.SingleTypeKVCacheManager(
                layer, self.spec_pool, False, 0, block_size)
        else:
            num_sink_blocks = data.draw(st.integers(1, min(3, num_blocks - 1)), label="sinks")
            layer = K.SinkFullAttentionSpec(**attn, sink_len=num_sink_blocks * block_size)
            self.impl = K.SinkFullAttentionManager(layer, self.impl_pool, False, 0)
            self.spec = spec_managers.sink_manager(layer, self.spec_pool, False, 0)
            assert [b.block_id for b in self.impl.sink_blocks] == self.spec.sink_blocks
        note(f"{layer!r} over {num_blocks} blocks")
        self.block_size = block_size
        self.prompts = {rid: data.draw(st.integers(1, 8), label="prompt") for rid in REQUEST_IDS}

    def num_slots(self, rid: str) -> int:
        return len(self.spec.req_to_blocks.get(rid, ())) * self.block_size

    @rule(rid=st.sampled_from(REQUEST_IDS), more=st.integers(1, 6))
    def allocate(self, rid: str, more: int) -> None:
        """The admission count, then the allocation when the pool can give it."""
        num_tokens = self.num_slots(rid) + more
        args = (rid, num_tokens, [], min(num_tokens - more, self.num_slots(rid)), num_tokens)
        needed = self.spec.get_num_blocks_to_allocate(*args)
        assert self.impl.get_num_blocks_to_allocate(*args) == needed
        note(f"{rid}: {needed} blocks for {num_tokens} tokens")
        if needed > self.spec_pool.get_num_free_blocks():
            return
        spec_new = self.spec.allocate_new_blocks(rid, num_tokens, num_tokens)
        impl_new = self.impl.allocate_new_blocks(rid, num_tokens, num_tokens)
        assert [b.block_id for b in impl_new] == spec_new

    @precondition(lambda self: self.spec.req_to_blocks)
    @rule(data=st.data())
    def remove_skipped_blocks(self, data: Any) -> None:
        rid = data.draw(st.sampled_from(sorted(self.spec.req_to_blocks)), label="rid")
        # Drawn down from the table's end: decodes far past the window are the point.
        slots = self.num_slots(rid)
        computed = slots - data.draw(st.integers(0, slots), label="back")
        prompt = self.prompts[rid] if data.draw(st.integers(0, 7), label="no_prompt") else None
        note(f"remove_skipped_blocks({rid!r}, {computed}, num_prompt_tokens={prompt})")
        self.spec.remove_skipped_blocks(rid, computed, prompt)
        self.impl.remove_skipped_blocks(rid, computed, prompt)

    @precondition(lambda self: self.spec.req_to_blocks)
    @rule(data=st.data())
    def get_num_common_prefix_blocks(self, data: Any) -> None:
        rid = data.draw(st.sampled_from(sorted(self.spec.req_to_blocks)), label="rid")
        got = self.impl.get_num_common_prefix_blocks(rid)
        assert got == self.spec.get_num_common_prefix_blocks(rid)

    @rule(rid=st.sampled_from(REQUEST_IDS))
    def free(self, rid: str) -> None:
        self.spec.free(rid)
        self.impl.free(rid)

    @invariant()
    def states_agree(self) -> None:
        self.counters["steps"] += 1
        tables = {r: [b.block_id for b in bs] for r, bs in self.impl.req_to_blocks.items()}
        assert tables == self.spec.req_to_blocks
        free = [b.block_id for b in self.impl_pool.free_block_queue.get_all_free_blocks()]
        assert free == self.spec_pool.free_queue
        impl_refs = {b.block_id: b.ref_cnt for b in self.impl_pool.blocks[1:] if b.ref_cnt}
        spec_refs = {b: n for b, n in enumerate(self.spec_pool.ref_cnt) if b and n}
        assert impl_refs == spec_refs
        self.spec.check_invariants()


def test_kind_managers_machine(stateful_settings: settings, record_property: Any) -> None:
    """kvcache agrees with spec on the R-SWA and sink managers (a sixth of the budget)."""
    examples = max(1, stateful_settings.max_examples // 6)
    before = dict(KindManagerMachine.counters)
    try:
        run_state_machine_as_test(
            KindManagerMachine,
            settings=settings(stateful_settings, max_examples=examples, stateful_step_count=40),
        )
    finally:
        for key, value in KindManagerMachine.counters.items():
            record_property(f"stateful_{key}", value - before[key])
