"""Argument checks shared by the launchers (no kernels here)."""

from __future__ import annotations

import torch


def check_block_table(block_table: torch.Tensor, num_reqs: int) -> None:
    """Check the ``[num_reqs, max_blocks]`` int32 block table a kernel reads row by row.

    Raises:
        ValueError: naming the bad shape, dtype or stride.
    """
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(
            "block_table must be a 2-D int32 tensor, got "
            f"shape={tuple(block_table.shape)} dtype={block_table.dtype}"
        )
    if block_table.shape[0] < num_reqs:
        raise ValueError(
            f"block_table has {block_table.shape[0]} rows, fewer than num_reqs={num_reqs}"
        )
    if block_table.numel() > 0 and block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(
            f"block_table's last dim must be contiguous, got strides {block_table.stride()}"
        )
