"""A used manager survives a pickle round trip, on both builds.

The exhaustive search (``proofs/exhaustive.py``) copies states by pickling them;
compiled classes pickle because every core class allows interpreted subclasses
(docs/verification.md, "Two builds"). Here a manager is driven part way through a random
scheduler run, pickled together with its requests, and both the original and the
copy then run the same continuation: every result (hits, block ids, refusals,
events) and the final abstract state must be equal, and the copy must be
independent of the original (its pool's blocks are other objects).
"""

from __future__ import annotations

import pickle
import random
from typing import Any

import pytest

import kvcache as K

BS = 2
ATTN: dict[str, Any] = {"num_kv_heads": 1, "head_size": 8, "dtype": "float16"}
LAYOUTS = {
    "full": [K.FullAttentionSpec(block_size=BS, **ATTN)],
    "full+swa": [
        K.FullAttentionSpec(block_size=BS, **ATTN),
        K.SlidingWindowSpec(block_size=BS, sliding_window=3, **ATTN),
    ],
    "full+mamba": [
        K.FullAttentionSpec(block_size=BS, **ATTN),
        K.MambaSpec(block_size=BS, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="align"),
    ],
}


def make_manager(layout: str) -> K.KVCacheManager:
    groups = [K.KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(LAYOUTS[layout])]
    return K.KVCacheManager(
        K.KVCacheConfig(24, [], groups),
        max_model_len=24,
        scheduler_block_size=BS,
        hash_block_size=BS,
        enable_caching=True,
        enable_kv_cache_events=True,
        log_stats=True,
    )


def step(
    m: K.KVCacheManager, requests: dict[str, K.Request], rng: random.Random, n: int
) -> list[Any]:
    """One random scheduler action; returns what the manager answered."""
    m.new_step_starts()
    waiting = [r for r in requests.values() if r.status == K.RequestStatus.WAITING]
    running = [r for r in requests.values() if r.status == K.RequestStatus.RUNNING]
    choice = rng.random()
    if choice < 0.3 or not (waiting or running):
        prompt = [rng.randrange(3) for _ in range(rng.randint(1, 9))]
        rid = f"r{n}"
        requests[rid] = K.Request(
            rid, prompt, block_hasher=K.get_request_block_hasher(BS, K.sha256)
        )
        return ["add", list(requests[rid].block_hashes)]
    if waiting and choice < 0.6:
        request = waiting[0]
        hits, num_hit = m.get_computed_blocks(request)
        blocks = m.allocate_slots(
            request, request.num_tokens - num_hit, num_hit, hits, has_scheduled_reqs=False
        )
        if blocks is not None:
            request.status = K.RequestStatus.RUNNING
            request.num_computed_tokens = request.num_tokens
        return ["admit", num_hit, hits.get_block_ids(), blocks and blocks.get_block_ids()]
    if running and choice < 0.85:
        request = rng.choice(running)
        if request.num_tokens + 1 >= 24:
            request.status = K.RequestStatus.FINISHED_LENGTH_CAPPED
            m.free(request)
            return ["finish"]
        request.append_output_token_ids(rng.randrange(3))
        blocks = m.allocate_slots(request, 1)
        if blocks is None:  # preempted
            m.free(request)
            request.status = K.RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            return ["preempt"]
        request.num_computed_tokens += 1
        return ["decode", blocks.get_block_ids()]
    request = rng.choice(running or waiting)
    request.status = K.RequestStatus.FINISHED_STOPPED
    m.free(request)
    return ["free", list(m.take_events())]


def pickled(m: K.KVCacheManager, requests: dict[str, K.Request]) -> Any:
    """A pickle round trip of the manager and its requests (the hasher, a closure,
    travels outside, as in the exhaustive search)."""
    hashers = {rid: r._block_hasher for rid, r in requests.items()}
    for r in requests.values():
        r._block_hasher = None
    try:
        m2, requests2 = pickle.loads(pickle.dumps((m, requests), pickle.HIGHEST_PROTOCOL))
    finally:
        for rid, r in requests.items():
            r._block_hasher = hashers[rid]
    for rid, r in requests2.items():
        r._block_hasher = hashers[rid]
    return m2, requests2


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("seed", range(4))
def test_a_used_manager_pickles_and_behaves_alike(layout: str, seed: int) -> None:
    rng = random.Random(seed)
    m = make_manager(layout)
    requests: dict[str, K.Request] = {}
    for n in range(40):
        step(m, requests, rng, n)
    m2, requests2 = pickled(m, requests)
    assert type(m2) is type(m) and m2.abstract_state() == m.abstract_state()
    assert m2.block_pool.blocks[1] is not m.block_pool.blocks[1]
    state = rng.getstate()
    rng2 = random.Random()
    rng2.setstate(state)
    for n in range(40, 120):
        assert step(m2, requests2, rng2, n) == step(m, requests, rng, n), f"step {n}"
        m2.check_invariants()
    assert m2.abstract_state() == m.abstract_state()
    assert m2.make_prefix_cache_stats() == m.make_prefix_cache_stats()


@pytest.mark.parametrize("release", ["0.25.1", "0.29.0", "0.33.0"])
def test_the_spec_pickles_under_every_release_with_events_and_stats_pending(
    release: str,
) -> None:
    """The spec's manager, as the exhaustive search copies it: with events queued and
    stats gathered, of the release's classes (0.33.0's events and stats are built
    with ``make_dataclass``, so they must pickle by the names that hold them)."""
    import spec

    groups = [K.KVCacheGroupSpec(["l"], K.FullAttentionSpec(block_size=BS, **ATTN))]
    m = spec.KVCacheManager(K.KVCacheConfig(8, [], groups), 16, BS, BS,
                            enable_kv_cache_events=True, log_stats=True, profile=release)
    r = K.Request("a", [1, 2, 3, 4, 5], block_hasher=K.get_request_block_hasher(BS, K.sha256))
    hits, num_hits = m.get_computed_blocks(r)
    assert m.allocate_slots(r, 5, num_hits, hits) is not None
    m.evict_blocks({1})  # a BlockRemoved too
    r._block_hasher = None
    m2 = pickle.loads(pickle.dumps(m, pickle.HIGHEST_PROTOCOL))
    assert m2.abstract_state() == m.abstract_state()
    events = m.take_events()
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved"]
    assert m2.take_events() == events
    assert m2.make_prefix_cache_stats() == m.make_prefix_cache_stats()
