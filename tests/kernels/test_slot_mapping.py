"""``kernels.slot_mapping`` against vLLM 0.25.1's formula (``slot_mapping_ref``), exactly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given
from kernel_helpers import DEVICE, KERNEL_SETTINGS

from kvcache_kernels import map_to_kernel_blocks, slot_mapping
from kvcache_kernels.reference import map_to_kernel_blocks_ref, slot_mapping_ref

# (manager_block_size, kernel_block_size) pairs: equal, and split into 2/4/8/16 kernel blocks
BLOCK_SIZES = [(1, 1), (4, 4), (16, 16), (4, 2), (8, 2), (16, 4), (16, 1), (32, 16), (6, 3)]


@st.composite
def batches(draw: st.DrawFn) -> dict[str, Any]:
    """A batch as the model runner builds it: each request's new tokens sit at
    the end of its sequence; padding tokens (position 0) follow the last request."""
    manager_block_size, kernel_block_size = draw(st.sampled_from(BLOCK_SIZES))
    num_reqs = draw(st.integers(0, 4))
    max_num_blocks = draw(st.integers(1, 6))
    max_len = max_num_blocks * manager_block_size
    query_lens: list[int] = []
    positions: list[int] = []
    for _ in range(num_reqs):
        seq_len = draw(st.integers(1, max_len))
        query_len = draw(st.integers(0, min(seq_len, 12)))
        query_lens.append(query_len)
        positions.extend(range(seq_len - query_len, seq_len))
    num_pad = draw(st.integers(0, 3))
    positions.extend([0] * num_pad)
    # Block ids up to 2**31 - 1 (int32): their slots overflow int32 once multiplied.
    block_ids = st.one_of(st.integers(0, 64), st.integers(2**31 - 64, 2**31 - 1))
    table = draw(
        st.lists(
            st.lists(block_ids, min_size=max_num_blocks, max_size=max_num_blocks),
            min_size=num_reqs,
            max_size=num_reqs,
        )
    )
    # Extra table rows (rows of requests not scheduled this step) are never read.
    table.extend([[7] * max_num_blocks] * draw(st.integers(0, 2)))
    return dict(
        query_start_loc=np.cumsum([0, *query_lens]).astype(np.int32),
        positions=np.array(positions, dtype=np.int64),
        block_table=np.array(table, dtype=np.int64).reshape(-1, max_num_blocks).astype(np.int32),
        manager_block_size=manager_block_size,
        kernel_block_size=kernel_block_size,
    )


def run_kernel(batch: dict[str, Any]) -> np.ndarray:
    out = slot_mapping(
        torch.from_numpy(batch["query_start_loc"]).to(DEVICE),
        torch.from_numpy(batch["positions"]).to(DEVICE),
        torch.from_numpy(batch["block_table"]).to(DEVICE),
        batch["manager_block_size"],
        batch["kernel_block_size"],
    )
    assert out.dtype == torch.int64
    slots: np.ndarray = out.cpu().numpy()
    return slots


@KERNEL_SETTINGS
@given(batches())
def test_slot_mapping_matches_vllm_formula(batch: dict[str, Any]) -> None:
    expected = slot_mapping_ref(**batch)
    np.testing.assert_array_equal(run_kernel(batch), expected)


def test_slot_mapping_worked_example() -> None:
    """Two requests, manager blocks of 4 split into kernel blocks of 2."""
    batch: dict[str, Any] = dict(
        query_start_loc=np.array([0, 3, 4], dtype=np.int32),
        positions=np.array([5, 6, 7, 2, 0, 0], dtype=np.int64),  # two padding tokens
        block_table=np.array([[9, 3, 0], [5, 0, 0]], dtype=np.int32),
        manager_block_size=4,
        kernel_block_size=2,
    )
    # pos 5 -> manager block 3 -> kernel block 3*2 + (5 % 4) // 2 = 6 -> slot 6*2 + 1 = 13
    expected = [13, 14, 15, 22, -1, -1]
    assert run_kernel(batch).tolist() == expected
    assert slot_mapping_ref(**batch).tolist() == expected


def test_slot_mapping_int64_slots() -> None:
    """A block id near 2**31 times the block size only fits in int64."""
    block_id = 2**31 - 1
    batch: dict[str, Any] = dict(
        query_start_loc=np.array([0, 2], dtype=np.int32),
        positions=np.array([16, 17], dtype=np.int64),
        block_table=np.array([[0, block_id]], dtype=np.int32),
        manager_block_size=16,
        kernel_block_size=4,
    )
    assert run_kernel(batch).tolist() == [block_id * 16, block_id * 16 + 1]


def test_slot_mapping_position_past_the_table_gets_the_pad_slot() -> None:
    """An out-of-range position is not read from the next row (vLLM would): it gets -1."""
    batch: dict[str, Any] = dict(
        query_start_loc=np.array([0, 2, 3], dtype=np.int32),
        positions=np.array([7, 8, 0], dtype=np.int64),  # row 0 covers positions 0..7
        block_table=np.array([[4, 5], [6, 7]], dtype=np.int32),
        manager_block_size=4,
        kernel_block_size=4,
    )
    assert run_kernel(batch).tolist() == [23, -1, 24]


@pytest.mark.parametrize("blocks_per_manager_block", [1, 2, 4])
def test_map_to_kernel_blocks_matches_vllm(blocks_per_manager_block: int) -> None:
    table = np.array([[0, 1, 2], [7, 3, 0]], dtype=np.int32)
    expected = np.stack([map_to_kernel_blocks_ref(row, blocks_per_manager_block) for row in table])
    got = map_to_kernel_blocks(torch.from_numpy(table), blocks_per_manager_block)
    assert got.dtype == torch.int32
    np.testing.assert_array_equal(got.numpy(), expected)


def _good_args() -> dict[str, Any]:
    return dict(
        query_start_loc=torch.tensor([0, 2], dtype=torch.int32, device=DEVICE),
        positions=torch.tensor([0, 1], dtype=torch.int64, device=DEVICE),
        block_table=torch.ones(1, 4, dtype=torch.int32, device=DEVICE),
        manager_block_size=4,
        kernel_block_size=2,
    )


BAD_ARGUMENTS: list[tuple[str, Callable[[], object], str]] = [
    ("query_start_loc", lambda: torch.tensor([0, 2], dtype=torch.int64), "query_start_loc"),
    ("positions", lambda: torch.tensor([0, 1], dtype=torch.int32), "positions"),
    ("positions", lambda: torch.zeros(4, dtype=torch.int64)[::2], "positions must be contig"),
    ("block_table", lambda: torch.ones(1, 4, dtype=torch.int64), "block_table"),
    ("block_table", lambda: torch.ones(0, 4, dtype=torch.int32), "fewer than num_reqs=1"),
    ("block_table", lambda: torch.ones(1, 8, dtype=torch.int32)[:, ::2], "contiguous"),
    ("manager_block_size", lambda: 0, "manager_block_size must be a positive int, got 0"),
    ("kernel_block_size", lambda: 3, "kernel_block_size must be a positive divisor"),
]


@pytest.mark.parametrize(("name", "make_bad", "match"), BAD_ARGUMENTS)
def test_slot_mapping_rejects_bad_arguments(
    name: str, make_bad: Callable[[], object], match: str
) -> None:
    with torch.device(DEVICE):
        args = _good_args()
        args[name] = make_bad()
    with pytest.raises(ValueError, match=match):
        slot_mapping(**args)
