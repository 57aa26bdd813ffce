"""``kernels.paged_attention`` against ``paged_attention_ref`` (float64), per-dtype tolerances.

Cache block 0 plays vLLM's null block: it is filled with NaN and sits in the
block table left of every sliding window, so any read of it shows up as NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given
from kernel_helpers import DEVICE, KERNEL_SETTINGS, TOLERANCES

from kvcache_kernels import paged_attention
from kvcache_kernels.reference import paged_attention_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@st.composite
def batches(draw: st.DrawFn) -> dict[str, Any]:
    """A mixed batch: decodes (query length 1), prefill chunks, whole prompts."""
    dtype = draw(st.sampled_from(DTYPES))
    block_size = draw(st.sampled_from([1, 2, 4, 5, 16]))
    num_kv_heads = draw(st.integers(1, 2))
    num_queries_per_kv = draw(st.sampled_from([1, 2, 3, 4]))
    head_size = draw(st.sampled_from([4, 8, 12, 32]))
    sliding_window = draw(st.one_of(st.none(), st.integers(1, 12)))
    block_n = draw(st.sampled_from([None, 1, 4, 16]))
    num_reqs = draw(st.integers(1, 3))
    seq_lens, query_lens = [], []
    for _ in range(num_reqs):
        seq_len = draw(st.integers(1, 40))
        kind = draw(st.sampled_from(["decode", "chunk", "prompt"]))
        query_len = {"decode": 1, "prompt": seq_len}.get(kind) or draw(st.integers(1, seq_len))
        seq_lens.append(seq_len)
        query_lens.append(min(query_len, 20))
    num_pad = draw(st.integers(0, 2))
    seed = draw(st.integers(0, 2**16))

    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(seq_lens) // block_size)
    # Each request gets distinct blocks 1.. (block 0 is the null block); blocks
    # wholly left of the request's first window hold the null block, as the
    # sliding-window manager leaves them.
    num_blocks = 1 + num_reqs * max_blocks
    block_table = (1 + torch.randperm(num_blocks - 1, generator=gen)).reshape(num_reqs, max_blocks)
    if sliding_window is not None:
        for req_idx, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
            first_visible = max(0, seq_len - query_len - sliding_window + 1)
            block_table[req_idx, : first_visible // block_size] = 0
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    k_cache[0] = float("nan")
    v_cache[0] = float("nan")
    num_tokens = sum(query_lens) + num_pad
    query = torch.randn((num_tokens, num_kv_heads * num_queries_per_kv, head_size), generator=gen)
    return dict(
        query=query.to(dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table.to(torch.int32),
        query_start_loc=torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        sliding_window=sliding_window,
        block_n=block_n,
    )


def check_against_reference(batch: dict[str, Any], **kwargs: Any) -> None:
    tensors: dict[str, Any] = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    options = {k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)}
    expected = paged_attention_ref(**tensors, sliding_window=options["sliding_window"])
    out = paged_attention(
        **{k: v.to(DEVICE) for k, v in tensors.items()},
        **options,
        **kwargs,
    )
    query = tensors["query"]
    assert out.shape == query.shape and out.dtype == query.dtype
    atol, rtol = TOLERANCES[query.dtype]
    torch.testing.assert_close(out.cpu().double(), expected, atol=atol, rtol=rtol)


@KERNEL_SETTINGS
@given(batches())
def test_paged_attention_matches_reference(batch: dict[str, Any]) -> None:
    check_against_reference(batch)


@KERNEL_SETTINGS
@given(batches(), st.integers(1, 64))
def test_paged_attention_any_max_query_len_hint(batch: dict[str, Any], hint: int) -> None:
    """``max_query_len`` only sizes the query blocks: any value gives the same answer."""
    check_against_reference(batch, max_query_len=hint)


def test_paged_attention_decode_worked_example() -> None:
    """One decode over two blocks in reverse order, checked by hand with torch."""
    k_cache = torch.randn(3, 2, 1, 4)
    v_cache = torch.randn(3, 2, 1, 4)
    query = torch.randn(1, 1, 4)
    block_table = torch.tensor([[2, 1]], dtype=torch.int32)  # positions 0-1 in block 2, 2-3 in 1
    keys = torch.cat([k_cache[2, :, 0], k_cache[1, :, 0]])
    values = torch.cat([v_cache[2, :, 0], v_cache[1, :, 0]])
    weights = torch.softmax(keys @ query[0, 0] / 2.0, dim=0)
    out = paged_attention(
        query.to(DEVICE),
        k_cache.to(DEVICE),
        v_cache.to(DEVICE),
        block_table.to(DEVICE),
        torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
        torch.tensor([4], dtype=torch.int32, device=DEVICE),
    )
    torch.testing.assert_close(out[0, 0].cpu(), weights @ values)


def test_paged_attention_int64_offsets() -> None:
    """K/V in blocks whose element offset exceeds 2**31 are read where torch puts them.

    The caches hold 2**31 + 2**16 elements each (4 GiB of float16), never
    initialised: only the pages of the blocks written below are backed.
    """
    block_size, num_kv_heads, head_size = 16, 1, 16
    num_blocks = (2**31 + 2**16) // (block_size * num_kv_heads * head_size)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache = torch.empty(shape, dtype=torch.float16, device=DEVICE)
    v_cache = torch.empty(shape, dtype=torch.float16, device=DEVICE)
    block_ids = [num_blocks - 1, 5, num_blocks - 3]  # positions 0-15, 16-31, 32-47
    assert max(block_ids) * block_size * num_kv_heads * head_size >= 2**31
    gen = torch.Generator().manual_seed(0)
    for block_id in block_ids:
        k_cache[block_id] = torch.randn(shape[1:], generator=gen).to(torch.float16).to(DEVICE)
        v_cache[block_id] = torch.randn(shape[1:], generator=gen).to(torch.float16).to(DEVICE)
    seq_len, query_len = 40, 3
    query = torch.randn((query_len, num_kv_heads, head_size), generator=gen).to(torch.float16)
    block_table = torch.tensor([block_ids], dtype=torch.int32)
    query_start_loc = torch.tensor([0, query_len], dtype=torch.int32)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    out = paged_attention(
        query.to(DEVICE),
        k_cache,
        v_cache,
        block_table.to(DEVICE),
        query_start_loc.to(DEVICE),
        seq_lens.to(DEVICE),
    )
    expected = paged_attention_ref(query, k_cache, v_cache, block_table, query_start_loc, seq_lens)
    atol, rtol = TOLERANCES[torch.float16]
    torch.testing.assert_close(out.cpu().double(), expected, atol=atol, rtol=rtol)


def _good_args() -> dict[str, Any]:
    return dict(
        query=torch.zeros(2, 4, 8),
        k_cache=torch.zeros(3, 4, 2, 8),
        v_cache=torch.zeros(3, 4, 2, 8),
        block_table=torch.ones(1, 2, dtype=torch.int32),
        query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
        seq_lens=torch.tensor([5], dtype=torch.int32),
    )


BAD_ARGUMENTS: list[tuple[Callable[[], dict[str, Any]], str]] = [
    (lambda: dict(query=torch.zeros(2, 32)), r"query must be \[num_tokens"),
    (lambda: dict(k_cache=torch.zeros(3, 4, 16)), r"k_cache must be \[num_blocks"),
    (lambda: dict(v_cache=torch.zeros(3, 4, 2, 4)), "v_cache shape"),
    (
        lambda: dict(k_cache=torch.zeros(3, 4, 2, 4), v_cache=torch.zeros(3, 4, 2, 4)),
        "k_cache head_size 4 != query head_size 8",
    ),
    (
        lambda: dict(k_cache=torch.zeros(3, 4, 3, 8), v_cache=torch.zeros(3, 4, 3, 8)),
        "num_q_heads=4 must be a multiple of num_kv_heads=3",
    ),
    (lambda: dict(query=torch.zeros(2, 4, 8, dtype=torch.float64)), "query dtype must be one"),
    (lambda: dict(v_cache=torch.zeros(3, 4, 2, 8, dtype=torch.float16)), "v_cache dtype"),
    (lambda: dict(query=torch.zeros(2, 4, 16)[:, :, ::2]), "query's head_size dim"),
    (
        lambda: dict(query_start_loc=torch.tensor([0, 2], dtype=torch.int64)),
        "query_start_loc must be a 1-D int32 tensor, got .* dtype=torch.int64",
    ),
    (lambda: dict(seq_lens=torch.tensor([5, 5], dtype=torch.int32)), r"seq_lens must be a \[1\]"),
    (lambda: dict(block_table=torch.ones(1, 2)), "block_table must be a 2-D int32"),
    (lambda: dict(block_table=torch.ones(0, 2, dtype=torch.int32)), "fewer than num_reqs=1"),
    (lambda: dict(sliding_window=0), "sliding_window must be None or a positive int, got 0"),
    (lambda: dict(block_n=3), "block_n must be a power of 2, got 3"),
    (lambda: dict(max_query_len=0), "max_query_len must be >= 1, got 0"),
]


@pytest.mark.parametrize(("make_bad", "match"), BAD_ARGUMENTS)
def test_paged_attention_rejects_bad_arguments(
    make_bad: Callable[[], dict[str, Any]], match: str
) -> None:
    with torch.device(DEVICE):
        args = _good_args() | make_bad()
    with pytest.raises(ValueError, match=match):
        paged_attention(**args)
