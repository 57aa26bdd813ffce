"""vLLM 0.33.0's lookahead hashing and prefill lookahead, in kvcache and in the spec.

Lookahead hashing (``num_hash_lookahead_tokens`` = L): a block's hash also covers
the L tokens after it, so it exists only once they do; its extra keys are
``(keys of the block and its lookahead window, *those L tokens)``; BlockStored
events list each block's lookahead tokens, so a consumer can rebuild the hash; a
Mamba state is cached at the prompt's last boundary whose lookahead exists.
Prefill lookahead (``num_prefill_lookahead`` = P): the last P - 1 computed tokens
are re-prefilled by a multi-module drafter, so they are not cached yet.

The spec is held against the same numbers here; ``tests/conformance/
test_profile_0_33.py`` runs the lookahead families of ``kvcache.kit.driver``
(``Family.lookahead``) kvcache against spec, and ``make conformance-0.33`` against
vLLM 0.33.0.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

import kvcache.kv_cache_utils as kcu
import spec
import spec.block_pool as spec_block_pool
from kvcache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    LoRARequest,
    MambaSpec,
    MultiModalFeatureSpec,
    PlaceholderRange,
    Request,
    SlidingWindowSpec,
    sha256,
)
from kvcache import kv_cache_math as kmath
from kvcache import vllm_0_33 as v33
from kvcache.kit.conformance import family_index, family_seed
from kvcache.kit.driver import FAMILIES, Stats, random_config, run_sequence
from kvcache.kv_cache_manager import KVCacheManager
from kvcache.kv_cache_utils import (
    BlockHashListWithBlockSize,
    BlockHashViewError,
    resolve_block_hashes,
)
from kvcache.kv_events import BlockStored
from spec import pure
from spec.vocab import request_block_hashes

BS = 4
IMPLS = ("kvcache", "spec")
LOOKAHEAD_FAMILIES = {name: f for name, f in FAMILIES.items() if f.lookahead}


@pytest.fixture(autouse=True)
def sha256_none_hash() -> None:
    kcu.init_none_hash(sha256)


def full_config(num_blocks: int = 16, block_sizes: tuple[int, ...] = (BS,)) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, [], [
        KVCacheGroupSpec([f"layer.{i}"], FullAttentionSpec(
            block_size=bs, num_kv_heads=i + 1, head_size=8, dtype="float16"))
        for i, bs in enumerate(block_sizes)
    ])


def build(impl: str, cfg: KVCacheConfig, scheduler_block_size: int = BS,
          hash_block_size: int = BS, **kwargs: Any) -> Any:
    if impl == "spec":
        return spec.KVCacheManager(cfg, 64, scheduler_block_size, hash_block_size,
                                   profile="0.33.0", **kwargs)
    return v33.KVCacheManager(cfg, max_model_len=64, scheduler_block_size=scheduler_block_size,
                              hash_block_size=hash_block_size, **kwargs)


def request(rid: str, tokens: list[int], lookahead: int, **kwargs: Any) -> Request:
    hasher = v33.get_request_block_hasher(BS, sha256, lookahead)
    return Request(rid, tokens, block_hasher=hasher, **kwargs)


def mm(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(identifier=identifier, modality="image", data=None,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


# ---------------------------------------------------------------- the hasher


@pytest.mark.parametrize("lookahead", [1, 2, 3])
def test_a_block_hash_covers_its_lookahead_tokens(lookahead: int) -> None:
    tokens = list(range(100, 111))
    r = request("a", tokens, lookahead)
    # Only blocks whose L following tokens exist are hashed.
    assert len(r.block_hashes) == (len(tokens) - lookahead) // BS
    parent = kcu.NONE_HASH
    for i, block_hash in enumerate(r.block_hashes):
        end = (i + 1) * BS
        keys = (None, *tokens[end:end + lookahead])
        parent = sha256((parent, tuple(tokens[end - BS:end]), keys))
        assert block_hash == parent
    # Without lookahead the same tokens hash differently (the planted bug's tell).
    plain = Request("b", tokens, block_hasher=v33.get_request_block_hasher(BS, sha256))
    assert plain.block_hashes[0] != r.block_hashes[0]


def test_lookahead_window_keys_a_block_with_the_next_items() -> None:
    # An image starting inside block 0's lookahead keys block 0 too; the next block
    # still sees it (the multimodal index steps back).
    features = [mm("A", 5, 2), mm("B", 7, 1)]
    tokens = list(range(14))
    r = request("a", tokens, 2, mm_features=features, cache_salt="s",
                lora_request=LoRARequest("lora", 1, lora_path="/p"))
    lora, salt = ("lora", "lora", "/p"), ("cache_salt", "s")
    first = sha256((kcu.NONE_HASH, (0, 1, 2, 3), ((lora, ("mm", "A", 5), salt), 4, 5)))
    second = sha256((first, (4, 5, 6, 7), ((lora, ("mm", "A", 1), ("mm", "B", 3)), 8, 9)))
    third = sha256((second, (8, 9, 10, 11), ((lora,), 12, 13)))
    assert r.block_hashes == [first, second, third]
    # Hashing as tokens arrive gives the same hashes as hashing all at once.
    grown = request("g", tokens[:9], 2, mm_features=features, cache_salt="s",
                    lora_request=LoRARequest("lora", 1, lora_path="/p"))
    for token in tokens[9:]:
        grown.append_output_token_ids(token)
    assert grown.block_hashes == r.block_hashes
    # The spec hashes the request itself, to the same bytes.
    assert request_block_hashes(r, BS, sha256, kcu.NONE_HASH, True, True, 2) == r.block_hashes


def test_a_bool_lookahead_counts_as_one_and_bad_counts_are_refused() -> None:
    tokens = list(range(9))
    assert request("t", tokens, True).block_hashes == request("o", tokens, 1).block_hashes
    assert request("f", tokens, False).block_hashes == request("z", tokens, 0).block_hashes
    assert v33.KVCacheManager(full_config(), 64, BS, BS,
                              num_hash_lookahead_tokens=True).num_hash_lookahead_tokens == 1
    for bad in (-1, 1.0, None):
        with pytest.raises(ValueError, match="num_hash_lookahead_tokens"):
            v33.get_request_block_hasher(BS, sha256, bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="num_hash_lookahead_tokens"):
            build("spec", full_config(), num_hash_lookahead_tokens=bad)


@pytest.mark.parametrize("argument", ["num_hash_lookahead_tokens", "num_prefill_lookahead"])
def test_0_25_1_profile_refuses_lookahead_arguments(argument: str) -> None:
    # vLLM 0.25.1's manager has no such argument (switch lookahead_arguments).
    since = "0.33.0" if argument == "num_hash_lookahead_tokens" else "0.28.0"
    for make in (lambda **kw: KVCacheManager(full_config(), 64, BS, BS, **kw),
                 lambda **kw: spec.KVCacheManager(full_config(), 64, BS, BS, **kw)):
        with pytest.raises(ValueError, match=f"{argument}=2: this lookahead is vLLM {since}'s"):
            make(**{argument: 2})
        assert make(**{argument: 0}) is not None


@pytest.mark.parametrize("release", ["0.28.0", "0.32.0"])
def test_middle_profiles_take_prefill_lookahead_alone(release: str) -> None:
    # prefill_lookahead_argument: 0.28.0-0.32.0 take num_prefill_lookahead, not yet
    # lookahead hashing (lookahead_arguments, 0.33.0).
    for make in (lambda **kw: KVCacheManager(full_config(), 64, BS, BS, profile=release, **kw),
                 lambda **kw: spec.KVCacheManager(full_config(), 64, BS, BS, profile=release,
                                                  **kw)):
        assert make(num_prefill_lookahead=2) is not None
        with pytest.raises(ValueError, match=r"num_hash_lookahead_tokens=2: this lookahead is "
                                             r"vLLM 0\.33\.0's"):
            make(num_hash_lookahead_tokens=2)


def test_0_25_1_manager_hashes_and_reports_without_lookahead() -> None:
    m = KVCacheManager(full_config(), 64, BS, BS, enable_kv_cache_events=True)
    assert m.num_hash_lookahead_tokens == 0 and m.block_pool.num_hash_lookahead_tokens == 0
    r = Request("a", list(range(9)), block_hasher=kcu.get_request_block_hasher(BS, sha256))
    assert m.allocate_slots(r, 9) is not None
    (event,) = m.take_events()
    assert type(event) is BlockStored and not hasattr(event, "lookahead_token_ids")


# ---------------------------------------------------------------- events and caching


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lookahead", [1, 2])
def test_events_list_lookahead_tokens_and_rebuild_the_hashes(impl: str, lookahead: int) -> None:
    m = build(impl, full_config(), enable_kv_cache_events=True,
              num_hash_lookahead_tokens=lookahead)
    tokens = list(range(50, 50 + 3 * BS + lookahead - 1))
    r = request("a", tokens, lookahead, mm_features=[mm("A", 3, 3)])
    assert m.allocate_slots(r, len(tokens)) is not None
    (event,) = m.take_events()
    assert type(event).__name__ == "BlockStored"
    # Block 2 has only lookahead - 1 tokens after it: not hashed, so not cached.
    assert len(event.block_hashes) == 2 == len(r.block_hashes)
    assert event.lookahead_token_ids == [tokens[4:4 + lookahead], tokens[8:8 + lookahead]]
    # Untagged keys of each block's window (events keep 0.25.1's key shapes).
    first_keys = (("A", 3),)
    assert event.extra_keys == [first_keys, (("A", -1),)]
    parent = kcu.NONE_HASH
    pairs = zip(event.extra_keys, event.lookahead_token_ids, strict=True)
    for i, (keys, ahead) in enumerate(pairs):
        tagged = tuple(("mm", *k) for k in keys)
        parent = sha256((parent, tuple(event.token_ids[i * BS:(i + 1) * BS]), (tagged, *ahead)))
        assert kcu.maybe_convert_block_hash(parent) == event.block_hashes[i]
    # One more token makes block 2's lookahead exist: it is hashed and cached then.
    r.append_output_token_ids(7)
    r.num_computed_tokens = len(tokens)
    assert m.allocate_slots(r, 1) is not None
    (later,) = m.take_events()
    assert later.lookahead_token_ids == [([*tokens, 7])[12:12 + lookahead]]


@pytest.mark.parametrize("impl", IMPLS)
def test_partial_prompt_tail_entry_reports_its_lookahead(impl: str) -> None:
    # Groups of blocks of 4 and 8 over a hash block of 4, a 16-token prompt, L = 2:
    # hashes exist for 12 tokens, so the 8-block group caches one full block and the
    # prompt's last reachable hash boundary (12) as a partial entry of its second
    # block, its event with the lookahead tokens 12 and 13.
    m = build(impl, full_config(block_sizes=(BS, 2 * BS)), scheduler_block_size=2 * BS,
              enable_kv_cache_events=True, num_hash_lookahead_tokens=2)
    r = request("a", list(range(16)), 2)
    assert m.allocate_slots(r, 16) is not None
    events = [e for e in m.take_events() if e.group_idx == 1]
    assert [(e.token_ids, e.lookahead_token_ids) for e in events] == [
        (list(range(8)), [[8, 9]]),
        ([8, 9, 10, 11], [[12, 13]]),
    ]


@pytest.mark.parametrize("impl", IMPLS)
def test_mamba_state_cached_where_the_prompt_lookahead_exists(impl: str) -> None:
    # 10-token prompt, hash blocks of 4: with L = 2 the last boundary whose two
    # following tokens exist is 8 (10 - 2); with L = 3 it is 4 (10 - 3 = 7).
    assert kmath.mamba_prompt_tail_boundary(10, BS, False, 2) == 8
    assert kmath.mamba_prompt_tail_boundary(10, BS, False, 3) == 4
    assert pure.mamba_prompt_tail_boundary(10, BS, False, 3) == 4
    assert kmath.mamba_prompt_tail_boundary(10, BS, True, 3) == 4  # EAGLE: 8 less a block
    mamba = MambaSpec(block_size=BS, shapes=((1,),), dtypes=("float16",),
                      mamba_cache_mode="align")
    cfg = KVCacheConfig(24, [], [KVCacheGroupSpec(["m"], mamba)])
    keyed = {}
    for lookahead in (2, 3):
        m = build(impl, cfg, enable_kv_cache_events=True, num_hash_lookahead_tokens=lookahead)
        r = request("a", list(range(10)), lookahead)
        assert m.allocate_slots(r, 4) is not None
        r.num_computed_tokens = 4
        m.new_step_starts()
        assert m.allocate_slots(r, 4) is not None
        r.num_computed_tokens = 8
        blocks = getattr(m, "coordinator", m).single_type_managers[0].req_to_blocks["a"]
        state = blocks[1] if isinstance(blocks[1], int) else blocks[1].block_id
        m.take_events()
        m.evict_blocks({state})
        m.take_events()
        m.cache_blocks(r, 8)  # the boundary at 8 is re-keyed only where it is the tail's
        keyed[lookahead] = [type(e).__name__ for e in m.take_events()]
    assert keyed == {2: ["BlockStored"], 3: []}


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_lookahead_leaves_reprefilled_tokens_uncached(impl: str) -> None:
    cached = {}
    for prefill in (0, 1, 3, 6):
        m = build(impl, full_config(), num_prefill_lookahead=prefill)
        r = request("a", list(range(13)), 0)
        assert m.allocate_slots(r, 13) is not None
        cached[prefill] = getattr(m, "coordinator", m).single_type_managers[0].num_cached_block["a"]
    # 13 tokens less P - 1: 13, 13, 11, 8 tokens cached, in blocks of 4.
    assert cached == {0: 3, 1: 3, 3: 2, 6: 2}
    assert kmath.num_tokens_to_cache(13, 4, 4, True, 2) == pure.num_tokens_to_cache(13, 4, 4, True,
                                                                                    2) == 11
    assert kmath.num_tokens_to_cache(13, 4, 4, False, 2) == 12  # without EAGLE: aligned only


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_lookahead_needs_a_scheduler_block_that_holds_it(impl: str) -> None:
    with pytest.raises(ValueError, match="num_prefill_lookahead=5"):
        build(impl, full_config(), use_eagle=True, num_prefill_lookahead=5)
    # Without EAGLE or without caching nothing needs checking.
    build(impl, full_config(), num_prefill_lookahead=5)
    build(impl, full_config(), use_eagle=True, enable_caching=False, num_prefill_lookahead=5)
    with pytest.raises(ValueError, match="num_prefill_lookahead"):
        build(impl, full_config(), num_prefill_lookahead=-1)


# ---------------------------------------------------------------- resolve_block_hashes


def test_resolve_block_hashes_views_at_the_block_size() -> None:
    raw: list[Any] = [bytes([i]) for i in range(8)]
    assert resolve_block_hashes(raw, 2, 2) is raw
    assert resolve_block_hashes(raw, 2, 4, supports_fine_grained_hash_lookup=True,
                                alignment_tokens=2) is raw
    view = resolve_block_hashes(raw, 2, 4, supports_fine_grained_hash_lookup=True,
                                alignment_tokens=4)
    assert isinstance(view, BlockHashListWithBlockSize) and list(view) == raw[1::2]
    assert resolve_block_hashes(view, 2, 4) is view
    with pytest.raises(BlockHashViewError, match="block_size=8"):
        resolve_block_hashes(view, 2, 8)
    assert issubclass(BlockHashViewError, ValueError)
    assert issubclass(BlockHashViewError, AssertionError)


# ---------------------------------------------------------------- the kit and a planted bug


def test_lookahead_families_draw_both_lookaheads() -> None:
    drawn = set()
    assert set(LOOKAHEAD_FAMILIES) == {
        "full-lookahead", "full+swa-lookahead", "full+full-lookahead", "full+chunked-lookahead",
        "full+mamba-align-lookahead", "full+mamba-checkpoint-lookahead"}
    assert all(f.since == "0.33.0" for f in LOOKAHEAD_FAMILIES.values())
    for name, family in LOOKAHEAD_FAMILIES.items():
        for i in range(20):
            config = random_config(random.Random(family_seed(0, family_index(name), i)), family)
            drawn.add((config.num_hash_lookahead_tokens > 0, config.num_prefill_lookahead > 1))
            assert not (config.enable_caching and config.has_eagle
                        and config.num_prefill_lookahead > config.scheduler_block_size)
            if "mamba" in name:  # past the hash block vLLM 0.33.0 asserts (0.33.0 doubt 7)
                assert config.num_hash_lookahead_tokens <= config.hash_block_size
    assert drawn == {(False, False), (False, True), (True, False), (True, True)}


def test_spec_without_the_lookahead_tokens_in_its_hashes_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: the spec hashes the right blocks but leaves the lookahead tokens
    out of each hash; the lockstep against kvcache's 0.33.0 profile must notice."""
    original = spec_block_pool.request_block_hashes

    def without_lookahead_tokens(request: Any, block_size: int, hash_fn: Any, first: bytes,
                                 tagged: bool = False, by_window: bool = False,
                                 lookahead: int = 0) -> list[bytes]:
        count = len(original(request, block_size, hash_fn, first, tagged, by_window, lookahead))
        return original(request, block_size, hash_fn, first, tagged, by_window)[:count]

    family = FAMILIES["full-lookahead"]
    seeds = [family_seed(7, family_index(family.name), i) for i in range(6)]
    clean = [run_sequence(s, family, "kvcache-0.33", "spec-0.33", Stats()) for s in seeds]
    assert all(r.mismatch is None and r.cannot_build is None for r in clean)
    monkeypatch.setattr(spec_block_pool, "request_block_hashes", without_lookahead_tokens)
    planted = [run_sequence(s, family, "kvcache-0.33", "spec-0.33", Stats()) for s in seeds]
    assert any(r.mismatch is not None for r in planted)


def test_sliding_window_hit_search_reads_past_lookahead_hashes_as_vllm_does() -> None:
    # vLLM 0.33.0 looks a lone sliding-window (or Mamba) group's hit up to the lookup
    # length, past the fewer hashes lookahead leaves: IndexError, in kvcache too.
    cfg = KVCacheConfig(16, [], [KVCacheGroupSpec(["w"], SlidingWindowSpec(
        block_size=BS, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=BS))])
    m = build("kvcache", cfg, num_hash_lookahead_tokens=3)
    with pytest.raises(IndexError):
        m.get_computed_blocks(request("a", list(range(2 * BS + 1)), 3))
