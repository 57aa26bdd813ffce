"""Worker-side sizing methods of kvcache's specs equal vLLM 0.25.1's.

vLLM's sizing helpers (``get_kv_cache_configs``, ``estimate_max_model_len``) call them
on whatever specs they are given, kvcache's included.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import kvcache.kv_cache_interface as K


def vllm_config(max_model_len: int = 1000, batched: int = 96, encoder: int = 300,
                mamba_mode: str = "none", dcp: int = 1, pcp: int = 1) -> Any:  # fmt: skip
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(
            max_num_batched_tokens=batched, max_num_encoder_input_tokens=encoder
        ),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp
        ),
        cache_config=SimpleNamespace(mamba_cache_mode=mamba_mode),
    )


def pairs(vllm: Any, torch: Any) -> list[tuple[Any, Any]]:
    attn = {"num_kv_heads": 2, "head_size": 8}
    return [
        (K.FullAttentionSpec(block_size=16, dtype="float16", **attn),
         vllm.FullAttentionSpec(block_size=16, dtype=torch.float16, **attn)),
        (K.SlidingWindowSpec(block_size=8, dtype="float16", sliding_window=40, **attn),
         vllm.SlidingWindowSpec(block_size=8, dtype=torch.float16, sliding_window=40, **attn)),
        (K.ChunkedLocalAttentionSpec(block_size=4, dtype="float32", attention_chunk_size=32,
                                     **attn),
         vllm.ChunkedLocalAttentionSpec(block_size=4, dtype=torch.float32,
                                        attention_chunk_size=32, **attn)),
        (K.CrossAttentionSpec(block_size=16, dtype="float16", **attn),
         vllm.CrossAttentionSpec(block_size=16, dtype=torch.float16, **attn)),
        (K.MambaSpec(block_size=32, shapes=((2, 3),), dtypes=("float32",),
                     num_speculative_blocks=1),
         vllm.MambaSpec(block_size=32, shapes=((2, 3),), dtypes=(torch.float32,),
                        num_speculative_blocks=1)),
    ]  # fmt: skip


def test_max_memory_usage_bytes_equals_vllms() -> None:
    vllm = pytest.importorskip("vllm.v1.kv_cache_interface")
    torch = pytest.importorskip("torch")
    configs = [vllm_config(), vllm_config(max_model_len=77, batched=5, encoder=17),
               *(vllm_config(mamba_mode=m) for m in ("all", "align")),
               vllm_config(dcp=2, pcp=3)]  # fmt: skip
    for ours, theirs in pairs(vllm, torch):
        for config in configs:
            if config.parallel_config.decode_context_parallel_size > 1 and isinstance(
                ours, K.SlidingWindowSpec
            ):
                with pytest.raises(ValueError, match="decode context parallel"):
                    ours.max_memory_usage_bytes(config)
                continue
            assert ours.max_memory_usage_bytes(config) == theirs.max_memory_usage_bytes(config)
        assert ours.storage_block_size == theirs.storage_block_size
        assert ours.copy_with_new_block_size(64).block_size == 64


def test_is_uniform_with_collection_equals_vllms() -> None:
    vllm = pytest.importorskip("vllm.v1.kv_cache_interface")
    torch = pytest.importorskip("torch")
    ours_all = [o for o, _ in pairs(vllm, torch)]
    theirs_all = [t for _, t in pairs(vllm, torch)]
    other_window = K.SlidingWindowSpec(block_size=8, num_kv_heads=2, head_size=8,
                                       dtype="float16", sliding_window=41)  # fmt: skip
    vllm_other_window = vllm.SlidingWindowSpec(block_size=8, num_kv_heads=2, head_size=8,
                                               dtype=torch.float16, sliding_window=41)  # fmt: skip
    for i, (ours, theirs) in enumerate(zip(ours_all, theirs_all, strict=True)):
        for j in range(len(ours_all)):
            mine = {"a": ours_all[i], "b": ours_all[j]}
            vllms = {"a": theirs_all[i], "b": theirs_all[j]}
            assert ours.is_uniform_with_collection(mine) == theirs.is_uniform_with_collection(
                vllms
            ), (type(ours).__name__, type(ours_all[j]).__name__)
        assert ours.is_uniform_with_collection({"w": other_window}) == (
            theirs.is_uniform_with_collection({"w": vllm_other_window})
        )
