"""Paged attention over a mixed batch of prefill chunks and decodes.

Request ``r`` owns query tokens ``query_start_loc[r]:query_start_loc[r + 1]``,
the last ``query_len`` of its ``seq_lens[r]`` tokens; their K/V are already in
the cache (``kv_write`` runs first). The query at position ``p`` attends,
causally, to positions ``max(0, p - sliding_window + 1) .. p``. No position
left of the window of the request's first query token is ever loaded: its
block may be the null block, whose content is garbage.

Each program handles ``BLOCK_M`` consecutive query tokens of one request and
one KV head; the rows of its tile are (token, query head) pairs, all the query
heads sharing that KV head (grouped-query attention). It walks the request's
keys in tiles of ``BLOCK_N`` positions, looking each position's block up in
the block table, and keeps an fp32 online softmax (running max ``m_i``,
running sum ``l_i``, accumulator ``acc``) as in the Triton fused-attention
tutorial. Scores use broadcast-multiply and ``tl.sum`` rather than ``tl.dot``,
so any ``head_size`` and group size compile.

Programs are numbered over "query blocks": request ``r``'s blocks start at
``query_start_loc[r] // BLOCK_M + r``, an upper bound that needs no host sync
(vLLM's unified attention kernel numbers its programs the same way); programs
past a request's last block return at once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .checks import check_block_table

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit  # type: ignore[untyped-decorator]
def paged_attention_kernel(  # type: ignore[no-untyped-def]
    # Pointers to tensors
    query_ptr,  # [num_tokens, num_q_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table_ptr,  # [num_reqs, max_num_blocks] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    out_ptr,  # [num_tokens, num_q_heads, head_size]
    # Sizes
    num_reqs,
    num_queries_per_kv,
    head_size,
    block_size,
    sliding_window,  # 0: no window
    sm_scale,
    # Strides
    stride_query_tok,
    stride_query_head,
    stride_k_cache_block,
    stride_k_cache_tok,
    stride_k_cache_head,
    stride_v_cache_block,
    stride_v_cache_tok,
    stride_v_cache_head,
    stride_block_table_req,
    stride_out_tok,
    stride_out_head,
    # Meta-parameters
    BLOCK_R: tl.constexpr,  # num_reqs rounded up to a power of 2
    BLOCK_M: tl.constexpr,  # query tokens per program
    BLOCK_G: tl.constexpr,  # num_queries_per_kv rounded up to a power of 2
    BLOCK_D: tl.constexpr,  # head_size rounded up to a power of 2
    BLOCK_N: tl.constexpr,  # key positions per tile
):
    q_block_idx = tl.program_id(axis=0)
    kv_head_idx = tl.program_id(axis=1)

    # Find this program's request: the last one whose first query block is <= ours.
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < num_reqs
    req_starts = tl.load(query_start_loc_ptr + offs_r, mask=mask_r, other=0)
    req_first_q_block = req_starts // BLOCK_M + offs_r
    req_idx = tl.sum(((req_first_q_block <= q_block_idx) & mask_r).to(tl.int32), axis=0) - 1
    query_start = tl.load(query_start_loc_ptr + req_idx)
    query_len = tl.load(query_start_loc_ptr + req_idx + 1) - query_start
    q_block_in_req = q_block_idx - (query_start // BLOCK_M + req_idx)
    if q_block_in_req * BLOCK_M >= query_len:
        return  # past the request's last query block

    # Rows are (token, query head) pairs: row = token_in_block * BLOCK_G + head_in_group.
    offs_row = tl.arange(0, BLOCK_M * BLOCK_G)
    token_in_req = q_block_in_req * BLOCK_M + offs_row // BLOCK_G
    head_in_group = offs_row % BLOCK_G
    offs_d = tl.arange(0, BLOCK_D)
    mask_row = (token_in_req < query_len) & (head_in_group < num_queries_per_kv)
    mask_d = offs_d < head_size
    mask_row_d = mask_row[:, None] & mask_d[None, :]

    token_idx = (query_start + token_in_req).to(tl.int64)
    q_head_idx = (kv_head_idx * num_queries_per_kv + head_in_group).to(tl.int64)

    # Positions: the queries are the last query_len of the request's seq_len tokens.
    seq_len = tl.load(seq_lens_ptr + req_idx)
    context_len = seq_len - query_len
    q_pos = context_len + token_in_req  # [BLOCK_M * BLOCK_G]
    kv_start = tl.where(sliding_window > 0, tl.maximum(q_pos - sliding_window + 1, 0), 0)
    first_q_pos = context_len + q_block_in_req * BLOCK_M
    last_q_pos = tl.minimum(first_q_pos + BLOCK_M, seq_len) - 1
    first_kv_pos = tl.where(sliding_window > 0, tl.maximum(first_q_pos - sliding_window + 1, 0), 0)

    # Load the query rows: [BLOCK_M * BLOCK_G, BLOCK_D], fp32 from here on.
    q_offs = (
        token_idx[:, None] * stride_query_tok
        + q_head_idx[:, None] * stride_query_head
        + offs_d[None, :]
    )
    q = tl.load(query_ptr + q_offs, mask=mask_row_d, other=0.0).to(tl.float32)

    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], dtype=tl.float32)

    block_table_row_ptr = block_table_ptr + req_idx.to(tl.int64) * stride_block_table_req
    kv_head_offset = kv_head_idx.to(tl.int64)
    for start_n in range((first_kv_pos // BLOCK_N) * BLOCK_N, last_q_pos + 1, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # Load only [first_kv_pos, last_q_pos]: left of it may be the null block,
        # right of it may not be written yet.
        mask_n = (offs_n >= first_kv_pos) & (offs_n <= last_q_pos)
        block_id = tl.load(block_table_row_ptr + offs_n // block_size, mask=mask_n, other=0).to(
            tl.int64
        )
        block_offset = (offs_n % block_size).to(tl.int64)
        mask_n_d = mask_n[:, None] & mask_d[None, :]
        k_offs = (
            block_id[:, None] * stride_k_cache_block
            + block_offset[:, None] * stride_k_cache_tok
            + kv_head_offset * stride_k_cache_head
            + offs_d[None, :]
        )
        k = tl.load(k_cache_ptr + k_offs, mask=mask_n_d, other=0.0).to(tl.float32)
        v_offs = (
            block_id[:, None] * stride_v_cache_block
            + block_offset[:, None] * stride_v_cache_tok
            + kv_head_offset * stride_v_cache_head
            + offs_d[None, :]
        )
        v = tl.load(v_cache_ptr + v_offs, mask=mask_n_d, other=0.0).to(tl.float32)

        # scores [rows, BLOCK_N] = q @ k^T, by broadcasting over head_size
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * sm_scale
        visible = (
            mask_row[:, None]
            & (offs_n[None, :] >= kv_start[:, None])
            & (offs_n[None, :] <= q_pos[:, None])
        )
        scores = tl.where(visible, scores, float("-inf"))

        # Online softmax. A row may see nothing in this tile (window not reached
        # yet, or a padding row): keep its max finite so exp gives 0, not NaN.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_offs = (
        token_idx[:, None] * stride_out_tok
        + q_head_idx[:, None] * stride_out_head
        + offs_d[None, :]
    )
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask_row_d)


# Up to this many fp32 values in the [rows, BLOCK_N, BLOCK_D] products of one
# tile: with 4 warps, ptxas fits them in registers on sm_90 without spilling.
TILE_PRODUCT_BUDGET = 4096


def launch_meta(
    num_reqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    max_query_len: int,
    block_n: int | None = None,
) -> dict[str, int]:
    """The meta-parameters ``paged_attention`` launches with.

    A tile has ``BLOCK_M * BLOCK_G`` rows, at most 16: a decode batch
    (``max_query_len == 1``) gets one token per program, a prefill up to
    ``16 // BLOCK_G`` tokens sharing each K/V load.
    """
    block_g = triton.next_power_of_2(num_q_heads // num_kv_heads)
    block_m = min(triton.next_power_of_2(max_query_len), max(1, 16 // block_g))
    block_d = triton.next_power_of_2(head_size)
    if block_n is None:
        block_n = min(64, max(1, TILE_PRODUCT_BUDGET // (block_m * block_g * block_d)))
    return dict(
        BLOCK_R=triton.next_power_of_2(num_reqs),
        BLOCK_M=block_m,
        BLOCK_G=block_g,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        num_warps=4,
    )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None = None,
    sm_scale: float | None = None,
    max_query_len: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Attention of each query token over its request's cached K/V.

    Args:
        query: ``[num_tokens, num_q_heads, head_size]``; tokens past
            ``query_start_loc[-1]`` are padding and get zeros.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, same dtype
            as ``query``; ``num_q_heads`` must be a multiple of ``num_kv_heads``.
        v_cache: Same shape and dtype as ``k_cache``.
        block_table: ``[num_reqs, max_num_blocks]`` int32 ids of ``k_cache``
            blocks (kernel blocks: see ``map_to_kernel_blocks``).
        query_start_loc: ``[num_reqs + 1]`` int32 cumulative query lengths.
        seq_lens: ``[num_reqs]`` int32 tokens per request including this
            step's queries (must be >= the request's query length).
        sliding_window: Attend to the last ``sliding_window`` positions only
            (None: all).
        sm_scale: Softmax scale (default ``head_size ** -0.5``).
        max_query_len: Longest query of the batch, which sizes the query
            blocks (1 for a pure decode batch); None reads it from
            ``query_start_loc``, a host sync on GPU.
        block_n: Key positions per tile, a power of 2 (default: as many as keep
            the ``[rows, block_n, head_size]`` fp32 product within
            ``TILE_PRODUCT_BUDGET``).

    Returns:
        ``[num_tokens, num_q_heads, head_size]`` in ``query``'s dtype.
    """
    # (1) check the layout the kernel assumes
    if query.dim() != 3:
        raise ValueError(
            f"query must be [num_tokens, num_q_heads, head_size], got shape {tuple(query.shape)}"
        )
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache must be [num_blocks, block_size, num_kv_heads, head_size], got shape "
            f"{tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    num_tokens, num_q_heads, head_size = query.shape
    _, block_size, num_kv_heads, cache_head_size = k_cache.shape
    if cache_head_size != head_size:
        raise ValueError(f"k_cache head_size {cache_head_size} != query head_size {head_size}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}"
        )
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"query dtype must be one of {SUPPORTED_DTYPES}, got {query.dtype}")
    for name, tensor in (("k_cache", k_cache), ("v_cache", v_cache)):
        if tensor.dtype != query.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} != query dtype {query.dtype}")
        if tensor.stride(-1) != 1 and head_size > 1:
            raise ValueError(
                f"{name}'s head_size dim must be contiguous, got strides {tensor.stride()}"
            )
    if query.stride(-1) != 1 and head_size > 1:
        raise ValueError(f"query's head_size dim must be contiguous, got strides {query.stride()}")
    if query_start_loc.dim() != 1 or query_start_loc.dtype != torch.int32:
        raise ValueError(
            "query_start_loc must be a 1-D int32 tensor, got "
            f"shape={tuple(query_start_loc.shape)} dtype={query_start_loc.dtype}"
        )
    num_reqs = query_start_loc.shape[0] - 1
    if num_reqs < 0:
        raise ValueError("query_start_loc must have num_reqs + 1 >= 1 entries, got 0")
    if seq_lens.shape != (num_reqs,) or seq_lens.dtype != torch.int32:
        raise ValueError(
            f"seq_lens must be a [{num_reqs}] int32 tensor, got "
            f"shape={tuple(seq_lens.shape)} dtype={seq_lens.dtype}"
        )
    check_block_table(block_table, num_reqs)
    for name, tensor in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
    if block_n is not None and (block_n < 1 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of 2, got {block_n!r}")
    if max_query_len is not None and max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len!r}")
    devices = {t.device for t in (query, k_cache, v_cache, block_table, query_start_loc, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")

    # (2) allocate the output; padding tokens keep their zeros
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_reqs == 0:
        return out
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_size)
    if max_query_len is None:
        max_query_len = max(1, int((query_start_loc[1:] - query_start_loc[:-1]).max()))

    # (3) launch: one program per (query block, KV head)
    meta = launch_meta(num_reqs, num_q_heads, num_kv_heads, head_size, max_query_len, block_n)
    num_q_blocks = num_tokens // meta["BLOCK_M"] + num_reqs  # enough for any split into requests
    paged_attention_kernel[(num_q_blocks, num_kv_heads)](
        query_ptr=query,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        block_table_ptr=block_table,
        query_start_loc_ptr=query_start_loc,
        seq_lens_ptr=seq_lens,
        out_ptr=out,
        num_reqs=num_reqs,
        num_queries_per_kv=num_q_heads // num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        sliding_window=0 if sliding_window is None else sliding_window,
        sm_scale=sm_scale,
        stride_query_tok=query.stride(0),
        stride_query_head=query.stride(1),
        stride_k_cache_block=k_cache.stride(0),
        stride_k_cache_tok=k_cache.stride(1),
        stride_k_cache_head=k_cache.stride(2),
        stride_v_cache_block=v_cache.stride(0),
        stride_v_cache_tok=v_cache.stride(1),
        stride_v_cache_head=v_cache.stride(2),
        stride_block_table_req=block_table.stride(0),
        stride_out_tok=out.stride(0),
        stride_out_head=out.stride(1),
        **meta,
    )
    return out
