"""Triton kernels that consume the block tables kvcache hands out.

One kernel per module, each with its launcher:

* ``slot_mapping``    — token positions + block table -> cache slots;
* ``kv_write``        — store new tokens' K/V at their slots;
* ``paged_attention`` — attention of a mixed prefill/decode batch through the
  block table (causal, optional sliding window, grouped-query heads).

``reference`` holds the torch/numpy references the tests compare against.
Set ``TRITON_INTERPRET=1`` before importing the kernels to run on CPU.
kvcache never imports this package: it needs torch and triton.

Importing the package needs neither where triton is absent: the kernels are
then not loaded, and using one raises ``ModuleNotFoundError`` saying what to
install. From the repository root this directory is a top-level ``kernels``,
which transformers probes (and, finding no distribution for it, imports) when
it looks for Hugging Face's ``kernels`` package; that must not fail. Installed,
the package is ``kvcache_kernels``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

__all__ = ["PAD_SLOT_ID", "kv_write", "map_to_kernel_blocks", "paged_attention", "slot_mapping"]

if importlib.util.find_spec("triton") is not None:
    from .kv_write import kv_write
    from .paged_attention import paged_attention
    from .slot_mapping import PAD_SLOT_ID, map_to_kernel_blocks, slot_mapping
else:

    def __getattr__(name: str) -> Any:
        """Without triton the kernels are not loaded: say so for each exported name."""
        if name in __all__:
            raise ModuleNotFoundError(
                f"{__name__}.{name} needs triton (and torch): pip install 'kvcache[kernels]'"
            )
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
