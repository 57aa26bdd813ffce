"""Paged decode attention on CUDA: correctness first, then bandwidth ratios.

1. Runs the kernel tests compiled for the GPU (``pytest tests/kernels`` with
   ``TRITON_INTERPRET=0``); stops if they fail.
2. For each decode batch, times (in one run, with ``triton.testing.do_bench``)
   - ``paged_attention`` reading K/V scattered over a shuffled block table,
   - a device-to-device copy of the same K/V bytes (the bandwidth ceiling),
   - ``torch.nn.functional.scaled_dot_product_attention`` on contiguous K/V,
   after checking that ``paged_attention`` and SDPA agree, and prints ratios.

Usage: ``TRITON_INTERPRET=0 python -m kvcache_kernels.bench [--skip-tests] [--dtype bf16]``.
Exits with status 2 and a message when no CUDA device is visible, or when
``TRITON_INTERPRET`` made the kernels interpreted.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

from .paged_attention import paged_attention

REPO_ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class DecodeShape:
    batch: int
    context_len: int
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16


SHAPES = [
    DecodeShape(batch=8, context_len=4096),
    DecodeShape(batch=32, context_len=1024),
    DecodeShape(batch=32, context_len=4096),
    DecodeShape(batch=128, context_len=2048),
    DecodeShape(batch=64, context_len=4096, num_q_heads=64, num_kv_heads=8),
]


def run_tests() -> int:
    """The kernel tests, compiled for the GPU instead of interpreted."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    command = [sys.executable, "-m", "pytest", "tests/kernels", "-q"]
    print("$ TRITON_INTERPRET=0 " + " ".join(command[1:]), flush=True)
    return subprocess.run(command, cwd=REPO_ROOT, env=env).returncode


class DecodeBatch:
    """One decode step: a query token per request over ``context_len`` cached tokens,
    stored twice: paged (scattered over a shuffled block table) and contiguous."""

    def __init__(self, shape: DecodeShape, dtype: torch.dtype, device: torch.device) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        blocks_per_seq = -(-shape.context_len // shape.block_size)
        num_blocks = 1 + shape.batch * blocks_per_seq  # block 0: the null block
        cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_size)
        self.k_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
        self.v_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
        # Shuffled, as after hours of serving: a request's blocks are not adjacent.
        block_ids = 1 + torch.randperm(num_blocks - 1, generator=gen, device=device)
        self.block_table = block_ids.view(shape.batch, blocks_per_seq).to(torch.int32)
        self.query = torch.randn(
            (shape.batch, shape.num_q_heads, shape.head_size), generator=gen, device=device
        ).to(dtype)
        self.query_start_loc = torch.arange(shape.batch + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.full(
            (shape.batch,), shape.context_len, dtype=torch.int32, device=device
        )
        self.context_len = shape.context_len
        # Contiguous [batch, num_kv_heads, context_len, head_size] copies for SDPA.
        self.k_dense = self._gather(self.k_cache)
        self.v_dense = self._gather(self.v_cache)
        self.kv_bytes = 2 * self.k_dense.numel() * self.k_dense.element_size()

    def _gather(self, cache: torch.Tensor) -> torch.Tensor:
        flat = cache[self.block_table.long()].flatten(1, 2)[:, : self.context_len]
        return flat.permute(0, 2, 1, 3).contiguous()

    def run_paged(self) -> torch.Tensor:
        """``[batch, num_q_heads, head_size]``"""
        return paged_attention(
            self.query,
            self.k_cache,
            self.v_cache,
            self.block_table,
            self.query_start_loc,
            self.seq_lens,
            max_query_len=1,
        )

    def run_sdpa(self) -> torch.Tensor:
        """``[batch, num_q_heads, head_size]``"""
        q = self.query.unsqueeze(2)  # [batch, num_q_heads, 1, head_size]
        out = F.scaled_dot_product_attention(q, self.k_dense, self.v_dense, enable_gqa=True)
        return out.squeeze(2)

    def check(self) -> None:
        """Paged attention and SDPA agree (bf16-level tolerance)."""
        torch.testing.assert_close(
            self.run_paged().float(), self.run_sdpa().float(), atol=2e-2, rtol=2e-2
        )


def bench_shape(shape: DecodeShape, dtype_name: str) -> dict[str, float]:
    """Check, then time paged attention, a copy of the K/V bytes and SDPA (milliseconds)."""
    from triton.testing import do_bench

    device = torch.device("cuda")
    batch = DecodeBatch(shape, getattr(torch, dtype_name), device)
    batch.check()
    copy_src = torch.empty(batch.kv_bytes, dtype=torch.uint8, device=device)
    copy_dst = torch.empty_like(copy_src)
    times: dict[str, Any] = {
        "paged": do_bench(batch.run_paged),
        "copy": do_bench(lambda: copy_dst.copy_(copy_src)),
        "sdpa": do_bench(batch.run_sdpa),
    }
    return {name: float(ms) for name, ms in times.items()} | {"kv_bytes": float(batch.kv_bytes)}


def print_table(dtype_name: str, rows: list[tuple[DecodeShape, dict[str, float]]]) -> None:
    print(f"\npaged decode attention, {dtype_name}; one run, times from triton.testing.do_bench")
    print("  bandwidth = K/V bytes / time (the copy moves them twice: read + write)")
    header = (
        f"{'batch':>5} {'ctx':>5} {'heads q/kv':>10} | {'paged us':>9} {'copy us':>8} "
        f"{'sdpa us':>8} | {'paged GB/s':>10} {'copy GB/s':>9} | "
        f"{'paged/copy bw':>13} {'sdpa/paged time':>15}"
    )
    print(header)
    print("-" * len(header))
    for shape, t in rows:
        paged_bw = t["kv_bytes"] / (t["paged"] * 1e-3) / 1e9
        copy_bw = 2 * t["kv_bytes"] / (t["copy"] * 1e-3) / 1e9
        heads = f"{shape.num_q_heads}/{shape.num_kv_heads}"
        print(
            f"{shape.batch:>5} {shape.context_len:>5} {heads:>10} | "
            f"{t['paged'] * 1e3:>9.1f} {t['copy'] * 1e3:>8.1f} {t['sdpa'] * 1e3:>8.1f} | "
            f"{paged_bw:>10.0f} {copy_bw:>9.0f} | "
            f"{paged_bw / copy_bw:>13.2f} {t['sdpa'] / t['paged']:>15.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-tests", action="store_true", help="only benchmark")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print(
            "kernels.bench needs a CUDA GPU, and torch sees none "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False).\n"
            "On CPU the kernel tests run in the Triton interpreter: "
            "`python -m pytest tests/kernels`.",
            file=sys.stderr,
        )
        return 2
    if triton.knobs.runtime.interpret:
        print(
            "kernels.bench times compiled kernels: run it with TRITON_INTERPRET unset or 0",
            file=sys.stderr,
        )
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if not args.skip_tests:
        returncode = run_tests()
        if returncode != 0:
            print(f"kernel tests failed on CUDA (exit {returncode}); not benchmarking")
            return returncode
    dtype_name = DTYPES[args.dtype]
    rows = [(shape, bench_shape(shape, dtype_name)) for shape in SHAPES]
    print_table(dtype_name, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
