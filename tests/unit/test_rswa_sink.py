"""R-SWA and sink full attention: kvcache and spec against vLLM 0.25.1, below the
``KVCacheManager`` (the kit's conformance families drive R-SWA through it; no sink
group can be built through it, in vLLM either).

* Specs: page size, memory bound, event kind and window, uniformity and ``merge``
  (results and which inputs fail) equal vLLM's for the same fields.
* ``RSWAManager``: seeded walks of one request (allocate, then release the gap as
  decoding passes the window, with and without the prompt length), the same calls
  on vLLM's, kvcache's and spec's managers over their own pools: equal tables and
  free queues after every call.
* ``SinkFullAttentionManager``: constructed directly as vLLM constructs it (the
  sink blocks taken off the free queue, the shifted ``scheduler_block_size``), the
  same refusals of a bad ``sink_len``, the same ``TypeError`` when a coordinator
  builds one, then full attention on the smaller pool.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcache as K
import spec.pure
from kvcache import kv_cache_math
from kvcache.block_pool import BlockPool
from kvcache.kv_cache_interface import KVCacheSpecMergeError, KVCacheSpecValueError
from spec import single_type_kv_cache_manager as spec_managers
from spec.block_pool import BlockPool as SpecBlockPool
from spec.kv_cache_manager import KVCacheManager as SpecKVCacheManager

needs_vllm = pytest.mark.usefixtures("vllm_reference")

ATTN: dict[str, Any] = dict(num_kv_heads=2, head_size=8)


def _config(max_model_len: int = 64) -> Any:
    """The parts of a ``VllmConfig`` the memory bounds read."""
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=1, prefill_context_parallel_size=1
        ),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=32),
    )


def _pair(name: str, block_size: int = 4, **fields: Any) -> tuple[Any, Any]:
    """The spec ``name`` from kvcache and from vLLM, with the same fields."""
    import torch
    from vllm.v1 import kv_cache_interface as V

    ours = getattr(K, name)(block_size=block_size, dtype="float16", **ATTN, **fields)
    theirs = getattr(V, name)(block_size=block_size, dtype=torch.float16, **ATTN, **fields)
    return ours, theirs


# ---------------------------------------------------------------- specs


@needs_vllm
@pytest.mark.parametrize(
    "name, fields",
    [("RSWASpec", {"rswa_window": 8}), ("SinkFullAttentionSpec", {"sink_len": 8})],
)
def test_spec_sizes_kind_and_uniformity_match_vllm(name: str, fields: dict[str, Any]) -> None:
    from vllm.v1 import kv_cache_interface as V

    ours, theirs = _pair(name, **fields)
    assert ours.page_size_bytes == theirs.page_size_bytes
    assert ours.max_memory_usage_bytes(_config()) == theirs.max_memory_usage_bytes(_config())
    assert K.get_kv_cache_spec_kind(ours).value == V.get_kv_cache_spec_kind(theirs).value
    assert K.get_kv_cache_spec_sliding_window(ours) == V.get_kv_cache_spec_sliding_window(theirs)
    full = _pair("FullAttentionSpec")[0]
    swa = _pair("SlidingWindowSpec", sliding_window=4)[0]
    # Grouped with full attention, as vLLM's registry groups them.
    assert ours.is_uniform_with_collection({"a": ours, "b": full})
    assert not ours.is_uniform_with_collection({"a": ours, "b": swa})
    assert full.is_uniform_with_collection({"a": full, "b": ours})


def _merge(cls: Any, specs: list[Any]) -> Any:
    """``cls.merge(specs)``, or the exception class name."""
    try:
        return cls.merge(specs)
    except AssertionError:
        return "AssertionError"
    except (ValueError, AttributeError) as exc:
        return type(exc).__name__


@needs_vllm
def test_merge_matches_vllm() -> None:
    """Same merged fields, same failures (kvcache's merge error is an AssertionError)."""
    r8, v8 = _pair("RSWASpec", rswa_window=8)
    r4, v4 = _pair("RSWASpec", rswa_window=4)
    s8, w8 = _pair("SinkFullAttentionSpec", sink_len=8)
    s4, w4 = _pair("SinkFullAttentionSpec", sink_len=4)
    full, vfull = _pair("FullAttentionSpec")
    cases = [
        ("RSWASpec", [r8, r8], [v8, v8]),
        ("RSWASpec", [r8, r4], [v8, v4]),  # two windows
        ("RSWASpec", [r8, full], [v8, vfull]),  # not all R-SWA
        ("SinkFullAttentionSpec", [s8, s8], [w8, w8]),
        ("SinkFullAttentionSpec", [s8, s4], [w8, w4]),  # first sink_len wins
        ("SinkFullAttentionSpec", [s8, full], [w8, vfull]),  # a plain layer merges too
        ("SinkFullAttentionSpec", [full, s8], [vfull, w8]),  # first has no sink_len
    ]
    from vllm.v1 import kv_cache_interface as V

    for name, ours, theirs in cases:
        got, want = _merge(getattr(K, name), ours), _merge(getattr(V, name), theirs)
        if isinstance(want, str):
            assert got == want, (name, ours, got, want)
            continue
        assert type(got).__name__ == type(want).__name__
        for field in ("block_size", "num_kv_heads", "head_size", "head_size_v"):
            assert getattr(got, field) == getattr(want, field)
        for field in ("rswa_window", "sink_len"):
            assert getattr(got, field, None) == getattr(want, field, None)
    with pytest.raises(KVCacheSpecMergeError, match="rswa_window"):
        K.RSWASpec.merge([r8, r4])


def test_rswa_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rswa_window must be a positive int, got 0"):
        K.RSWASpec(block_size=4, dtype="float16", **ATTN, rswa_window=0)


# ---------------------------------------------------------------- RSWAManager walks


@settings(max_examples=300, deadline=None)
@given(
    blocks=st.lists(st.integers(0, 3), max_size=8),
    null=st.integers(0, 1),
    first=st.integers(0, 9),
    last=st.integers(-1, 10),
)
def test_gap_blocks_to_free_twins_agree(
    blocks: list[int], null: int, first: int, last: int
) -> None:
    """kvcache's gap scan against the spec's, input by input (proofs/manifest.py has
    no CrossHair pair for these four-argument twins)."""
    ours = kv_cache_math.gap_blocks_to_free(blocks, null, first, last)
    assert ours == spec.pure.gap_blocks_to_free(blocks, null, first, last)
    assert null not in blocks[ours[0] : ours[1]]
    assert ours[0] == ours[1] or first <= ours[0] < ours[1] == min(last, len(blocks))


def _vllm_side(num_blocks: int, block_size: int, window: int) -> tuple[Any, Any]:
    from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
    from vllm.v1.core.single_type_kv_cache_manager import RSWAManager

    _, spec = _pair("RSWASpec", block_size, rswa_window=window)
    pool = VllmBlockPool(
        num_gpu_blocks=num_blocks, enable_caching=False, hash_block_size=block_size
    )
    manager = RSWAManager(
        spec,
        block_pool=pool,
        enable_caching=False,
        kv_cache_group_id=0,
        scheduler_block_size=block_size,
    )
    return pool, manager


def _sides(num_blocks: int, block_size: int, window: int) -> dict[str, tuple[Any, Any]]:
    """(pool, manager) of vLLM, kvcache and spec for one R-SWA group."""
    ours, _ = _pair("RSWASpec", block_size, rswa_window=window)
    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=False, hash_block_size=block_size)
    spec_pool = SpecBlockPool(num_blocks, False, block_size)
    return {
        "vllm": _vllm_side(num_blocks, block_size, window),
        "kvcache": (pool, K.RSWAManager(ours, pool, False, 0, block_size)),
        "spec": (
            spec_pool,
            spec_managers.SingleTypeKVCacheManager(ours, spec_pool, False, 0, block_size),
        ),
    }


def _view(name: str, pool: Any, manager: Any) -> tuple[Any, ...]:
    """Tables and free queue as plain ids."""
    if name == "spec":
        return dict(manager.req_to_blocks), list(pool.free_queue)
    tables = {r: [b.block_id for b in bs] for r, bs in manager.req_to_blocks.items()}
    return tables, [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def _walk(seed: int) -> bool:
    """One seeded walk on the three managers; whether it released a gap."""
    rng = random.Random(seed)
    block_size, window = rng.choice([1, 2, 4]), rng.randint(1, 9)
    sides = _sides(80, block_size, window)
    prompt = rng.randint(1, 20)
    computed = 0
    freed = False
    for _ in range(rng.randint(3, 15)):
        step = rng.randint(1, 6)
        with_prompt = rng.random() < 0.85
        views = []
        for name, (pool, manager) in sides.items():
            manager.remove_skipped_blocks("r", computed, prompt if with_prompt else None)
            manager.allocate_new_blocks("r", computed + step, computed + step)
            views.append(_view(name, pool, manager))
        assert views[1] == views[0] and views[2] == views[0], (seed, computed, step)
        freed |= 0 in views[0][0]["r"]
        computed += step
    # An unknown request: nothing released, no table made.
    assert [m.remove_skipped_blocks("x", 40, 4) for _, m in sides.values()] == [None] * 3
    assert all("x" not in manager.req_to_blocks for _, manager in sides.values())
    for _, manager in sides.values():
        manager.free("r")
    views = [_view(name, *side) for name, side in sides.items()]
    assert views[1] == views[0] and views[2] == views[0]
    return freed


@needs_vllm
def test_rswa_manager_walks_match_vllm() -> None:
    freed = [_walk(seed) for seed in range(60)]
    assert sum(freed) >= 20, f"only {sum(freed)} of 60 walks released a gap"


# ---------------------------------------------------------------- SinkFullAttentionManager


def _sink_managers(sink_len: int, block_size: int = 4, num_blocks: int = 12) -> dict[str, Any]:
    from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
    from vllm.v1.core.single_type_kv_cache_manager import SinkFullAttentionManager

    ours, theirs = _pair("SinkFullAttentionSpec", block_size, sink_len=sink_len)
    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=block_size)
    vllm_pool = VllmBlockPool(
        num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=block_size
    )
    spec_pool = SpecBlockPool(num_blocks, True, block_size)
    out: dict[str, Any] = {}
    for name, make in (
        ("vllm", lambda: SinkFullAttentionManager(theirs, vllm_pool, True, 0)),
        ("kvcache", lambda: K.SinkFullAttentionManager(ours, pool, True, 0)),
        ("spec", lambda: spec_managers.sink_manager(ours, spec_pool, True, 0)),
    ):
        try:
            out[name] = make()
        except Exception as exc:
            out[name] = exc
    out["pools"] = {"vllm": vllm_pool, "kvcache": pool, "spec": spec_pool}
    return out


@needs_vllm
def test_sink_manager_takes_its_blocks_as_vllm() -> None:
    built = _sink_managers(sink_len=8)
    pools = built["pools"]
    sinks = {
        name: [b if isinstance(b, int) else b.block_id for b in built[name].sink_blocks]
        for name in ("vllm", "kvcache", "spec")
    }
    assert sinks["vllm"] == [1, 2]
    assert sinks["kvcache"] == sinks["vllm"] and sinks["spec"] == sinks["vllm"]
    assert [built[n].scheduler_block_size for n in ("vllm", "kvcache", "spec")] == [1, 1, 1]
    # Full attention on what is left: the same tables and free queues.
    for name in ("vllm", "kvcache", "spec"):
        manager = built[name]
        manager.allocate_new_blocks("a", 10, 10)
        manager.allocate_new_blocks("b", 5, 5)
        manager.free("a")
    views = [_view(n, pools[n], built[n]) for n in ("vllm", "kvcache", "spec")]
    assert views[1] == views[0] and views[2] == views[0]
    assert pools["kvcache"].get_num_free_blocks() == pools["vllm"].get_num_free_blocks()
    assert pools["kvcache"].get_usage() == pools["vllm"].get_usage()
    # The sinks count as used: the prefix cache can never be reset.
    for name in ("vllm", "kvcache", "spec"):
        built[name].free("b")
    assert [pools[n].reset_prefix_cache() for n in ("vllm", "kvcache", "spec")] == [False] * 3


@needs_vllm
@pytest.mark.parametrize("sink_len", [0, 6])
def test_sink_manager_refuses_a_bad_sink_len_as_vllm(sink_len: int) -> None:
    built = _sink_managers(sink_len=sink_len)
    assert isinstance(built["vllm"], AssertionError)
    assert isinstance(built["kvcache"], KVCacheSpecValueError)
    assert isinstance(built["kvcache"], AssertionError)
    assert f"sink_len={sink_len}" in str(built["kvcache"])
    assert isinstance(built["spec"], ValueError)
    assert built["pools"]["kvcache"].get_num_free_blocks() == 11  # nothing taken


def test_no_manager_can_hold_a_sink_group() -> None:
    """The coordinator passes ``scheduler_block_size``, which the sink manager's
    constructor lacks (vLLM 0.25.1 raises the same ``TypeError``)."""
    for lib, manager_cls in ((K, K.KVCacheManager), (K, SpecKVCacheManager)):
        sink = lib.SinkFullAttentionSpec(block_size=4, dtype="float16", **ATTN, sink_len=8)
        config = lib.KVCacheConfig(8, [], [lib.KVCacheGroupSpec(["s"], sink)])
        with pytest.raises(TypeError):  # the compiled build words its message otherwise
            manager_cls(config, max_model_len=16, scheduler_block_size=4, hash_block_size=4)


@needs_vllm
def test_sink_manager_pcp_argument_scales_the_block_as_vllm() -> None:
    """``pcp_world_size=2`` lands in the base class's ``dcp_world_size``: a block
    spans twice the tokens, so 8 sink tokens of 4-token blocks are one block."""
    from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
    from vllm.v1.core.single_type_kv_cache_manager import SinkFullAttentionManager

    ours, theirs = _pair("SinkFullAttentionSpec", 4, sink_len=8)
    vllm_manager = SinkFullAttentionManager(
        theirs, VllmBlockPool(12, True, 4), True, 0, pcp_world_size=2
    )
    managers = [
        K.SinkFullAttentionManager(ours, BlockPool(12, True, 4), True, 0, pcp_world_size=2),
        spec_managers.sink_manager(ours, SpecBlockPool(12, True, 4), True, 0, 1, 2),
    ]
    for manager in managers:
        assert manager.block_size == vllm_manager.block_size == 8
        assert manager.scheduler_block_size == vllm_manager.scheduler_block_size == 1
        assert len(manager.sink_blocks) == len(vllm_manager.sink_blocks) == 1
