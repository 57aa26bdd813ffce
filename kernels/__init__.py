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
which transformers probes when it looks for Hugging Face's ``kernels`` package
(transformers 5.25 and later depend on it and import it at start-up). The one
name that is always this package is ``kvcache_kernels`` (installed, or editable
from a checkout). Imported as plain ``kernels`` while Hugging Face's ``kernels``
is installed elsewhere on ``sys.path``, this module hands the name over to that
package (``_yield_to_installed``), so a checkout never shadows it; without it,
``kernels`` is this package, and importing it must not fail either.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from typing import Any


def _yield_to_installed(name: str) -> bool:
    """Load the other top-level ``name`` package (Hugging Face's ``kernels``) in this
    module's place in ``sys.modules``, if one is found on ``sys.path`` outside this
    checkout; True when it was. Why: from a checkout's root the directory
    ``kernels/`` comes first on ``sys.path`` and would shadow it."""
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != checkout]
    found = importlib.machinery.PathFinder.find_spec(name, elsewhere)
    if found is None or found.loader is None:
        return False
    module = importlib.util.module_from_spec(found)
    sys.modules[name] = module  # the import statement returns what sys.modules holds
    try:
        found.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return True


__all__ = ["PAD_SLOT_ID", "kv_write", "map_to_kernel_blocks", "paged_attention", "slot_mapping"]

if __name__ == "kernels" and _yield_to_installed(__name__):
    pass  # Hugging Face's package answers to ``kernels`` now; nothing of ours loads
elif importlib.util.find_spec("triton") is not None:
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
