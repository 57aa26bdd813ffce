"""The physical block pool: allocation, ref counts, the prefix-cache map, events.

Behaviour matches vLLM 0.25.1's ``BlockPool`` (see the class docstring for the
eviction order); the data structures differ: the prefix-cache map is split per
KV-cache group and keyed by the raw ``BlockHash``, so lookups never build
``hash + group id`` keys. The free queue is a linked list threaded through
the blocks, as in vLLM (``FreeKVCacheBlockQueue``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

from mypy_extensions import mypyc_attr

from kvcache.kv_cache_utils import (
    BlockHash,
    BlockHashList,
    BlockHashListWithBlockSize,
    BlockHashWithGroupId,
    ExternalBlockHash,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    first_mm_feature_ending_after,
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    lookahead_extra_keys,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
)
from kvcache.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockStored,
    KVCacheEvent,
    event_class,
    in_vocabulary,
    release_fields,
)
from kvcache.profile import Profile, resolve_profile

if TYPE_CHECKING:
    from kvcache.request import Request


# Two builtin bases: an ordinary (non-native) class in the compiled build.
@mypyc_attr(native_class=False)
class PartialBlockError(ValueError, AssertionError):
    """Bad arguments to ``BlockPool.cache_partial_block``.

    A ``ValueError`` (kvcache's error at a public boundary) that is also an
    ``AssertionError``, which vLLM 0.25.1 raises for the same arguments.
    """


@mypyc_attr(allow_interpreted_subclasses=True)
class BlockHashToBlockMap:
    """Prefix-cache map: pool key -> cached block(s), per KV-cache group.

    NOTE: identical blocks cached by different requests are not merged, because
    block tables are append-only: a request keeps the ids it was given. A hit
    returns the oldest block cached under the key.

    Layout: ``group_maps[g][hash]`` is always that oldest block, so a hit search
    is one C-level dict lookup per block; younger duplicates wait, oldest first,
    in ``extras[g][hash]`` and the next one is promoted when the oldest leaves.
    ``extras[g][hash]`` exists (possibly empty) from the second block cached under a
    hash until the hash has no block left: that is when vLLM's map holds a
    ``{block_id: block}`` dict rather than a bare block, which ``_cache`` shows.
    ``num_extras`` counts those hashes over all groups: while it is 0 (duplicates
    are rare) removing a block looks no duplicates map up.
    """

    def __init__(self) -> None:
        self.group_maps: dict[int, dict[BlockHash, KVCacheBlock]] = {}
        self.extras: dict[int, dict[BlockHash, dict[int, KVCacheBlock]]] = {}
        self.num_extras = 0

    def group_map(self, group_id: int) -> dict[BlockHash, KVCacheBlock]:
        """The (hash -> oldest block) map of one group, created on first use."""
        m = self.group_maps.get(group_id)
        if m is None:
            m = self.group_maps[group_id] = {}
            self.extras[group_id] = {}
        return m

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        """The oldest block cached under ``key``, or None."""
        m = self.group_maps.get(get_group_id(key))
        return None if m is None else m.get(get_block_hash(key))

    def contain(self, key: BlockHashWithGroupId, block_id: int) -> bool:
        """Whether ``key`` maps to block ``block_id``."""
        return any(b.block_id == block_id for b in self.get_blocks(key))

    def get_blocks(self, key: BlockHashWithGroupId) -> list[KVCacheBlock]:
        """All blocks cached under ``key``, oldest first."""
        group_id, h = get_group_id(key), get_block_hash(key)
        m = self.group_maps.get(group_id)
        first = None if m is None else m.get(h)
        if first is None:
            return []
        return [first, *self.extras[group_id].get(h, {}).values()]

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        """Add ``block`` under ``key`` (after any block already there)."""
        self.insert_raw(get_group_id(key), get_block_hash(key), block)

    def insert_raw(self, group_id: int, h: BlockHash, block: KVCacheBlock) -> None:
        """Add ``block`` under hash ``h`` of group ``group_id``."""
        self.insert_into(self.group_map(group_id), group_id, h, block)

    def insert_into(
        self, m: dict[BlockHash, KVCacheBlock], group_id: int, h: BlockHash, block: KVCacheBlock
    ) -> None:
        """``insert_raw`` into ``m``, group ``group_id``'s map (``group_map``), which a
        caller caching many blocks of one group looks up once."""
        # NOTE: one dict operation (hash, probe, store) where the key is new, the
        # common case; the size tells whether it was.
        num_hashes = len(m)
        m.setdefault(h, block)
        if len(m) == num_hashes:
            self.younger_blocks(group_id, h)[block.block_id] = block

    def younger_blocks(self, group_id: int, h: BlockHash) -> dict[int, KVCacheBlock]:
        """The duplicates map of hash ``h`` in group ``group_id`` (oldest first,
        by block id), created empty if the hash has none: the hash then holds vLLM's
        dict form until its last block leaves."""
        extras = self.extras[group_id]
        younger = extras.get(h)
        if younger is None:
            younger = extras[h] = {}
            self.num_extras += 1
        return younger

    def drop_younger_blocks(self, group_id: int, h: BlockHash) -> None:
        """Forget hash ``h``'s duplicates map in group ``group_id``, if it has one."""
        if self.extras[group_id].pop(h, None) is not None:
            self.num_extras -= 1

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Remove block ``block_id`` from ``key``; return it, or None if absent."""
        return self.pop_raw(get_group_id(key), get_block_hash(key), block_id)

    def pop_raw(self, group_id: int, h: BlockHash, block_id: int) -> KVCacheBlock | None:
        """Remove block ``block_id`` from hash ``h`` of group ``group_id``."""
        m = self.group_maps.get(group_id)
        if m is None:
            return None
        first = m.get(h)
        if first is None:
            return None
        # NOTE: duplicates are rare: while there are none, no lookup.
        younger = self.extras[group_id].get(h) if self.num_extras else None
        if first.block_id == block_id:
            if younger:
                # Promote the next oldest duplicate (an emptied ``younger`` stays: the
                # hash keeps vLLM's dict form until its last block leaves).
                next_id = next(iter(younger))
                m[h] = younger.pop(next_id)
            else:
                del m[h]
                if younger is not None:
                    self.drop_younger_blocks(group_id, h)
            return first
        if younger is None:
            return None
        return younger.pop(block_id, None)

    def items(self) -> list[tuple[BlockHashWithGroupId, list[KVCacheBlock]]]:
        """Every (pool key, blocks oldest first) pair. For tests and tools."""
        out = []
        for group_id, m in self.group_maps.items():
            extras = self.extras[group_id]
            for h, first in m.items():
                blocks = [first, *extras.get(h, {}).values()]
                out.append((make_block_hash_with_group_id(h, group_id), blocks))
        return out

    def __len__(self) -> int:
        return sum(len(m) for m in self.group_maps.values())

    @property
    def _cache(self) -> _VllmCacheView:
        """vLLM's private ``_cache`` dict, as a live view (vLLM's own tests read and edit it)."""
        return _VllmCacheView(self)


_CacheEntry = KVCacheBlock | dict[int, KVCacheBlock]


@mypyc_attr(allow_interpreted_subclasses=True)
class _VllmCacheView(MutableMapping[BlockHashWithGroupId, _CacheEntry]):
    """A :class:`BlockHashToBlockMap` seen as vLLM 0.25.1 lays it out.

    vLLM keeps one dict from pool key to a bare block, or to ``{block_id: block}``
    once a second block was cached under the key. Reads, writes and deletes
    translate to the per-group layout; ``copy.copy`` gives a plain dict snapshot.
    """

    def __init__(self, owner: BlockHashToBlockMap) -> None:
        self._owner = owner

    def __getitem__(self, key: BlockHashWithGroupId) -> _CacheEntry:
        group_id, h = get_group_id(key), get_block_hash(key)
        m = self._owner.group_maps.get(group_id)
        first = None if m is None else m.get(h)
        if first is None:
            raise KeyError(key)
        younger = self._owner.extras[group_id].get(h)
        if younger is None:
            return first
        return {first.block_id: first, **younger}

    def __setitem__(self, key: BlockHashWithGroupId, value: _CacheEntry) -> None:
        if key in self:
            del self[key]
        group_id, h = get_group_id(key), get_block_hash(key)
        blocks = list(value.values()) if isinstance(value, dict) else [value]
        for block in blocks:
            self._owner.insert_raw(group_id, h, block)
        if isinstance(value, dict) and blocks:
            self._owner.younger_blocks(group_id, h)

    def __delitem__(self, key: BlockHashWithGroupId) -> None:
        group_id, h = get_group_id(key), get_block_hash(key)
        m = self._owner.group_maps.get(group_id)
        if m is None or h not in m:
            raise KeyError(key)
        del m[h]
        self._owner.drop_younger_blocks(group_id, h)

    def __iter__(self) -> Iterator[BlockHashWithGroupId]:
        for group_id, m in self._owner.group_maps.items():
            for h in m:
                yield make_block_hash_with_group_id(h, group_id)

    def __len__(self) -> int:
        return len(self._owner)

    def __copy__(self) -> dict[BlockHashWithGroupId, _CacheEntry]:
        return dict(self.items())


@mypyc_attr(allow_interpreted_subclasses=True)
class BlockPool:
    """All physical blocks of the KV cache, and which of them are free or cached.

    Invariants: block 0 is the null block (a placeholder for skipped
    positions; never free, never cached, never counted). A non-null block is in
    the free queue iff its ref count is 0. A block has a hash iff it is in the
    prefix-cache map under that hash.

    Eviction order (the free queue, front reused first): blocks start in id
    order. Freed blocks without a hash go to the front (they can never be hit),
    freed blocks with a hash go to the back, so among cached blocks the least
    recently freed is evicted first. Reusing a cached block evicts its hash.

    Args:
        num_gpu_blocks: Number of blocks, including the null block.
        enable_caching: Whether blocks are cached for prefix hits.
        hash_block_size: Token granularity of ``Request.block_hashes``; a
            group's block size is a multiple of it.
        enable_kv_cache_events: Whether to queue KV events.
        metrics_collector: A ``KVCacheMetricsCollector`` (kvcache's or vLLM's:
            anything with ``on_block_allocated`` / ``on_block_accessed`` /
            ``on_block_evicted`` / ``reset``), told of allocations, hits and
            evictions exactly where vLLM 0.25.1 tells it; None for none.
        medium: The storage tier its events name (vLLM 0.33.0's argument; ``"GPU"``,
            or ``"CPU"`` for a HiSparse host pool).
        vllm_events: Keyword only, not in vLLM's signature: ``take_events`` returns
            vLLM's event structs (``kv_events.to_vllm``; needs vLLM) instead of
            kvcache's dataclasses. A manager sets it when it is built from vLLM's
            objects (``kv_events.built_from_vllm``), so vLLM's publisher can send
            its events; each pool keeps the vocabulary it was built with.
        profile: Keyword only: the release whose pool switches it follows
            (``kvcache.profile``; None: the default release). It reads
            ``mm_keys_by_window``, and the event fields of its release
            (``kv_events.release_fields``).

    vLLM 0.33.0's HiSparse additions (used only by HiSparse layouts): ``unpin_blocks``
    (a reference dropped while the block stays readable until the pool reuses it,
    with a watcher told then), ``share_event_queue`` (a host pool queueing its events
    into the device pool's queue) and ``free_blocks`` accepting a sharing pool's
    blocks (they go back to their own pool).
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        metrics_collector: Any = None,
        medium: str = MEDIUM_GPU,
        *,
        vllm_events: bool = False,
        profile: Profile | None = None,
    ) -> None:
        if not isinstance(num_gpu_blocks, int) or num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be a positive int, got {num_gpu_blocks!r}")
        if not isinstance(hash_block_size, int) or hash_block_size <= 0:
            raise ValueError(f"hash_block_size must be a positive int, got {hash_block_size!r}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Secondary pool keys per block id: partial-block entries registered on a
        # block that already has a (primary) hash; see cache_partial_block.
        self.cached_block_hashes_by_block: dict[int, set[BlockHashWithGroupId]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_kv_cache_events = enable_kv_cache_events
        self.vllm_events = vllm_events
        self.kv_event_queue: list[KVCacheEvent] = []
        self.metrics_collector: Any = metrics_collector
        # The release this pool and every manager built over it follow.
        profile = resolve_profile(profile)
        self.profile = profile
        self.mm_keys_by_window = profile.mm_keys_by_window
        # Tokens after each block its hash covers (vLLM 0.33.0's lookahead hashing; 0
        # in 0.25.1), set by the KVCacheManager: events report them and key the window.
        self.num_hash_lookahead_tokens = 0
        # The release's event classes: the fields later releases added (a
        # BlockStored's session_id is the request's).
        self.stored_fields = release_fields(profile, "BlockStored")
        self.removed_fields = release_fields(profile, "BlockRemoved")
        self.medium = medium
        # HiSparse (vLLM 0.33.0): block id -> what to tell when the pool hands out
        # that block again (blocks released with unpin_blocks), ...
        self._reuse_watchers: dict[int, Callable[[KVCacheBlock], None]] = {}
        # ... whether another pool queues its events into this pool's queue (then
        # take_events drains the queue in place), and those pools.
        self._queue_shared = False
        self._sharing_pools: list[BlockPool] = []

    # ------------------------------------------------------------ lookups

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: list[int]
    ) -> list[KVCacheBlock] | None:
        """The oldest cached block under ``block_hash`` in each group, or None if
        any group misses."""
        group_maps = self.cached_block_hash_to_block.group_maps
        found = []
        for group_id in kv_cache_group_ids:
            m = group_maps.get(group_id)
            block = None if m is None else m.get(block_hash)
            if block is None:
                return None
            found.append(block)
        return found

    def get_cached_block_map(self, group_id: int) -> dict[BlockHash, KVCacheBlock]:
        """The raw (hash -> oldest cached block) map of one group, for hit loops."""
        return self.cached_block_hash_to_block.group_map(group_id)

    # ------------------------------------------------------------ caching

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: list[bool] | None = None,
    ) -> None:
        """Cache ``blocks[num_cached_blocks:num_full_blocks]`` under the request's hashes.

        Null blocks and blocks whose ``block_mask`` entry is False are skipped.
        One ``BlockStored`` event covers the whole range (when events are on).

        Args:
            request: Owner of the blocks; its ``block_hashes`` name them.
            blocks: All blocks of the request in this group.
            num_cached_blocks: Blocks already cached.
            num_full_blocks: Blocks that are full and cached after this call.
            block_size: Tokens per block of this group.
            kv_cache_group_id: The group.
            block_mask: Optional filter aligned with the new blocks.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
        if block_mask is not None and len(block_mask) != len(new_full_blocks):
            raise ValueError(
                f"block_mask has {len(block_mask)} entries for {len(new_full_blocks)} blocks"
            )
        block_hashes: BlockHashList = request.block_hashes
        if block_size != self.hash_block_size:
            block_hashes = BlockHashListWithBlockSize(
                request.block_hashes, self.hash_block_size, block_size
            )
        if len(block_hashes) < num_full_blocks:
            raise ValueError(
                f"num_full_blocks={num_full_blocks} but request {request.request_id!r} has "
                f"only {len(block_hashes)} block hashes"
            )
        new_hashes = block_hashes[num_cached_blocks:num_full_blocks]
        cache = self.cached_block_hash_to_block
        group_map = cache.group_map(kv_cache_group_id)
        events = self.enable_kv_cache_events
        stored: list[ExternalBlockHash] = []
        for i, blk in enumerate(new_full_blocks):
            if blk.is_null or (block_mask is not None and not block_mask[i]):
                continue
            h = new_hashes[i]
            num_hash_tokens = (num_cached_blocks + i + 1) * block_size
            if blk._hash is not None:
                # NOTE: the one valid re-cache is promoting a block cached under a
                # shorter partial entry to its full-block hash: its old keys go.
                num_tokens = blk._hash_num_tokens
                if num_tokens == 0 or num_tokens >= num_hash_tokens:
                    raise ValueError(f"block {blk.block_id} is already cached")
                self._evict(blk)
            blk._hash = h
            blk._group_id = kv_cache_group_id
            blk._hash_num_tokens = num_hash_tokens
            cache.insert_into(group_map, kv_cache_group_id, h, blk)
            if events:
                stored.append(maybe_convert_block_hash(h))
        if events:
            self._emit_block_stored(
                request,
                blocks,
                num_cached_blocks,
                num_full_blocks,
                block_size,
                kv_cache_group_id,
                block_mask,
                block_hashes,
                stored,
            )

    def _emit_block_stored(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group_id: int,
        block_mask: list[bool] | None,
        block_hashes: BlockHashList,
        stored: list[ExternalBlockHash],
    ) -> None:
        parent = (
            None
            if num_cached_blocks == 0
            else maybe_convert_block_hash(block_hashes[num_cached_blocks - 1])
        )
        # One extra-keys entry per stored block, recomputed at this group's block size.
        extra_keys_list: list[tuple[Any, ...] | None] = []
        lookahead = self.num_hash_lookahead_tokens
        lookahead_ids: list[list[int]] = []
        mm_idx = 0
        for i in range(num_cached_blocks, num_full_blocks):
            if blocks[i].is_null or (
                block_mask is not None and not block_mask[i - num_cached_blocks]
            ):
                continue
            start = i * block_size
            end = start + block_size
            if lookahead:
                extra_keys, mm_idx = lookahead_extra_keys(request, start, end, lookahead, mm_idx)
                lookahead_ids.append(list(request.all_token_ids[end : end + lookahead]))
            else:
                extra_keys, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
            extra_keys_list.append(extra_keys)
        lora = request.lora_request
        self.kv_event_queue.append(
            self._block_stored(
                block_hashes=stored,
                parent_block_hash=parent,
                token_ids=list(
                    request.all_token_ids[
                        num_cached_blocks * block_size : num_full_blocks * block_size
                    ]
                ),
                block_size=block_size,
                lora_id=lora.adapter_id if lora else None,
                lora_name=lora.lora_name if lora else None,
                extra_keys=extra_keys_list or None,
                group_idx=group_id,
                lookahead_token_ids=lookahead_ids,
                session_id=getattr(request, "session_id", None),
            )
        )

    def _block_stored(
        self,
        block_hashes: list[ExternalBlockHash],
        parent_block_hash: ExternalBlockHash | None,
        token_ids: list[int],
        block_size: int,
        lora_id: int | None,
        lora_name: str | None,
        extra_keys: list[tuple[Any, ...] | None] | None,
        group_idx: int,
        lookahead_token_ids: list[list[int]],
        session_id: str | None = None,
    ) -> BlockStored:
        """A ``BlockStored`` of the pool's release (``stored_fields``): its
        ``session_id`` is the request's, its ``lookahead_token_ids`` the blocks'
        lookahead tokens under lookahead hashing (a release without that field gains it
        after its own then)."""
        fields = self.stored_fields
        extra: dict[str, Any] = {}
        if "session_id" in fields:
            extra["session_id"] = session_id
        if self.num_hash_lookahead_tokens:
            if "lookahead_token_ids" not in fields:
                fields = (*fields, "lookahead_token_ids")
            extra["lookahead_token_ids"] = lookahead_token_ids
        cls: type[BlockStored] = event_class("BlockStored", fields)
        return cls(
            block_hashes=block_hashes,
            parent_block_hash=parent_block_hash,
            token_ids=token_ids,
            block_size=block_size,
            lora_id=lora_id,
            medium=self.medium,
            lora_name=lora_name,
            extra_keys=extra_keys,
            group_idx=group_idx,
            **extra,
        )

    def emit_cached_block_events(
        self,
        request: Request,
        num_cached_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        """Queue one ``BlockStored`` for the request's first ``num_cached_blocks``
        blocks of ``block_size`` tokens, which are already cached (vLLM 0.33.0's
        "full" KV-event report mode tells subscribers of prefix hits too). Changes
        no block; nothing without events or hits.

        Raises:
            ValueError: ``num_cached_blocks`` is negative or past the request's hashes.
        """
        if not self.enable_kv_cache_events or num_cached_blocks == 0:
            return
        block_hashes: BlockHashList = request.block_hashes
        if block_size != self.hash_block_size:
            block_hashes = BlockHashListWithBlockSize(
                request.block_hashes, self.hash_block_size, block_size
            )
        if not 0 < num_cached_blocks <= len(block_hashes):
            raise ValueError(
                f"num_cached_blocks={num_cached_blocks}: request {request.request_id!r} "
                f"has {len(block_hashes)} block hashes of {block_size} tokens"
            )
        lookahead = self.num_hash_lookahead_tokens
        extra_keys_list: list[tuple[Any, ...] | None] = []
        lookahead_ids: list[list[int]] = []
        mm_idx = 0
        for i in range(num_cached_blocks):
            start, end = i * block_size, (i + 1) * block_size
            if lookahead:
                extra_keys, mm_idx = lookahead_extra_keys(request, start, end, lookahead, mm_idx)
                lookahead_ids.append(list(request.all_token_ids[end : end + lookahead]))
            else:
                extra_keys, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
            extra_keys_list.append(extra_keys)
        lora = request.lora_request
        self.kv_event_queue.append(
            self._block_stored(
                block_hashes=[
                    maybe_convert_block_hash(block_hashes[i]) for i in range(num_cached_blocks)
                ],
                parent_block_hash=None,  # hits start at the first block
                token_ids=list(request.all_token_ids[: num_cached_blocks * block_size]),
                block_size=block_size,
                lora_id=lora.adapter_id if lora else None,
                lora_name=lora.lora_name if lora else None,
                extra_keys=extra_keys_list,
                group_idx=kv_cache_group_id,
                lookahead_token_ids=lookahead_ids,
                session_id=getattr(request, "session_id", None),
            )
        )

    def cache_partial_block(
        self,
        request: Request,
        block: KVCacheBlock,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
    ) -> BlockHashWithGroupId | None:
        """Make ``block`` reachable from a prefix of ``num_tokens`` tokens that ends
        inside it (a partial-block prefix-cache entry), without a new block.

        The key is the request's ``hash_block_size`` chain hash ending at
        ``num_tokens`` (it covers the whole prefix). If the block has no hash it
        becomes the block's hash; if the block holds a shorter entry, that entry
        is replaced (``BlockRemoved``); otherwise the key is added as a secondary
        key in ``cached_block_hashes_by_block``. Eviction, reset and promotion by
        ``cache_full_blocks`` drop every key of the block. A new entry queues a
        ``BlockStored`` of the last ``hash_block_size`` tokens; registering an
        entry again changes nothing.

        Args:
            request: Owner of the prefix; its ``block_hashes`` name it.
            block: The block the prefix ends in.
            num_tokens: Prefix length: a multiple of ``hash_block_size``, not of
                ``block_size``, at most the request's hashed tokens.
            kv_cache_group_id: The group the entry belongs to.
            block_size: The group's block size (a multiple of ``hash_block_size``,
                larger than it).

        Returns:
            The pool key of the entry, or None for the null block.

        Raises:
            PartialBlockError: for sizes breaking the rules above (nothing changes).
        """
        if block.is_null:
            return None
        hash_block_size = self.hash_block_size
        if block_size <= hash_block_size or block_size % hash_block_size:
            raise PartialBlockError(
                f"block_size={block_size} must be a multiple of hash_block_size="
                f"{hash_block_size} larger than it"
            )
        num_hash_blocks = num_tokens // hash_block_size
        if (
            num_tokens % block_size == 0
            or num_tokens % hash_block_size
            or not 0 < num_hash_blocks <= len(request.block_hashes)
        ):
            raise PartialBlockError(
                f"num_tokens={num_tokens} must end inside a block of {block_size} tokens, "
                f"on a hash boundary ({hash_block_size}), within the request's "
                f"{len(request.block_hashes)} block hashes"
            )
        return self._register_prefix_entry(request, block, num_hash_blocks, kv_cache_group_id)

    def cache_state_entry(
        self,
        request: Request,
        block: KVCacheBlock,
        num_tokens: int,
        kv_cache_group_id: int,
        replace: bool = False,
    ) -> BlockHashWithGroupId | None:
        """Key a Mamba state ``block`` by the request's chain hash at ``num_tokens``
        (the ``mamba_prompt_tail_state`` switch: 0.33.0 re-keys the state at the
        prompt's last hash boundary, e.g. after ``evict_blocks`` dropped its key).
        Same entry rules and event as ``cache_partial_block``, but ``num_tokens``
        may also end on a block boundary. ``replace``: the block holds another state
        now (a prefill checkpoint), so every key it had is dropped first, once the
        arguments are known good (vLLM checks them before it removes anything).

        Returns:
            The pool key, or None for the null block.

        Raises:
            PartialBlockError: unless ``num_tokens`` is a positive multiple of the
                hash block size within the request's block hashes (nothing changes).
        """
        if block.is_null:
            return None
        num_hash_blocks = num_tokens // self.hash_block_size
        if num_tokens % self.hash_block_size or not 0 < num_hash_blocks <= len(
            request.block_hashes
        ):
            raise PartialBlockError(
                f"num_tokens={num_tokens} must be a positive multiple of hash_block_size="
                f"{self.hash_block_size} within the request's "
                f"{len(request.block_hashes)} block hashes"
            )
        if replace:
            self._evict(block)
        return self._register_prefix_entry(request, block, num_hash_blocks, kv_cache_group_id)

    def _register_prefix_entry(
        self,
        request: Request,
        block: KVCacheBlock,
        num_hash_blocks: int,
        kv_cache_group_id: int,
    ) -> BlockHashWithGroupId:
        """Make ``block`` reachable under the request's chain hash of its first
        ``num_hash_blocks`` hash blocks (see ``cache_partial_block``)."""
        hash_block_size = self.hash_block_size
        num_tokens = num_hash_blocks * hash_block_size
        h = request.block_hashes[num_hash_blocks - 1]
        key = make_block_hash_with_group_id(h, kv_cache_group_id)
        entry_tokens = num_hash_blocks * hash_block_size
        already_cached = (
            block._hash == h and block._group_id == kv_cache_group_id
        ) or self.cached_block_hash_to_block.contain(key, block.block_id)
        if already_cached:
            return key
        if block._hash is not None and (
            block._block_hash_num_tokens is not None
            and block._block_hash_num_tokens < entry_tokens
        ):
            self._evict(block)  # a longer entry replaces the shorter one
        if block._hash is None:
            block._hash = h
            block._group_id = kv_cache_group_id
            block._block_hash_num_tokens = entry_tokens
        else:
            self.cached_block_hashes_by_block.setdefault(block.block_id, set()).add(key)
        self.cached_block_hash_to_block.insert_raw(kv_cache_group_id, h, block)
        if self.enable_kv_cache_events:
            start = (num_hash_blocks - 1) * hash_block_size
            parent = request.block_hashes[num_hash_blocks - 2] if num_hash_blocks > 1 else None
            mm_start = -1 if start > 0 else 0
            if self.mm_keys_by_window and start > 0:
                mm_start = first_mm_feature_ending_after(request, start)
            lookahead = self.num_hash_lookahead_tokens
            extra_keys, _ = generate_block_hash_extra_keys(
                request, start, num_tokens + lookahead, mm_start
            )
            lora = request.lora_request
            self.kv_event_queue.append(
                self._block_stored(
                    block_hashes=[maybe_convert_block_hash(h)],
                    parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
                    token_ids=list(request.all_token_ids[start:num_tokens]),
                    block_size=num_tokens - start,
                    lora_id=lora.adapter_id if lora else None,
                    lora_name=lora.lora_name if lora else None,
                    extra_keys=[extra_keys],
                    group_idx=kv_cache_group_id,
                    lookahead_token_ids=[
                        list(request.all_token_ids[num_tokens : num_tokens + lookahead])
                    ],
                    session_id=getattr(request, "session_id", None),
                )
            )
        return key

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        """Move every prefix-cache key of ``src_block`` to ``dst_block`` (the
        ``partial_hit_copy_on_write`` switch: a running request keeps writing its
        state into ``src_block``, so the cache keeps a copy under the same keys).
        ``src_block``'s hash becomes ``dst_block``'s, with its token count; its other
        keys follow as further keys. No event: the entries stay cached.

        Raises:
            PartialBlockError: if ``dst_block`` is cached already (nothing changes).
        """
        if dst_block._hash is not None or dst_block.block_id in self.cached_block_hashes_by_block:
            raise PartialBlockError(
                f"move_block_hashes: destination block {dst_block.block_id} is cached already"
            )
        h = src_block._hash
        if h is None:
            return
        cache = self.cached_block_hash_to_block
        group_id, num_tokens = src_block._group_id, src_block._block_hash_num_tokens
        moved = []
        if cache.pop_raw(group_id, h, src_block.block_id) is not None:
            moved.append(make_block_hash_with_group_id(h, group_id))
        for key in self.cached_block_hashes_by_block.pop(src_block.block_id, ()):
            if cache.pop(key, src_block.block_id) is not None:
                moved.append(key)
        src_block.reset_hash()
        for key in moved:
            key_hash, key_group = get_block_hash(key), get_group_id(key)
            if dst_block._hash is None:
                dst_block._hash = key_hash
                dst_block._group_id = key_group
                dst_block._block_hash_num_tokens = num_tokens
            elif (dst_block._hash, dst_block._group_id) == (key_hash, key_group):
                continue
            else:
                self.cached_block_hashes_by_block.setdefault(dst_block.block_id, set()).add(key)
            cache.insert_raw(key_group, key_hash, dst_block)

    # ------------------------------------------------------------ allocation

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue.

        A reused block that was cached loses its hash (``BlockRemoved`` event).

        Raises:
            ValueError: if ``num_blocks`` exceeds the free blocks (or is negative).
        """
        if not 0 <= num_blocks <= self.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        if self._reuse_watchers:
            self._notify_reuse(blocks)
        collector = self.metrics_collector
        if collector is not None:
            # vLLM's order: with caching, each reused block is reported evicted
            # (hashed or not) before its allocation is.
            for block in blocks:
                if self.enable_caching:
                    collector.on_block_evicted(block)
                    if block._hash is not None:
                        self._evict(block)
                block.ref_cnt = 1
                collector.on_block_allocated(block)
        elif self.enable_caching:
            try:
                for block in blocks:
                    if block._hash is not None:
                        self._evict(block)
                    block.ref_cnt = 1
            except BaseException:
                # Put every taken block back where it was, so a failure leaks none.
                for block in blocks:
                    block.ref_cnt = 0
                self.free_block_queue.prepend_n(blocks)
                raise
        else:
            for block in blocks:
                block.ref_cnt = 1
        return blocks

    def _notify_reuse(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Tell the watcher of each unpinned block among ``blocks`` that its contents
        are gone (once: the watcher is dropped)."""
        for block in blocks:
            watcher = self._reuse_watchers.pop(block.block_id, None)
            if watcher is not None:
                watcher(block)

    def unpin_blocks(
        self, blocks: Iterable[KVCacheBlock], on_reuse: Callable[[KVCacheBlock], None]
    ) -> None:
        """Drop one reference from each block while its contents stay readable
        (vLLM 0.33.0, HiSparse): a block reaching 0 joins the back of the free
        queue (last to be reused, hashed or not) and counts as free; ``on_reuse(block)``
        is called when ``get_new_blocks`` hands it out or the prefix cache is reset.

        Raises:
            ValueError: for the null block or a block no one holds (nothing changes).
        """
        blocks = list(blocks)
        for block in blocks:
            if block.is_null or block.ref_cnt <= 0:
                raise ValueError(
                    f"unpin_blocks: block {block.block_id} (ref_cnt={block.ref_cnt}) is "
                    "the null block or not held"
                )
        released = []
        for block in blocks:
            block.ref_cnt -= 1
            self._reuse_watchers[block.block_id] = on_reuse
            if block.ref_cnt == 0:
                released.append(block)
        self.free_block_queue.append_n(released)

    def share_event_queue(self, owner: BlockPool) -> None:
        """Queue this pool's events into ``owner``'s queue from now on (a HiSparse
        host pool and the device pool: one ``take_events`` drains both), and let
        ``owner.free_blocks`` take this pool's blocks back to this pool."""
        self.kv_event_queue = owner.kv_event_queue
        self._queue_shared = owner._queue_shared = True
        owner._sharing_pools.append(self)

    def _evict(self, block: KVCacheBlock) -> bool:
        """Drop ``block``'s hash (and any secondary partial-block keys) from the
        prefix cache, one ``BlockRemoved`` per key; True if any key was mapped."""
        h = block._hash
        if h is None:
            return False
        group_id = block._group_id
        block.reset_hash()
        cache = self.cached_block_hash_to_block
        removed = cache.pop_raw(group_id, h, block.block_id) is not None
        if removed and self.enable_kv_cache_events:
            self.kv_event_queue.append(
                event_class("BlockRemoved", self.removed_fields)(
                    block_hashes=[maybe_convert_block_hash(h)],
                    medium=self.medium,
                    group_idx=group_id,
                )
            )
        if self.cached_block_hashes_by_block:
            for key in self.cached_block_hashes_by_block.pop(block.block_id, ()):
                if cache.pop(key, block.block_id) is None:
                    continue
                removed = True
                if self.enable_kv_cache_events:
                    self.kv_event_queue.append(
                        event_class("BlockRemoved", self.removed_fields)(
                            block_hashes=[maybe_convert_block_hash(get_block_hash(key))],
                            medium=self.medium,
                            group_idx=get_group_id(key),
                        )
                    )
        return removed

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """vLLM's name for ``_evict`` (its own tests call it), which also tells the
        metrics collector. A method, not a class attribute alias: the compiled
        build does not support aliases."""
        if self.metrics_collector is not None:
            self.metrics_collector.on_block_evicted(block)
        return self._evict(block)

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Add one reference to each block (a prefix hit), taking free ones out of
        the free queue. As in vLLM, the null block's count moves too."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                queue.remove(block)
            block.ref_cnt += 1
        if self.metrics_collector is not None:
            for block in blocks:
                self.metrics_collector.on_block_accessed(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in eviction-priority order.

        Blocks reaching 0 are queued: unhashed ones at the front (in the given
        order), hashed ones at the back. The null block may appear (windowed
        tables hold it); it is never queued.

        Raises:
            ValueError: if a block is not one of this pool's, or would be freed
                more times than it is held; nothing is freed then.
        """
        blocks = list(ordered_blocks)
        counts: dict[int, int] = {}
        pool_blocks = self.blocks
        for block in blocks:
            block_id = block.block_id
            if not (0 <= block_id < self.num_gpu_blocks and pool_blocks[block_id] is block):
                if self._sharing_pools:  # a HiSparse host pool's block: freed there
                    self._free_foreign_blocks(blocks)
                    return
                raise ValueError(
                    f"ordered_blocks holds {block!r}, which is not a block of this pool"
                )
            if block.is_null:
                continue
            n = counts[block_id] = counts.get(block_id, 0) + 1
            if n > block.ref_cnt:
                raise ValueError(
                    f"ordered_blocks frees block {block_id} {n} times but it is held "
                    f"{block.ref_cnt} times (double free)"
                )
        self.release_blocks(blocks)

    def _free_foreign_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """``free_blocks`` of a list mixing this pool's blocks and those of pools that
        share its event queue (vLLM 0.33.0 frees each block into its own pool): each
        pool frees its own, in the given order.

        Raises:
            ValueError: if a block belongs to none of them (nothing is freed then).
        """
        pools: list[BlockPool] = [self, *self._sharing_pools]
        parts: list[list[KVCacheBlock]] = [[] for _ in pools]
        for block in blocks:
            for i, pool in enumerate(pools):
                block_id = block.block_id
                if 0 <= block_id < pool.num_gpu_blocks and pool.blocks[block_id] is block:
                    parts[i].append(block)
                    break
            else:
                raise ValueError(
                    f"ordered_blocks holds {block!r}, which is not a block of this pool"
                )
        for pool, part in zip(pools, parts, strict=True):
            if part:
                pool.free_blocks(part)

    def release_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """``free_blocks`` without the argument checks, for the managers' own
        (always valid) releases on the hot path."""
        unhashed = []
        hashed = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                if block._hash is None:
                    unhashed.append(block)
                else:
                    hashed.append(block)
        queue = self.free_block_queue
        if hashed:
            queue.append_n(hashed)
        if unhashed:
            queue.prepend_n(unhashed)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop the given blocks' hashes from the prefix cache (blocks in use stay
        allocated; only future hits are prevented).

        Raises:
            ValueError: if an id is not a block of this pool (checked before any
                eviction, so a bad call changes nothing).
        """
        ids = list(block_ids)
        for block_id in ids:
            if not isinstance(block_id, int) or not 0 <= block_id < self.num_gpu_blocks:
                raise ValueError(
                    f"block_ids contains {block_id!r}, not a block id in [0, {self.num_gpu_blocks})"
                )
        for block_id in ids:
            self._maybe_evict_cached_block(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, if no block is in use.

        Returns:
            True on success; False (and no change) while any non-null block is held.
        """
        if self.num_gpu_blocks - self.free_block_queue.num_free_blocks != 1:
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_block_hashes_by_block.clear()
        if self._reuse_watchers:  # unpinned contents are dropped with the cache
            self._notify_reuse([self.blocks[i] for i in list(self._reuse_watchers)])
        for block in self.blocks:
            block.reset_hash()
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # ------------------------------------------------------------ accounting

    def get_num_free_blocks(self) -> int:
        """Number of blocks in the free queue (cached-but-free blocks included)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of non-null blocks in use, in [0, 1]."""
        total = self.num_gpu_blocks - 1
        if not total:
            return 0
        return 1.0 - self.free_block_queue.num_free_blocks / total

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the queued events ([] when events are off)."""
        if not self.enable_kv_cache_events:
            return []
        if self._queue_shared:  # the queue object is shared: drain it in place
            events = list(self.kv_event_queue)
            self.kv_event_queue.clear()
        else:
            events, self.kv_event_queue = self.kv_event_queue, []
        return in_vocabulary(events, self.vllm_events)

    def check_invariants(self) -> None:
        """Assert the class invariants (O(pool size); for tests and self-checks)."""
        queue = self.free_block_queue
        free: list[KVCacheBlock] = []
        prev, block = queue.fake_free_list_head, queue.fake_free_list_head.next_free_block
        while block is not queue.fake_free_list_tail:
            assert block is not None, "free queue list is cut"
            assert block.prev_free_block is prev, f"block {block.block_id}: broken back link"
            assert len(free) < self.num_gpu_blocks, "free queue list has a cycle"
            free.append(block)
            prev, block = block, block.next_free_block
        assert queue.fake_free_list_tail.prev_free_block is prev, "free queue tail link broken"
        assert len(free) == queue.num_free_blocks, (
            f"free queue counts {queue.num_free_blocks} blocks but links {len(free)}"
        )
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free), "free queue holds a block twice"
        assert 0 not in free_ids, "null block in the free queue"
        for block in self.blocks[1:]:
            assert (block.block_id in free_ids) == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt={block.ref_cnt}, in free queue="
                f"{block.block_id in free_ids}"
            )
            assert block.ref_cnt >= 0
            if block.ref_cnt:
                assert block.prev_free_block is None and block.next_free_block is None, (
                    f"block {block.block_id} is in use but still linked into the free queue"
                )
        mapped: dict[int, BlockHashWithGroupId] = {}
        secondary: dict[int, set[BlockHashWithGroupId]] = {}
        for key, blocks in self.cached_block_hash_to_block.items():
            assert blocks, f"empty entry for {key!r}"
            for b in blocks:
                if b.block_hash == key:
                    mapped[b.block_id] = key
                else:
                    assert key in self.cached_block_hashes_by_block.get(b.block_id, ()), (
                        f"block {b.block_id} mapped under a foreign key"
                    )
                    secondary.setdefault(b.block_id, set()).add(key)
        for block in self.blocks:
            if block._hash is not None:
                assert mapped.get(block.block_id) == block.block_hash
        assert len(mapped) == sum(b._hash is not None for b in self.blocks)
        assert secondary == self.cached_block_hashes_by_block, "secondary keys out of sync"
        for block_id in secondary:
            assert self.blocks[block_id]._hash is not None, "secondary key without a primary"
        assert self.null_block._hash is None
