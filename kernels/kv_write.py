"""KV write: store each new token's K and V at its slot in the paged caches.

``slot = block_id * block_size + offset_in_block`` (see ``slot_mapping``);
slot -1 marks a padding token and is skipped. The caches may be strided views
(e.g. the K half of a ``[num_blocks, 2, block_size, heads, head_size]``
tensor) as long as ``head_size`` is contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit  # type: ignore[untyped-decorator]
def kv_write_kernel(  # type: ignore[no-untyped-def]
    # Pointers to tensors
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_tokens] int64
    # Sizes
    num_kv_heads,
    head_size,
    block_size,
    # Strides
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_k_cache_block,
    stride_k_cache_tok,
    stride_k_cache_head,
    stride_v_cache_block,
    stride_v_cache_tok,
    stride_v_cache_head,
    # Meta-parameters
    BLOCK_H: tl.constexpr,  # num_kv_heads rounded up to a power of 2
    BLOCK_D: tl.constexpr,  # head_size rounded up to a power of 2
):
    # One program per token copies all of its heads.
    token_idx = tl.program_id(axis=0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token_idx)
    if slot < 0:
        return
    block_idx = slot // block_size
    block_offset = slot % block_size

    offs_h = tl.arange(0, BLOCK_H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_hd = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_size)

    key_offs = token_idx * stride_key_tok + offs_h[:, None] * stride_key_head + offs_d[None, :]
    value_offs = (
        token_idx * stride_value_tok + offs_h[:, None] * stride_value_head + offs_d[None, :]
    )
    k_cache_offs = (
        block_idx * stride_k_cache_block
        + block_offset * stride_k_cache_tok
        + offs_h[:, None] * stride_k_cache_head
        + offs_d[None, :]
    )
    v_cache_offs = (
        block_idx * stride_v_cache_block
        + block_offset * stride_v_cache_tok
        + offs_h[:, None] * stride_v_cache_head
        + offs_d[None, :]
    )
    key = tl.load(key_ptr + key_offs, mask=mask_hd)
    value = tl.load(value_ptr + value_offs, mask=mask_hd)
    tl.store(k_cache_ptr + k_cache_offs, key, mask=mask_hd)
    tl.store(v_cache_ptr + v_cache_offs, value, mask=mask_hd)


def kv_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` into ``k_cache``/``v_cache`` in place.

    Args:
        key: ``[num_tokens, num_kv_heads, head_size]``; heads and tokens may be
            strided, ``head_size`` must be contiguous.
        value: Same shape and dtype as ``key``.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, same
            dtype as ``key``; ``head_size`` contiguous.
        v_cache: Same shape and dtype as ``k_cache``.
        slot_mapping: ``[num_tokens]`` int64 slots; -1 skips the token. Slots
            must be below ``num_blocks * block_size`` (not checked: no host sync).
    """
    # (1) check the layout the kernel assumes
    if key.dim() != 3:
        raise ValueError(
            f"key must be [num_tokens, num_kv_heads, head_size], got shape {tuple(key.shape)}"
        )
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache must be [num_blocks, block_size, num_kv_heads, head_size], got shape "
            f"{tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    num_tokens, num_kv_heads, head_size = key.shape
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_size):
        raise ValueError(
            f"k_cache heads/head_size {tuple(k_cache.shape[2:])} != key's "
            f"{(num_kv_heads, head_size)}"
        )
    if key.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"key dtype must be one of {SUPPORTED_DTYPES}, got {key.dtype}")
    for name, tensor in (("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if tensor.dtype != key.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} != key dtype {key.dtype}")
    for name, tensor in (
        ("key", key),
        ("value", value),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
    ):
        if tensor.stride(-1) != 1 and tensor.shape[-1] > 1:
            raise ValueError(
                f"{name}'s head_size dim must be contiguous, got strides {tensor.stride()}"
            )
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be a [{num_tokens}] int64 tensor, got "
            f"shape={tuple(slot_mapping.shape)} dtype={slot_mapping.dtype}"
        )
    if not slot_mapping.is_contiguous():
        raise ValueError(f"slot_mapping must be contiguous, got strides {slot_mapping.stride()}")
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")

    # (2) nothing to allocate: the caches are written in place
    if num_tokens == 0:
        return

    # (3) launch: one program per token
    kv_write_kernel[(num_tokens,)](
        key_ptr=key,
        value_ptr=value,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        slot_mapping_ptr=slot_mapping,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=k_cache.shape[1],
        stride_key_tok=key.stride(0),
        stride_key_head=key.stride(1),
        stride_value_tok=value.stride(0),
        stride_value_head=value.stride(1),
        stride_k_cache_block=k_cache.stride(0),
        stride_k_cache_tok=k_cache.stride(1),
        stride_k_cache_head=k_cache.stride(2),
        stride_v_cache_block=v_cache.stride(0),
        stride_v_cache_tok=v_cache.stride(1),
        stride_v_cache_head=v_cache.stride(2),
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_size),
    )
