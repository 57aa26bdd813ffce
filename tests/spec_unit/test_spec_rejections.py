"""Bad input, kvcache and the spec side by side: both refuse it, with the same
exception class (or two the kit's ``compare_outcomes`` accepts as one), the spec's
message names the argument, and neither side's state changes.

The spec's refusals are reference semantics too: another implementation learns from
them what a call may not do. kvcache's refusals are held to vLLM's by the
conformance families and ``tests/reliability/test_rejected_inputs.py``; these cases
hold the spec's to kvcache's. What only the spec refuses (its own arguments, what it
does not model, its pool's internal calls) is checked at the end, alone.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import kvcache as K
import spec as S
from kvcache.kit.lockstep import assert_allowance, compare_outcomes
from kvcache.kv_cache_interface import CircularBufferSpec
from spec import profile as spec_profile
from spec import vocab
from spec.single_type_kv_cache_manager import CROSS, find_fine_grained_hit, find_longest_cache_hit

BS = 4


def full(block_size: int = BS) -> K.FullAttentionSpec:
    return K.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8,
                               dtype="float16")


def window(block_size: int = BS, sliding_window: int = 8) -> K.SlidingWindowSpec:
    return K.SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=8,
                               dtype="float16", sliding_window=sliding_window)


def chunked() -> K.ChunkedLocalAttentionSpec:
    return K.ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8,
                                       dtype="float16", attention_chunk_size=8)


def cross() -> K.CrossAttentionSpec:
    return K.CrossAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float16")


def ring(block_size: int = BS) -> CircularBufferSpec:
    return CircularBufferSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype="float16")


def config(*specs: Any, num_blocks: int = 12) -> K.KVCacheConfig:
    return K.KVCacheConfig(num_blocks, [], [K.KVCacheGroupSpec([f"l{i}"], s)
                                            for i, s in enumerate(specs)])


def request(rid: str, num_tokens: int = 9) -> K.Request:
    return K.Request(rid, list(range(num_tokens)),
                     block_hasher=K.get_request_block_hasher(BS, K.sha256))


def outcome(call: Callable[[], object]) -> dict[str, Any]:
    """A call's outcome as the kit records one: its exception, or that it returned."""
    try:
        call()
    except Exception as error:  # every refusal is an outcome
        return {"raises": type(error).__name__, "message": str(error)}
    return {"ok": None}


def agree(kvcache_outcome: dict[str, Any], spec_outcome: dict[str, Any], needle: str) -> None:
    """Both refused alike, the spec naming ``needle``: by the kit's rule with kvcache as
    the reference, or, where vLLM asserts, each refusal one the kit accepts for vLLM's
    ``AssertionError`` (kvcache's ``ContextParallelError``, the spec's
    ``NotImplementedError``)."""
    assert "raises" in kvcache_outcome, f"kvcache accepted it; the spec: {spec_outcome}"
    ok, note = compare_outcomes(kvcache_outcome, spec_outcome)
    both_for_assert = all(assert_allowance("AssertionError", o["raises"])
                          for o in (kvcache_outcome, spec_outcome))
    assert ok or both_for_assert, note
    assert needle in spec_outcome["message"], spec_outcome["message"]


# ---------------------------------------------------------------- construction

BUILDS: list[tuple[str, str, Callable[[Any], object]]] = [
    ("prefill lookahead a bool", "num_prefill_lookahead",
     lambda M: M(config(full()), 32, BS, BS, num_prefill_lookahead=True, profile="0.33.0")),
    ("negative hash lookahead", "num_hash_lookahead_tokens",
     lambda M: M(config(full()), 32, BS, BS, num_hash_lookahead_tokens=-1, profile="0.33.0")),
    ("lookahead under 0.25.1", "num_prefill_lookahead=2",
     lambda M: M(config(full()), 32, BS, BS, num_prefill_lookahead=2)),
    ("dcp world size 0", "dcp_world_size", lambda M: M(config(full()), 32, BS, BS,
                                                       dcp_world_size=0)),
    ("pcp world size a float", "pcp_world_size", lambda M: M(config(full()), 32, BS, BS,
                                                             pcp_world_size=1.5)),
    ("scheduler block off the hash block", "scheduler_block_size=6",
     lambda M: M(config(full()), 32, 6, 4)),
    ("scheduler block off a group's block", "scheduler_block_size=4",
     lambda M: M(config(full(8)), 32, 4, 4)),
    ("negative watermark", "watermark", lambda M: M(config(full()), 32, BS, BS,
                                                    watermark=-0.5)),
    ("hash block off a hybrid block", "hash_block_size=4",
     lambda M: M(config(full(4), window(6)), 32, 12, 4)),
    ("hybrid of one spec", "distinct",
     lambda M: M(config(full(), full()), 32, BS, BS)),
    ("cross attention with caching", "cross-attention",
     lambda M: M(config(full(), cross()), 32, BS, BS)),
    ("hybrid under dcp with caching", "context parallelism",
     lambda M: M(config(full(), window()), 32, BS, BS, dcp_world_size=2)),
    ("only ring buffers", "ring buffer",
     lambda M: M(config(ring(4), ring(8)), 32, 8, 4, profile="0.33.0")),
    ("chunked local attention looked up under EAGLE", "EAGLE",
     lambda M: M(config(chunked()), 32, BS, BS, use_eagle=True).get_computed_blocks(
         request("a"))),
    ("release with no profile", "release='0.99.0'",
     lambda M: M(config(full()), 32, BS, BS, profile="0.99.0")),
    ("profile of no kind", "profile=3.5", lambda M: M(config(full()), 32, BS, BS,
                                                      profile=3.5)),
    # vLLM 0.33.0's Mamba manager asserts as it is built, before the coordinator
    # bundles the groups (CI's seed 11760222781902215246, two equal Mamba groups).
    ("Mamba 'none' with caching under 0.33.0, before the bundling", "mamba_cache_mode",
     lambda M: M(config(*[K.MambaSpec(block_size=BS, shapes=((2,),), dtypes=("float16",),
                                      mamba_cache_mode="none")] * 2), 32, BS, BS,
                 profile="0.33.0")),
    ("retention not a multiple", "prefix_cache_retention_interval=6",
     lambda M: M(config(window()), 32, BS, BS, prefix_cache_retention_interval=6)),
    ("retention without a window", "prefix_cache_retention_interval=4",
     lambda M: M(config(full()), 32, BS, BS, prefix_cache_retention_interval=4)),
]


@pytest.mark.parametrize(("name", "needle", "build"), BUILDS, ids=[b[0] for b in BUILDS])
def test_a_bad_layout_is_refused_alike(name: str, needle: str,
                                       build: Callable[[Any], object]) -> None:
    agree(outcome(lambda: build(K.KVCacheManager)), outcome(lambda: build(S.KVCacheManager)),
          needle)


@pytest.mark.parametrize("release", ["0.25.1", "0.33.0"])
def test_a_window_under_dcp_is_refused_by_the_spec_where_kvcache_refuses_its_lookup(
        release: str) -> None:
    """One sliding-window group under decode context parallelism with caching: vLLM
    builds it and asserts at the first lookup (kvcache: ``ContextParallelError``); the
    spec refuses the layout at once, with the same class the kit accepts there."""
    layout = config(window())
    manager = K.KVCacheManager(layout, 32, 8, 8, dcp_world_size=2, profile=release)
    looked_up = outcome(lambda: manager.get_computed_blocks(request("a")))
    built = outcome(lambda: S.KVCacheManager(layout, 32, 8, 8, dcp_world_size=2,
                                             profile=release))
    agree(looked_up, built, "context parallelism")


# ---------------------------------------------------------------- calls

BLOCK_IDS = {"kvcache": lambda m, ids: [m.block_pool.blocks[i] for i in ids],
             "spec": lambda m, ids: list(ids)}


def populated(side: str, **kwargs: Any) -> tuple[Any, K.Request]:
    """A manager of one full-attention group holding request "a" (9 tokens, running)."""
    manager_class = K.KVCacheManager if side == "kvcache" else S.KVCacheManager
    manager = manager_class(config(full()), 32, BS, BS, enable_kv_cache_events=True, **kwargs)
    a = request("a")
    assert manager.allocate_slots(a, 9) is not None
    a.num_computed_tokens = 9
    a.status = K.RequestStatus.RUNNING
    return manager, a


CALLS: list[tuple[str, str, dict[str, Any], Callable[[Any, K.Request, str], object]]] = [
    ("no new tokens", "num_new_tokens", {}, lambda m, a, side: m.allocate_slots(a, 0)),
    ("a running request given hits", "running", {},
     lambda m, a, side: m.allocate_slots(a, 1, 4, m.create_kv_cache_blocks(
         (BLOCK_IDS[side](m, [1]),)))),
    ("evict past the pool", "block_ids", {}, lambda m, a, side: m.evict_blocks({12})),
    ("unhashed ids of one group asked of two", "1 group", {},
     lambda m, a, side: m.create_kv_cache_blocks(
         (BLOCK_IDS[side](m, [1]), BLOCK_IDS[side](m, [2]))).get_unhashed_block_ids()),
    ("fresh blocks past the free ones", "Cannot get", {},
     lambda m, a, side: m.block_pool.get_new_blocks(99)),
    ("a negative number of fresh blocks", "num_blocks", {},
     lambda m, a, side: m.block_pool.get_new_blocks(-1)),
]


@pytest.mark.parametrize(("name", "needle", "kwargs", "call"), CALLS,
                         ids=[c[0] for c in CALLS])
def test_a_bad_call_is_refused_alike_and_changes_nothing(
        name: str, needle: str, kwargs: dict[str, Any],
        call: Callable[[Any, K.Request, str], object]) -> None:
    outcomes, states = {}, {}
    for side in ("kvcache", "spec"):
        manager, a = populated(side, **kwargs)
        before = manager.abstract_state()
        outcomes[side] = outcome(lambda: call(manager, a, side))  # noqa: B023 - called here
        states[side] = (before, manager.abstract_state())
        manager.check_invariants()
    agree(outcomes["kvcache"], outcomes["spec"], needle)
    for side, (before, after) in states.items():
        assert after == before, f"{side} changed its state"


def test_hits_with_caching_off_are_refused_by_the_spec() -> None:
    """With caching off no lookup yields hits; the spec refuses hits handed in anyway
    (kvcache trusts its caller there), keeping its state."""
    manager, _ = populated("spec", enable_caching=False)
    before = manager.abstract_state()
    with pytest.raises(ValueError, match=r"new_computed_blocks=\[1\] with caching off"):
        manager.allocate_slots(request("b"), 5, 4, manager.create_kv_cache_blocks(([1],)))
    assert manager.abstract_state() == before


# ---------------------------------------------------------------- the spec alone


class Unmodelled(K.FullAttentionSpec):
    """A layer spec class the spec has no row for (rows go by exact class name)."""


def test_what_the_spec_does_not_model_says_so() -> None:
    with pytest.raises(NotImplementedError, match="metrics_collector"):
        S.KVCacheManager(config(full()), 32, BS, BS, metrics_collector=object())
    with pytest.raises(NotImplementedError, match="metrics_collector"):
        S.BlockPool(8, True, BS, metrics_collector=object())
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        S.BlockPool(0, True, BS)
    with pytest.raises(ValueError, match="caching_hash_algo"):
        S.KVCacheManager(config(full()), 32, BS, BS, caching_hash_algo="md5")
    with pytest.raises(NotImplementedError, match="no spec manager for Unmodelled"):
        S.KVCacheManager(config(Unmodelled(block_size=BS, num_kv_heads=1, head_size=8,
                                           dtype="float16")), 32, BS, BS)


def test_cross_attention_hits_are_refused() -> None:
    """Cross-attention blocks are never cached, so hits for its group are bad input
    even with caching off (the state stays valid)."""
    manager = S.KVCacheManager(config(full(), cross()), 32, BS, BS, enable_caching=False)
    with pytest.raises(ValueError, match=r"new_computed_blocks=\[1\] for cross attention"):
        manager.allocate_slots(request("b"), 5, 4, manager.create_kv_cache_blocks(([], [1])),
                               num_encoder_tokens=4)
    manager.check_invariants()


def test_edges_of_the_pool_and_the_profile() -> None:
    """A pool of the null block alone is unused (as kvcache's); a profile has no
    attribute but its switches and rules."""
    assert S.BlockPool(1, True, BS).get_usage() == K.BlockPool(1, True, BS).get_usage() == 0
    with pytest.raises(AttributeError, match="no_such_switch"):
        _ = spec_profile.Profile().no_such_switch


def test_a_kind_without_a_search_is_not_searched() -> None:
    pool = S.BlockPool(8, True, BS)
    with pytest.raises(NotImplementedError, match="CrossAttentionManager"):
        find_longest_cache_hit(CROSS, [], 8, [0], pool, cross(), False, BS)
    with pytest.raises(NotImplementedError, match="CrossAttentionManager"):
        find_fine_grained_hit(CROSS, [], 8, [0], pool, cross(), False, BS)


def test_the_pool_refuses_what_vllm_asserts_and_keeps_its_state() -> None:
    manager, a = populated("spec")
    pool, blocks = manager.block_pool, manager.get_block_ids("a")[0]
    before = manager.abstract_state()
    with pytest.raises(ValueError, match="block_mask has 1 entries"):
        pool.cache_full_blocks(a, blocks, 0, 2, BS, 0, [True])
    with pytest.raises(ValueError, match="num_full_blocks=3 exceeds"):
        pool.cache_full_blocks(a, blocks, 2, 3, BS, 0)
    with pytest.raises(ValueError, match=r"blocks\[0\]=1 is already cached"):
        pool.cache_full_blocks(a, [1, 2], 0, 1, BS, 0)
    with pytest.raises(ValueError, match="block 2 is cached already"):
        pool.move_block_hashes(1, 2)
    assert manager.abstract_state() == before
    pool.cache_full_blocks(a, blocks, 2, 2, BS, 0)  # nothing to cache: nothing happens
    assert manager.abstract_state() == before


def test_bad_vocabulary_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="block_size=6 is not a multiple of hash_block_size=4"):
        vocab.coarsen([b"x"], 4, 6)
    with pytest.raises(ValueError, match=r"no switch of releases\.toml"):
        spec_profile.Profile("0.25.1", no_such_switch=True)


TABLE_FLAWS = [
    ("a release not a version", lambda t: t.replace('"0.26.0",', '"0.26",', 1),
     "release='0.26': expected major.minor.patch"),
    ("releases out of order", lambda t: t.replace('"0.26.0",', "", 1).replace(
        '"0.25.1",', '"0.25.1", "0.26.0", "0.25.2",', 1), "not strictly ascending"),
    ("a default of no release", lambda t: t.replace('default = "0.25.1"',
                                                    'default = "0.24.0"'), "default="),
    ("a switch twice", lambda t: t + '\n[[switch]]\nname = "event_locality"\n'
                                     'since = "0.26.0"\n', "listed twice"),
    ("a switch of no release", lambda t: t + '\n[[switch]]\nname = "x"\nsince = "0.2.0"\n',
     "since='0.2.0'"),
]


@pytest.mark.parametrize(("name", "edit", "needle"), TABLE_FLAWS, ids=[f[0] for f in TABLE_FLAWS])
def test_a_flawed_release_table_is_refused(name: str, edit: Callable[[str], str], needle: str,
                                           tmp_path: Path) -> None:
    text = spec_profile.TABLE_PATH.read_text(encoding="utf-8")
    assert edit(text) != text, "the flaw was not written"
    tomllib.loads(edit(text))  # still TOML: the reader, not the parser, refuses it
    path = tmp_path / "releases.toml"
    path.write_text(edit(text), encoding="utf-8")
    with pytest.raises(ValueError, match=needle):
        spec_profile.read_table(path)
