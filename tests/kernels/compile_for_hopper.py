"""Compile every kernel for sm_90 (Hopper) with Triton's real compiler, no GPU needed.

The interpreter accepts code the GPU compiler rejects, so the kernel tests also
run this script (in a subprocess: in the tests' process ``TRITON_INTERPRET=1``
already turned every ``@triton.jit`` function, Triton's own included, into an
interpreted one). Triton's NVIDIA backend lowers to PTX and runs its bundled
ptxas to a cubin; nothing is launched.

Each variant lists a launch's runtime arguments; they are specialized as the
JIT would at that launch (an int equal to 1 becomes a constexpr, one divisible
by 16 gets a divisibility hint, pointers are 16-byte aligned), and the
meta-parameters are the launchers' own (``paged_attention.launch_meta``).

Run: ``TRITON_INTERPRET=0 python tests/kernels/compile_for_hopper.py``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_for_hopper.py needs TRITON_INTERPRET unset or 0")

import triton
from triton.backends.compiler import GPUTarget

from kvcache_kernels.kv_write import kv_write_kernel
from kvcache_kernels.paged_attention import launch_meta, paged_attention_kernel
from kvcache_kernels.slot_mapping import PAD_SLOT_ID, slot_mapping_kernel

TARGET = GPUTarget("cuda", 90, 32)
DTYPES = ["fp16", "bf16", "fp32"]


class Ptr:
    """A pointer argument of element type ``dtype`` (e.g. ``"bf16"``, ``"i32"``)."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


def compile_launch(fn: Any, args: dict[str, Any], meta: dict[str, int]) -> None:
    """Compile ``fn`` as a launch with runtime ``args`` and constexpr ``meta`` would."""
    meta = dict(meta)
    num_warps = meta.pop("num_warps", 4)
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = dict(meta)
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for index, name in enumerate(fn.arg_names):
        if name in meta:
            signature[name] = "constexpr"
            continue
        value = args[name]
        if isinstance(value, Ptr):
            signature[name] = "*" + value.dtype
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    missing = set(args) - set(fn.arg_names)
    assert not missing, f"{fn.__name__} has no arguments {missing}"
    start = time.perf_counter()
    source = triton.compiler.ASTSource(fn, signature, constexprs, attrs)
    compiled = triton.compile(source, target=TARGET, options={"num_warps": num_warps})
    assert compiled.asm.get("cubin"), f"{fn.__name__}: no cubin"
    ones = sorted(name for name, value in constexprs.items() if value == 1 and name not in meta)
    print(f"{fn.__name__} {meta} ones={ones}: {time.perf_counter() - start:.1f}s")


def paged_attention_launch(
    dtype: str,
    num_reqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    max_num_blocks: int,
    max_query_len: int,
    sliding_window: int,
) -> None:
    args = dict(
        query_ptr=Ptr(dtype),
        k_cache_ptr=Ptr(dtype),
        v_cache_ptr=Ptr(dtype),
        block_table_ptr=Ptr("i32"),
        query_start_loc_ptr=Ptr("i32"),
        seq_lens_ptr=Ptr("i32"),
        out_ptr=Ptr(dtype),
        num_reqs=num_reqs,
        num_queries_per_kv=num_q_heads // num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        sliding_window=sliding_window,
        sm_scale=head_size**-0.5,
        stride_query_tok=num_q_heads * head_size,
        stride_query_head=head_size,
        stride_k_cache_block=block_size * num_kv_heads * head_size,
        stride_k_cache_tok=num_kv_heads * head_size,
        stride_k_cache_head=head_size,
        stride_v_cache_block=block_size * num_kv_heads * head_size,
        stride_v_cache_tok=num_kv_heads * head_size,
        stride_v_cache_head=head_size,
        stride_block_table_req=max_num_blocks,
        stride_out_tok=num_q_heads * head_size,
        stride_out_head=head_size,
    )
    meta = launch_meta(num_reqs, num_q_heads, num_kv_heads, head_size, max_query_len)
    compile_launch(paged_attention_kernel, args, meta)


def kv_write_launch(dtype: str, num_kv_heads: int, head_size: int, block_size: int) -> None:
    token_stride = num_kv_heads * head_size
    args = dict(
        key_ptr=Ptr(dtype),
        value_ptr=Ptr(dtype),
        k_cache_ptr=Ptr(dtype),
        v_cache_ptr=Ptr(dtype),
        slot_mapping_ptr=Ptr("i64"),
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        stride_key_tok=3 * token_stride,  # sliced out of a fused qkv tensor
        stride_key_head=head_size,
        stride_value_tok=3 * token_stride,
        stride_value_head=head_size,
        stride_k_cache_block=2 * block_size * token_stride,  # K half of [blocks, 2, ...]
        stride_k_cache_tok=token_stride,
        stride_k_cache_head=head_size,
        stride_v_cache_block=2 * block_size * token_stride,
        stride_v_cache_tok=token_stride,
        stride_v_cache_head=head_size,
    )
    meta = dict(
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_size)
    )
    compile_launch(kv_write_kernel, args, meta)


def slot_mapping_launch(num_reqs: int, manager_block_size: int, kernel_block_size: int) -> None:
    args = dict(
        query_start_loc_ptr=Ptr("i32"),
        positions_ptr=Ptr("i64"),
        block_table_ptr=Ptr("i32"),
        slot_mapping_ptr=Ptr("i64"),
        num_reqs=num_reqs,
        num_tokens=256,
        max_num_blocks=128,
        manager_block_size=manager_block_size,
        kernel_block_size=kernel_block_size,
        stride_block_table_req=128,
    )
    compile_launch(slot_mapping_kernel, args, dict(PAD_ID=PAD_SLOT_ID, BLOCK_T=128))


def main() -> None:
    for dtype in DTYPES:
        # A decode batch (GQA 4), a prefill, odd test-sized shapes with a window,
        # and the all-ones corner (every int that can be 1 is, so it is a constexpr).
        paged_attention_launch(dtype, 64, 32, 8, 128, 16, 256, 1, 0)
        paged_attention_launch(dtype, 8, 32, 4, 128, 16, 256, 512, 0)
        paged_attention_launch(dtype, 3, 6, 2, 12, 5, 9, 20, 7)
        paged_attention_launch(dtype, 1, 1, 1, 16, 1, 40, 1, 1)
        kv_write_launch(dtype, 8, 128, 16)
        kv_write_launch(dtype, 1, 1, 1)
    slot_mapping_launch(64, 32, 16)
    slot_mapping_launch(1, 1, 1)
    print("all kernels compile for sm_90")


if __name__ == "__main__":
    main()
