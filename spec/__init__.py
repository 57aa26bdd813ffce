"""The executable model (oracle) of vLLM 0.25.1's request-level KV-cache manager.

Plain lists, dicts and ints: a block is its id and block 0 is the null block.

The spec stands alone: it imports nothing from kvcache (or vLLM) and owns its
vocabulary (``spec/vocab.py``): block hashes, extra keys, pool keys, events, stats,
layer-spec kinds. It computes every request's block hashes itself and never reads
``request.block_hashes``. Its inputs, kvcache's or vLLM's objects alike, are read
as data, by attribute (``tests/spec_unit/test_spec_standalone.py`` enforces the
imports):

- config: ``num_blocks``, ``kv_cache_groups[g].kv_cache_spec`` / ``.is_eagle_group`` /
  ``.role`` (0.33.0, if present: ``"hisparse_source"`` or an enum of that value);
- layer spec: its class name (and its bases' names: ``vocab.is_a``), ``block_size``,
  ``sliding_window``, ``attention_chunk_size``, ``mamba_cache_mode``,
  ``num_speculative_blocks``, ``rswa_window``, ``sink_len``, ``blocks_per_request``,
  ``prefix_cacheable`` (0.33.0, if present), and ``==`` between specs;
- request: ``request_id``, ``all_token_ids``, ``num_tokens``, ``num_prompt_tokens``,
  ``num_computed_tokens``, ``num_preemptions``, ``status.name``,
  ``skip_reading_prefix_cache``, ``lora_request.lora_name`` / ``.adapter_id`` (and
  ``.lora_path`` under the 0.33.0 profile), ``num_in_flight_tokens`` (0.33.0, if present),
  ``cache_salt``, ``mm_features[i].identifier`` / ``.mm_position.offset`` /
  ``.length``, and ``prompt_embeds`` (a torch tensor, or absent / None).

Release differences (vLLM 0.25.1, the default, and 0.33.0) are named switches of
``spec/profile.py``, passed as ``KVCacheManager(..., profile="0.33.0")``.
"""

from .block_pool import BlockPool
from .kv_cache_manager import KVCacheBlocks, KVCacheManager
from .single_type_kv_cache_manager import (
    KINDS,
    KindRules,
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
    sink_manager,
)
from .vocab import NULL_BLOCK

__all__ = [
    "KINDS", "NULL_BLOCK", "BlockPool", "KVCacheBlocks", "KVCacheManager",
    "KindRules", "SingleTypeKVCacheManager", "get_manager_for_kv_cache_spec", "sink_manager",
]
