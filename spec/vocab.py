"""The spec's own vocabulary: block hashes and their extra keys, events, stats, spec kinds.

Written from vLLM 0.25.1's behaviour, independently of kvcache, so a
slip in kvcache's hashing, events or stats shows up as a difference from the spec.

A block's hash is ``hash_fn((parent, tuple(tokens), extra_keys))``, chained from
the previous block's hash; the first block's parent is ``none_hash``. The pool
keys a cached block by its hash followed by the 4-byte big-endian group id.
Requests, configs and layer specs are read as data (``spec/__init__.py``).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, make_dataclass
from typing import Any

Request = Any
"""A request, kvcache's or vLLM's, read as data (``spec/__init__.py``)."""
KVCacheSpec = Any
"""A layer spec, read as data: its class name, ``block_size`` and its kind's fields."""
KVCacheConfig = Any
"""A KV-cache config, read as data: ``num_blocks``, the groups' ``kv_cache_spec`` and
``is_eagle_group``."""
NULL_BLOCK = 0
"""Placeholder id for skipped positions; never free, never cached."""

# ---------------------------------------------------------------- hash functions


def sha256(obj: Any) -> bytes:
    """SHA-256 of the pickle (highest protocol) of ``obj``: vLLM's default."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of the canonical CBOR encoding of ``obj``."""
    import cbor2  # only this algorithm needs it

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash(obj: Any) -> bytes:
    """xxh3-128 of the pickle (highest protocol) of ``obj``."""
    return _xxh3_128(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash_cbor(obj: Any) -> bytes:
    """xxh3-128 of the canonical CBOR encoding of ``obj``."""
    import cbor2

    return _xxh3_128(cbor2.dumps(obj, canonical=True))


def _xxh3_128(data: bytes) -> bytes:
    import xxhash as xxh  # only the xxhash algorithms need it

    return bytes(xxh.xxh3_128_digest(data))


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": sha256, "sha256_cbor": sha256_cbor, "xxhash": xxhash, "xxhash_cbor": xxhash_cbor}


def get_hash_fn(name: str) -> Callable[[Any], bytes]:
    """The hash function of a ``prefix_caching_hash_algo`` name; ValueError if unknown."""
    if name not in HASH_FUNCTIONS:
        raise ValueError(f"caching_hash_algo must be one of {sorted(HASH_FUNCTIONS)}, got {name!r}")
    return HASH_FUNCTIONS[name]


def none_hash(hash_fn: Callable[[Any], bytes], seed: str | None) -> bytes:
    """The parent of every first block: ``hash_fn(seed)`` (the ``PYTHONHASHSEED``
    string, or the release's default, ``none_hash_fixed_seed``), or 32 random bytes
    without a seed, so hashes differ between processes."""
    return os.urandom(32) if seed is None else hash_fn(seed)


# ---------------------------------------------------------------- request hashes


def embeds_digest(embeds: Any) -> bytes:
    """SHA-256 of a slice of prompt embeddings (a torch tensor): its elements' bytes
    in row-major order. An empty slice (a block of output tokens) still has one."""
    dense = embeds.detach().cpu().contiguous().clone()  # its own storage, nothing else
    return hashlib.sha256(bytes(dense.untyped_storage())).digest()


def mm_extra_keys(mm_features: Sequence[Any], start: int, end: int, first: int = 0
                  ) -> list[tuple[Any, int]]:
    """``(identifier, offset - start)`` of each multimodal item in tokens ``[start, end)``,
    scanning items (sorted by offset) from index ``first``: the scan stops at an item
    starting at or after ``end`` or at one running past it, and none is looked at when
    the last item ends by ``start``."""
    if not mm_features or _end_of(mm_features[-1]) <= start:
        return []
    keys = []
    for item in mm_features[first:]:
        offset = item.mm_position.offset
        if offset >= end:
            break
        if _end_of(item) <= start:
            continue
        keys.append((item.identifier, offset - start))
        if _end_of(item) > end:
            break
    return keys


def _end_of(item: Any) -> int:
    return int(item.mm_position.offset + item.mm_position.length)


def block_extra_keys(request: Any, start: int, end: int, first_mm: int = 0,
                     tagged: bool = False) -> tuple[Any, ...] | None:
    """Extra keys of the block of tokens ``[start, end)``: the LoRA name, the multimodal
    keys, the cache salt (first block only), the digest of the block's prompt
    embeddings; None when there are none. ``tagged`` (0.33.0's tagged_extra_keys): each
    key is tagged with its source, ``("lora", name, path)``, ``("mm", identifier,
    offset)``, ``("cache_salt", salt)``, ``("prompt_embeds", digest)``."""
    keys: list[Any] = []
    lora = request.lora_request
    if lora:
        keys.append(("lora", lora.lora_name, lora.lora_path) if tagged else lora.lora_name)
    keys += [("mm", *key) if tagged else key
             for key in mm_extra_keys(request.mm_features, start, end, first_mm)]
    if start == 0 and request.cache_salt:
        keys.append(("cache_salt", request.cache_salt) if tagged else request.cache_salt)
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        digest = embeds_digest(embeds[start:end])
        keys.append(("prompt_embeds", digest) if tagged else digest)
    return tuple(keys) if keys else None


def request_block_hashes(request: Any, block_size: int, hash_fn: Callable[[Any], bytes],
                         first_parent: bytes, tagged: bool = False,
                         by_window: bool = False, lookahead: int = 0) -> list[bytes]:
    """The hashes of the request's full ``block_size`` blocks, chained from ``first_parent``.

    As in vLLM, where a request's hashes grow as tokens arrive: a block that was not
    full when the request was made (the prompt's partial tail) is hashed later,
    and that later hashing looks at the last multimodal item only (0.33.0's
    mm_keys_by_window, ``by_window``: at every item in the block, as the first
    hashing does). ``tagged``: see ``block_extra_keys``. ``lookahead`` (0.33.0's
    lookahead hashing): a block's hash also covers the ``lookahead`` tokens after it,
    so it exists only once they do; its keys are those of the block and its lookahead
    tokens, followed by those tokens.
    """
    tokens, num_prompt = request.all_token_ids, request.num_prompt_tokens
    hashes: list[bytes] = []
    parent = first_parent
    for start in range(0, len(tokens) - lookahead - block_size + 1, block_size):
        end = start + block_size
        hashed_later = start > 0 and end > num_prompt and not by_window
        first_mm = len(request.mm_features) - 1 if hashed_later else 0
        keys = block_extra_keys(request, start, end + lookahead, max(first_mm, 0), tagged)
        if lookahead:
            keys = (keys, *tokens[end:end + lookahead])
        parent = hash_fn((parent, tuple(tokens[start:end]), keys))
        hashes.append(parent)
    return hashes


def coarsen(block_hashes: Sequence[bytes], hash_block_size: int, block_size: int) -> list[bytes]:
    """Hashes of ``block_size`` blocks from those of ``hash_block_size`` blocks (a divisor):
    a coarse block's hash is the fine hash at its last boundary, chained already."""
    if block_size % hash_block_size:
        raise ValueError(f"block_size={block_size} is not a multiple of "
                         f"hash_block_size={hash_block_size}")
    scale = block_size // hash_block_size
    return list(block_hashes[scale - 1::scale])


def pool_key(block_hash: bytes, group_id: int) -> bytes:
    """The pool's key of a cached block: its hash, then the group id (4 bytes, big-endian)."""
    return block_hash + group_id.to_bytes(4, "big")


def external_hash(block_hash: bytes) -> bytes | int:
    """A hash as events report it: the low 64 bits of the big-endian integer, or the
    bytes when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` reads as the integer 0."""
    if not int(os.getenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")):
        return block_hash
    return int.from_bytes(block_hash, "big") % 2**64


# ---------------------------------------------------------------- events and stats

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
"""A HiSparse host pool's medium (vLLM 0.33.0)."""


@dataclass
class KVCacheEvent:
    """Base of the events the pool queues (vLLM's class and field names)."""


@dataclass
class BlockStored(KVCacheEvent):
    """Blocks became cached, one hash each, chained after ``parent_block_hash``."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
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
    """A cached hash was evicted."""

    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


@dataclass
class AllBlocksCleared(KVCacheEvent):
    """The prefix cache was reset."""


@dataclass
class PrefixCacheStats:
    """Lookups since the last ``make_prefix_cache_stats``: requests, queried and hit
    tokens, counted apart for requests preempted before."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Count one lookup of ``num_tokens`` tokens of which ``num_hits`` hit."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


# Later releases' classes of the same names: 0.25.1's fields plus the ones a release
# added, at their defaults unless the pool fills them.
def _release_class(attr: str, base: type, fields: list[Any]) -> Any:
    """A class named as ``base``, with ``fields`` added; held by the module attribute
    ``attr``, through which its instances pickle (``_remade``): a made class has no
    importable name of its own, and a manager's queued events are its state."""
    def reduce(self: Any) -> tuple[Any, ...]:
        return _remade, (attr, dict(vars(self)))

    return make_dataclass(base.__name__, fields, bases=(base,),
                          namespace={"__reduce__": reduce})


def _remade(attr: str, values: dict[str, Any]) -> Any:
    """An instance of the class held by ``attr``, from its field values (unpickling)."""
    return globals()[attr](**values)


_EVENT_CLASSES: dict[tuple[str, tuple[str, ...]], Any] = {}


def event_class(name: str, fields: tuple[str, ...]) -> Any:
    """The event class ``name`` (BlockStored, BlockRemoved) with the later releases'
    ``fields`` after 0.25.1's, each None by default; 0.25.1's class for none. One
    class per field set, so that equal events compare equal."""
    if not fields:
        return {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved}[name]
    key = (name, fields)
    if key not in _EVENT_CLASSES:
        def reduce(self: Any) -> tuple[Any, ...]:  # pickled by its name and field set
            return _event_remade, (name, fields, dict(vars(self)))

        _EVENT_CLASSES[key] = make_dataclass(name, [(f, Any, None) for f in fields],
                                             bases=(globals()[name],),
                                             namespace={"__reduce__": reduce})
    return _EVENT_CLASSES[key]


def _event_remade(name: str, fields: tuple[str, ...], values: dict[str, Any]) -> Any:
    """An event of ``event_class(name, fields)`` from its field values (unpickling)."""
    return event_class(name, fields)(**values)


PrefixCacheStats033: Any = _release_class(
    "PrefixCacheStats033", PrefixCacheStats,
    [("hits_by_source", dict[str, int], field(default_factory=dict))])


# ---------------------------------------------------------------- layer specs, by class name


def is_a(kv_cache_spec: Any, class_name: str) -> bool:
    """``isinstance`` by class name: kvcache's and vLLM's spec classes are named alike."""
    return any(c.__name__ == class_name for c in type(kv_cache_spec).__mro__)


def cacheable(kv_cache_spec: Any) -> bool:
    """Whether the spec's group takes part in prefix caching (not a ring buffer, nor a
    vLLM 0.33.0 spec saying ``prefix_cacheable`` is False)."""
    return not is_a(kv_cache_spec, "CircularBufferSpec") and bool(
        getattr(kv_cache_spec, "prefix_cacheable", True))


EVENT_KINDS = [  # subclasses first, as in vLLM
    ("SlidingWindowMLASpec", "sliding_window_mla"), ("MLAAttentionSpec", "mla_attention"),
    ("SinkFullAttentionSpec", "sink_full_attention"), ("FullAttentionSpec", "full_attention"),
    ("ChunkedLocalAttentionSpec", "chunked_local_attention"),
    ("SlidingWindowSpec", "sliding_window"), ("MambaSpec", "mamba"),
    ("EncoderOnlyAttentionSpec", "encoder_only_attention"),
    ("CrossAttentionSpec", "cross_attention")]


def needs_kv_cache_zeroing(kv_cache_config: Any) -> bool:
    """Whether 0.33.0 zeroes new blocks (the zeroing switches): a Mamba layer, or attention
    layers of more than one precision (dtype, kv_quant_mode) outside host-resident groups."""
    precisions = set()
    for group in kv_cache_config.kv_cache_groups:
        layers = getattr(group.kv_cache_spec, "kv_cache_specs", None)
        for spec in layers.values() if isinstance(layers, dict) else [group.kv_cache_spec]:
            if is_a(spec, "MambaSpec"):
                return True
            if is_a(spec, "AttentionSpec") and not getattr(group, "host_resident", False):
                precisions.add((spec.dtype, getattr(spec, "kv_quant_mode", 0)))
    return len(precisions) > 1


def prefill_checkpoint_fields(kv_cache_spec: Any) -> tuple[int, int | None]:
    """A Mamba spec's prefill-checkpoint fields (vLLM 0.33.0's): ``(blocks, alignment)``,
    ``(0, None)`` for a spec without them."""
    return (getattr(kv_cache_spec, "num_prefill_checkpoint_blocks", 0),
            getattr(kv_cache_spec, "prefill_checkpoint_alignment", None))


def is_dcp_sharded(kv_cache_spec: Any) -> bool:
    """Whether decode context parallelism shards the spec's blocks over the ranks: its
    own ``dcp_sharded`` field (vLLM 0.33.0's specs), else attention specs are and the
    rest (Mamba) are not; a uniform-type spec follows its first layer."""
    sharded = getattr(kv_cache_spec, "dcp_sharded", None)
    if isinstance(sharded, bool):
        return sharded
    layers = getattr(kv_cache_spec, "kv_cache_specs", None)
    if isinstance(layers, dict) and layers:
        return is_dcp_sharded(next(iter(layers.values())))
    return is_a(kv_cache_spec, "AttentionSpec")


def event_kind(kv_cache_spec: Any) -> str:
    """The kind label of a group's BlockStored events ("unknown" for other specs)."""
    return next((kind for name, kind in EVENT_KINDS if is_a(kv_cache_spec, name)), "unknown")


def event_sliding_window(kv_cache_spec: Any) -> int | None:
    """The window of a group's BlockStored events (sliding-window specs only)."""
    return kv_cache_spec.sliding_window if is_a(kv_cache_spec, "SlidingWindowSpec") else None


def admission_cap(kv_cache_spec: Any, max_num_batched_tokens: int, max_model_len: int
                  ) -> int | None:
    """Most blocks a windowed group lets one request hold: the window (or chunk) plus
    one step's tokens, capped at the model length; a sliding window one block more,
    as it may start mid-block. None for other specs."""
    block_size: int = kv_cache_spec.block_size
    num_tokens: int
    if is_a(kv_cache_spec, "SlidingWindowSpec"):
        num_tokens = min(kv_cache_spec.sliding_window - 1 + max_num_batched_tokens,
                         max_model_len)
        return -(num_tokens // -block_size) + 1
    if is_a(kv_cache_spec, "ChunkedLocalAttentionSpec"):
        num_tokens = min(kv_cache_spec.attention_chunk_size + max_num_batched_tokens,
                         max_model_len)
        return -(num_tokens // -block_size)
    if is_a(kv_cache_spec, "HiSparseResidentSpec"):  # vLLM 0.33.0: the tokens in flight
        return -(min(max_num_batched_tokens, max_model_len) // -block_size)
    return None
