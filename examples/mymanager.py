"""A third-party KV-cache manager with one realistic bug, for the README's kit commands.

``MyManager`` is kvcache's manager except that ``free`` hands a request's blocks
back head first. vLLM frees them tail first, so that the free queue evicts a
cached chain from its end and a later request still hits the chain's head;
head first, the head goes first and the whole chain stops hitting. Nothing
crashes and every block is returned: only a comparison with the oracle (or
with vLLM) shows it, which is what ``python -m kvcache fuzz --impl
examples.mymanager:MyManager`` does.
"""

from __future__ import annotations

from typing import Any

import kvcache


class MyManager(kvcache.KVCacheManager):
    """kvcache's manager with ``free`` releasing blocks in allocation order (the bug)."""

    def free(self, request: Any) -> None:
        """Release ``request``'s blocks, head first (vLLM: tail first)."""
        self.block_pool.free_blocks(self.pop_blocks_for_free(request))
