"""``kernels.bench``'s decode batch is right, and it refuses to run without CUDA."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE

from kvcache_kernels.bench import DecodeBatch, DecodeShape, main


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bench_decode_batch_agrees_with_sdpa(dtype: torch.dtype) -> None:
    """The paged and contiguous copies hold the same K/V; paged attention matches SDPA."""
    shape = DecodeShape(
        batch=2, context_len=37, num_q_heads=4, num_kv_heads=2, head_size=16, block_size=8
    )
    batch = DecodeBatch(shape, dtype, DEVICE)
    assert batch.k_dense.shape == (2, 2, 37, 16)
    assert batch.kv_bytes == 2 * 2 * 2 * 37 * 16 * batch.k_dense.element_size()
    assert int(batch.block_table.min()) >= 1  # the null block is not used
    batch.check()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_bench_exits_with_a_message_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--skip-tests"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
