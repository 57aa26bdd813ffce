"""Triton kernels that consume the block tables kvcache hands out.

One kernel per module, each with its launcher:

* ``slot_mapping``    — token positions + block table -> cache slots;
* ``kv_write``        — store new tokens' K/V at their slots;
* ``paged_attention`` — attention of a mixed prefill/decode batch through the
  block table (causal, optional sliding window, grouped-query heads).

``reference`` holds the torch/numpy references the tests compare against.
Set ``TRITON_INTERPRET=1`` before importing this package to run on CPU.
kvcache never imports this package: it needs torch and triton.
"""

from .kv_write import kv_write
from .paged_attention import paged_attention
from .slot_mapping import PAD_SLOT_ID, map_to_kernel_blocks, slot_mapping

__all__ = ["PAD_SLOT_ID", "kv_write", "map_to_kernel_blocks", "paged_attention", "slot_mapping"]
