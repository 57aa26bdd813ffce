"""Slot mapping: where each scheduled token's K/V goes in the paged cache.

A slot is a flat token index into a cache laid out as
``[num_kernel_blocks, kernel_block_size, ...]``. The block table holds the
KV-cache manager's block ids; when the attention kernel uses smaller blocks
than the manager (``kernel_block_size`` divides ``manager_block_size``), each
manager block is split into ``manager_block_size // kernel_block_size``
consecutive kernel blocks, as vLLM 0.25.1's ``BlockTable`` does::

    kernel_block_id = manager_block_id * blocks_per_manager_block
                      + (pos % manager_block_size) // kernel_block_size
    slot            = kernel_block_id * kernel_block_size + pos % kernel_block_size

Tokens past ``query_start_loc[num_reqs]`` (CUDA-graph padding) get slot -1,
which ``kv_write`` skips.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_block_table

PAD_SLOT_ID = -1


@triton.jit  # type: ignore[untyped-decorator]
def slot_mapping_kernel(  # type: ignore[no-untyped-def]
    # Pointers to tensors
    query_start_loc_ptr,  # [num_reqs + 1] int32
    positions_ptr,  # [num_tokens] int64
    block_table_ptr,  # [num_reqs, max_num_blocks] int32, manager block ids
    slot_mapping_ptr,  # [num_tokens] int64, output
    # Sizes
    num_reqs,
    num_tokens,
    max_num_blocks,
    manager_block_size,
    kernel_block_size,
    # Strides
    stride_block_table_req,
    # Meta-parameters
    PAD_ID: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens handled per loop iteration
):
    # One program per request; the last program pads the unscheduled tail.
    req_idx = tl.program_id(axis=0)
    if req_idx == num_reqs:
        num_actual_tokens = tl.load(query_start_loc_ptr + num_reqs)
        for start in range(num_actual_tokens, num_tokens, BLOCK_T):
            offs_t = start + tl.arange(0, BLOCK_T)
            tl.store(slot_mapping_ptr + offs_t, PAD_ID, mask=offs_t < num_tokens)
        return

    token_start = tl.load(query_start_loc_ptr + req_idx)
    token_end = tl.load(query_start_loc_ptr + req_idx + 1)
    blocks_per_manager_block = manager_block_size // kernel_block_size
    block_table_row_ptr = block_table_ptr + req_idx.to(tl.int64) * stride_block_table_req
    for start in range(token_start, token_end, BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        mask_t = offs_t < token_end
        pos = tl.load(positions_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
        manager_block_idx = pos // manager_block_size
        # NOTE: positions past the table would read the next row (vLLM does);
        # here they are masked and get the pad slot instead.
        mask_table = mask_t & (manager_block_idx < max_num_blocks)
        manager_block_id = tl.load(
            block_table_row_ptr + manager_block_idx, mask=mask_table, other=0
        ).to(tl.int64)
        kernel_block_id = (
            manager_block_id * blocks_per_manager_block
            + (pos % manager_block_size) // kernel_block_size
        )
        slot = kernel_block_id * kernel_block_size + pos % kernel_block_size
        slot = tl.where(mask_table, slot, PAD_ID)
        tl.store(slot_mapping_ptr + offs_t, slot, mask=mask_t)


def map_to_kernel_blocks(block_table: torch.Tensor, blocks_per_manager_block: int) -> torch.Tensor:
    """Split each manager block id into its ``blocks_per_manager_block`` kernel block ids.

    Args:
        block_table: ``[num_reqs, max_num_blocks]`` int32 manager block ids.
        blocks_per_manager_block: ``manager_block_size // kernel_block_size``.

    Returns:
        ``[num_reqs, max_num_blocks * blocks_per_manager_block]`` int32 kernel
        block ids, the table ``paged_attention`` reads for a kernel-block cache.
    """
    if blocks_per_manager_block < 1:
        raise ValueError(f"blocks_per_manager_block must be >= 1, got {blocks_per_manager_block}")
    if blocks_per_manager_block == 1:
        return block_table
    arange = torch.arange(
        blocks_per_manager_block, device=block_table.device, dtype=block_table.dtype
    )
    expanded = block_table[:, :, None] * blocks_per_manager_block + arange
    return expanded.reshape(block_table.shape[0], -1)


def slot_mapping(
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    manager_block_size: int,
    kernel_block_size: int | None = None,
) -> torch.Tensor:
    """Compute the cache slot of every token in a batch.

    Args:
        query_start_loc: ``[num_reqs + 1]`` int32; request ``i`` owns tokens
            ``query_start_loc[i]:query_start_loc[i + 1]``. Tokens from
            ``query_start_loc[-1]`` to ``num_tokens`` are padding.
        positions: ``[num_tokens]`` int64 position of each token in its request.
        block_table: ``[num_reqs, max_num_blocks]`` int32 manager block ids
            (row ``i`` is request ``i``); its last dim must be contiguous.
        manager_block_size: Tokens per manager block.
        kernel_block_size: Tokens per cache block; must divide
            ``manager_block_size`` (default: equal to it).

    Returns:
        ``[num_tokens]`` int64 slots; -1 for padding tokens.
    """
    if kernel_block_size is None:
        kernel_block_size = manager_block_size
    # (1) check the layout the kernel assumes
    if query_start_loc.dim() != 1 or query_start_loc.dtype != torch.int32:
        raise ValueError(
            "query_start_loc must be a 1-D int32 tensor, got "
            f"shape={tuple(query_start_loc.shape)} dtype={query_start_loc.dtype}"
        )
    if query_start_loc.shape[0] < 1:
        raise ValueError(
            "query_start_loc must have num_reqs + 1 >= 1 entries, got shape "
            f"{tuple(query_start_loc.shape)}"
        )
    if positions.dim() != 1 or positions.dtype != torch.int64:
        raise ValueError(
            "positions must be a 1-D int64 tensor, got "
            f"shape={tuple(positions.shape)} dtype={positions.dtype}"
        )
    num_reqs = query_start_loc.shape[0] - 1
    check_block_table(block_table, num_reqs)
    for name, tensor in (("query_start_loc", query_start_loc), ("positions", positions)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")
    if not isinstance(manager_block_size, int) or manager_block_size < 1:
        raise ValueError(f"manager_block_size must be a positive int, got {manager_block_size!r}")
    if (
        not isinstance(kernel_block_size, int)
        or kernel_block_size < 1
        or manager_block_size % kernel_block_size != 0
    ):
        raise ValueError(
            f"kernel_block_size must be a positive divisor of manager_block_size="
            f"{manager_block_size}, got {kernel_block_size!r}"
        )
    devices = {t.device for t in (query_start_loc, positions, block_table)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")

    # (2) allocate the output
    num_tokens = positions.shape[0]
    slots = torch.empty(num_tokens, dtype=torch.int64, device=positions.device)

    # (3) launch: one program per request, plus one for the padding tail
    slot_mapping_kernel[(num_reqs + 1,)](
        query_start_loc_ptr=query_start_loc,
        positions_ptr=positions,
        block_table_ptr=block_table,
        slot_mapping_ptr=slots,
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        max_num_blocks=block_table.shape[1],
        manager_block_size=manager_block_size,
        kernel_block_size=kernel_block_size,
        stride_block_table_req=block_table.stride(0),
        PAD_ID=PAD_SLOT_ID,
        BLOCK_T=128,
    )
    return slots
