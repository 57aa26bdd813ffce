"""Block metadata, the free-block queue, and prefix-cache hashing.

Hashing is byte-identical to vLLM 0.25.1 for the same ``PYTHONHASHSEED``: a
block's hash is ``hash_fn((parent_hash or NONE_HASH, tuple(tokens), extra_keys))``
(extra keys: LoRA name, multimodal items, cache salt, prompt-embedding digest)
and the pool keys a cached block by that hash followed by the 4-byte
big-endian KV-cache group id.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, NewType, TypeAlias, TypeVar, cast, overload

import cbor2
from mypy_extensions import mypyc_attr

from kvcache.kv_cache_math import coarse_hash_index, num_coarse_hashes

if TYPE_CHECKING:
    from kvcache.request import Request

BlockHash = NewType("BlockHash", bytes)
"""Hash of one full block, chained over the whole prefix before it."""

BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)
"""A ``BlockHash`` followed by the 4-byte big-endian group id: the pool's key."""

ExternalBlockHash: TypeAlias = bytes | int
"""Block hash as reported in KV events."""

HashValue: TypeAlias = Hashable
"""What a hash function returns, on the way into ``request.block_hashes``.

A ``BlockHash`` (bytes) from every hash function vLLM configures; vLLM's own
tests also hash requests with the builtin ``hash()`` (an int), which vLLM's code
accepts since Python checks no annotation. The hashing path below holds its
values as ``HashValue`` so that the compiled build accepts them too: mypyc checks
a ``bytes`` annotation at run time, and erases ``Hashable``."""

_HashT = TypeVar("_HashT", bound=Hashable)


# Two builtin bases: an ordinary (non-native) class in the compiled build.
@mypyc_attr(native_class=False)
class UniformityError(ValueError, AssertionError):
    """Specs that should share one page size do not: a ``ValueError`` that is
    also the ``AssertionError`` vLLM 0.25.1 raises."""


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """Pack ``block_hash`` and ``group_id`` into one pool key (hash + 4 bytes big-endian)."""
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big", signed=False))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    """The ``BlockHash`` part of a pool key."""
    return BlockHash(key[:-4])


def get_group_id(key: BlockHashWithGroupId) -> int:
    """The group id part of a pool key."""
    return int.from_bytes(key[-4:], "big", signed=False)


def maybe_convert_block_hash(hash_bytes: BlockHash) -> ExternalBlockHash:
    """Hash as events report it: by default (as in vLLM) the low 64 bits of the
    big-endian integer; the raw bytes when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``."""
    if not int(os.getenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")):
        return hash_bytes
    return int.from_bytes(hash_bytes, byteorder="big") & ((1 << 64) - 1)


# ---------------------------------------------------------------- hash functions


# NOTE: bound once, called positionally: in the compiled build a module attribute
# (``pickle.dumps``) is looked up on every call, and a keyword argument takes the
# slower calling convention; the hash functions run once per block.
_pickle_dumps: Final = pickle.dumps
_new_sha256: Final = hashlib.sha256
_PICKLE_PROTOCOL: Final = 5


def sha256(input: Any) -> bytes:
    """SHA-256 of the pickle (protocol 5) of ``input``; vLLM's default block hash."""
    return _new_sha256(_pickle_dumps(input, _PICKLE_PROTOCOL)).digest()


def sha256_cbor(input: Any) -> bytes:
    """SHA-256 of the canonical CBOR encoding of ``input`` (language-neutral)."""
    return hashlib.sha256(cbor2.dumps(input, canonical=True)).digest()


_xxh3_128_digest: Callable[[bytes], bytes] | None = None
"""``xxhash.xxh3_128_digest``, imported on first use (xxhash is needed only by the
xxhash functions)."""


def _xxh3_128(data: bytes) -> bytes:
    global _xxh3_128_digest
    digest = _xxh3_128_digest
    if digest is None:
        import xxhash as _xxhash

        digest = _xxh3_128_digest = _xxhash.xxh3_128_digest
    return bytes(digest(data))


def xxhash(input: Any) -> bytes:
    """xxh3-128 of the pickle (protocol 5) of ``input``."""
    return _xxh3_128(_pickle_dumps(input, _PICKLE_PROTOCOL))


def xxhash_cbor(input: Any) -> bytes:
    """xxh3-128 of the canonical CBOR encoding of ``input``."""
    return _xxh3_128(cbor2.dumps(input, canonical=True))


Sha256Chain: TypeAlias = Callable[[object, Sequence[int], int, int, int], list[bytes] | None]
"""``kvcache._blockhash.sha256_chain``'s signature: ``(parent, tokens, start, stop,
block_size)``, the hashes of the blocks of ``tokens[start:stop]`` or None."""


def _load_sha256_chain() -> Sha256Chain | None:
    """``sha256_chain`` of the C extension ``kvcache/_blockhash.c``, or None.

    The extension writes the pickle of a keyless block (``(parent, tokens, None)``)
    itself and digests it with OpenSSL: one call for a request's chain of blocks,
    where ``sha256`` costs a ``pickle.dumps`` and a ``hashlib`` object a block. It
    loads only with the compiled build (``kvcache._builds.C_EXTENSIONS``); and it is
    used only if its hashes equal ``sha256``'s on every token width and both parent
    encodings here (a Python whose pickle wrote these tuples differently would
    make it disagree: then a warning, and ``sha256`` hashes every block).
    """
    try:
        from kvcache._blockhash import sha256_chain
    except ImportError:
        return None
    tokens = (0, 255, 256, 65535, 65536, -1, 2**31 - 1, -(2**31), 7, 8, 9, 10)
    for first_parent, block_size in ((b"\x01" * 32, 1), (b"", 3), (b"\x02" * 300, 4), (b"", 12)):
        expected: list[bytes] = []
        parent = first_parent
        for start in range(0, len(tokens), block_size):
            parent = sha256((parent, tokens[start : start + block_size], None))
            expected.append(parent)
        if sha256_chain(first_parent, tokens, 0, len(tokens), block_size) != expected:
            import warnings

            warnings.warn(
                "kvcache._blockhash disagrees with pickle + hashlib here; not used",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
    return sha256_chain


_sha256_chain: Sha256Chain | None = _load_sha256_chain()
"""The keyless sha256 chain in one C call, None without the extension (the pure
build). Read from the module's namespace by each new request hasher (also in the
compiled build), so a test may set it to None."""


def _is_pickle_sha256(hash_fn: Callable[[Any], HashValue]) -> bool:
    """Whether ``hash_fn`` is ``sha256(pickle.dumps(x, 5))``: kvcache's ``sha256``, or
    vLLM's (``vllm.utils.hashing.sha256``, pickle's highest protocol: 5) when it
    agrees with kvcache's on a block (a wrapper of either is neither: it may count
    its calls)."""
    if hash_fn is sha256:
        return True
    code = getattr(hash_fn, "__code__", None)
    if not (
        getattr(hash_fn, "__module__", None) == "vllm.utils.hashing"
        and getattr(code, "co_name", None) == "sha256"
    ):
        return False
    probe = (b"\x03" * 32, (1, 300, 70000, -1), None)
    return hash_fn(probe) == sha256(probe)


_HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash,
    "xxhash_cbor": xxhash_cbor,
}


def get_hash_fn_by_name(hash_fn_name: str) -> Callable[[Any], bytes]:
    """Hash function for a ``--prefix-caching-hash-algo`` name.

    Raises:
        ValueError: for a name other than sha256, sha256_cbor, xxhash, xxhash_cbor.
    """
    try:
        return _HASH_FUNCTIONS[hash_fn_name]
    except (KeyError, TypeError):
        raise ValueError(f"Unsupported hash function: hash_fn_name={hash_fn_name!r}") from None


NONE_HASH: HashValue = BlockHash(b"")
"""Parent hash of every first block (a ``BlockHash`` for vLLM's hash functions);
set by ``init_none_hash``."""


def resolve_none_hash_seed(
    hash_fn: Callable[[Any], HashValue], fixed_default_seed: bool = False
) -> str | None:
    """The seed ``init_none_hash`` derives ``NONE_HASH`` from: ``PYTHONHASHSEED`` when
    set; otherwise None (0.25.1: ``NONE_HASH`` is then 32 random bytes, no seed).

    ``fixed_default_seed`` (the ``none_hash_fixed_seed`` switch of vLLM 0.33.0's
    profile): with the variable unset, the cryptographic hashes (sha256,
    sha256_cbor) get ``DEFAULT_NONE_HASH_SEED``, so their hashes agree across
    processes, and the xxhash ones a fresh random hex seed on every call.
    """
    seed = os.getenv("PYTHONHASHSEED")
    if seed is None and fixed_default_seed:
        seed = os.urandom(32).hex() if _is_xxhash(hash_fn) else DEFAULT_NONE_HASH_SEED
    return seed


def _is_xxhash(hash_fn: Callable[[Any], HashValue]) -> bool:
    """Whether ``hash_fn`` is one of the non-cryptographic xxhash functions:
    kvcache's, or vLLM's of the same name (``vllm.utils.hashing``)."""
    if hash_fn is xxhash or hash_fn is xxhash_cbor:
        return True
    return getattr(hash_fn, "__module__", None) == "vllm.utils.hashing" and getattr(
        hash_fn, "__name__", None
    ) in ("xxhash", "xxhash_cbor")


def init_none_hash(
    hash_fn: Callable[[Any], HashValue], fixed_default_seed: bool = False
) -> None:
    """Seed the chain: ``NONE_HASH = hash_fn(seed)`` for the seed
    ``resolve_none_hash_seed`` gives, or 32 random bytes when it gives none (then
    hashes differ between processes, as in vLLM). The seed used is kept for
    ``none_hash_seed``.
    """
    global NONE_HASH, _none_hash_seed
    seed = resolve_none_hash_seed(hash_fn, fixed_default_seed)
    _none_hash_seed = seed
    NONE_HASH = BlockHash(os.urandom(32)) if seed is None else hash_fn(seed)


def none_hash_seed() -> str | None:
    """The seed the last ``init_none_hash`` derived ``NONE_HASH`` from (None: random
    bytes, or ``init_none_hash`` has not run since this module was loaded)."""
    return _none_hash_seed


DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""The seed of ``NONE_HASH`` for a cryptographic hash without PYTHONHASHSEED
(vLLM 0.33.0; ``init_none_hash(..., fixed_default_seed=True)``)."""

_none_hash_seed: str | None = None

init_none_hash(sha256)


def hash_block_tokens(
    hash_function: Callable[[Any], _HashT],
    parent_block_hash: _HashT | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> _HashT:
    """Hash one full block, chained to its parent (``NONE_HASH`` for the first block).

    Returns what ``hash_function`` returns: a ``BlockHash`` for vLLM's hash
    functions (any hashable value passes, see ``HashValue``).

    Args:
        hash_function: One of ``get_hash_fn_by_name``'s functions.
        parent_block_hash: Hash of the previous block, or None/empty for the first.
        curr_block_token_ids: The block's tokens.
        extra_keys: LoRA name, multimodal ``(identifier, offset)`` pairs, the
            cache salt and the prompt-embedding digest that apply to this
            block, or None.
    """
    parent = parent_block_hash if parent_block_hash else NONE_HASH
    return hash_function((parent, tuple(curr_block_token_ids), extra_keys))


def request_num_tokens(request: Request) -> int:
    """``Request.num_tokens``, prompt plus output tokens: the property's body,
    here so that it is compiled (it reads ``_all_token_ids`` on every call)."""
    return len(request._all_token_ids)


def need_extra_keys(request: Request) -> bool:
    """Whether the request's blocks carry extra hash keys (MM, LoRA or salt)."""
    return (
        bool(request.mm_features)
        or request.lora_request is not None
        or (request.cache_salt is not None)
    )


def _gen_mm_extra_hash_keys(
    request: Request, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[list[Any], int]:
    """``(identifier, offset - block_start)`` of each MM item overlapping the block.

    ``start_mm_idx`` is the first item worth checking (-1: the last item); the
    returned index is where the next block should start. Items must be sorted
    by offset, as vLLM assumes.
    """
    keys: list[Any] = []
    features = request.mm_features
    if not features:
        return keys, start_mm_idx
    last = features[-1].mm_position
    if last.offset + last.length <= start_token_idx:
        return keys, start_mm_idx
    idx = len(features) + start_mm_idx if start_mm_idx < 0 else start_mm_idx
    while idx < len(features):
        feature = features[idx]
        offset, length = feature.mm_position.offset, feature.mm_position.length
        if end_token_idx <= offset:
            break  # the block ends before this item starts
        if start_token_idx >= offset + length:
            idx += 1  # the item ended before this block
            continue
        keys.append((feature.identifier, offset - start_token_idx))
        if end_token_idx >= offset + length:
            idx += 1  # the item ends inside this block; the next may start here too
        else:
            break
    return keys, idx


def _tensor_data(tensor: Any) -> memoryview:
    """The bytes of a torch tensor in row-major order, as a flat ``uint8`` memoryview.

    What a prompt-embedding block hash digests: the element bytes in the
    tensor's own dtype, on the CPU, whatever its strides.
    """
    import torch  # only requests with prompt embeddings get here

    flat = tensor.detach().reshape(-1).cpu().contiguous()
    data: memoryview = flat.view(torch.uint8).numpy().data
    return data


tensor_data: Callable[[Any], memoryview] = _tensor_data
"""``_tensor_data``, looked up as a module global on every call, so that a test may
wrap it to count calls (vLLM's do): compiled code calls a module's own function
directly, but reads a module variable from the module's namespace each time."""


def _gen_prompt_embeds_extra_hash_keys(
    request: Request, start_token_idx: int, end_token_idx: int
) -> list[bytes]:
    """``[sha256 of the block's slice of prompt_embeds]``, or ``[]`` without embeddings.

    Every block of such a request gets the key, also blocks past the prompt
    (their slice is empty, or partial for the block holding the prompt's end),
    as in vLLM. The digest is memoised per ``(start, end)`` in the request's
    ``_prompt_embeds_per_block_hashes`` when it has that dict.
    """
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None:
        return []
    memo: dict[tuple[int, int], bytes] | None = getattr(
        request, "_prompt_embeds_per_block_hashes", None
    )
    block_range = (start_token_idx, end_token_idx)
    digest = None if memo is None else memo.get(block_range)
    if digest is None:
        digest = hashlib.sha256(tensor_data(embeds[start_token_idx:end_token_idx])).digest()
        if memo is not None:
            memo[block_range] = digest
    return [digest]


def generate_block_hash_extra_keys(
    request: Request, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[tuple[Any, ...] | None, int]:
    """Extra keys of one block: LoRA name, then MM keys, then the salt (first block
    only), then the digest of the block's prompt embeddings (see
    ``_gen_prompt_embeds_extra_hash_keys``).

    Returns:
        ``(keys or None, next multimodal index)``.
    """
    mm_keys, next_mm_idx = _gen_mm_extra_hash_keys(
        request, start_token_idx, end_token_idx, start_mm_idx
    )
    keys: list[Any] = []
    if request.lora_request:
        keys.append(request.lora_request.lora_name)
    keys.extend(mm_keys)
    if start_token_idx == 0 and request.cache_salt:
        keys.append(request.cache_salt)
    keys.extend(_gen_prompt_embeds_extra_hash_keys(request, start_token_idx, end_token_idx))
    return (tuple(keys) if keys else None), next_mm_idx


def get_request_block_hasher(
    hash_block_size: int,
    caching_hash_fn: Callable[[Any], bytes],
    tagged_extra_keys: bool = False,
    mm_keys_by_window: bool = False,
    num_hash_lookahead_tokens: int = 0,
) -> Callable[[Request], list[BlockHash]]:
    """A function returning the hashes of a request's full blocks not hashed yet.

    The two flags are switches of vLLM 0.33.0's profile (``kvcache.profile``):
    ``tagged_extra_keys`` tags each extra key with its source
    (``tag_extra_keys``); ``mm_keys_by_window`` finds a later block's
    multimodal items by its token window instead of from the last item only.

    ``num_hash_lookahead_tokens`` (L, vLLM 0.33.0's lookahead hashing; 0 in 0.25.1):
    each block's hash also covers the L tokens after it (a drafter's KV at the
    block's last position depends on them), so a block is hashed only once they
    exist. The hashed tokens stay the block's; its extra keys become
    ``(keys, *next_L_tokens)``, ``keys`` being those of the window from the block's
    start to L tokens past its end (``lookahead_extra_keys``; None when empty).

    Raises:
        ValueError: if ``hash_block_size`` is not a positive int, or
            ``num_hash_lookahead_tokens`` is negative.
    """
    if not isinstance(hash_block_size, int) or hash_block_size <= 0:
        raise ValueError(f"hash_block_size must be a positive int, got {hash_block_size!r}")
    lookahead = check_num_hash_lookahead_tokens(num_hash_lookahead_tokens)
    # Keyless blocks without lookahead hash as one C call where the compiled build
    # has the extension (``_load_sha256_chain``): the bytes ``hash_block_tokens``
    # digests, so the same hashes.
    chain = _sha256_chain if not lookahead and _is_pickle_sha256(caching_hash_fn) else None

    def request_block_hasher(request: Request) -> list[BlockHash]:
        # HashValue, not BlockHash: read and made without a bytes check (see there).
        block_hashes: Sequence[HashValue] = request.block_hashes
        start = len(block_hashes) * hash_block_size
        num_tokens = request.num_tokens - lookahead  # a block's lookahead must exist
        if start + hash_block_size > num_tokens:
            return []
        parent: HashValue | None = block_hashes[-1] if block_hashes else None
        tokens = request.all_token_ids
        # NOTE: a request without isolation keys has no extra keys in any block;
        # checking that once saves the per-block call (most requests).
        keyless = not (
            request.mm_features
            or request.lora_request
            or request.cache_salt
            or getattr(request, "prompt_embeds", None) is not None
        )
        if chain is not None and keyless:
            # None where the extension does not encode the input exactly (a token
            # that is no int of 32 bits, a parent that is not bytes): the loop below.
            chained = chain(
                parent if parent else NONE_HASH, tokens, start, num_tokens, hash_block_size
            )
            if chained is not None:
                return cast(list[BlockHash], chained)
        # Blocks completed after the first call can only touch the last MM item.
        mm_idx = 0 if start == 0 else -1
        if mm_keys_by_window and start > 0:
            mm_idx = first_mm_feature_ending_after(request, start)
        # The tokens of every block hashed now, as one tuple: each block's tuple is a
        # slice of it (one copy, where slicing the token list and converting each
        # slice made two; vLLM's ``ConstantList`` slices in Python code, too).
        first = start
        window = tuple(
            tokens[first : first + (num_tokens - first) // hash_block_size * hash_block_size]
        )
        new_hashes: list[HashValue] = []
        while start + hash_block_size <= num_tokens:
            end = start + hash_block_size
            extra_keys: tuple[Any, ...] | None = None
            if lookahead:
                if not keyless:
                    extra_keys, mm_idx = lookahead_extra_keys(
                        request, start, end, lookahead, mm_idx
                    )
                    if tagged_extra_keys and extra_keys is not None:
                        extra_keys = tag_extra_keys(request, start, extra_keys)
                extra_keys = (extra_keys, *tokens[end : end + lookahead])
            elif not keyless:
                extra_keys, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
                if tagged_extra_keys and extra_keys is not None:
                    extra_keys = tag_extra_keys(request, start, extra_keys)
            parent = hash_block_tokens(
                caching_hash_fn, parent, window[start - first : end - first], extra_keys
            )
            new_hashes.append(parent)
            start = end
        # BlockHashes for vLLM's hash functions (a list is all the compiled build checks).
        return cast(list[BlockHash], new_hashes)

    return request_block_hasher


def check_num_hash_lookahead_tokens(value: Any) -> int:
    """``num_hash_lookahead_tokens`` as an int: a bool counts as 0 / 1 (vLLM 0.33.0
    does arithmetic with the value, and its tests pass ``True``).

    Raises:
        ValueError: for a negative value or one that is no int.
    """
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"num_hash_lookahead_tokens must be a non-negative int, got {value!r}")
    return int(value)


def lookahead_extra_keys(
    request: Request, start: int, end: int, num_lookahead_tokens: int, start_mm_idx: int
) -> tuple[tuple[Any, ...] | None, int]:
    """Extra keys of the block ``[start, end)`` hashed with ``num_lookahead_tokens``
    tokens after it: ``generate_block_hash_extra_keys`` of the window ``[start, end +
    num_lookahead_tokens)`` (so a multimodal item or prompt-embedding rows inside the
    lookahead key the block too).

    Returns:
        ``(keys or None, next multimodal index)``; the index steps back to the first
        item still running past ``end``, since the next block starts there.
    """
    keys, mm_idx = generate_block_hash_extra_keys(
        request, start, end + num_lookahead_tokens, start_mm_idx
    )
    features = request.mm_features
    while mm_idx > 0:
        pos = features[mm_idx - 1].mm_position
        if pos.offset + pos.length <= end:
            break
        mm_idx -= 1
    return keys, mm_idx


def first_mm_feature_ending_after(request: Request, start: int) -> int:
    """Index of the first multimodal item that ends after token ``start`` (0 when
    none does: then no item reaches the block). Items are sorted by offset and do
    not overlap, as vLLM assumes, so their ends are sorted too."""
    features = request.mm_features
    if not features:
        return 0
    last = features[-1].mm_position
    if last.offset + last.length <= start:
        return 0
    lo, hi = 0, len(features)
    while lo < hi:
        mid = (lo + hi) // 2
        pos = features[mid].mm_position
        if pos.offset + pos.length < start + 1:
            lo = mid + 1
        else:
            hi = mid
    return lo


def tag_extra_keys(request: Request, start: int, keys: tuple[Any, ...]) -> tuple[Any, ...]:
    """One block's extra keys (``generate_block_hash_extra_keys``) tagged with their
    source, as vLLM 0.33.0 hashes them: ``("lora", name, path)``, ``("mm",
    identifier, offset)``, ``("cache_salt", salt)``, ``("prompt_embeds", digest)``.

    The untagged keys come in that order: the LoRA name when the request has a
    LoRA, the multimodal pairs, the salt on the first block, then the digest when
    the request has prompt embeddings.
    """
    tagged: list[Any] = []
    index = 0
    lora = request.lora_request
    if lora:
        tagged.append(("lora", lora.lora_name, lora.lora_path))
        index = 1
    has_embeds = getattr(request, "prompt_embeds", None) is not None
    has_salt = start == 0 and bool(request.cache_salt)
    end = len(keys) - has_embeds - has_salt
    for key in keys[index:end]:
        tagged.append(("mm", key[0], key[1]))
    if has_salt:
        tagged.append(("cache_salt", request.cache_salt))
    if has_embeds:
        tagged.append(("prompt_embeds", keys[-1]))
    return tuple(tagged)


def to_event_extra_keys(
    extra_keys: Iterable[tuple[Any, ...] | None] | None,
) -> list[tuple[Any, ...] | None] | None:
    """Tagged per-block extra keys (``tag_extra_keys``) as KV events publish them,
    untagged: the LoRA name, ``(identifier, offset)`` pairs, the salt and the digest
    bare, in the same order (vLLM 0.33.0 tags the hash keys, not its events).

    Returns:
        One entry per block (None stays None), or None for no entries at all.
    """
    if not extra_keys:
        return None
    untagged: list[tuple[Any, ...] | None] = []
    for keys in extra_keys:
        if keys is None:
            untagged.append(None)
            continue
        untagged.append(tuple(key[1:] if key[0] == "mm" else key[1] for key in keys))
    return untagged or None


def null_head_len(blocks: Sequence[KVCacheBlock]) -> int:
    """How many null blocks ``blocks`` starts with (a window's skipped prefix)."""
    count = 0
    for block in blocks:
        if not block.is_null:
            break
        count += 1
    return count


def trim_null_head(blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
    """``blocks`` without its leading null blocks (``blocks`` itself when none)."""
    start = null_head_len(blocks)
    return blocks[start:] if start else blocks


@mypyc_attr(allow_interpreted_subclasses=True)
class BlockHashListWithBlockSize:
    """Read-only view of hashes computed at ``hash_block_size`` as hashes of
    ``target_block_size`` blocks (a multiple): block ``i``'s hash is the fine hash
    at its last boundary, ``block_hashes[(i + 1) * scale - 1]``, which already
    chains over the whole prefix."""

    def __init__(
        self, block_hashes: list[BlockHash], hash_block_size: int, target_block_size: int
    ) -> None:
        if target_block_size % hash_block_size != 0:
            raise ValueError(
                f"target_block_size={target_block_size} is not a multiple of "
                f"hash_block_size={hash_block_size}"
            )
        self.block_hashes = block_hashes
        self.scale_factor = target_block_size // hash_block_size

    def __len__(self) -> int:
        return num_coarse_hashes(len(self.block_hashes), self.scale_factor)

    @overload
    def __getitem__(self, idx: int) -> BlockHash: ...

    @overload
    def __getitem__(self, idx: slice) -> list[BlockHash]: ...

    def __getitem__(self, idx: int | slice) -> BlockHash | list[BlockHash]:
        if isinstance(idx, slice):
            return [self._get_value_at(i) for i in range(*idx.indices(len(self)))]
        if isinstance(idx, int):
            if idx < 0:
                idx += len(self)
            if not 0 <= idx < len(self):
                raise IndexError(f"block index {idx} out of range")
            return self._get_value_at(idx)
        raise TypeError(f"Invalid index type: {type(idx)!r}")

    def __iter__(self) -> Iterator[BlockHash]:
        for i in range(len(self)):
            yield self._get_value_at(i)

    def _get_value_at(self, idx: int) -> BlockHash:
        return self.block_hashes[coarse_hash_index(idx, self.scale_factor)]


BlockHashList: TypeAlias = list[BlockHash] | BlockHashListWithBlockSize


@mypyc_attr(native_class=False)
class BlockHashViewError(ValueError, AssertionError):
    """A hash view of another block size than the one asked for
    (``resolve_block_hashes``): a ``ValueError``, and the ``AssertionError`` vLLM
    0.33.0 raises there."""


def resolve_block_hashes(
    block_hashes: BlockHashList,
    hash_block_size: int,
    block_size: int,
    *,
    supports_fine_grained_hash_lookup: bool = False,
    alignment_tokens: int | None = None,
) -> BlockHashList:
    """A request's hashes seen at ``block_size`` (vLLM 0.33.0's helper).

    The list itself when ``block_size`` is the hash block size, or when a manager
    that can find hits ending inside a block (``supports_fine_grained_hash_lookup``)
    looks them up at a finer ``alignment_tokens`` dividing ``block_size``; a view
    given already is returned as it is; otherwise a ``BlockHashListWithBlockSize``.

    Raises:
        BlockHashViewError: for a view of another block size.
        ValueError: if ``block_size`` is not a multiple of ``hash_block_size``.
    """
    if block_size == hash_block_size:
        return block_hashes
    if isinstance(block_hashes, BlockHashListWithBlockSize):
        if block_hashes.scale_factor * hash_block_size != block_size:
            raise BlockHashViewError(
                f"block_hashes is a view at {block_hashes.scale_factor * hash_block_size} "
                f"tokens per block, not block_size={block_size}"
            )
        return block_hashes
    if (
        supports_fine_grained_hash_lookup
        and alignment_tokens is not None
        and alignment_tokens < block_size
        and block_size % alignment_tokens == 0
    ):
        return block_hashes
    return BlockHashListWithBlockSize(block_hashes, hash_block_size, block_size)


# ---------------------------------------------------------------- blocks


@mypyc_attr(allow_interpreted_subclasses=True)
@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one physical block.

    ``ref_cnt`` counts the requests holding the block; ``block_hash`` is the
    pool key while the block is full and cached. The null block (id 0) is a
    placeholder whose ref count is not maintained.

    NOTE: the hash and group id are stored apart and ``block_hash`` packs them
    on access, so the hot paths (hit search, caching, freeing) never build
    the packed key. The tokens the hash covers are a plain int (0: none, read
    as None through ``_block_hash_num_tokens``): compiled, an ``int | None``
    field is a boxed object, allocated for every block cached and freed on
    every eviction.
    """

    block_id: int
    ref_cnt: int = 0
    _hash: BlockHash | None = None
    _group_id: int = 0
    _hash_num_tokens: int = 0
    is_null: bool = False
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        """Pool key of the block while it is cached, else None."""
        if self._hash is None:
            return None
        return make_block_hash_with_group_id(self._hash, self._group_id)

    @property
    def _block_hash(self) -> BlockHashWithGroupId | None:
        """vLLM's field name for the pool key (read-only here)."""
        return self.block_hash

    @property
    def block_hash_num_tokens(self) -> int | None:
        """Number of prefix tokens the cached hash covers."""
        return self._block_hash_num_tokens

    @property
    def _block_hash_num_tokens(self) -> int | None:
        """vLLM 0.33.0's field: the tokens the cached hash covers, None if unknown."""
        return self._hash_num_tokens or None

    @_block_hash_num_tokens.setter
    def _block_hash_num_tokens(self, num_tokens: int | None) -> None:
        self._hash_num_tokens = num_tokens or 0

    def set_block_hash(
        self, block_hash: BlockHashWithGroupId, num_tokens: int | None = None
    ) -> None:
        """Record the pool key of a newly cached block (it must have none yet)."""
        assert self._hash is None, f"block {self.block_id} already has a hash"
        self._hash = get_block_hash(block_hash)
        self._group_id = get_group_id(block_hash)
        self._block_hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        """Forget the hash (the block was evicted from the prefix cache)."""
        self._hash = None
        self._hash_num_tokens = 0

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={self.block_hash!r})"
        )


@mypyc_attr(allow_interpreted_subclasses=True)
class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: the front is evicted (reused) first.

    Starts in block-id order. A freed block goes to the back if it is cached
    (least recently used first) or to the front if it has no hash (it can
    never be hit, so reuse it first); callers free a request's blocks tail
    first so that, among blocks freed together, the tail of a chain goes first.

    A doubly linked list threaded through the blocks themselves
    (``prev_free_block`` / ``next_free_block``, between two sentinel blocks),
    as in vLLM: every operation touches only the blocks it moves and their
    neighbours, so its cost does not grow with the pool. A block is in the
    queue exactly when its links are set.

    NOTE: an ``OrderedDict`` keyed by block id was measured first: faster on
    small pools, but its inserts slow down ~3x at 10^6 blocks (the hash
    table's cache misses), which made ``free`` grow with the pool.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = prev

    def __len__(self) -> int:
        return self.num_free_blocks

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free_block is not None

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front block.

        Raises:
            ValueError: if the queue is empty.
        """
        if self.num_free_blocks == 0:
            raise ValueError("No free blocks available")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the ``n`` front blocks, front first.

        Raises:
            ValueError: if fewer than ``n`` blocks are free or ``n`` is negative.
        """
        if n < 0 or n > self.num_free_blocks:
            raise ValueError(f"cannot pop n={n} blocks from {self.num_free_blocks} free blocks")
        head = self.fake_free_list_head
        block = head.next_free_block
        out = []
        # NOTE: a named counter: compiled, ``_`` is boxed on every iteration.
        for i in range(n):  # noqa: B007
            assert block is not None
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        assert block is not None
        head.next_free_block = block
        block.prev_free_block = head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Remove ``block`` from anywhere in the queue.

        Raises:
            RuntimeError: if the block is not in the queue.
        """
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() called on a block not in the free queue: {block}")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back (evicted last)."""
        self.append_n((block,))

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put ``blocks`` at the back, in order."""
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        assert last is not None
        n = 0
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            n += 1
        last.next_free_block = tail
        tail.prev_free_block = last
        self.num_free_blocks += n

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front, keeping their order (``blocks[0]`` goes first)."""
        if not blocks:
            return
        head = self.fake_free_list_head
        first = head.next_free_block
        assert first is not None
        prev = head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, front (next evicted) first. For tests and tools."""
        out = []
        block = self.fake_free_list_head.next_free_block
        tail = self.fake_free_list_tail
        while block is not None and block is not tail:
            out.append(block)
            block = block.next_free_block
        return out


# ---------------------------------------------------------------- spec uniformity
# The checks vLLM's KV-cache config code runs over a model's per-layer specs
# before forming groups (which layers can share one group, one page size).


def is_kv_cache_spec_uniform(kv_cache_spec: dict[str, Any]) -> bool:
    """Whether every layer's spec merges into one (one KV-cache group can hold
    them all); full attention with and without a recorded window counts as one
    kind. True for no layers (an encoder-only model keeps no KV cache).

    A merge's ``AssertionError`` (kvcache's ``KVCacheSpecMergeError`` is one)
    means "not uniform"; a ``ValueError`` of two different windows propagates,
    as in vLLM.
    """
    if not kv_cache_spec:
        return True
    specs = list(kv_cache_spec.values())
    try:
        specs[0].merge(specs)
    except AssertionError:
        return False
    return True


def get_uniform_page_size(kv_cache_specs: Iterable[Any]) -> int:
    """The one page size of ``kv_cache_specs``.

    Raises:
        ValueError: (also an ``AssertionError``, as vLLM asserts) when the specs
            have several page sizes, or none.
    """
    page_sizes = {spec.page_size_bytes for spec in kv_cache_specs}
    if len(page_sizes) != 1:
        raise UniformityError(f"expected one page size, got {sorted(page_sizes)}")
    return int(page_sizes.pop())


def is_kv_cache_page_size_uniform(kv_cache_spec: dict[str, Any]) -> bool:
    """Whether every layer's spec has the same page size."""
    return len({spec.page_size_bytes for spec in kv_cache_spec.values()}) == 1


def is_kv_cache_type_attention_free(kv_cache_spec: dict[str, Any]) -> bool:
    """Whether the model has no KV-cache layers at all (an empty spec dict)."""
    return not kv_cache_spec
