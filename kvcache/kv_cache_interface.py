"""KV-cache layout vocabulary: per-layer specs, groups and the pool config.

Field names follow vLLM 0.25.1 (``vllm/v1/kv_cache_interface.py``) so a config
built for one package reads the same in the other. Only the fields the
request-level lifecycle (allocation, hit search, caching) and page-size
accounting need are modelled; torch is optional: ``dtype`` may be a torch
dtype or its name (``"float16"``, ``"torch.bfloat16"``).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, TypeVar, cast

from mypy_extensions import mypyc_attr

from kvcache import kv_cache_math

_DTYPE_SIZES = {
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float32": 4,
    "float": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def get_dtype_size(dtype: Any) -> int:
    """Size in bytes of one element of ``dtype`` (torch dtype or its name).

    Raises:
        ValueError: if the dtype name is unknown.
    """
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_SIZES:
        raise ValueError(f"dtype={dtype!r} is not a known KV-cache dtype")
    return _DTYPE_SIZES[name]


# vLLM 0.25.1's ``KVQuantMode`` values (``kv_quant_mode`` is an int here; vLLM's
# IntEnum members compare equal to them).
KV_QUANT_INT8_PER_TOKEN_HEAD = 2
KV_QUANT_FP8_PER_TOKEN_HEAD = 3
KV_QUANT_INT4_PER_TOKEN_HEAD = 4
KV_QUANT_NVFP4 = 5
_PER_TOKEN_HEAD_MODES = (
    KV_QUANT_INT8_PER_TOKEN_HEAD,
    KV_QUANT_FP8_PER_TOKEN_HEAD,
    KV_QUANT_INT4_PER_TOKEN_HEAD,
)


def _kv_head_dim(kv_quant_mode: int, head_size: int, *, int4_halves: bool = True) -> int:
    """Bytes-per-element units one head of K (or V) takes in a block's last dim:
    NVFP4 packs fp4 data plus fp8 block scales, INT4 packs two values a byte."""
    if kv_quant_mode == KV_QUANT_NVFP4:
        return head_size // 2 + head_size // 16
    if int4_halves and kv_quant_mode == KV_QUANT_INT4_PER_TOKEN_HEAD:
        return head_size // 2
    return head_size


class KVCacheSpecKind(enum.StrEnum):
    """Kind label attached to ``BlockStored`` events (same strings as vLLM)."""

    FULL_ATTENTION = "full_attention"
    MLA_ATTENTION = "mla_attention"
    SLIDING_WINDOW = "sliding_window"
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    MAMBA = "mamba"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    SINK_FULL_ATTENTION = "sink_full_attention"
    ENCODER_ONLY_ATTENTION = "encoder_only_attention"
    CROSS_ATTENTION = "cross_attention"
    UNKNOWN = "unknown"


# Two builtin bases: an ordinary (non-native) class in the compiled build.
@mypyc_attr(native_class=False)
class KVCacheSpecMergeError(ValueError, AssertionError):
    """Layers of one KV-cache group whose specs cannot be merged into one.

    Both a ``ValueError`` (kvcache's error at a public boundary) and an
    ``AssertionError`` (what vLLM 0.25.1 raises for the same inputs), so callers
    written against either catch it.
    """


# Two builtin bases: an ordinary (non-native) class in the compiled build.
@mypyc_attr(native_class=False)
class KVCacheSpecValueError(ValueError, AssertionError):
    """A spec field value a manager cannot work with (e.g. a sink length that is no
    multiple of the block size): a ``ValueError`` for kvcache's callers and an
    ``AssertionError`` for callers written against vLLM 0.25.1, which asserts."""


# Two builtin bases: an ordinary (non-native) class in the compiled build.
@mypyc_attr(native_class=False)
class ContextParallelError(ValueError, AssertionError):
    """Decode / prefill context parallelism (``dcp_world_size`` or
    ``pcp_world_size`` > 1) where vLLM 0.25.1 does not support it: with several
    KV-cache groups under prefix caching, and for sliding-window hit lookups.

    Both a ``ValueError`` and the ``AssertionError`` vLLM raises there.
    """


def check_world_size(name: str, value: object) -> int:
    """``value`` if it is a positive int (a context-parallel world size).

    Raises:
        ValueError: naming ``name`` and the value otherwise.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


_SpecT = TypeVar("_SpecT", bound="KVCacheSpec")


@dataclass(frozen=True)
class KVCacheSpec:
    """Base spec of one layer's KV cache: ``block_size`` tokens per block."""

    block_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer."""
        raise NotImplementedError

    @property
    def storage_block_size(self) -> int:
        """Tokens one block stores (``block_size``; compressed layouts store fewer)."""
        return self.block_size

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """Most bytes one request can hold in this layer (worker-side pool sizing).

        ``vllm_config`` is read as data: ``model_config.max_model_len``,
        ``scheduler_config``, ``parallel_config``, ``cache_config``, as vLLM's
        ``VllmConfig`` lays them out.
        """
        raise NotImplementedError(f"{type(self).__name__} has no memory bound")

    def copy_with_new_block_size(self: _SpecT, block_size: int) -> _SpecT:
        """This spec with ``block_size`` replaced."""
        return dataclasses.replace(self, block_size=block_size)

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, Any]) -> bool:
        """Whether every spec of ``kv_cache_specs`` is of this spec's kind family
        (one KV-cache group can hold them all). Subclasses add their own fields."""
        family = _uniform_family(self)
        return all(is_spec_kind(spec, family) for spec in kv_cache_specs.values())

    @classmethod
    def merge(cls: type[_SpecT], specs: Sequence[_SpecT]) -> _SpecT:
        """One spec for the layers of a KV-cache group (vLLM's ``merge``): the
        layers must all have equal specs; a copy of the first is returned.

        Raises:
            KVCacheSpecMergeError: if ``specs`` is empty or the specs differ.
        """
        if not specs:
            raise KVCacheSpecMergeError("specs is empty: nothing to merge")
        if any(spec != specs[0] for spec in specs[1:]):
            raise KVCacheSpecMergeError(
                f"all layers of one KV-cache group must have equal specs, got {list(specs)!r}"
            )
        return copy.deepcopy(specs[0])


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """Spec of an attention layer: heads, head size and element dtype."""

    num_kv_heads: int
    head_size: int
    dtype: Any
    kv_quant_mode: int = 0
    page_size_padded: int | None = None
    indexes_kv_by_block_stride: bool = False

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of one block's K and V before padding."""
        head_dim = _kv_head_dim(self.kv_quant_mode, self.head_size)
        return 2 * self.block_size * self.num_kv_heads * head_dim * get_dtype_size(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block (K and V, plus the float32 per-token-head scales of
        those quantisation modes), or the padded size when one is given."""
        real = self.real_page_size_bytes
        if self.kv_quant_mode in _PER_TOKEN_HEAD_MODES:
            real += 2 * self.block_size * self.num_kv_heads * 4
        if self.page_size_padded is not None:
            if self.page_size_padded < real:
                raise ValueError(
                    f"page_size_padded={self.page_size_padded} is below the real page size {real}"
                )
            return self.page_size_padded
        return real


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Full (global, causal) attention: every token's KV is kept until the request ends.

    ``sliding_window`` / ``attention_chunk_size`` record a window the model
    runner applies while the manager still keeps every block (vLLM's behaviour
    when the hybrid allocator is disabled).
    """

    head_size_v: int | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    non_causal: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)

    @classmethod
    def merge(cls: type[_SpecT], specs: Sequence[_SpecT]) -> _SpecT:
        """One full-attention spec for a group's layers, as vLLM merges them: the
        attention fields must agree, the recorded sliding windows (and chunk
        sizes) that are set must be one value, and ``non_causal`` is true if any
        layer is non-causal.

        Raises:
            KVCacheSpecMergeError: if a spec is not full attention (or is MLA,
                which vLLM merges separately), the attention fields differ, or
                both a window and a chunk size remain.
            ValueError: if the layers record two different windows or chunk sizes.
        """
        if not specs:
            raise KVCacheSpecMergeError("specs is empty: nothing to merge")
        for spec in specs:
            if not is_spec_kind(spec, "FullAttentionSpec") or is_spec_kind(
                spec, "MLAAttentionSpec"
            ):
                raise KVCacheSpecMergeError(
                    f"every layer of a full-attention group must be a (non-MLA) "
                    f"FullAttentionSpec, got {type(spec).__name__}"
                )
        full = [cast(FullAttentionSpec, s) for s in specs]
        first = full[0]
        merged = cls(  # type: ignore[call-arg]
            block_size=first.block_size,
            num_kv_heads=first.num_kv_heads,
            head_size=first.head_size,
            head_size_v=first.head_size_v,
            dtype=first.dtype,
            kv_quant_mode=first.kv_quant_mode,
            page_size_padded=first.page_size_padded,
            indexes_kv_by_block_stride=first.indexes_kv_by_block_stride,
            sliding_window=_merge_window_sizes(
                "sliding_window", {s.sliding_window for s in full if s.sliding_window is not None}
            ),
            attention_chunk_size=_merge_window_sizes(
                "attention_chunk_size",
                {s.attention_chunk_size for s in full if s.attention_chunk_size is not None},
            ),
            non_causal=any(s.non_causal for s in full),
        )
        names = [f.name for f in fields(AttentionSpec)]
        for layer in full:
            for name in names:
                if getattr(layer, name) != getattr(merged, name):
                    raise KVCacheSpecMergeError(
                        f"all layers of one KV-cache group must have the same {name}: "
                        f"{getattr(layer, name)!r} != {getattr(merged, name)!r}"
                    )
        merged_full = cast(FullAttentionSpec, merged)
        if merged_full.sliding_window is not None and merged_full.attention_chunk_size is not None:
            raise KVCacheSpecMergeError(
                "a group cannot mix sliding-window and chunked-local layers "
                f"(sliding_window={merged_full.sliding_window}, "
                f"attention_chunk_size={merged_full.attention_chunk_size})"
            )
        return merged

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of one block before padding: K uses ``head_size``, V ``head_size_v``."""
        head_size_v = self.head_size if self.head_size_v is None else self.head_size_v
        mode = self.kv_quant_mode
        return (
            self.block_size
            * self.num_kv_heads
            * (_kv_head_dim(mode, self.head_size) + _kv_head_dim(mode, head_size_v))
            * get_dtype_size(self.dtype)
        )

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """Every block up to ``max_model_len`` (a context-parallel rank keeps its share)."""
        return _full_attention_memory(self, vllm_config)


def _full_attention_memory(spec: AttentionSpec, vllm_config: Any) -> int:
    max_model_len = vllm_config.model_config.max_model_len
    parallel = vllm_config.parallel_config
    ranks = parallel.decode_context_parallel_size * parallel.prefill_context_parallel_size
    if ranks > 1:  # each context-parallel rank keeps its share of the tokens
        max_model_len = kv_cache_math.cdiv(max_model_len, ranks)
    return kv_cache_math.cdiv(max_model_len, spec.block_size) * spec.page_size_bytes


def _admission_cap_memory(
    spec: SlidingWindowSpec | ChunkedLocalAttentionSpec, vllm_config: Any
) -> int:
    """Bytes of the blocks one request may hold under ``spec``'s admission cap."""
    blocks = spec.max_admission_blocks_per_request(
        vllm_config.scheduler_config.max_num_batched_tokens,
        vllm_config.model_config.max_model_len,
    )
    return blocks * spec.page_size_bytes


def _merge_window_sizes(name: str, sizes: set[int]) -> int | None:
    """The one window (or chunk) size of a group's layers, None if none is set.

    Raises:
        ValueError: for two different sizes (vLLM raises ValueError here too).
    """
    if len(sizes) > 1:
        raise ValueError(
            f"all attention layers of one KV-cache group must have the same {name}, "
            f"got {sorted(sizes)}"
        )
    return next(iter(sizes), None)


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention: a token attends to the ``sliding_window`` tokens
    ending at itself, so blocks left of the window are released."""

    sliding_window: int
    head_size_v: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.sliding_window, int) or self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive int, got {self.sliding_window!r}")
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of one block before padding: K uses ``head_size``, V ``head_size_v``
        (NVFP4 packed; vLLM 0.25.1 does not halve INT4 for sliding windows)."""
        head_size_v = self.head_size if self.head_size_v is None else self.head_size_v
        mode = self.kv_quant_mode
        return (
            self.block_size
            * self.num_kv_heads
            * (
                _kv_head_dim(mode, self.head_size, int4_halves=False)
                + _kv_head_dim(mode, head_size_v, int4_halves=False)
            )
            * get_dtype_size(self.dtype)
        )

    def max_admission_blocks_per_request(
        self, max_num_batched_tokens: int, max_model_len: int
    ) -> int:
        """Most blocks one request holds at once: the window behind the computed
        tokens plus one step's tokens, plus one block for a window that starts
        mid-block (same bound vLLM uses to size the pool and gate admission)."""
        return kv_cache_math.sliding_window_admission_blocks(
            self.sliding_window, self.block_size, max_num_batched_tokens, max_model_len
        )

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """The admission cap's blocks (no decode context parallelism, as in vLLM)."""
        if vllm_config.parallel_config.decode_context_parallel_size != 1:
            raise ValueError("sliding window attention does not support decode context parallel")
        return _admission_cap_memory(self, vllm_config)

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, Any]) -> bool:
        """Sliding windows of the same size (and the same MLA-ness) only."""
        return super().is_uniform_with_collection(kv_cache_specs) and all(
            spec.sliding_window == self.sliding_window for spec in kv_cache_specs.values()
        )


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention: a token attends only to tokens of its own
    ``attention_chunk_size``-aligned chunk."""

    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.attention_chunk_size, int) or self.attention_chunk_size <= 0:
            raise ValueError(
                f"attention_chunk_size must be a positive int, got {self.attention_chunk_size!r}"
            )

    def max_admission_blocks_per_request(
        self, max_num_batched_tokens: int, max_model_len: int
    ) -> int:
        """Most blocks one request holds at once: one chunk plus one step's tokens."""
        return kv_cache_math.chunked_local_admission_blocks(
            self.attention_chunk_size, self.block_size, max_num_batched_tokens, max_model_len
        )

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """The admission cap's blocks."""
        return _admission_cap_memory(self, vllm_config)

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, Any]) -> bool:
        """Chunked local attention with the same chunk size only."""
        return super().is_uniform_with_collection(kv_cache_specs) and all(
            spec.attention_chunk_size == self.attention_chunk_size
            for spec in kv_cache_specs.values()
        )


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """State-space (Mamba) layers: one state per request instead of per-token KV.

    ``mamba_cache_mode``: "none" (no prefix caching of states), "all" (a state
    block per ``block_size`` tokens, all cacheable) or "align" (only the running
    state plus the block-aligned checkpoint). ``num_speculative_blocks`` extra
    state blocks serve speculative decoding.

    vLLM 0.33.0's prefill checkpoints ('align' mode, the ``mamba_prefill_checkpoints``
    switch): ``num_prefill_checkpoint_blocks`` (> 0 turns them on) more state blocks
    a request may hold for a state exported mid-chunk, and
    ``prefill_checkpoint_alignment`` (tokens; None: the backend exports none), the
    granularity of the positions a backend can export a state at, counted from
    the chunk's start. Both are part of the spec's equality (layers with
    different values do not merge).
    """

    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[Any, ...] = ()
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mamba_cache_mode not in ("none", "all", "align"):
            raise ValueError(
                f"mamba_cache_mode must be 'none', 'all' or 'align', got {self.mamba_cache_mode!r}"
            )
        if not isinstance(self.num_speculative_blocks, int) or self.num_speculative_blocks < 0:
            raise ValueError(
                "num_speculative_blocks must be a non-negative int, got "
                f"{self.num_speculative_blocks!r}"
            )
        n = self.num_prefill_checkpoint_blocks
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"num_prefill_checkpoint_blocks must be a non-negative int, got {n!r}")
        alignment = self.prefill_checkpoint_alignment
        if alignment is not None and (
            not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0
        ):
            raise ValueError(
                f"prefill_checkpoint_alignment must be None or a positive int, got {alignment!r}"
            )

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one state block (sum over state tensors), or the padded size."""
        size = 0
        for shape, dtype in zip(self.shapes, self.dtypes, strict=True):
            n = get_dtype_size(dtype)
            for dim in shape:
                n *= dim
            size += n
        if self.page_size_padded is not None:
            return max(self.page_size_padded, size)
        return size

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """States one request holds: one per block ("all"), running + checkpoint
        and the prefill checkpoint blocks ("align") or the running one ("none"), plus
        the speculative ones. The mode read is the cache config's, as vLLM reads it."""
        mode = vllm_config.cache_config.mamba_cache_mode
        if mode == "all":
            max_model_len = vllm_config.model_config.max_model_len
            states = kv_cache_math.cdiv(max_model_len, self.block_size)
        elif mode == "align":
            states = 2 + self.num_prefill_checkpoint_blocks
        else:
            states = 1
        return (states + self.num_speculative_blocks) * self.page_size_bytes

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, Any]) -> bool:
        """Mamba layers with the same speculative and prefill checkpoint blocks and
        checkpoint alignment only."""
        return super().is_uniform_with_collection(kv_cache_specs) and all(
            spec.num_speculative_blocks == self.num_speculative_blocks
            and getattr(spec, "num_prefill_checkpoint_blocks", 0)
            == self.num_prefill_checkpoint_blocks
            and getattr(spec, "prefill_checkpoint_alignment", None)
            == self.prefill_checkpoint_alignment
            for spec in kv_cache_specs.values()
        )


@dataclass(frozen=True)
class CrossAttentionSpec(AttentionSpec):
    """Cross attention of an encoder-decoder model: blocks for the encoder
    output, allocated once per request and never cached."""

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """Blocks for the longest encoder input the scheduler admits."""
        max_encoder_len = vllm_config.scheduler_config.max_num_encoder_input_tokens
        return kv_cache_math.cdiv(max_encoder_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class CircularBufferSpec(AttentionSpec):
    """A ring buffer of vLLM 0.33.0 (``CircularBufferSpec``): each request holds one
    block for its whole life, ``block_size`` being the ring's capacity in tokens.

    Its blocks are private scratch (the raw keys a compressor has not folded in
    yet), so the group takes no part in prefix caching (``prefix_cacheable`` is
    False): nothing is looked up, cached or hashed for it. Under the 0.25.1 profile
    (``circular_buffer_groups`` off) a manager with such a group cannot be built.
    """

    @property
    def prefix_cacheable(self) -> bool:
        """False: the ring's block is per-request scratch, never shared."""
        return False

    @property
    def uses_slot_mapping(self) -> bool:
        """False: the worker addresses the ring itself (no per-token slot mapping)."""
        return False

    @property
    def block_table_token_alignment(self) -> int | None:
        """None: the ring's one block covers no fixed token range."""
        return None

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """One page: the ring is one block per request, whatever the length."""
        del vllm_config
        return self.page_size_bytes

    def max_num_blocks_per_req(self, vllm_config: Any, max_len: int) -> int:
        """1: one ring block per request."""
        del vllm_config, max_len
        return 1

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, Any]) -> bool:
        """Whether every spec is a ring buffer (their group can hold them all)."""
        return all(is_spec_kind(spec, "CircularBufferSpec") for spec in kv_cache_specs.values())


# ---------------------------------------------------------------- HiSparse (vLLM 0.33.0)


@dataclass(frozen=True, kw_only=True)
class HiSparseResidentSpec(KVCacheSpec):
    """vLLM 0.33.0's GPU-resident pages of a HiSparse model (``HiSparseResidentSpec``):
    a device copy of some pages of a sequence whose KV lives in host memory (the
    HiSparse source group). Not prefix-cacheable (the host source caches); a page is
    ``page_size`` bytes; a request holds at most its admission window of pages
    (``max_admission_blocks_per_request``). Under the 0.25.1 profile
    (``hisparse_groups`` off) a manager with such a group cannot be built.
    """

    page_size: int

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, Any]) -> bool:
        """Whether every spec is a ``HiSparseResidentSpec`` (their group can hold them all)."""
        return all(is_spec_kind(spec, "HiSparseResidentSpec") for spec in kv_cache_specs.values())

    @property
    def prefix_cacheable(self) -> bool:
        """False: the host source group owns prefix caching."""
        return False

    @property
    def page_size_bytes(self) -> int:
        """``page_size``: the spec states its page directly."""
        return self.page_size

    def max_admission_blocks_per_request(
        self, max_num_batched_tokens: int, max_model_len: int
    ) -> int:
        """Pages one request may hold at admission: its tokens in flight
        (``min(max_num_batched_tokens, max_model_len)``; vLLM 0.33.0 names the first
        argument ``max_in_flight_tokens``) in blocks; older pages move to the host."""
        return kv_cache_math.cdiv(min(max_num_batched_tokens, max_model_len), self.block_size)

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """The admission window's pages (``vllm_config.max_in_flight_tokens``, or the
        scheduler's batched-token budget, and the model length)."""
        in_flight = getattr(vllm_config, "max_in_flight_tokens", None)
        if in_flight is None:
            in_flight = vllm_config.scheduler_config.max_num_batched_tokens
        max_len = vllm_config.model_config.max_model_len
        return self.max_admission_blocks_per_request(in_flight, max_len) * self.page_size

    @property
    def has_layer_views(self) -> bool:
        """False: the worker lays the pages out itself."""
        return False


@dataclass(frozen=True, kw_only=True)
class HiSparseHotSpec(KVCacheSpec):
    """vLLM 0.33.0's hot region of a HiSparse model (``HiSparseHotSpec``): a fixed
    ``blocks_per_request`` blocks a request takes once it must read history that
    only the host holds. Not prefix-cacheable, no slot mapping, pages of
    ``page_size`` bytes. Refused under the 0.25.1 profile like the resident spec.
    """

    page_size: int
    blocks_per_request: int

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, Any]) -> bool:
        """Whether every spec is a ``HiSparseHotSpec`` (their group can hold them all)."""
        return all(is_spec_kind(spec, "HiSparseHotSpec") for spec in kv_cache_specs.values())

    @property
    def prefix_cacheable(self) -> bool:
        """False: the region is per-request scratch."""
        return False

    @property
    def page_size_bytes(self) -> int:
        """``page_size``: the spec states its page directly."""
        return self.page_size

    @property
    def block_table_token_alignment(self) -> int | None:
        """None: the region's blocks cover no fixed token range."""
        return None

    @property
    def uses_slot_mapping(self) -> bool:
        """False: the worker addresses the region itself."""
        return False

    @property
    def has_layer_views(self) -> bool:
        """False: the worker lays the region out itself."""
        return False

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """The region: ``blocks_per_request`` pages."""
        del vllm_config
        return self.blocks_per_request * self.page_size

    def max_num_blocks_per_req(self, vllm_config: Any, max_len: int) -> int:
        """``blocks_per_request``, whatever the length."""
        del vllm_config, max_len
        return self.blocks_per_request


HISPARSE_SPEC_KINDS = ("HiSparseResidentSpec", "HiSparseHotSpec")
"""The spec class names of vLLM 0.33.0's HiSparse groups (``hisparse_groups``)."""

HISPARSE_SOURCE_ROLE = "hisparse_source"
"""vLLM 0.33.0's ``KVCacheGroupRole.HISPARSE_SOURCE``: the group whose KV lives in
host memory (``HiSparseSourceManager``)."""


def is_prefix_cacheable(kv_cache_spec: object) -> bool:
    """Whether a group of ``kv_cache_spec`` takes part in prefix caching (vLLM 0.33.0's
    ``prefix_cacheable``; specs without the property, such as 0.25.1's, do)."""
    return bool(getattr(kv_cache_spec, "prefix_cacheable", True))


@dataclass(frozen=True, kw_only=True)
class RSWASpec(FullAttentionSpec):
    """Reference sliding-window attention (R-SWA): the prompt stays visible to every
    token, generated tokens only within the last ``rswa_window`` tokens.

    To the manager this is full attention (hits, caching, page size, memory bound,
    event kind ``full_attention``) except that the blocks lying wholly between the
    prompt's last block and the decode window are released (``RSWAManager``).
    """

    rswa_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.rswa_window, int) or self.rswa_window <= 0:
            raise ValueError(f"rswa_window must be a positive int, got {self.rswa_window!r}")

    @classmethod
    def merge(cls: type[_SpecT], specs: Sequence[_SpecT]) -> _SpecT:
        """One R-SWA spec for a group's layers: every layer must be R-SWA with one
        ``rswa_window``; the other fields merge as full attention's do.

        Raises:
            KVCacheSpecMergeError: if ``specs`` is empty, a layer is not R-SWA, the
                windows differ, or the full-attention fields do not merge.
        """
        if not specs:
            raise KVCacheSpecMergeError("specs is empty: nothing to merge")
        if not all(is_spec_kind(spec, "RSWASpec") for spec in specs):
            raise KVCacheSpecMergeError(
                "every layer of an R-SWA group must be an RSWASpec, got "
                f"{[type(spec).__name__ for spec in specs]}"
            )
        windows = {cast(RSWASpec, spec).rswa_window for spec in specs}
        if len(windows) != 1:
            raise KVCacheSpecMergeError(
                f"all R-SWA layers of one group must share rswa_window, got {sorted(windows)}"
            )
        # NOTE: merged as plain full attention (vLLM does the same), then re-typed.
        base = FullAttentionSpec.merge(cast(Sequence[FullAttentionSpec], specs))
        values = {f.name: getattr(base, f.name) for f in fields(FullAttentionSpec)}
        return cast(_SpecT, RSWASpec(**values, rswa_window=windows.pop()))


@dataclass(frozen=True, kw_only=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with ``sink_len`` sink tokens whose KV the model keeps in blocks
    of its own (event kind ``sink_full_attention``).

    ``sink_len`` may be None here, as in vLLM; ``SinkFullAttentionManager`` needs a
    positive multiple of the block size.
    """

    sink_len: int | None = None

    @classmethod
    def merge(cls: type[_SpecT], specs: Sequence[_SpecT]) -> _SpecT:
        """Merged as full attention, keeping the first layer's ``sink_len``.

        NOTE: as in vLLM 0.25.1, neither the layers' ``sink_len`` values nor their
        classes are compared (any non-MLA full-attention layer merges), so layers
        with other sink lengths take the first one's (docs/divergences.md).

        Raises:
            KVCacheSpecMergeError: as ``FullAttentionSpec.merge``.
        """
        merged = FullAttentionSpec.merge(cast(Sequence[FullAttentionSpec], specs))
        values = {f.name: getattr(merged, f.name) for f in fields(FullAttentionSpec)}
        # The first layer's own field (a plain full-attention first layer has none:
        # AttributeError, as in vLLM).
        sink_len = cast(Any, specs[0]).sink_len
        return cast(_SpecT, SinkFullAttentionSpec(**values, sink_len=sink_len))

# ---------------------------------------------------------------- MLA-style and marker kinds


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _apply_alignment_padding(spec: MLAAttentionSpec | SlidingWindowMLASpec) -> None:
    """With an ``alignment``, pad the page to a multiple of it (vLLM sets
    ``page_size_padded`` then, replacing any given one; an aligned page keeps it)."""
    if spec.alignment is None:
        return
    if not isinstance(spec.alignment, int) or spec.alignment <= 0:
        raise ValueError(f"alignment must be a positive int or None, got {spec.alignment!r}")
    real = spec.real_page_size_bytes
    padded = _round_up(real, spec.alignment)
    if padded != real:
        object.__setattr__(spec, "page_size_padded", padded)


def _check_compress_ratio(compress_ratio: int) -> None:
    if not isinstance(compress_ratio, int) or compress_ratio <= 0:
        raise ValueError(f"compress_ratio must be a positive int, got {compress_ratio!r}")


def _one_value(specs: Sequence[Any], names: Sequence[str], kind: str) -> list[Any]:
    """The common value of each field ``names`` over ``specs``.

    Raises:
        KVCacheSpecMergeError: if some field has two values (vLLM asserts).
    """
    values = []
    for name in names:
        seen = {getattr(spec, name) for spec in specs}
        if len(seen) != 1:
            raise KVCacheSpecMergeError(
                f"all layers of one {kind} group must have the same {name}, got "
                f"{sorted(map(repr, seen))}"
            )
        values.append(seen.pop())
    return values


def _mla_page_bytes(
    spec: MLAAttentionSpec | SlidingWindowMLASpec, storage_block_size: int, custom_v3: bool
) -> int | None:
    """Bytes of a DeepSeek fp8 MLA page (584 per stored token for V4; 656 per
    token for V3.2 when ``custom_v3``), None for the element-size layout."""
    if spec.cache_dtype_str != "fp8_ds_mla":
        return None
    if spec.model_version == "deepseek_v4":
        return storage_block_size * 584
    return spec.block_size * 656 if custom_v3 else None


@dataclass(frozen=True, kw_only=True)
class TQFullAttentionSpec(FullAttentionSpec):
    """Full attention whose page holds ``tq_slot_size`` bytes per head and token
    (when positive) instead of K and V elements. Full attention to the manager."""

    tq_slot_size: int = 0

    @property
    def real_page_size_bytes(self) -> int:
        """``block_size * num_kv_heads * tq_slot_size``, or full attention's size."""
        if self.tq_slot_size > 0:
            return self.block_size * self.num_kv_heads * self.tq_slot_size
        return super().real_page_size_bytes

    @classmethod
    def merge(cls: type[_SpecT], specs: Sequence[_SpecT]) -> _SpecT:
        """Full attention's merge, then the layers' one ``tq_slot_size``.

        Raises:
            KVCacheSpecMergeError: as ``FullAttentionSpec.merge``, or if the layers'
                ``tq_slot_size`` differ (or a layer is not a ``TQFullAttentionSpec``).
        """
        merged = super().merge(specs)
        if not all(is_spec_kind(s, "TQFullAttentionSpec") for s in specs):
            raise KVCacheSpecMergeError(
                "every layer of a TQ full-attention group must be a TQFullAttentionSpec"
            )
        (slot,) = _one_value(specs, ("tq_slot_size",), "TQ full-attention")
        return dataclasses.replace(merged, tq_slot_size=slot)  # type: ignore[call-arg]


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent vector per token (no separate V).

    Full attention to the manager (same block tables, hits and hashing); only
    the page size and the event kind (``mla_attention``) differ. DeepSeek V4
    fields: ``compress_ratio`` tokens share one stored entry
    (``storage_block_size``), ``alignment`` pads the page, ``model_version``
    and ``cache_dtype_str`` pick fp8 layouts.
    """

    cache_dtype_str: str | None = None
    alignment: int | None = None
    compress_ratio: int = 1
    model_version: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_compress_ratio(self.compress_ratio)
        _apply_alignment_padding(self)

    @property
    def storage_block_size(self) -> int:
        """Stored entries per block: ``block_size // compress_ratio``."""
        return self.block_size // self.compress_ratio

    @property
    def real_page_size_bytes(self) -> int:
        """Latent bytes of one block before padding (fp8 DeepSeek layouts fixed)."""
        custom = _mla_page_bytes(self, self.storage_block_size, custom_v3=True)
        if custom is not None:
            return custom
        head_dim = self.head_size  # vLLM packs only INT4 (not NVFP4) for MLA
        if self.kv_quant_mode == KV_QUANT_INT4_PER_TOKEN_HEAD:
            head_dim //= 2
        return self.storage_block_size * self.num_kv_heads * head_dim * get_dtype_size(self.dtype)

    @classmethod
    def merge(cls: type[_SpecT], specs: Sequence[_SpecT]) -> _SpecT:
        """One MLA spec for a group, as vLLM merges them: the layers' one cache
        dtype string, compress ratio, model version and block-stride flag; the
        rest from the first layer (``head_size_v`` re-derived, window, chunk,
        ``non_causal`` and ``alignment`` dropped).

        Raises:
            KVCacheSpecMergeError: if ``specs`` is empty, a layer is not MLA, or
                those fields differ.
        """
        if not specs:
            raise KVCacheSpecMergeError("specs is empty: nothing to merge")
        if not all(is_spec_kind(s, "MLAAttentionSpec") for s in specs):
            raise KVCacheSpecMergeError(
                "every layer of an MLA group must be an MLAAttentionSpec, got "
                f"{[type(s).__name__ for s in specs]}"
            )
        mla = [cast(MLAAttentionSpec, s) for s in specs]
        dtype_str, ratio, version, stride = _one_value(
            mla,
            ("cache_dtype_str", "compress_ratio", "model_version", "indexes_kv_by_block_stride"),
            "MLA",
        )
        first = mla[0]
        return cls(  # type: ignore[call-arg]
            block_size=first.block_size,
            num_kv_heads=first.num_kv_heads,
            head_size=first.head_size,
            dtype=first.dtype,
            kv_quant_mode=first.kv_quant_mode,
            page_size_padded=first.page_size_padded,
            indexes_kv_by_block_stride=stride,
            cache_dtype_str=dtype_str,
            compress_ratio=ratio,
            model_version=version,
        )


@dataclass(frozen=True, kw_only=True)
class HiddenStateCacheSpec(MLAAttentionSpec):
    """Marker for layers that cache hidden states (vLLM's extract_hidden_states):
    an MLA spec in every respect (full attention to the manager, kind
    ``mla_attention``)."""


@dataclass(frozen=True, kw_only=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """Sliding-window attention with MLA's page layout (DeepSeek V4 fields as
    ``MLAAttentionSpec``). A sliding window to the manager; event kind
    ``sliding_window_mla``.

    NOTE: as in vLLM 0.25.1, ``head_size_v`` stays None (vLLM's initialiser
    skips the base one that derives it); the page has no V part anyway.
    """

    cache_dtype_str: str | None = None
    alignment: int | None = None
    compress_ratio: int = 1
    model_version: str | None = None

    def __post_init__(self) -> None:
        KVCacheSpec.__post_init__(self)
        if not isinstance(self.sliding_window, int) or self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive int, got {self.sliding_window!r}")
        _check_compress_ratio(self.compress_ratio)
        _apply_alignment_padding(self)

    @property
    def storage_block_size(self) -> int:
        """Stored entries per block: ``block_size // compress_ratio``."""
        return self.block_size // self.compress_ratio

    @property
    def real_page_size_bytes(self) -> int:
        """Latent bytes of one block before padding.

        Raises:
            ValueError: for a ``model_version`` other than None or "deepseek_v4"
                (vLLM asserts).
        """
        custom = _mla_page_bytes(self, self.storage_block_size, custom_v3=False)
        if custom is not None:
            return custom
        if self.model_version not in (None, "deepseek_v4"):
            raise ValueError(f"model_version={self.model_version!r} is not supported")
        return (
            self.storage_block_size
            * self.num_kv_heads
            * self.head_size
            * get_dtype_size(self.dtype)
        )

    @classmethod
    def merge(cls: type[_SpecT], specs: Sequence[_SpecT]) -> _SpecT:
        """One sliding-window MLA spec for a group, as vLLM merges them: the
        layers' one cache dtype string, compress ratio, model version, window and
        block-stride flag; the rest from the first layer (``kv_quant_mode`` and
        ``alignment`` dropped, as vLLM drops them).

        Raises:
            KVCacheSpecMergeError: if ``specs`` is empty, a layer is not a
                ``SlidingWindowMLASpec``, or those fields differ.
        """
        if not specs:
            raise KVCacheSpecMergeError("specs is empty: nothing to merge")
        if not all(is_spec_kind(s, "SlidingWindowMLASpec") for s in specs):
            raise KVCacheSpecMergeError(
                "every layer of a sliding-window MLA group must be a SlidingWindowMLASpec, "
                f"got {[type(s).__name__ for s in specs]}"
            )
        swa = [cast(SlidingWindowMLASpec, s) for s in specs]
        dtype_str, ratio, version, window, stride = _one_value(
            swa,
            (
                "cache_dtype_str",
                "compress_ratio",
                "model_version",
                "sliding_window",
                "indexes_kv_by_block_stride",
            ),
            "sliding-window MLA",
        )
        first = swa[0]
        return cls(  # type: ignore[call-arg]
            block_size=first.block_size,
            num_kv_heads=first.num_kv_heads,
            head_size=first.head_size,
            dtype=first.dtype,
            page_size_padded=first.page_size_padded,
            indexes_kv_by_block_stride=stride,
            sliding_window=window,
            cache_dtype_str=dtype_str,
            compress_ratio=ratio,
            model_version=version,
        )


@dataclass(frozen=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Layers of an encoder-only model: no KV cache is kept between steps.

    vLLM 0.25.1 registers no manager for it (a KV-cache group of this kind
    cannot be managed); it appears in layer specs and as an event kind.
    """

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """0: encoder-only layers keep no KV cache."""
        return 0


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Layers of one kind (same tokens per slot, same block size) whose specs
    differ otherwise (e.g. head sizes), kept per layer: ``kv_cache_specs``.

    Worker-side only: vLLM's scheduler config replaces it by one of its layers'
    specs, and vLLM 0.25.1 registers no manager for it.
    """

    kv_cache_specs: dict[str, KVCacheSpec]

    @property
    def page_size_bytes(self) -> int:
        """Sum of the layers' page sizes (one block holds a page of each)."""
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """The most pages any layer needs, times this spec's page size."""
        return self.max_memory_usage_pages(vllm_config) * self.page_size_bytes

    def max_memory_usage_pages(self, vllm_config: Any) -> int:
        """The most pages (blocks) any one layer needs for one request."""
        return max(
            kv_cache_math.cdiv(spec.max_memory_usage_bytes(vllm_config), spec.page_size_bytes)
            for spec in self.kv_cache_specs.values()
        )

    @classmethod
    def is_uniform_type(cls, kv_cache_specs: dict[str, Any]) -> bool:
        """Whether the layers share a block size and a kind family (the first
        layer's ``is_uniform_with_collection``)."""
        if len({spec.block_size for spec in kv_cache_specs.values()}) > 1:
            return False
        first = next(iter(kv_cache_specs.values()))
        return bool(first.is_uniform_with_collection(kv_cache_specs))

    @classmethod
    def from_specs(cls, kv_cache_specs: dict[str, Any]) -> UniformTypeKVCacheSpecs | None:
        """The layers as one ``UniformTypeKVCacheSpecs`` if uniform, else None."""
        if not cls.is_uniform_type(kv_cache_specs):
            return None
        block_size = next(iter(kv_cache_specs.values())).block_size
        return cls(block_size=block_size, kv_cache_specs=kv_cache_specs)

    def get_page_sizes(self) -> list[int]:
        """The distinct page sizes of the layers."""
        return list({spec.page_size_bytes for spec in self.kv_cache_specs.values()})

    def get_num_layer_tuples(self) -> int:
        """How many layers share the most common page size."""
        counts = Counter(spec.page_size_bytes for spec in self.kv_cache_specs.values())
        return counts.most_common(1)[0][1]


# The spec class each kind's layers share a group by (vLLM's registry bases), most
# specific first.
_UNIFORM_FAMILIES = (
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "ChunkedLocalAttentionSpec",
    "MambaSpec",
    "CrossAttentionSpec",
    "FullAttentionSpec",
)


def _uniform_family(kv_cache_spec: object) -> str:
    for family in _UNIFORM_FAMILIES:
        if is_spec_kind(kv_cache_spec, family):
            return family
    raise NotImplementedError(f"{type(kv_cache_spec).__name__} has no uniform-type family")


# ---------------------------------------------------------------- spec kinds

SPEC_MODULES = frozenset({__name__, "vllm.v1.kv_cache_interface"})
"""Modules whose spec classes are recognised by name: kvcache's and vLLM 0.25.1's
(the classes carry the same names and fields). vLLM is never imported for this."""

_SPEC_CLASS_NAMES: dict[type, frozenset[str]] = {}


def spec_class_names(kv_cache_spec: object) -> frozenset[str]:
    """Names of the spec classes ``kv_cache_spec`` is an instance of, from
    kvcache's and vLLM's ``kv_cache_interface`` (subclasses defined elsewhere
    inherit their bases' names). Cached per class."""
    cls = type(kv_cache_spec)
    names = _SPEC_CLASS_NAMES.get(cls)
    if names is None:
        names = frozenset(c.__name__ for c in cls.__mro__ if c.__module__ in SPEC_MODULES)
        _SPEC_CLASS_NAMES[cls] = names
    return names


def is_spec_kind(kv_cache_spec: object, *class_names: str) -> bool:
    """Whether ``kv_cache_spec`` is an instance of a spec class called one of
    ``class_names`` in kvcache's or vLLM's ``kv_cache_interface`` (or of a subclass).

    This is ``isinstance`` across both families, so a config vLLM's engine built
    drives kvcache's managers unchanged.
    """
    names = _SPEC_CLASS_NAMES.get(type(kv_cache_spec)) or spec_class_names(kv_cache_spec)
    return any(name in names for name in class_names)


def records_blocks_for_zeroing(kv_cache_spec: object) -> bool:
    """Whether a group of this spec reports its new blocks for zeroing when the KV
    cache needs zeroing (vLLM 0.33.0): attention kinds, but a circular buffer."""
    return is_spec_kind(kv_cache_spec, "AttentionSpec") and not is_spec_kind(
        kv_cache_spec, "CircularBufferSpec"
    )


def needs_kv_cache_zeroing(kv_cache_config: Any) -> bool:
    """Whether vLLM 0.33.0 zeroes newly allocated blocks for this config: it has a
    Mamba layer (its state is read before it is written), or the attention layers
    outside host-resident groups use more than one precision (``dtype``,
    ``kv_quant_mode``), so a block reused across groups could decode stale bytes.
    (vLLM 0.33.0's ``KVCacheConfig.needs_kv_cache_zeroing``; 0.25.1's property, which
    ``KVCacheConfig`` here keeps, counts Mamba only.)"""
    precisions: set[tuple[Any, Any]] = set()
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        layer_specs = getattr(spec, "kv_cache_specs", None)
        for layer_spec in layer_specs.values() if isinstance(layer_specs, dict) else (spec,):
            if is_spec_kind(layer_spec, "MambaSpec"):
                return True
            if is_spec_kind(layer_spec, "AttentionSpec") and not getattr(
                group, "host_resident", False
            ):
                precisions.add((layer_spec.dtype, getattr(layer_spec, "kv_quant_mode", 0)))
    return len(precisions) > 1


def is_dcp_sharded(kv_cache_spec: object) -> bool:
    """Whether decode context parallelism shards ``kv_cache_spec``'s blocks over the
    ranks (vLLM 0.33.0's ``dcp_sharded``; the ``dcp_sharded_geometry`` switch).

    A spec that carries the field (vLLM 0.33.0's) says so itself; for specs without
    it (kvcache's and 0.25.1's) attention specs are sharded and the rest (Mamba) are
    not, as 0.33.0's defaults. A ``UniformTypeKVCacheSpecs`` follows its layers.
    """
    sharded = getattr(kv_cache_spec, "dcp_sharded", None)
    if isinstance(sharded, bool):
        return sharded
    layers = getattr(kv_cache_spec, "kv_cache_specs", None)
    if isinstance(layers, dict) and layers:
        return is_dcp_sharded(next(iter(layers.values())))
    return is_spec_kind(kv_cache_spec, "AttentionSpec")


def spec_exact_class_name(kv_cache_spec: object) -> str | None:
    """The class name of ``kv_cache_spec`` if its class itself is one of kvcache's
    or vLLM's spec classes (not a subclass defined elsewhere), else None."""
    cls = type(kv_cache_spec)
    return cls.__name__ if cls.__module__ in SPEC_MODULES else None


# Most specific first, as vLLM orders its isinstance tests.
_KIND_ORDER = (
    ("SlidingWindowMLASpec", KVCacheSpecKind.SLIDING_WINDOW_MLA),
    ("MLAAttentionSpec", KVCacheSpecKind.MLA_ATTENTION),
    ("SinkFullAttentionSpec", KVCacheSpecKind.SINK_FULL_ATTENTION),
    ("FullAttentionSpec", KVCacheSpecKind.FULL_ATTENTION),
    ("ChunkedLocalAttentionSpec", KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION),
    ("SlidingWindowSpec", KVCacheSpecKind.SLIDING_WINDOW),
    ("MambaSpec", KVCacheSpecKind.MAMBA),
    ("EncoderOnlyAttentionSpec", KVCacheSpecKind.ENCODER_ONLY_ATTENTION),
    ("CrossAttentionSpec", KVCacheSpecKind.CROSS_ATTENTION),
)


def _inner_specs(kv_cache_spec: object) -> list[Any] | None:
    """The per-layer specs of a ``UniformTypeKVCacheSpecs`` (vLLM's), else None."""
    if not is_spec_kind(kv_cache_spec, "UniformTypeKVCacheSpecs"):
        return None
    return list(getattr(kv_cache_spec, "kv_cache_specs", {}).values())


def get_kv_cache_spec_kind(kv_cache_spec: KVCacheSpec) -> KVCacheSpecKind:
    """The kind label vLLM attaches to this spec's ``BlockStored`` events.

    Works for kvcache's and vLLM's spec classes and their subclasses; a
    ``UniformTypeKVCacheSpecs`` has its layers' kind when they all share one.
    """
    inner = _inner_specs(kv_cache_spec)
    if inner is not None:
        kinds = {get_kv_cache_spec_kind(spec) for spec in inner}
        return kinds.pop() if len(kinds) == 1 else KVCacheSpecKind.UNKNOWN
    names = spec_class_names(kv_cache_spec)
    for name, kind in _KIND_ORDER:
        if name in names:
            return kind
    return KVCacheSpecKind.UNKNOWN


def get_kv_cache_spec_sliding_window(kv_cache_spec: KVCacheSpec) -> int | None:
    """The sliding window vLLM attaches to ``BlockStored`` events (None unless a
    sliding-window kind; a ``UniformTypeKVCacheSpecs`` has its layers' common window)."""
    inner = _inner_specs(kv_cache_spec)
    if inner is not None:
        windows = {get_kv_cache_spec_sliding_window(spec) for spec in inner}
        return windows.pop() if len(windows) == 1 else None
    if is_spec_kind(kv_cache_spec, "SlidingWindowSpec"):
        return cast(SlidingWindowSpec, kv_cache_spec).sliding_window
    return None


@dataclass
class KVCacheTensor:
    """How a worker lays out one KV-cache tensor (carried, not interpreted here)."""

    size: int
    shared_by: list[str]
    offset: int = 0
    block_stride: int = 0


@dataclass
class KVCacheGroupSpec:
    """Layers sharing one block table; the manager treats them as one layer."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False


@dataclass
class KVCacheConfig:
    """Pool size and groups of a model's KV cache."""

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor] = field(default_factory=list)
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)

    @property
    def has_mamba_layers(self) -> bool:
        """Whether any group is a Mamba group."""
        return any(is_spec_kind(g.kv_cache_spec, "MambaSpec") for g in self.kv_cache_groups)

    @property
    def needs_kv_cache_zeroing(self) -> bool:
        """Whether fresh blocks must be zeroed before use (Mamba state only)."""
        return self.has_mamba_layers


class KVCacheBlockCopy(NamedTuple):
    """One copy-on-write copy the worker runs: block ``src_block_id`` into
    ``dst_block_id`` (``KVCacheManager.take_kv_cache_block_copies``)."""

    src_block_id: int
    dst_block_id: int
