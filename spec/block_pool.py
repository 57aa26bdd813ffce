"""The block pool: every block is an int id, all state is plain data."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .profile import Profile
from .vocab import (
    MEDIUM_GPU,
    NULL_BLOCK,
    AllBlocksCleared,
    KVCacheEvent,
    Request,
    block_extra_keys,
    coarsen,
    event_class,
    external_hash,
    get_hash_fn,
    none_hash,
    pool_key,
    request_block_hashes,
)


class BlockPool:
    """Blocks ``0..num_gpu_blocks-1``, their ref counts, the free queue and the prefix cache.

    ``free_queue`` lists free ids in eviction order (the front is reused first);
    ``ref_cnt[b]`` counts the holders of block b; ``block_hash[b]`` is a cached block's
    pool key (``vocab.pool_key``); ``cached[key]`` lists the ids cached under a key,
    oldest first (a hit takes the first). Block 0 is the null block: ``touch`` and
    ``free_blocks`` move its count as vLLM does, but it means nothing.
    ``hash_num_tokens[b]`` is how many prefix tokens a cached block's hash covers;
    ``cached_block_hashes_by_block[b]`` holds the block's further (partial-block) keys.
    ``reuse_watchers[b]`` (vLLM 0.33.0's ``unpin_blocks``) is told once when block b,
    released but still read, is handed out again or the cache is reset. ``medium``
    names the pool's memory in its events (a HiSparse host pool's is ``"CPU"``).
    ``profile`` is the release whose rules it follows (hashing and events);
    ``num_hash_lookahead_tokens`` (0.33.0's argument) is how
    many tokens after each block its hash covers.

    Invariants (``check_invariants``): a block is in ``free_queue`` iff its ref count is
    0 and it is not block 0; the queue has no duplicates; no ref count is negative;
    ``cached`` is exactly ``block_hash`` plus ``cached_block_hashes_by_block``, inverted,
    with no empty list; only a block with a ``block_hash`` has further keys; block 0 is
    never cached.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                 enable_kv_cache_events: bool = False, metrics_collector: Any = None,
                 caching_hash_algo: str = "sha256", hash_seed: str | None = None,
                 medium: str = MEDIUM_GPU, *, profile: Profile | None = None,
                 num_hash_lookahead_tokens: int = 0) -> None:
        if not isinstance(num_gpu_blocks, int) or num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be a positive int, got {num_gpu_blocks!r}")
        if metrics_collector is not None:
            raise NotImplementedError("metrics_collector is not modelled by the spec")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = enable_kv_cache_events
        self.profile = Profile() if profile is None else profile
        self.num_hash_lookahead_tokens = int(num_hash_lookahead_tokens)
        self.hash_fn = get_hash_fn(caching_hash_algo)
        # hash_seed None: the process's PYTHONHASHSEED, as vLLM reads it (unset: random)
        self.none_hash = none_hash(self.hash_fn, self.profile.rules.none_hash_fixed_seed(
            os.getenv("PYTHONHASHSEED") if hash_seed is None else hash_seed, self.hash_fn))
        self.null_block = NULL_BLOCK
        self.ref_cnt = [0] * num_gpu_blocks
        self.free_queue = list(range(1, num_gpu_blocks))  # block 0 was taken as the null block
        self.block_hash: dict[int, bytes] = {}
        self.hash_num_tokens: dict[int, int] = {}
        self.cached_block_hashes_by_block: dict[int, set[bytes]] = {}
        self.cached: dict[bytes, list[int]] = {}
        self.kv_event_queue: list[KVCacheEvent] = []
        self.medium = medium
        self.reuse_watchers: dict[int, Callable[[int], None]] = {}

    def block_hashes(self, request: Request, block_size: int | None = None) -> list[bytes]:
        """The request's block hashes, computed by the spec from its tokens and keys
        (never read from the request), at ``block_size`` (default: the hash block size)."""
        hashes = request_block_hashes(request, self.hash_block_size, self.hash_fn, self.none_hash,
                                      self.profile.rules.tagged_extra_keys,
                                      self.profile.rules.mm_keys_by_window,
                                      self.num_hash_lookahead_tokens)
        if block_size is None or block_size == self.hash_block_size:
            return hashes
        return coarsen(hashes, self.hash_block_size, block_size)

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: list[int]
                         ) -> list[int] | None:
        """The oldest block cached under ``block_hash`` in each group; None on any miss."""
        hit_ids = []
        for group_id in kv_cache_group_ids:
            ids = self.cached.get(pool_key(block_hash, group_id))
            if not ids:
                return None
            hit_ids.append(ids[0])
        return hit_ids

    def cache_full_blocks(self, request: Request, blocks: Sequence[int], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, kv_cache_group_id: int,
                          block_mask: list[bool] | None = None) -> None:
        """Cache ``blocks[num_cached_blocks:num_full_blocks]`` (but null and masked-out
        ones) under the request's hashes; queue one BlockStored. Duplicates of cached blocks
        are kept: tables stay append-only. A block cached under a shorter partial entry
        is promoted (its old keys dropped). ValueError where vLLM asserts (bad mask length,
        too few hashes, a block cached already)."""
        if num_cached_blocks >= num_full_blocks:
            return
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
        if block_mask is not None and len(block_mask) != len(new_full_blocks):
            raise ValueError(f"block_mask has {len(block_mask)} entries, not "
                             f"{len(new_full_blocks)}")
        hashes = self.block_hashes(request, block_size)
        if len(hashes) < num_full_blocks:
            raise ValueError(f"num_full_blocks={num_full_blocks} exceeds the {len(hashes)} "
                             f"hashes of request {request.request_id!r}")
        keep = [b != NULL_BLOCK and (block_mask is None or block_mask[i])
                for i, b in enumerate(new_full_blocks)]
        for i, block_id in enumerate(new_full_blocks):
            if not keep[i]:
                continue
            num_tokens = (num_cached_blocks + i + 1) * block_size
            if block_id in self.block_hash:
                if self.hash_num_tokens[block_id] >= num_tokens:
                    raise ValueError(f"blocks[{num_cached_blocks + i}]={block_id} is already "
                                     "cached")
                self._maybe_evict_cached_block(block_id)  # promote a partial entry
            key = pool_key(hashes[num_cached_blocks + i], kv_cache_group_id)
            self._add_key(block_id, key, num_tokens)
        if not self.enable_kv_cache_events:
            return
        # NOTE: like vLLM, this reads blocks[i] up to num_full_blocks, so it raises
        # IndexError (after caching) when asked to cache past the request's last block.
        stored = [i for i in range(num_cached_blocks, num_full_blocks)
                  if blocks[i] != NULL_BLOCK and keep[i - num_cached_blocks]]
        self._queue_stored(request, [hashes[i] for i in stored],
                           hashes[num_cached_blocks - 1] if num_cached_blocks else None,
                           [i * block_size for i in stored],
                           (num_cached_blocks * block_size, num_full_blocks * block_size),
                           block_size, kv_cache_group_id)

    def _queue_stored(self, request: Request, hashes: list[bytes], parent: bytes | None,
                      starts: list[int], tokens: tuple[int, int], block_size: int,
                      group_idx: int, first_mm: int = 0) -> None:
        """Queue one BlockStored: the blocks of ``block_size`` tokens from each of
        ``starts``, cached under ``hashes`` chained after ``parent``, carrying the tokens
        ``[tokens[0], tokens[1])``; each block's extra keys cover the block and its
        lookahead tokens (the multimodal scan from item ``first_mm``). The release's
        class (``ReleaseRules.event_fields``): its ``session_id`` is the request's, its
        ``lookahead_token_ids`` those tokens (a release without the field gains it last
        under lookahead hashing)."""
        ids, la, lora = request.all_token_ids, self.num_hash_lookahead_tokens, request.lora_request
        fields: dict[str, Any] = dict(
            block_hashes=[external_hash(h) for h in hashes],
            parent_block_hash=None if parent is None else external_hash(parent),
            token_ids=list(ids[tokens[0]:tokens[1]]), block_size=block_size,
            lora_id=lora.adapter_id if lora else None, medium=self.medium,
            lora_name=lora.lora_name if lora else None,
            extra_keys=[block_extra_keys(request, s, s + block_size + la, first_mm)
                        for s in starts] or None,
            group_idx=group_idx)
        names = self.profile.rules.event_fields("BlockStored")
        if la:
            names += () if "lookahead_token_ids" in names else ("lookahead_token_ids",)
            fields["lookahead_token_ids"] = [list(ids[s + block_size:s + block_size + la])
                                             for s in starts]
        if "session_id" in names:
            fields["session_id"] = getattr(request, "session_id", None)
        self.kv_event_queue.append(event_class("BlockStored", names)(**fields))

    def emit_cached_block_events(self, request: Request, num_cached_blocks: int,
                                 block_size: int, kv_cache_group_id: int) -> None:
        """full_report_mode: queue one BlockStored for the request's first
        ``num_cached_blocks`` blocks, which are cached already (nothing changes; nothing
        without events or hits)."""
        if not self.enable_kv_cache_events or num_cached_blocks == 0:
            return
        hashes = self.block_hashes(request, block_size)[:num_cached_blocks]
        self._queue_stored(request, hashes, None,
                           [i * block_size for i in range(num_cached_blocks)],
                           (0, num_cached_blocks * block_size), block_size, kv_cache_group_id)

    def cache_partial_block(self, request: Request, block: int, num_tokens: int,
                            kv_cache_group_id: int, block_size: int,
                            any_boundary: bool = False, replace: bool = False) -> bytes | None:
        """Make ``block`` reachable from the ``num_tokens``-token prefix ending inside it,
        keyed by the request's chain hash at ``num_tokens`` (a multiple of
        ``hash_block_size``, not of ``block_size``). It is the block's hash if it has none,
        replaces a shorter entry, else is a further key. A new entry queues a BlockStored
        of the last ``hash_block_size`` tokens. None for the null block; ValueError where
        vLLM asserts (sizes off the rules). ``any_boundary``: ``num_tokens`` may also end
        on a block boundary (a Mamba prompt-tail state, ``mamba_prompt_tail_state``).
        ``replace``: the block holds another state now (a Mamba prefill checkpoint): every
        key it had is dropped first, and the entry is new even if it had this key."""
        if block == NULL_BLOCK:
            return None
        hbs = self.hash_block_size
        n = num_tokens // hbs
        hashes = self.block_hashes(request)
        off_rules = block_size <= hbs or block_size % hbs or num_tokens % block_size == 0
        if (off_rules and not any_boundary) or num_tokens % hbs or not 0 < n <= len(hashes):
            raise ValueError(f"num_tokens={num_tokens}, block_size={block_size}: not a "
                             f"partial-block boundary for hash_block_size={hbs}")
        key = pool_key(hashes[n - 1], kv_cache_group_id)
        if replace:
            self._maybe_evict_cached_block(block)
        elif block in self.cached.get(key, []):
            return key
        if block in self.block_hash and self.hash_num_tokens[block] < num_tokens:
            self._maybe_evict_cached_block(block)  # the longer entry replaces the shorter
        self._add_key(block, key, num_tokens)
        if self.enable_kv_cache_events:
            start = (n - 1) * hbs
            # As vLLM: past the first block the multimodal scan starts at the last item;
            # 0.33.0 (mm_keys_by_window): at every item of the window.
            late = start > 0 and not self.profile.rules.mm_keys_by_window
            first_mm = max(len(request.mm_features) - 1, 0) if late else 0
            self._queue_stored(request, [hashes[n - 1]], hashes[n - 2] if n > 1 else None,
                               [start], (start, num_tokens), num_tokens - start,
                               kv_cache_group_id, first_mm)
        return key

    def _add_key(self, block_id: int, key: bytes, num_tokens: int) -> None:
        """Cache ``block_id`` under ``key``: as its hash if it has none, else a further key."""
        if block_id in self.block_hash:
            self.cached_block_hashes_by_block.setdefault(block_id, set()).add(key)
        else:
            self.block_hash[block_id] = key
            self.hash_num_tokens[block_id] = num_tokens
        self.cached.setdefault(key, []).append(block_id)

    def move_block_hashes(self, src: int, dst: int) -> None:
        """Move every key of block ``src`` (its hash first) to block ``dst``, which becomes
        the one cached under them, after any older block there; no event (the entries stay
        cached). ValueError if ``dst`` is cached."""
        if dst in self.block_hash:
            raise ValueError(f"move_block_hashes: block {dst} is cached already")
        key = self.block_hash.pop(src, None)
        if key is None:
            return
        num_tokens = self.hash_num_tokens.pop(src)
        for k in [key, *self.cached_block_hashes_by_block.pop(src, set())]:
            self.cached[k].remove(src)
            if not self.cached[k]:
                del self.cached[k]
            self._add_key(dst, k, num_tokens)

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` ids from the front of the free queue, evicting their hashes;
        ValueError if fewer are free or ``num_blocks < 0``."""
        if num_blocks > len(self.free_queue):
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        new_ids = self.free_queue[:num_blocks]
        del self.free_queue[:num_blocks]
        self._tell_watchers(new_ids)
        for block_id in new_ids:
            if self.enable_caching:
                self._maybe_evict_cached_block(block_id)
            assert self.ref_cnt[block_id] == 0
            self.ref_cnt[block_id] = 1
        return new_ids

    def _tell_watchers(self, block_ids: Iterable[int]) -> None:
        """Call (and forget) the reuse watcher of each block that has one."""
        for block_id in list(block_ids):
            watcher = self.reuse_watchers.pop(block_id, None)
            if watcher is not None:
                watcher(block_id)

    def unpin_blocks(self, blocks: Iterable[int], on_reuse: Callable[[int], None]) -> None:
        """vLLM 0.33.0 (HiSparse): drop one reference per block, which its reader keeps
        reading until the pool hands it out again; then ``on_reuse(block)`` is called,
        once. Blocks reaching 0 go to the back of the free queue (hashed or not).
        ValueError, changing nothing, for the null block or a block not held."""
        blocks = list(blocks)
        for block_id in blocks:
            if block_id == NULL_BLOCK or self.ref_cnt[block_id] <= 0:
                raise ValueError(f"unpin_blocks: block {block_id} is the null block or not "
                                 "held")
        for block_id in blocks:
            self.ref_cnt[block_id] -= 1
            self.reuse_watchers[block_id] = on_reuse
            if self.ref_cnt[block_id] == 0:
                self.free_queue.append(block_id)

    def share_event_queue(self, owner: BlockPool) -> None:
        """Queue events into ``owner``'s queue (a HiSparse host pool into the device
        pool's): one ``take_events`` of either drains both."""
        self.kv_event_queue = owner.kv_event_queue

    def _maybe_evict_cached_block(self, block_id: int) -> bool:
        """Drop every key of the block (its hash first) from the prefix cache, one
        BlockRemoved each; True if it had any."""
        key = self.block_hash.pop(block_id, None)
        if key is None:
            return False
        del self.hash_num_tokens[block_id]
        for k in [key, *self.cached_block_hashes_by_block.pop(block_id, set())]:
            self.cached[k].remove(block_id)
            if not self.cached[k]:
                del self.cached[k]
            if self.enable_kv_cache_events:
                removed = event_class("BlockRemoved",
                                      self.profile.rules.event_fields("BlockRemoved"))
                self.kv_event_queue.append(removed(
                    [external_hash(k[:-4])], self.medium, int.from_bytes(k[-4:], "big")))
        return True

    def touch(self, blocks: Sequence[int]) -> None:
        """Take one more reference on each block (a prefix hit), unfreeing it if needed."""
        for block_id in blocks:
            if self.ref_cnt[block_id] == 0 and block_id != NULL_BLOCK:
                self.free_queue.remove(block_id)
            self.ref_cnt[block_id] += 1

    def free_blocks(self, ordered_blocks: Iterable[int]) -> None:
        """Drop one reference per block; those reaching 0 become free in the order given,
        unhashed ones at the front (no hit can want them), hashed ones at the back."""
        unhashed: list[int] = []
        hashed: list[int] = []
        for block_id in ordered_blocks:
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0 and block_id != NULL_BLOCK:
                (hashed if block_id in self.block_hash else unhashed).append(block_id)
        self.free_queue[:0] = unhashed
        self.free_queue.extend(hashed)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the given blocks' hashes (in use or not). ValueError, evicting nothing, for
        an id outside ``[0, num_gpu_blocks)`` (vLLM asserts, or indexes from the end)."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            if not 0 <= block_id < self.num_gpu_blocks:
                raise ValueError(f"block_ids has {block_id}, outside [0, {self.num_gpu_blocks})")
        for block_id in block_ids:
            self._maybe_evict_cached_block(block_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any non-null block is in use."""
        if len(self.free_queue) != self.num_gpu_blocks - 1:
            return False
        self.block_hash.clear()
        self.hash_num_tokens.clear()
        self.cached_block_hashes_by_block.clear()
        self.cached.clear()
        self._tell_watchers(self.reuse_watchers)
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def get_num_free_blocks(self) -> int:
        """Number of blocks in the free queue (cached or not)."""
        return len(self.free_queue)

    def get_usage(self) -> float:
        """Fraction of non-null blocks in use (0 for a pool of only the null block)."""
        if self.num_gpu_blocks == 1:
            return 0
        return 1.0 - len(self.free_queue) / (self.num_gpu_blocks - 1)

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the queued events (always [] when events are off)."""
        events = list(self.kv_event_queue)
        self.kv_event_queue.clear()  # in place: a shared queue stays shared
        return events

    def check_invariants(self) -> None:
        """Assert the invariants of the class docstring."""
        assert len(set(self.free_queue)) == len(self.free_queue), "duplicate in free queue"
        assert NULL_BLOCK not in self.free_queue, "the null block is in the free queue"
        assert min(self.ref_cnt[1:], default=0) >= 0, "negative ref count"
        idle = {b for b in range(1, self.num_gpu_blocks) if self.ref_cnt[b] == 0}
        assert set(self.free_queue) == idle, "free queue is not the set of idle blocks"
        assert NULL_BLOCK not in self.block_hash, "the null block is cached"
        pairs = [(b, key) for key, ids in self.cached.items() for b in ids]
        keys = set(self.block_hash.items()) | {
            (b, k) for b, ks in self.cached_block_hashes_by_block.items() for k in ks}
        assert all(self.cached.values()) and len(pairs) == len(keys)
        assert set(pairs) == keys, "block_hash and cached disagree"
        assert set(self.hash_num_tokens) == set(self.block_hash)
        assert set(self.cached_block_hashes_by_block) <= set(self.block_hash)
