"""End-to-end KV integrity: kvcache's block tables, read by the kernels, give each
request the attention of its own sequence.

The oracle is a fake model whose key, value and query at position ``p`` are a
pure function of ``tokens[:p + 1]`` (a hash of the whole prefix seeds them),
and dense float64 attention over the request's logical sequence, assumed
perfect. The machine plays a small vLLM scheduler around
``kvcache.KVCacheManager``: shared prefixes, prefix-cache hits, chunked
prefill, decodes, eviction, preemption and aborts. After every step it

1. computes the slot mapping with ``kernels.slot_mapping`` from the manager's
   block tables and checks it against vLLM's formula, exactly;
2. writes the new tokens' K/V with ``kernels.kv_write``;
3. runs ``kernels.paged_attention`` for the new tokens and compares it with
   dense attention.

Prefix-hit blocks are not rewritten: their content must already be right. A
block handed out stale, shared between different prefixes, or freed while in
use shows up as a mismatch (``KVIntegrityError``); cache block 0 (the null
block) holds NaN, so reading it shows up too. ``test_kv_integrity_catches_*``
injects manager bugs and expects that failure.
"""

from __future__ import annotations

import hashlib
import struct
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import Phase, note, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    precondition,
    rule,
    run_state_machine_as_test,
)
from kernel_helpers import DEVICE, INTEGRITY_SETTINGS, TOLERANCES, record_integrity

import kvcache as K
from kvcache_kernels import kv_write, map_to_kernel_blocks, paged_attention, slot_mapping
from kvcache_kernels.reference import dense_attention_ref, slot_mapping_ref

VOCAB = 4  # a tiny alphabet, so that suffixes collide and prefixes repeat
# Shared prompt prefixes ("documents") requests start from.
DOCUMENTS = [np.random.default_rng(seed).integers(0, VOCAB, 24).tolist() for seed in range(3)]
NUM_PAD_TOKENS = 2  # CUDA-graph padding after each batch: slot -1, never written


class KVIntegrityError(AssertionError):
    """A request's attention differs from dense attention over its own sequence."""


@dataclass(frozen=True)
class IntegrityConfig:
    """One KV-cache layout: manager blocks, kernel blocks, window, pool size."""

    name: str
    manager_block_size: int
    kernel_block_size: int
    sliding_window: int | None
    num_blocks: int  # manager blocks, including the null block
    dtype: torch.dtype
    max_model_len: int = 48
    token_budget: int = 16  # max_num_batched_tokens
    max_running: int = 4
    num_kv_heads: int = 1
    num_queries_per_kv: int = 2
    head_size: int = 8

    def layer_spec(self) -> K.KVCacheSpec:
        common: dict[str, Any] = dict(
            block_size=self.manager_block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=str(self.dtype).removeprefix("torch."),
        )
        if self.sliding_window is None:
            return K.FullAttentionSpec(**common)
        return K.SlidingWindowSpec(sliding_window=self.sliding_window, **common)


CONFIGS = [
    # 16 usable blocks of 4 for up to 4 requests of up to 12 blocks: preemption is common.
    IntegrityConfig("full", 4, 4, None, num_blocks=17, dtype=torch.float16, num_kv_heads=2),
    # Manager blocks of 8 tokens, attention kernel blocks of 2 (vLLM's hybrid block split).
    IntegrityConfig("full-kernel-block-2", 8, 2, None, num_blocks=9, dtype=torch.float32),
    # Positions left of the window hold the null block (NaN here); no kernel may read them.
    IntegrityConfig(
        "sliding-window-7-kernel-block-2",
        4,
        2,
        7,
        num_blocks=8,
        dtype=torch.bfloat16,
        token_budget=8,
    ),
]


class FakeModel:
    """K, V and query at position ``p`` depend on ``tokens[:p + 1]`` and nothing else."""

    def __init__(self, config: IntegrityConfig) -> None:
        self.num_kv_heads = config.num_kv_heads
        self.num_q_heads = config.num_kv_heads * config.num_queries_per_kv
        self.head_size = config.head_size
        self.dtype = config.dtype
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    def _vectors(self, prefix: tuple[int, ...]) -> torch.Tensor:
        """``[2 * num_kv_heads + num_q_heads, head_size]`` rows: K heads, V heads, q heads."""
        vectors = self._memo.get(prefix)
        if vectors is None:
            digest = hashlib.blake2b(struct.pack(f"<{len(prefix)}i", *prefix), digest_size=8)
            gen = torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little") >> 1)
            rows = 2 * self.num_kv_heads + self.num_q_heads
            vectors = torch.randn((rows, self.head_size), generator=gen).to(self.dtype)
            self._memo[prefix] = vectors
        return vectors

    def kv(self, tokens: tuple[int, ...], pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        vectors = self._vectors(tokens[: pos + 1])
        return vectors[: self.num_kv_heads], vectors[self.num_kv_heads : 2 * self.num_kv_heads]

    def query(self, tokens: tuple[int, ...], pos: int) -> torch.Tensor:
        return self._vectors(tokens[: pos + 1])[2 * self.num_kv_heads :]

    def next_token(self, tokens: tuple[int, ...]) -> int:
        """Greedy "sampling": equal sequences continue equally, so outputs get shared too."""
        return int(self._vectors(tokens)[0, 0].float().abs().mul(1000).item()) % VOCAB


@dataclass
class Counters:
    steps: int = 0  # steps whose attention was checked
    tokens: int = 0  # query tokens checked
    prefix_hit_tokens: int = 0
    evictions: int = 0  # cached blocks reused for other content
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


@dataclass
class Engine:
    """A small vLLM-like scheduler and model runner around ``kvcache.KVCacheManager``."""

    config: IntegrityConfig
    counters: Counters = field(default_factory=Counters)

    def __post_init__(self) -> None:
        cfg = self.config
        K.init_none_hash(K.sha256)
        kv_cache_config = K.KVCacheConfig(
            cfg.num_blocks, [], [K.KVCacheGroupSpec(["layer.0"], cfg.layer_spec())]
        )
        self.manager = K.KVCacheManager(
            kv_cache_config,
            max_model_len=cfg.max_model_len,
            scheduler_block_size=cfg.manager_block_size,
            hash_block_size=cfg.manager_block_size,
            max_num_batched_tokens=cfg.token_budget,
            enable_kv_cache_events=True,  # to count evictions
        )
        self.hasher = K.get_request_block_hasher(cfg.manager_block_size, K.sha256)
        self.model = FakeModel(cfg)
        self.blocks_per_manager_block = cfg.manager_block_size // cfg.kernel_block_size
        # The cache in kernel blocks; every block starts as NaN, which no read may see.
        shape = (
            cfg.num_blocks * self.blocks_per_manager_block,
            cfg.kernel_block_size,
            cfg.num_kv_heads,
            cfg.head_size,
        )
        self.k_cache = torch.full(shape, float("nan"), dtype=cfg.dtype, device=DEVICE)
        self.v_cache = torch.full(shape, float("nan"), dtype=cfg.dtype, device=DEVICE)
        self.max_num_blocks = -(-cfg.max_model_len // cfg.manager_block_size)
        self.waiting: deque[K.Request] = deque()
        self.running: list[K.Request] = []
        self.target_len: dict[str, int] = {}
        self.next_id = 0

    # ------------------------------------------------------------ requests

    def add_request(self, prompt: list[int], max_new_tokens: int) -> str:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        request = K.Request(request_id, prompt, block_hasher=self.hasher)
        self.target_len[request_id] = min(len(prompt) + max_new_tokens, self.config.max_model_len)
        self.waiting.append(request)
        return request_id

    def live_requests(self) -> list[K.Request]:
        return [*self.running, *self.waiting]

    def abort(self, request: K.Request) -> None:
        self.manager.free(request)
        request.status = K.RequestStatus.FINISHED_ABORTED
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.counters.aborted += 1

    def _preempt(self, request: K.Request) -> None:
        self.manager.free(request)
        self.running.remove(request)
        request.status = K.RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.counters.preemptions += 1

    # ------------------------------------------------------------ one step

    def schedule(self) -> list[tuple[K.Request, int]]:
        """Pick (request, new tokens) pairs within the token budget, as vLLM does:
        running requests first (preempting the newest when blocks run out), then
        waiting ones with their prefix hits, unless something was preempted."""
        budget = self.config.token_budget
        scheduled: list[tuple[K.Request, int]] = []
        preempted = False
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted earlier in this loop
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while self.manager.allocate_slots(request, num_new) is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request in self.running:
                scheduled.append((request, num_new))
                budget -= num_new
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.config.max_running:
                break
            request = self.waiting[0]
            hit_blocks, num_hit_tokens = self.manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if self.manager.allocate_slots(request, num_new, num_hit_tokens, hit_blocks) is None:
                break
            self.waiting.popleft()
            request.status = K.RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
            self.counters.prefix_hit_tokens += num_hit_tokens
        return scheduled

    def step(self) -> str:
        """Schedule, run and check one step; returns a one-line summary."""
        scheduled = self.schedule()
        self.counters.evictions += sum(
            len(event.block_hashes)
            for event in self.manager.take_events()
            if isinstance(event, K.BlockRemoved)
        )
        if scheduled:
            self.run_and_check(scheduled)
        for request, num_new in scheduled:
            request.num_computed_tokens += num_new
            if request.num_computed_tokens < request.num_tokens:
                continue  # a chunked prefill goes on next step
            if request.num_tokens >= self.target_len[request.request_id]:
                self.manager.free(request)
                request.status = K.RequestStatus.FINISHED_LENGTH_CAPPED
                self.running.remove(request)
                self.counters.finished += 1
            else:
                request.append_output_token_ids(self.model.next_token(tuple(request.all_token_ids)))
        return ", ".join(f"{r.request_id}+{n}" for r, n in scheduled) or "idle"

    def run_and_check(self, scheduled: list[tuple[K.Request, int]]) -> None:
        cfg, model = self.config, self.model
        num_reqs = len(scheduled)
        block_table = torch.zeros((num_reqs, self.max_num_blocks), dtype=torch.int32)
        query_lens: list[int] = []
        seq_lens: list[int] = []
        positions: list[int] = []
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        queries: list[torch.Tensor] = []
        for req_idx, (request, num_new) in enumerate(scheduled):
            (block_ids,) = self.manager.get_block_ids(request.request_id)
            block_table[req_idx, : len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
            start = request.num_computed_tokens
            tokens = tuple(request.all_token_ids)
            for pos in range(start, start + num_new):
                k, v = model.kv(tokens, pos)
                keys.append(k)
                values.append(v)
                queries.append(model.query(tokens, pos))
            query_lens.append(num_new)
            seq_lens.append(start + num_new)
            positions.extend(range(start, start + num_new))
        # Padding tokens carry garbage K/V that must not be written anywhere.
        positions.extend([0] * NUM_PAD_TOKENS)
        garbage = torch.full((cfg.num_kv_heads, cfg.head_size), 1e4, dtype=cfg.dtype)
        keys.extend([garbage] * NUM_PAD_TOKENS)
        values.extend([garbage] * NUM_PAD_TOKENS)
        queries.extend([torch.zeros_like(queries[0])] * NUM_PAD_TOKENS)

        query_start_loc = torch.tensor(np.cumsum([0, *query_lens]), dtype=torch.int32)
        positions_t = torch.tensor(positions, dtype=torch.int64)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)

        # 1. slot mapping, exactly vLLM's
        slots = slot_mapping(
            query_start_loc.to(DEVICE),
            positions_t.to(DEVICE),
            block_table.to(DEVICE),
            cfg.manager_block_size,
            cfg.kernel_block_size,
        )
        expected_slots = slot_mapping_ref(
            query_start_loc.numpy(),
            positions_t.numpy(),
            block_table.numpy(),
            cfg.manager_block_size,
            cfg.kernel_block_size,
        )
        np.testing.assert_array_equal(slots.cpu().numpy(), expected_slots)

        # 2. write this step's K/V
        kv_write(
            torch.stack(keys).to(DEVICE),
            torch.stack(values).to(DEVICE),
            self.k_cache,
            self.v_cache,
            slots,
        )

        # 3. paged attention through the (kernel-block) table vs dense attention
        query = torch.stack(queries)
        out = paged_attention(
            query.to(DEVICE),
            self.k_cache,
            self.v_cache,
            map_to_kernel_blocks(block_table, self.blocks_per_manager_block).to(DEVICE),
            query_start_loc.to(DEVICE),
            seq_lens_t.to(DEVICE),
            sliding_window=cfg.sliding_window,
            max_query_len=max(query_lens),
        ).cpu()
        atol, rtol = TOLERANCES[cfg.dtype]
        for req_idx, (request, num_new) in enumerate(scheduled):
            start, end = int(query_start_loc[req_idx]), int(query_start_loc[req_idx + 1])
            tokens = tuple(request.all_token_ids)
            seq_len = seq_lens[req_idx]
            key_positions = torch.arange(seq_len)
            dense_kv = [model.kv(tokens, pos) for pos in range(seq_len)]
            expected = dense_attention_ref(
                query[start:end],
                torch.stack([k for k, _ in dense_kv]),
                torch.stack([v for _, v in dense_kv]),
                key_positions[seq_len - num_new :],
                key_positions,
                cfg.sliding_window,
            )
            got = out[start:end].double()
            if not torch.allclose(got, expected, atol=atol, rtol=rtol):
                raise KVIntegrityError(
                    f"{request.request_id} (positions {seq_len - num_new}..{seq_len - 1}): "
                    f"max |paged - dense| = {(got - expected).abs().max().item():.3g}; "
                    + self.diagnose(request, block_table[req_idx], seq_len - num_new, seq_len)
                )
        self.counters.steps += 1
        self.counters.tokens += sum(query_lens)

    def diagnose(
        self, request: K.Request, manager_row: torch.Tensor, first_q_pos: int, seq_len: int
    ) -> str:
        """Which cached positions the attention could see hold the wrong K."""
        cfg = self.config
        tokens = tuple(request.all_token_ids)
        first = 0
        if cfg.sliding_window is not None:
            first = max(0, first_q_pos - cfg.sliding_window + 1)
        wrong = []
        for pos in range(first, seq_len):
            block_id = int(manager_row[pos // cfg.manager_block_size])
            slot = block_id * cfg.manager_block_size + pos % cfg.manager_block_size
            cached = self.k_cache[slot // cfg.kernel_block_size, slot % cfg.kernel_block_size]
            if not torch.equal(cached.cpu(), self.model.kv(tokens, pos)[0]):
                wrong.append(f"pos {pos} (block {block_id})")
        return "stale or foreign K at " + (", ".join(wrong) or "no position (a kernel bug?)")


class KVIntegrityMachine(RuleBasedStateMachine):
    """Drives ``Engine`` with random requests; every step checks every scheduled token
    against dense attention over the request's own tokens (the oracle)."""

    config: ClassVar[IntegrityConfig] = CONFIGS[0]
    #: counters of the examples run in this process, summed (read by the test)
    totals: ClassVar[Counters] = Counters()

    def __init__(self) -> None:
        super().__init__()
        self.engine = Engine(self.config)
        note(f"Engine({self.config})")

    @rule(
        document=st.sampled_from(range(len(DOCUMENTS))),
        prefix_len=st.sampled_from([0, 3, 4, 8, 11, 16, 24]),
        suffix=st.lists(st.integers(0, VOCAB - 1), max_size=8),
        max_new_tokens=st.integers(1, 12),
    )
    def add_request(
        self, document: int, prefix_len: int, suffix: list[int], max_new_tokens: int
    ) -> None:
        prompt = DOCUMENTS[document][:prefix_len] + suffix
        if not prompt:
            prompt = [document]
        request_id = self.engine.add_request(prompt, max_new_tokens)
        note(f"add_request({request_id!r}, prompt={prompt}, max_new_tokens={max_new_tokens})")

    @precondition(lambda self: bool(self.engine.live_requests()))
    @rule(num_steps=st.integers(1, 6))
    def step(self, num_steps: int) -> None:
        for _ in range(num_steps):
            note(f"step: {self.engine.step()}")

    @precondition(lambda self: len(self.engine.live_requests()) > self.config.max_running)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = sorted(self.engine.live_requests(), key=lambda r: r.request_id)
        request = data.draw(st.sampled_from(live), label="request")
        note(f"abort({request.request_id!r})")
        self.engine.abort(request)

    def teardown(self) -> None:
        for key, value in self.engine.counters.as_dict().items():
            setattr(self.totals, key, getattr(self.totals, key) + value)


def machine_for(config: IntegrityConfig) -> type[KVIntegrityMachine]:
    return type(
        f"KVIntegrityMachine_{config.name.replace('-', '_')}",
        (KVIntegrityMachine,),
        {"config": config, "totals": Counters()},
    )


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_kv_integrity(config: IntegrityConfig, record_property: Any) -> None:
    machine = machine_for(config)
    run_state_machine_as_test(machine, settings=INTEGRITY_SETTINGS)
    counts = machine.totals.as_dict()
    record_integrity(config.name, counts)
    for key, value in counts.items():
        record_property(f"integrity_{key}", value)
    print(f"kv integrity [{config.name}]: {counts}")
    # The workload must really exercise what it claims to check.
    assert counts["steps"] > 0 and counts["prefix_hit_tokens"] > 0, counts
    assert counts["evictions"] > 0 and counts["preemptions"] > 0, counts


# ---------------------------------------------------------------- teeth: injected bugs


def _evict_keeps_map_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reusing a cached block clears its hash but leaves it findable under the old one."""

    def _evict(self: K.BlockPool, block: K.KVCacheBlock) -> bool:
        if block.block_hash is None:
            return False
        block.reset_hash()
        return True

    monkeypatch.setattr(K.BlockPool, "_evict", _evict)


def _hash_ignores_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block hashes forget the prefix: equal blocks after different prefixes collide."""
    import kvcache.kv_cache_utils as utils

    original = utils.hash_block_tokens

    def hash_block_tokens(
        hash_function: Callable[[Any], bytes],
        parent_block_hash: Any,
        curr_block_token_ids: Any,
        extra_keys: Any = None,
    ) -> K.BlockHash:
        return original(hash_function, None, curr_block_token_ids, extra_keys)

    monkeypatch.setattr(utils, "hash_block_tokens", hash_block_tokens)


BUGS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "evict_keeps_map_entry": _evict_keeps_map_entry,
    "hash_ignores_parent": _hash_ignores_parent,
}


#: a pool of 8 usable blocks, so that a 29-token request reuses every free block
DIRECTED_CONFIG = IntegrityConfig("directed", 4, 4, None, num_blocks=9, dtype=torch.float32)


def _directed_scenario(engine: Engine) -> Iterator[str]:
    """A fixed program that needs a correct prefix cache. A is cached and freed; A2
    hits A's two full blocks; B, another prefix, then takes every free block (A's
    included); C asks for A's prefix again, which is no longer cached. A's second
    block repeats its first, and B's second block repeats A's, after other prefixes."""
    doc_a = [0, 1, 2, 3, 0, 1, 2, 3]
    doc_b = [3, 3, 2, 2, 0, 1, 2, 3]
    programs = [([*doc_a, 1], 1), ([*doc_a, 3], 1), ([*doc_b, *doc_b, 2], 12), ([*doc_a, 2, 2], 2)]
    for prompt, max_new_tokens in programs:
        engine.add_request(prompt, max_new_tokens)
        while engine.live_requests():
            yield engine.step()


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_kv_integrity_catches_injected_manager_bug(
    bug: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check has teeth: each injected bug fails it, in a fixed program and in
    the random workload, with ``KVIntegrityError`` (not some other crash)."""
    clean = Engine(DIRECTED_CONFIG)
    for _ in _directed_scenario(clean):  # the program passes on the real manager
        pass
    assert clean.counters.prefix_hit_tokens == 8, clean.counters  # A2's hit, none for C
    BUGS[bug](monkeypatch)
    with pytest.raises(KVIntegrityError) as directed:
        for _ in _directed_scenario(Engine(DIRECTED_CONFIG)):
            pass
    print(f"{bug}, fixed program: {directed.value}")
    with pytest.raises(KVIntegrityError) as random_workload:
        run_state_machine_as_test(
            machine_for(CONFIGS[0]),
            settings=settings(INTEGRITY_SETTINGS, phases=[Phase.generate], max_examples=20),
        )
    print(f"{bug}, random workload: {random_workload.value}")
