"""KV-cache events, with vLLM 0.25.1's classes and field names.

The pool queues a ``BlockStored`` for each batch of newly cached blocks, a
``BlockRemoved`` for each evicted hash and ``AllBlocksCleared`` on a prefix
cache reset; ``KVCacheManager.take_events`` drains them. vLLM builds these as
msgspec structs; here they are plain dataclasses with equal fields, which
``dataclasses.asdict`` turns into the same mapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcache.kv_cache_utils import ExternalBlockHash

MEDIUM_GPU = "GPU"


@dataclass
class KVCacheEvent:
    """Base class of all KV-cache events."""


@dataclass
class BlockStored(KVCacheEvent):
    """Blocks became cached: one hash per block, chained after ``parent_block_hash``."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass
class BlockRemoved(KVCacheEvent):
    """Cached hashes were evicted from the prefix cache."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


@dataclass
class AllBlocksCleared(KVCacheEvent):
    """The prefix cache was reset."""
