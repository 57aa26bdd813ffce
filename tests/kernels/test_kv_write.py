"""``kernels.kv_write`` against ``kv_write_ref``: the caches must be bit-identical."""

from __future__ import annotations

from collections.abc import Callable

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given
from kernel_helpers import DEVICE, KERNEL_SETTINGS

from kvcache_kernels import kv_write
from kvcache_kernels.reference import kv_write_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def writes(draw: st.DrawFn) -> dict[str, object]:
    dtype = draw(st.sampled_from(DTYPES))
    num_blocks = draw(st.integers(1, 8))
    block_size = draw(st.sampled_from([1, 2, 3, 4, 16]))
    num_kv_heads = draw(st.integers(1, 3))
    head_size = draw(st.sampled_from([1, 4, 6, 8, 32]))
    num_slots = num_blocks * block_size
    # Distinct slots (two tokens never share one), with some -1 padding mixed in.
    slots = draw(st.lists(st.integers(0, num_slots - 1), unique=True, max_size=min(num_slots, 10)))
    slots += [-1] * draw(st.integers(0, 2))
    slots = draw(st.permutations(slots))
    seed = draw(st.integers(0, 2**16))
    # Layouts: plain, the K/V halves of one [num_blocks, 2, ...] tensor, and key/value
    # sliced out of a fused [num_tokens, 3 * heads, head_size] qkv tensor.
    strided_cache = draw(st.booleans())
    strided_kv = draw(st.booleans())

    gen = torch.Generator().manual_seed(seed)
    num_tokens = len(slots)
    shape = (num_tokens, num_kv_heads, head_size)
    if strided_kv:
        qkv = torch.randn((num_tokens, 3 * num_kv_heads, head_size), generator=gen).to(dtype)
        key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    else:
        key = torch.randn(shape, generator=gen).to(dtype)
        value = torch.randn(shape, generator=gen).to(dtype)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    if strided_cache:
        kv_cache = torch.randn((num_blocks, 2, *cache_shape[1:]), generator=gen).to(dtype)
        k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]
    else:
        k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
        v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    return dict(
        key=key,
        value=value,
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )


@KERNEL_SETTINGS
@given(writes())
def test_kv_write_matches_reference(case: dict[str, torch.Tensor]) -> None:
    expected_k, expected_v = case["k_cache"].clone(), case["v_cache"].clone()
    kv_write_ref(case["key"], case["value"], expected_k, expected_v, case["slot_mapping"])
    # Move to the device keeping the (possibly strided) layout of the caches.
    k_cache = case["k_cache"].to(DEVICE)
    v_cache = case["v_cache"].to(DEVICE)
    if case["k_cache"].stride() != k_cache.stride():
        base = torch.stack([case["k_cache"], case["v_cache"]], dim=1).to(DEVICE)
        k_cache, v_cache = base[:, 0], base[:, 1]
    kv_write(
        case["key"].to(DEVICE),
        case["value"].to(DEVICE),
        k_cache,
        v_cache,
        case["slot_mapping"].to(DEVICE),
    )
    # Bitwise equality: a copy must not round.
    assert torch.equal(k_cache.cpu().view(torch.uint8), expected_k.contiguous().view(torch.uint8))
    assert torch.equal(v_cache.cpu().view(torch.uint8), expected_v.contiguous().view(torch.uint8))


def test_kv_write_int64_offsets() -> None:
    """Slots whose element offset exceeds 2**31 land where torch's int64 indexing puts them.

    The cache has 2**31 + 2**16 elements (4 GiB of float16) but is never
    initialised: the OS only backs the few pages the test touches.
    """
    block_size, num_kv_heads, head_size = 16, 2, 8
    num_blocks = (2**31 + 2**16) // (block_size * num_kv_heads * head_size)
    k_cache = torch.empty(
        num_blocks, block_size, num_kv_heads, head_size, dtype=torch.float16, device=DEVICE
    )
    v_cache = torch.empty_like(k_cache)
    last_slot = num_blocks * block_size - 1
    slots = torch.tensor([last_slot, 3, last_slot - block_size - 5], dtype=torch.int64)
    assert int(slots.max()) * num_kv_heads * head_size >= 2**31
    key = torch.randn(3, num_kv_heads, head_size).to(torch.float16)
    value = torch.randn(3, num_kv_heads, head_size).to(torch.float16)
    kv_write(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    for token_idx, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        assert torch.equal(k_cache[block, offset].cpu(), key[token_idx])
        assert torch.equal(v_cache[block, offset].cpu(), value[token_idx])


def _good_args() -> dict[str, torch.Tensor]:
    return dict(
        key=torch.zeros(2, 1, 4),
        value=torch.zeros(2, 1, 4),
        k_cache=torch.zeros(3, 4, 1, 4),
        v_cache=torch.zeros(3, 4, 1, 4),
        slot_mapping=torch.tensor([0, 5]),
    )


BAD_ARGUMENTS: list[tuple[Callable[[], dict[str, torch.Tensor]], str]] = [
    (lambda: dict(key=torch.zeros(2, 4)), r"key must be \[num_tokens"),
    (lambda: dict(value=torch.zeros(2, 1, 5)), "value shape"),
    (lambda: dict(k_cache=torch.zeros(3, 4, 4)), r"k_cache must be \[num_blocks"),
    (lambda: dict(v_cache=torch.zeros(3, 4, 1, 5)), "v_cache shape"),
    (
        lambda: dict(k_cache=torch.zeros(3, 4, 2, 4), v_cache=torch.zeros(3, 4, 2, 4)),
        r"k_cache heads/head_size \(2, 4\) != key's \(1, 4\)",
    ),
    (
        lambda: dict(key=torch.zeros(2, 1, 4, dtype=torch.int32)),
        "key dtype must be one of .* got torch.int32",
    ),
    (lambda: dict(value=torch.zeros(2, 1, 4, dtype=torch.float16)), "value dtype"),
    (
        lambda: dict(key=torch.zeros(2, 1, 8)[:, :, ::2]),
        "key's head_size dim must be contiguous",
    ),
    (
        lambda: dict(slot_mapping=torch.tensor([0, 5], dtype=torch.int32)),
        r"slot_mapping must be a \[2\] int64 tensor, got .* dtype=torch.int32",
    ),
    (lambda: dict(slot_mapping=torch.tensor([0, 1, 5])), r"slot_mapping must be a \[2\]"),
]


@pytest.mark.parametrize(("make_bad", "match"), BAD_ARGUMENTS)
def test_kv_write_rejects_bad_arguments(
    make_bad: Callable[[], dict[str, torch.Tensor]], match: str
) -> None:
    with torch.device(DEVICE):
        args = _good_args() | make_bad()
    with pytest.raises(ValueError, match=match):
        kv_write(**args)
