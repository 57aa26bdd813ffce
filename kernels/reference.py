"""References for the kernels: short per-request loops, no tricks.

``slot_mapping_ref`` replays vLLM 0.25.1's CPU formula (``BlockTable.
map_to_kernel_blocks`` followed by ``block_table[pos // block_size] *
block_size + pos % block_size``) in numpy and returns exact integers. The
attention references compute in float64.
"""

from __future__ import annotations

import math

import numpy as np
import torch

PAD_SLOT_ID = -1


def map_to_kernel_blocks_ref(
    manager_block_ids: np.ndarray, blocks_per_manager_block: int
) -> np.ndarray:
    """vLLM's ``BlockTable.map_to_kernel_blocks``: manager ids -> kernel block ids."""
    if blocks_per_manager_block == 1:
        return manager_block_ids
    arange = np.arange(blocks_per_manager_block).reshape(1, -1)
    kernel_block_ids = manager_block_ids.reshape(-1, 1) * blocks_per_manager_block + arange
    return kernel_block_ids.reshape(-1)


def slot_mapping_ref(
    query_start_loc: np.ndarray,
    positions: np.ndarray,
    block_table: np.ndarray,
    manager_block_size: int,
    kernel_block_size: int,
) -> np.ndarray:
    """Slots as vLLM's model runner computes them (int64; -1 for padding tokens)."""
    blocks_per_manager_block = manager_block_size // kernel_block_size
    num_reqs = len(query_start_loc) - 1
    slots = np.full(len(positions), PAD_SLOT_ID, dtype=np.int64)
    for req_idx in range(num_reqs):
        row = map_to_kernel_blocks_ref(
            block_table[req_idx].astype(np.int64), blocks_per_manager_block
        )
        for token_idx in range(int(query_start_loc[req_idx]), int(query_start_loc[req_idx + 1])):
            pos = int(positions[token_idx])
            slots[token_idx] = int(row[pos // kernel_block_size]) * kernel_block_size + (
                pos % kernel_block_size
            )
    return slots


def kv_write_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V at its slot, in place; slot -1 is skipped."""
    block_size = k_cache.shape[1]
    for token_idx, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[token_idx]
        v_cache[slot // block_size, slot % block_size] = value[token_idx]


def dense_attention_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    sliding_window: int | None = None,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Causal (optionally windowed) attention over contiguous K/V, in float64.

    Args:
        query: ``[num_queries, num_q_heads, head_size]``.
        key: ``[num_keys, num_kv_heads, head_size]``.
        value: ``[num_keys, num_kv_heads, head_size]``.
        query_positions: ``[num_queries]`` position of each query.
        key_positions: ``[num_keys]`` position of each key.
        sliding_window: A query at ``p`` sees keys in ``(p - sliding_window, p]``.
        sm_scale: Softmax scale (default ``head_size ** -0.5``).

    Returns:
        ``[num_queries, num_q_heads, head_size]`` float64.
    """
    num_q_heads, head_size = query.shape[1], query.shape[2]
    group = num_q_heads // key.shape[1]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_size)
    q = query.double()
    k = key.double().repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * sm_scale
    distance = query_positions[:, None] - key_positions[None, :]
    visible = distance >= 0
    if sliding_window is not None:
        visible &= distance < sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


def paged_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None = None,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Gather each request's K/V through its block table, then ``dense_attention_ref``.

    Only positions some query of the request can see are gathered, so
    out-of-window blocks (the null block) are never read. Padding tokens get 0.
    Returns float64.
    """
    block_size = k_cache.shape[1]
    device = k_cache.device
    out = torch.zeros(query.shape, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for req_idx, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[req_idx], starts[req_idx + 1]
        query_positions = torch.arange(seq_len - (end - start), seq_len)
        first = 0
        if sliding_window is not None and end > start:
            first = max(0, seq_len - (end - start) - sliding_window + 1)
        key_positions = torch.arange(first, seq_len)
        block_ids = block_table[req_idx].long().cpu()[key_positions // block_size]
        offsets = key_positions % block_size
        block_ids, offsets = block_ids.to(device), offsets.to(device)
        out[start:end] = dense_attention_ref(
            query[start:end].cpu(),
            k_cache[block_ids, offsets].cpu(),
            v_cache[block_ids, offsets].cpu(),
            query_positions,
            key_positions,
            sliding_window,
            sm_scale,
        )
    return out
