"""Drop-in for vLLM 0.33.0's KV-cache manager: 0.33.0's names over kvcache's one implementation.

``from kvcache.vllm_0_33 import KVCacheManager`` gives a manager with vLLM
0.33.0's constructor (``max_in_flight_tokens``, ``num_hash_lookahead_tokens``,
``num_prefill_lookahead``, ``enable_mamba_shared_prefix_checkpoint``) and
methods (``get_computed_blocks(request, max_cache_hit_length=None)`` returning
``(blocks, num_hit_tokens, shared_prefix_boundary)``, ``record_prefix_cache_stats``,
``allocate_slots(..., skip_zeroing_group_ids=())``, ...), built on
``kvcache.KVCacheManager`` with ``Profile("0.33.0")`` (``kvcache.profile``): the
behaviour differences are the profile's switches, consulted inside the shared
code; this module only maps names, shapes and the 0.33.0 vocabulary (events and
stats with the new fields).

Covered: layouts of full attention, sliding window and chunked local attention
(one group or several), with or without caching and EAGLE; ring buffers
(``CircularBufferSpec`` / ``CircularBufferManager``); HiSparse layouts (the source,
resident and hot managers of ``kvcache.hisparse``, driven by
vLLM's own ``HiSparseCoordinator``: see docs/profiles.md); managers chosen through the
spec registry (``KVCacheSpecRegistry``: registered spec classes, group roles); Mamba
alone, and Mamba beside attention, with 0.33.0's fine-grained (sub-block) hits and
their copy-on-write copies (the ``mamba_*`` and ``partial_hit_copy_on_write``
switches: a Mamba group caching outside 'align' is refused;
``take_kv_cache_block_copies`` hands out the copies); lookahead hashing
(``num_hash_lookahead_tokens``) and prefill lookahead (``num_prefill_lookahead``:
re-prefilled tokens are not cached); decode / prefill context parallelism with
0.33.0's per-group geometry (``pcp_not_scaled``, ``dcp_sharded_geometry``); Mamba
prefill checkpoints, the Mamba shared-prefix checkpoint
(``enable_mamba_shared_prefix_checkpoint``) and boundary-state offloads to a KV
connector (``take_boundary_state_offloads``, ``finalize_partial_tail_offloads``),
under the ``mamba_prefill_checkpoints`` switch; the lookup for a KV connector that
takes divergent hybrid hits (``get_computed_blocks_for_connector``). What is not
covered: see ``docs/profiles.md``; the layouts 0.33.0 cannot build:
``kvcache.kit.conformance.TARGETS["0.33.0"].not_in``.

For vLLM 0.33.0's module layout the module also has 0.33.0's hashing helpers
(``generate_block_hash_extra_keys`` tagged, ``resolve_none_hash_seed``,
``get_none_hash_seed``), and for pools and groups built on their own (outside a
manager) ``BlockPool`` and the single-type managers with 0.33.0's signatures and
the profile's pool and group switches (``_SingleTypeApi``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvcache import block_pool as _block_pool
from kvcache import kv_cache_interface as _kv_cache_interface
from kvcache import kv_cache_utils as _utils
from kvcache import kv_events as _events
from kvcache import metrics as _metrics
from kvcache import single_type_kv_cache_manager as _managers
from kvcache.hisparse import HiSparseHotManager, HiSparseResidentManager, HiSparseSourceManager
from kvcache.kv_cache_coordinator import HybridKVCacheCoordinator, partial_hash_hits_enabled
from kvcache.kv_cache_interface import (
    CircularBufferSpec,
    KVCacheConfig,
    is_prefix_cacheable,
    is_spec_kind,
)
from kvcache.kv_cache_manager import KVCacheBlocks
from kvcache.kv_cache_manager import KVCacheManager as _KVCacheManager
from kvcache.kv_cache_spec_registry import (
    KVCacheSpecMetadata,
    KVCacheSpecRegistry,
    register_kv_cache_spec,
)
from kvcache.kv_cache_utils import BlockHash, KVCacheBlock
from kvcache.profile import Profile
from kvcache.request import Request
from kvcache.single_type_kv_cache_manager import CircularBufferManager

__all__ = [
    "PROFILE",
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "ChunkedLocalAttentionManager",
    "CircularBufferManager",
    "CircularBufferSpec",
    "CrossAttentionManager",
    "FullAttentionManager",
    "HiSparseHotManager",
    "HiSparseResidentManager",
    "HiSparseSourceManager",
    "KVCacheBlockCopy",
    "KVCacheBlocks",
    "KVCacheManager",
    "KVCacheSpecMetadata",
    "KVCacheSpecRegistry",
    "MambaManager",
    "PrefixCacheStats",
    "RSWAManager",
    "SlidingWindowManager",
    "generate_block_hash_extra_keys",
    "generate_lookahead_block_hash_extra_keys",
    "get_none_hash_seed",
    "get_request_block_hasher",
    "init_none_hash",
    "partial_hash_hits_enabled",
    "register_kv_cache_spec",
    "resolve_cache_hit_alignment_tokens",
    "resolve_none_hash_seed",
]

_MEDIUM_CPU = _events.MEDIUM_CPU

PROFILE = Profile("0.33.0")
"""The profile every manager of this module is built with."""


# ---------------------------------------------------------------- vocabulary


PrefixCacheStats = _metrics.PrefixCacheStatsBySource
"""0.33.0's stats: 0.25.1's fields plus ``hits_by_source``."""


BlockStored = _events.event_class("BlockStored", _events.release_fields(PROFILE, "BlockStored"))
"""0.33.0's ``BlockStored``: 0.25.1's fields plus locality, ownership, session_id
(the request's) and lookahead_token_ids (under lookahead hashing)."""
BlockRemoved = _events.event_class(
    "BlockRemoved", _events.release_fields(PROFILE, "BlockRemoved")
)
"""0.33.0's ``BlockRemoved``: 0.25.1's fields plus locality and ownership."""
AllBlocksCleared = _events.AllBlocksCleared


class TruncateError(ValueError, AssertionError):
    """Bad ``num_computed_tokens`` for ``KVCacheManager.truncate_computed_blocks``: a
    ``ValueError`` (kvcache's error at a public boundary) that is also the
    ``AssertionError`` vLLM 0.33.0 raises there."""


KVCacheBlockCopy = _kv_cache_interface.KVCacheBlockCopy



# ---------------------------------------------------------------- hashing


def init_none_hash(hash_fn: Callable[[Any], bytes]) -> None:
    """0.33.0's seed rule (``none_hash_fixed_seed``): PYTHONHASHSEED when set, else a
    fixed seed for sha256 / sha256_cbor and a random one for the xxhash functions."""
    _utils.init_none_hash(hash_fn, fixed_default_seed=PROFILE.none_hash_fixed_seed)


def resolve_none_hash_seed(hash_fn: Callable[[Any], bytes]) -> str:
    """The seed 0.33.0 derives ``NONE_HASH`` from (``none_hash_fixed_seed``):
    PYTHONHASHSEED when set, else the fixed seed for sha256 / sha256_cbor and a
    fresh random hex seed for the xxhash functions."""
    seed = _utils.resolve_none_hash_seed(hash_fn, fixed_default_seed=PROFILE.none_hash_fixed_seed)
    if seed is None:  # only without the switch, which this profile has on
        raise RuntimeError("the 0.33.0 profile resolves a NONE_HASH seed in every case")
    return seed


def get_none_hash_seed() -> str:
    """The seed the last ``init_none_hash`` used (what peers sharing a cache must
    agree on); ``DEFAULT_NONE_HASH_SEED`` before any ``init_none_hash`` ran."""
    seed = _utils.none_hash_seed()
    return _utils.DEFAULT_NONE_HASH_SEED if seed is None else seed


def generate_block_hash_extra_keys(
    request: Request, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[tuple[Any, ...] | None, int]:
    """One block's extra hash keys as 0.33.0's hasher uses them: tagged with their
    source (``tagged_extra_keys``: ``("lora", name, path)``, ``("mm", identifier,
    offset)``, ``("cache_salt", salt)``, ``("prompt_embeds", digest)``), and the
    next multimodal index. ``to_event_extra_keys`` gives the untagged event form."""
    keys, next_mm_idx = _utils.generate_block_hash_extra_keys(
        request, start_token_idx, end_token_idx, start_mm_idx
    )
    if keys is not None and PROFILE.tagged_extra_keys:
        keys = _utils.tag_extra_keys(request, start_token_idx, keys)
    return keys, next_mm_idx


def get_request_block_hasher(
    hash_block_size: int,
    caching_hash_fn: Callable[[Any], bytes],
    num_hash_lookahead_tokens: int = 0,
) -> Callable[[Request], list[BlockHash]]:
    """0.33.0's request block hasher: tagged extra keys, multimodal items by window,
    and lookahead hashing: with ``num_hash_lookahead_tokens`` (L) > 0 a block is
    hashed once the L tokens after it exist, its extra keys ``(keys of the block and
    its lookahead, *those L tokens)``. A bool counts as 0 / 1, as in vLLM.

    Raises:
        ValueError: for a negative ``num_hash_lookahead_tokens`` or a bad block size.
    """
    return _utils.get_request_block_hasher(
        hash_block_size,
        caching_hash_fn,
        tagged_extra_keys=PROFILE.tagged_extra_keys,
        mm_keys_by_window=PROFILE.mm_keys_by_window,
        num_hash_lookahead_tokens=_check_lookahead(
            "num_hash_lookahead_tokens", num_hash_lookahead_tokens
        ),
    )


def generate_lookahead_block_hash_extra_keys(
    request: Request, start_token_idx: int, end_token_idx: int, hash_end_token_idx: int,
    start_mm_idx: int,
) -> tuple[tuple[Any, ...] | None, int]:
    """0.33.0's extra keys of the block ``[start_token_idx, end_token_idx)`` hashed up
    to ``hash_end_token_idx`` (its lookahead), tagged, and the multimodal index the
    next block starts from (``kvcache.kv_cache_utils.lookahead_extra_keys``)."""
    keys, mm_idx = _utils.lookahead_extra_keys(
        request, start_token_idx, end_token_idx, hash_end_token_idx - end_token_idx,
        start_mm_idx,
    )
    if keys is not None and PROFILE.tagged_extra_keys:
        keys = _utils.tag_extra_keys(request, start_token_idx, keys)
    return keys, mm_idx


def _check_lookahead(name: str, value: Any) -> int:
    """``value`` as an int (a bool counts as 0 / 1, as in vLLM).

    Raises:
        ValueError: for a negative value or one that is no int.
    """
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def resolve_cache_hit_alignment_tokens(
    kv_cache_config: KVCacheConfig,
    vllm_config: Any,
    scheduler_block_size: int,
    hash_block_size: int,
) -> int:
    """Where prefix hits land for ``kv_cache_config`` (vLLM 0.33.0's helper): the hash
    block when a hybrid layout with prefix caching gets fine-grained hits
    (``partial_hash_hits_enabled`` with the manager classes kvcache builds for the
    groups), else the scheduler block. ``vllm_config`` is read for
    ``cache_config.enable_prefix_caching`` and
    ``parallel_config.decode_context_parallel_size``."""
    groups = kv_cache_config.kv_cache_groups
    if not vllm_config.cache_config.enable_prefix_caching or len(groups) <= 1:
        return scheduler_block_size
    classes = [
        _managers.get_manager_class_for_kv_cache_spec(g.kv_cache_spec, getattr(g, "role", None))
        for g in groups
    ]
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    if partial_hash_hits_enabled(groups, hash_block_size, dcp, classes):
        return hash_block_size
    return scheduler_block_size


# ---------------------------------------------------------------- block pool and groups


class BlockPool(_block_pool.BlockPool):
    """vLLM 0.33.0's ``BlockPool`` constructor over kvcache's pool, with the 0.33.0
    profile's pool switches (``mm_keys_by_window``, ``event_session_id``): what a
    pool built on its own, outside a manager, gets.

    Args:
        num_hash_lookahead_tokens: Tokens after each block its hash covers (events
            list them); a bool counts as 0 / 1, as in vLLM.
        medium: The tier its events name: ``"GPU"``, or ``"CPU"`` (a HiSparse host
            pool).

    The other arguments (``vllm_events`` too) are ``kvcache.BlockPool``'s.

    Raises:
        ValueError: for a negative ``num_hash_lookahead_tokens``.
        ValueError: for another medium.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        metrics_collector: Any = None,
        num_hash_lookahead_tokens: int = 0,
        medium: str = _events.MEDIUM_GPU,
        *,
        vllm_events: bool = False,
    ) -> None:
        lookahead = _check_lookahead("num_hash_lookahead_tokens", num_hash_lookahead_tokens)
        if medium not in (_events.MEDIUM_GPU, _MEDIUM_CPU):
            raise ValueError(
                f"medium={medium!r}: kvcache's pool models the {_events.MEDIUM_GPU!r} and "
                f"{_MEDIUM_CPU!r} tiers"
            )
        super().__init__(
            num_gpu_blocks, enable_caching, hash_block_size, enable_kv_cache_events,
            metrics_collector, medium, vllm_events=vllm_events, profile=PROFILE,
        )  # fmt: skip
        self.num_hash_lookahead_tokens = lookahead


class _SingleTypeApi(_managers.SingleTypeKVCacheManager):
    """vLLM 0.33.0's single-type manager signatures over kvcache's managers (a mixin
    in front of each manager class below): the constructor's
    ``needs_kv_cache_zeroing``, ``get_num_blocks_to_allocate``'s
    ``num_local_computed_tokens`` and ``prefill_end``; built with the 0.33.0
    profile, whose per-manager switches it reads."""

    # Kinds whose 0.33.0 hits may end inside a block (fine-grained hits).
    _fine_grained_kind = False

    def __init__(
        self,
        kv_cache_spec: Any,
        block_pool: _block_pool.BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        scheduler_block_size: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        needs_kv_cache_zeroing: bool = False,
        max_admission_blocks_per_request: int | None = None,
    ) -> None:
        super().__init__(
            kv_cache_spec,
            block_pool,
            enable_caching,
            kv_cache_group_id,
            scheduler_block_size,
            dcp_world_size,
            pcp_world_size,
            max_admission_blocks_per_request,
            needs_kv_cache_zeroing=needs_kv_cache_zeroing,
            profile=PROFILE,
        )

    def get_num_blocks_to_allocate(  # type: ignore[override]
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """kvcache's count, with 0.33.0's argument order: ``num_local_computed_tokens``
        (the local hit's tokens: a hit ending inside a block counts its copy-on-write
        block) and ``prefill_end`` (where the prefill ends: a Mamba prefill
        checkpoint goes only into the chunk reaching it; 0: any chunk)."""
        return super().get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            new_computed_blocks,
            total_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap,
            num_local_computed_tokens=num_local_computed_tokens,
            prefill_end=prefill_end,
        )


    @classmethod
    def find_longest_cache_hit(  # type: ignore[override]
        cls,
        block_hashes: Any,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: _block_pool.BlockPool,
        kv_cache_spec: Any,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """kvcache's hit search with 0.33.0's arguments and result: ``block_hashes``
        may be at the pool's hash block size (viewed here at the group's block
        size, as 0.33.0's managers view them), and the result is ``(blocks per
        group, hit tokens)``; the hit covers whole blocks, except at the pool's hash
        block alignment inside a larger block of a kind that 0.33.0 lets hit inside
        a block (full attention, Mamba): there kvcache's ``find_fine_grained_hit``.

        Raises:
            NotImplementedError: for another alignment below the block size of such
                a kind, or one under context parallelism.
        """
        hash_block_size = block_pool.hash_block_size
        block_size = kv_cache_spec.block_size * dcp_world_size * pcp_world_size
        if block_size != hash_block_size and not isinstance(
            block_hashes, _utils.BlockHashListWithBlockSize
        ):
            if cls._fine_grained_kind and alignment_tokens < block_size:
                if (dcp_world_size, pcp_world_size) != (1, 1) or (
                    alignment_tokens != hash_block_size or block_size % alignment_tokens
                ):
                    raise NotImplementedError(
                        f"alignment_tokens={alignment_tokens} below the block size "
                        f"{block_size} with dcp_world_size={dcp_world_size}, "
                        f"pcp_world_size={pcp_world_size}, hash_block_size="
                        f"{hash_block_size}: not modelled by kvcache's 0.33.0 profile"
                    )
                # A fine-grained hit (mamba_fine_grained_hits): kvcache's sub-block
                # finder, which returns 0.33.0's pair itself.
                return cls.find_fine_grained_hit(
                    block_hashes, max_length, kv_cache_group_ids, block_pool,
                    kv_cache_spec, drop_eagle_block, alignment_tokens,
                )
            block_hashes = _utils.BlockHashListWithBlockSize(
                block_hashes, hash_block_size, block_size
            )
        blocks = super().find_longest_cache_hit(
            block_hashes,
            max_length,
            kv_cache_group_ids,
            block_pool,
            kv_cache_spec,
            drop_eagle_block,
            alignment_tokens,
            dcp_world_size,
            pcp_world_size,
        )
        return blocks, len(blocks[0]) * block_size if blocks else 0

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Free the blocks no later token needs, given the processed computed tokens
        (0.33.0's name for the count; see kvcache's manager)."""
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """The request's blocks to free, without the null blocks in front of them
        (``pop_drops_null_head``; inside a manager the coordinator drops them)."""
        blocks = super().pop_blocks_for_free(request_id)
        return _utils.trim_null_head(blocks) if PROFILE.pop_drops_null_head else blocks


class _NamesTheBuiltClass(type):
    """The metaclass of the per-kind classes below: ``isinstance(m, <class>)`` also
    holds for the manager of that kind the coordinator built (kvcache's class, whose
    methods keep the coordinator's signatures). vLLM 0.33.0's code and tests find a
    group's manager by class (``isinstance(manager, CrossAttentionManager)`` over
    ``coordinator.single_type_managers``), so the name this module exports must
    name what the coordinator holds, as vLLM's does."""

    _built_class: type | None = None  # set on each class below

    def __instancecheck__(cls, instance: object) -> bool:
        built = cls.__dict__.get("_built_class")
        return type.__instancecheck__(cls, instance) or (
            built is not None and isinstance(instance, built)
        )


class FullAttentionManager(  # type: ignore[misc]
    _SingleTypeApi, _managers.FullAttentionManager, metaclass=_NamesTheBuiltClass
):
    """vLLM 0.33.0's ``FullAttentionManager`` signatures (``_SingleTypeApi``)."""

    _fine_grained_kind = True


class SlidingWindowManager(  # type: ignore[misc]
    _SingleTypeApi, _managers.SlidingWindowManager, metaclass=_NamesTheBuiltClass
):
    """vLLM 0.33.0's ``SlidingWindowManager`` signatures (``_SingleTypeApi``)."""


class ChunkedLocalAttentionManager(  # type: ignore[misc]
    _SingleTypeApi, _managers.ChunkedLocalAttentionManager, metaclass=_NamesTheBuiltClass
):
    """vLLM 0.33.0's ``ChunkedLocalAttentionManager`` signatures (``_SingleTypeApi``)."""


class MambaManager(  # type: ignore[misc]
    _SingleTypeApi, _managers.MambaManager, metaclass=_NamesTheBuiltClass
):
    """vLLM 0.33.0's ``MambaManager`` for code that builds one directly (vLLM's own
    tests do): 0.33.0's signatures and switches, the Mamba state switches
    included (``_SingleTypeApi``)."""

    _fine_grained_kind = True


class CrossAttentionManager(  # type: ignore[misc]
    _SingleTypeApi, _managers.CrossAttentionManager, metaclass=_NamesTheBuiltClass
):
    """vLLM 0.33.0's ``CrossAttentionManager`` signatures (``_SingleTypeApi``)."""


class RSWAManager(  # type: ignore[misc]
    _SingleTypeApi, _managers.RSWAManager, metaclass=_NamesTheBuiltClass
):
    """vLLM 0.33.0's ``RSWAManager`` signatures (``_SingleTypeApi``)."""


for _cls in (
    FullAttentionManager,
    SlidingWindowManager,
    ChunkedLocalAttentionManager,
    MambaManager,
    CrossAttentionManager,
    RSWAManager,
):
    _cls._built_class = _cls.__mro__[2]  # kvcache's class of the kind (after the mixin)


# ---------------------------------------------------------------- the manager


class KVCacheManager(_KVCacheManager):
    """vLLM 0.33.0's ``KVCacheManager`` (see the module docstring).

    Args:
        max_in_flight_tokens: 0.33.0's name for 0.25.1's ``max_num_batched_tokens``
            (the admission cap's token budget; default ``max_model_len``).
        num_hash_lookahead_tokens: Lookahead hashing: tokens after each block its
            hash covers (the requests' hasher must use the same count); events
            list them per block (``lookahead_token_ids``). A bool counts as 0 / 1.
        num_prefill_lookahead: A multi-module drafter's prefill lookahead: the last
            ``num_prefill_lookahead - 1`` computed tokens are not cached yet.
        enable_mamba_shared_prefix_checkpoint: Also key a Mamba 'align' group's state
            at a request's shared-prefix boundary inside its prompt, where an EAGLE
            sibling resumes (``mamba_shared_prefix_checkpoint``: only with EAGLE
            groups, fine-grained hits and no re-prefilled tail, as in vLLM).

    The other arguments are ``kvcache.KVCacheManager``'s.

    Raises:
        NotImplementedError: naming an argument whose non-default value is not covered.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
    ) -> None:
        num_hash_lookahead_tokens = _check_lookahead(
            "num_hash_lookahead_tokens", num_hash_lookahead_tokens
        )
        num_prefill_lookahead = _check_lookahead("num_prefill_lookahead", num_prefill_lookahead)
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.num_prefill_lookahead = num_prefill_lookahead
        self.enable_mamba_shared_prefix_checkpoint = enable_mamba_shared_prefix_checkpoint
        # Groups that keep a longer hit than the common one (none without RSWA retention).
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self.enable_kv_cache_events = enable_kv_cache_events
        super().__init__(
            kv_cache_config,
            max_model_len,
            scheduler_block_size,
            hash_block_size,
            max_in_flight_tokens,
            enable_caching,
            use_eagle,
            log_stats,
            enable_kv_cache_events,
            dcp_world_size,
            pcp_world_size,
            metrics_collector,
            watermark,
            # 0.33.0 reads the retention interval from the config, never the environment.
            prefix_cache_retention_interval=getattr(
                kv_cache_config, "prefix_cache_retention_interval", None
            ),
            profile=PROFILE,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            num_prefill_lookahead=num_prefill_lookahead,
        )
        coordinator = self.coordinator
        # 0.33.0 narrows the option to where both the scheduler and the managers can
        # honour a junction: EAGLE groups, fine-grained hits, no re-prefilled tail
        # (whose caching lags the chunk end). The scheduler reads the same value.
        self.mamba_shared_prefix_checkpoint = (
            enable_mamba_shared_prefix_checkpoint
            and bool(coordinator.eagle_group_ids)
            and coordinator.enable_partial_hash_hits
            and coordinator.num_reprefillable_tokens == 0
        )
        if self.mamba_shared_prefix_checkpoint:
            for manager in coordinator.single_type_managers:
                if isinstance(manager, _managers.MambaManager):
                    manager.shared_prefix_checkpoint = True

    # ------------------------------------------------------------ lookups

    def get_computed_blocks(  # type: ignore[override]
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """The longest cached prefix: ``(blocks, num_hit_tokens, shared_prefix_boundary)``.

        ``shared_prefix_boundary`` (the ``shared_prefix_junctions`` switch): where the
        longest single-kind hit of a hybrid lookup ended, when it is longer than the
        common hit (a shared prefix a sparse-retention group has not cached yet);
        else 0. The scheduler stores it as ``request.shared_prefix_boundary``, whose
        tail sparse retention then keeps.
        """
        blocks, num_hit_tokens = super().get_computed_blocks(request, max_cache_hit_length)
        return blocks, num_hit_tokens, self.shared_prefix_boundary(request, num_hit_tokens)

    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        """The lookup for a request scheduled with a KV connector that takes divergent
        hybrid hits: ``(blocks, num_local_hit_tokens, shared_prefix_boundary,
        hit_diverged)``.

        Beside a Mamba group (a hybrid layout with a full-attention group) each kind
        is looked up on its own (``find_longest_cache_hit_per_group``), without
        agreeing on one length. If another group hit deeper than the first
        full-attention group (whose tail was evicted), this is ``get_computed_blocks``
        with ``hit_diverged`` False. Otherwise the full-attention hit is the local
        hit, each group's own hit blocks come with it, the boundary is 0, and
        ``hit_diverged`` says whether some group (a Mamba state evicted, or a group
        outside prefix caching, which never hits) fell short of it: the connector
        must then supply the rest, or the caller looks up again with
        ``get_computed_blocks``. Nothing is recorded (no stats, no "full" report
        events): the scheduler records the hit it admits. Any other layout: the
        ``get_computed_blocks`` triple and False; no lookup when caching is off or
        the request skips reading the cache.

        Raises:
            ValueError: for a ``max_cache_hit_length`` that is no non-negative int.
        """
        coordinator = self.coordinator
        full_group_id: int | None = getattr(coordinator, "full_attention_group_id", None)
        if (
            not self.kv_cache_config.has_mamba_layers
            or not isinstance(coordinator, HybridKVCacheCoordinator)
            or full_group_id is None
        ):
            return (*self.get_computed_blocks(request, max_cache_hit_length), False)
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0, False
        hits, hit_lengths = coordinator.find_longest_cache_hit_per_group(
            request.block_hashes, self.hit_length_bound(request, max_cache_hit_length)
        )
        num_local = hit_lengths[full_group_id]
        if max(hit_lengths) > num_local:
            return (*self.get_computed_blocks(request, max_cache_hit_length), False)
        return self.create_kv_cache_blocks(hits), num_local, 0, min(hit_lengths) < num_local

    # ------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """``kvcache.KVCacheManager.allocate_slots`` with 0.33.0's rules (the profile)
        and argument ``skip_zeroing_group_ids``: groups an async load writes, whose
        new blocks for external tokens are not reported for zeroing.

        Raises:
            ValueError: for a ``skip_zeroing_group_ids`` entry that names no group.
        """
        if skip_zeroing_group_ids:
            self._check_skip_zeroing(skip_zeroing_group_ids)
        self.skip_zeroing_group_ids = tuple(skip_zeroing_group_ids)
        try:
            return super().allocate_slots(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                new_computed_blocks,
                num_lookahead_tokens,
                num_external_computed_tokens,
                delay_cache_blocks,
                num_encoder_tokens,
                full_sequence_must_fit,
                reserved_blocks,
                has_scheduled_reqs,
            )
        finally:
            self.skip_zeroing_group_ids = ()

    def _check_skip_zeroing(self, group_ids: Sequence[int]) -> None:
        for group_id in group_ids:
            if (
                not isinstance(group_id, int)
                or isinstance(group_id, bool)
                or not 0 <= group_id < self.num_kv_cache_groups
            ):
                raise ValueError(
                    f"skip_zeroing_group_ids: {group_id!r} is no group id "
                    f"(there are {self.num_kv_cache_groups})"
                )

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Free blocks no future token attends to, up to ``processed_computed_tokens``
        (0.33.0's name: computed tokens whose forward pass is done)."""
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    # ------------------------------------------------------------ new helpers

    def estimate_cached_tokens(self, request: Request) -> int:
        """Tokens of ``request`` its cached blocks cover, the least over the groups
        that prefix-cache (cross-attention and ring-buffer groups left out); 0 if none."""
        cached: int | None = None
        for group, blocks in zip(
            self.kv_cache_config.kv_cache_groups,
            self.get_blocks(request.request_id).blocks,
            strict=True,
        ):
            if not is_prefix_cacheable(group.kv_cache_spec) or is_spec_kind(
                group.kv_cache_spec, "CrossAttentionSpec", "EncoderOnlyAttentionSpec"
            ):
                continue
            covered = max((b.block_hash_num_tokens or 0 for b in blocks), default=0)
            cached = covered if cached is None else min(cached, covered)
        return cached or 0

    def truncate_computed_blocks(
        self, blocks: KVCacheBlocks, num_computed_tokens: int
    ) -> KVCacheBlocks:
        """A lookup result cut to its first ``num_computed_tokens`` tokens (a view:
        reference counts untouched, ``blocks`` not changed).

        Raises:
            TruncateError: if ``num_computed_tokens`` is not a multiple of a group's
                block size, or longer than a group's hit (but Mamba's).
        """
        truncated: list[list[KVCacheBlock]] = []
        for group_blocks, manager in zip(
            blocks.blocks, self.coordinator.single_type_managers, strict=True
        ):
            if not is_prefix_cacheable(manager.kv_cache_spec):
                truncated.append([])  # a ring buffer: never part of a lookup result
                continue
            if num_computed_tokens % manager.block_size:
                raise TruncateError(
                    f"num_computed_tokens={num_computed_tokens} is not a multiple of group "
                    f"{manager.kv_cache_group_id}'s block size {manager.block_size}"
                )
            num_blocks = num_computed_tokens // manager.block_size
            if is_spec_kind(manager.kv_cache_spec, "MambaSpec"):
                num_blocks = min(num_blocks, len(group_blocks))
            elif num_blocks > len(group_blocks):
                raise TruncateError(
                    f"num_computed_tokens={num_computed_tokens} is past group "
                    f"{manager.kv_cache_group_id}'s hit of {len(group_blocks)} blocks"
                )
            truncated.append(list(group_blocks[:num_blocks]))
        return self.create_kv_cache_blocks(tuple(truncated))

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Report the request's blocks from ``start_token`` on for zeroing again (e.g.
        blocks a failed async load left unwritten), in the groups that report new
        blocks (``needs_kv_cache_zeroing``).

        Raises:
            ValueError: if ``start_token`` is not a multiple of such a group's block
                size (zeroing a block's valid prefix would lose it).
        """
        managers = [m for m in self.coordinator.single_type_managers if m.records_new_block_ids]
        for manager in managers:
            if start_token % manager.block_size:
                raise ValueError(
                    f"start_token={start_token} is not a multiple of group "
                    f"{manager.kv_cache_group_id}'s block size {manager.block_size}"
                )
        for manager in managers:
            held = manager.req_to_blocks.get(request_id, [])
            start = start_token // manager.block_size
            manager.new_blocks.extend(held[start:])

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """The boundary states recorded since the last call, for a KV connector:
        ``{request id: [(group id, block id, tokens the state covers), ...]}``. Mamba
        'align' groups record each state they cache (prefill checkpoints and the
        prompt's tail included) and the copy that preserves a request's own
        partial prompt-tail state; other groups record none. The scheduler drains
        this every step; the blocks are not held for the caller."""
        offloads: dict[str, list[tuple[int, int, int]]] = {}
        for manager in self.coordinator.single_type_managers:
            for request_id, group_id, block, num_tokens in (
                manager.take_pending_boundary_state_offloads()
            ):
                offloads.setdefault(request_id, []).append((group_id, block.block_id, num_tokens))
        return offloads

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """A finishing request's own partial prompt-tail states, for a KV connector to
        save before the request's blocks are freed: ``(group id, block id, tokens)``
        per Mamba 'align' group whose tail block no later token was written into
        (``finalize_partial_tail_offload``), each handed out once."""
        offloads: list[tuple[int, int, int]] = []
        in_flight: int = getattr(request, "num_in_flight_tokens", 0) or 0
        for manager in self.coordinator.single_type_managers:
            tail = manager.finalize_partial_tail_offload(
                request.request_id, request.num_computed_tokens, in_flight
            )
            if tail is not None:
                group_id, block, num_tokens = tail
                offloads.append((group_id, block.block_id, num_tokens))
        return offloads
