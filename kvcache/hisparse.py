"""vLLM 0.33.0's HiSparse managers (switch ``hisparse_groups``) over kvcache's core.

A HiSparse layout has a *source* group (full attention, role ``hisparse_source``)
whose KV lives in host memory, a private pool bound by ``bind_host_pool``;
*resident* groups (``HiSparseResidentSpec``): the pages of it a request reads from
the GPU; *hot* groups (``HiSparseHotSpec``): a fixed region a request takes once it
must read host-only history. The policy that moves pages between the tiers
(write-backs, publication of host hashes once durable, residency) is vLLM's
``HiSparseCoordinator`` (``vllm/v1/hisparse``, outside the core; not modelled): it
binds itself to these managers as ``coordinator``, and the managers call it at the
points each method names. Without one bound those methods raise ``RuntimeError``.

The managers choose nothing themselves: ``single_type_kv_cache_manager``'s registry
lookup gives them (by role and spec class name); ``kvcache.vllm_0_33`` exposes them.

NOTE: this module is interpreted on purpose (not one of ``kvcache._builds``'
``CORE_MODULES``): ``get_num_blocks_to_allocate`` takes vLLM 0.33.0's argument order
here (``num_local_computed_tokens`` fifth, as vLLM's callers pass it), which a
compiled override of the compiled base class (0.25.1's order) cannot; the
coordinator calls these managers by that order (``counts_in_0_33_order``). Their
cost does not matter: HiSparse layouts are rare and vLLM's coordinator is Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from kvcache.block_pool import BlockPool
from kvcache.kv_cache_interface import KVCacheSpec, KVCacheSpecValueError, is_prefix_cacheable
from kvcache.kv_cache_math import cdiv
from kvcache.kv_cache_utils import BlockHashList, KVCacheBlock, trim_null_head
from kvcache.kv_events import MEDIUM_CPU
from kvcache.single_type_kv_cache_manager import FullAttentionManager, SingleTypeKVCacheManager

if TYPE_CHECKING:
    from kvcache.request import Request

__all__ = ["HiSparseHotManager", "HiSparseResidentManager", "HiSparseSourceManager"]


def _hisparse_coordinator(manager: SingleTypeKVCacheManager, coordinator: Any) -> Any:
    """``coordinator`` (a manager's bound HiSparse coordinator), or a clear error."""
    if coordinator is None:
        raise RuntimeError(
            f"{type(manager).__name__} (group {manager.kv_cache_group_id}) has no HiSparse "
            "coordinator bound: build one for the KV-cache manager first (vLLM 0.33.0's "
            "vllm.v1.hisparse.coordinator.get_hisparse_coordinator)"
        )
    return coordinator


class HiSparseSourceManager(FullAttentionManager):
    """The host-resident source group of a HiSparse model (vLLM 0.33.0): full
    attention whose blocks come from a private host pool (``bind_host_pool``), so
    every page a request has is backed on the host and a GPU copy of it can be
    written back and reclaimed.

    Rules: the admission count is 0 when the host pool can back the request's new
    pages, else one more than the whole GPU pool (so admission fails: the host pool is
    not the pool the admission check counts); nothing is recorded for zeroing; its hit
    is kept longer than the hybrid hit (``retains_longer_hit``: the hybrid trim leaves
    it alone, ``allocate_slots`` keeps the part local and external hits cover); an
    external load is announced to the coordinator (``record_pending_host_import``)
    before its blocks are taken; caching defers to the coordinator
    (``publish_when_ready``), which publishes durable pages through ``publish_blocks``;
    freeing tells the coordinator first; copy-on-write copies of host blocks go to the
    coordinator (``take_host_cow_copies``), never to the worker's copy path.
    """

    retains_longer_hit: ClassVar[bool] = True
    counts_in_0_33_order: ClassVar[bool] = True
    coordinator: Any = None

    @property
    def records_new_block_ids(self) -> bool:
        """False: host blocks are never zeroed by the worker."""
        return False

    def take_new_block_ids(self) -> list[int]:
        """Nothing (host blocks are not zeroed); forgets what was recorded."""
        self.new_blocks = []
        return []

    def bind_host_pool(self, num_blocks: int) -> None:
        """Replace the device pool this group was built with by a host pool of
        ``num_blocks`` blocks (events with medium ``"CPU"``, queued into the device
        pool's queue; caching as the group; the device pool's hashing switches).

        Raises:
            ValueError: for a ``num_blocks`` that is no positive int.
        """
        device_pool = self.block_pool
        collector = device_pool.metrics_collector
        if collector is not None:
            collector = type(collector)(collector.sample_rate)
        host_pool = BlockPool(
            num_blocks,
            self.enable_caching and is_prefix_cacheable(self.kv_cache_spec),
            device_pool.hash_block_size,
            device_pool.enable_kv_cache_events,
            collector,
            MEDIUM_CPU,
            vllm_events=device_pool.vllm_events,
            profile=device_pool.profile,
        )
        host_pool.num_hash_lookahead_tokens = device_pool.num_hash_lookahead_tokens
        host_pool.share_event_queue(device_pool)
        self.block_pool = host_pool
        self._null_block = host_pool.null_block

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """Nothing: host copies do not go through the worker's block-copy path."""
        return []

    def take_host_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """Return and clear the (source, copy) host block pairs, for the coordinator."""
        copies, self._pending_cow_copies = self._pending_cow_copies, []
        return copies

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
        """0 if the host pool can back the pages (they never count against the GPU
        pool), else the GPU pool's size + 1 so the admission check fails."""
        required = super().get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            new_computed_blocks,
            total_computed_tokens,
            num_tokens_main_model,
            False,
            num_local_computed_tokens,
        )
        if required <= self.block_pool.get_num_free_blocks():
            return 0
        coordinator = _hisparse_coordinator(self, self.coordinator)
        return int(coordinator.gpu_pool.num_gpu_blocks) + 1

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """Announce the pages a connector will write (``record_pending_host_import``:
        only a completed receive makes them readable), then take their host blocks."""
        if num_external_computed_tokens <= 0:
            return
        coordinator = _hisparse_coordinator(self, self.coordinator)
        coordinator.record_pending_host_import(
            request_id, num_local_computed_tokens + num_external_computed_tokens
        )
        super().allocate_external_computed_blocks(
            request_id, num_local_computed_tokens, num_external_computed_tokens, record_for_zeroing
        )

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        replay_boundaries: Sequence[int] | None = None,
    ) -> None:
        """Nothing directly: the coordinator publishes the host hashes once the host
        copies are durable (``publish_when_ready``, then ``publish_blocks``)."""
        coordinator = _hisparse_coordinator(self, self.coordinator)
        coordinator.publish_when_ready(
            request, num_tokens, retention_interval, replay_boundaries=replay_boundaries
        )

    def publish_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        replay_boundaries: Sequence[int] | None = None,
    ) -> None:
        """Cache the request's full host blocks within ``num_tokens`` (full attention's
        caching; called by the coordinator once they are durable)."""
        FullAttentionManager.cache_blocks(
            self, request, num_tokens, retention_interval, replay_boundaries
        )

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Tell the coordinator the request is gone (``free``), then forget it."""
        _hisparse_coordinator(self, self.coordinator).free(request_id)
        return super().pop_blocks_for_free(request_id)

    def free(self, request_id: str) -> None:
        """Free what ``pop_blocks_for_free`` returns into the host pool, tail first."""
        self.block_pool.free_blocks(self.pop_blocks_for_free(request_id)[::-1])


class _HiSparseAuxiliaryManager(SingleTypeKVCacheManager):
    """Resident and hot groups: per-request device blocks whose content the host
    source owns, so nothing is cached, hit or shared."""

    counts_in_0_33_order: ClassVar[bool] = True
    coordinator: Any = None

    def cache_blocks(
        self,
        request: Request,
        num_tokens: int,
        retention_interval: int | None = None,
        replay_boundaries: Sequence[int] | None = None,
    ) -> None:
        """Nothing: the source group caches."""
        return None

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[list[KVCacheBlock], ...]:
        """No hit: an empty list per group."""
        return tuple([] for _ in kv_cache_group_ids)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """0: blocks are never shared."""
        return 0

    def free(self, request_id: str) -> None:
        """Free what ``pop_blocks_for_free`` returns, tail first."""
        self.block_pool.free_blocks(self.pop_blocks_for_free(request_id)[::-1])


class HiSparseHotManager(_HiSparseAuxiliaryManager):
    """A HiSparse hot group (``HiSparseHotSpec``): ``blocks_per_request`` blocks a
    request gets only once it must read host-backed history: an external import, a
    new request resuming a host prefix hit, or one the coordinator asked for
    (``require_hot``, kept in ``hot_required``). A running request keeps its answer."""

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        scheduler_block_size: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        max_admission_blocks_per_request: int | None = None,
        needs_kv_cache_zeroing: bool = False,
    ) -> None:
        # NOTE: explicit arguments, not **kwargs (mypyc forwards **kwargs wrongly).
        super().__init__(
            kv_cache_spec,
            block_pool,
            enable_caching,
            kv_cache_group_id,
            scheduler_block_size,
            dcp_world_size,
            pcp_world_size,
            max_admission_blocks_per_request,
        )
        blocks_per_request = getattr(kv_cache_spec, "blocks_per_request", None)
        if not isinstance(blocks_per_request, int) or blocks_per_request <= 0:
            raise KVCacheSpecValueError(
                f"blocks_per_request={blocks_per_request!r}: a HiSparseHotSpec needs a "
                "positive int"
            )
        self.blocks_per_request: int = blocks_per_request
        self.hot_required: set[str] = set()
        self._tracks_new_block_ids = False

    def require_hot(self, request_id: str) -> None:
        """Give the request its region at its next allocation."""
        self.hot_required.add(request_id)

    def has_hot(self, request_id: str) -> bool:
        """Whether the request holds its whole region."""
        blocks = self.req_to_blocks.get(request_id)
        return (0 if blocks is None else len(blocks)) == self.blocks_per_request

    def get_num_required_blocks(self, request_id: str) -> int:
        """Blocks the request's region still lacks."""
        blocks = self.req_to_blocks.get(request_id)
        return max(self.blocks_per_request - (0 if blocks is None else len(blocks)), 0)

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
        """The region's missing blocks when the request must read the host (an
        external import, a new request with a local hit, or ``require_hot``), else 0.

        Raises:
            ValueError: for prefix hits (a hot group has none).
        """
        if len(new_computed_blocks):
            raise ValueError(f"group {self.kv_cache_group_id} (HiSparse hot) takes no hits")
        host_import = total_computed_tokens > num_local_computed_tokens
        resumes_host_prefix = (
            num_local_computed_tokens > 0 and request_id not in self.num_cached_block
        )
        if host_import or resumes_host_prefix or request_id in self.hot_required:
            return self.get_num_required_blocks(request_id)
        return 0

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Admit the request (no blocks yet); a local hit, or a layout without
        resident groups, needs the region (``require_hot``)."""
        if len(new_computed_blocks):
            raise ValueError(f"group {self.kv_cache_group_id} (HiSparse hot) takes no hits")
        self.num_cached_block[request_id] = 0
        coordinator = _hisparse_coordinator(self, self.coordinator)
        if num_local_computed_tokens > 0 or not coordinator.resident_managers:
            self.require_hot(request_id)

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """An import is read from the host: the request needs its region."""
        self.require_hot(request_id)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """The region's missing blocks if the request needs it, else nothing; the
        request counts as admitted either way."""
        self.num_cached_block[request_id] = 0
        if request_id not in self.hot_required:
            return []
        req_blocks = self.req_to_blocks[request_id]
        num_new_blocks = self.blocks_per_request - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request (its region request too)."""
        self.hot_required.discard(request_id)
        return super().pop_blocks_for_free(request_id)


class HiSparseResidentManager(_HiSparseAuxiliaryManager):
    """A HiSparse resident group (``HiSparseResidentSpec``): per request, the GPU
    blocks its pages are read from. In the table a host-only page is the null block,
    and the table only grows; ``residency_changes`` (request -> page -> block, the
    null block for a page no longer resident) overlays it: ``adopt_resident_page``,
    ``drop_resident_page``, ``get_resident_page``, ``get_residency_row``.

    Admission counts the pages past the host prefix (capped at the admission window
    under ``apply_admission_cap``); an import keeps only its last page writable and
    resident, earlier imported pages stay host-only.
    """

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        scheduler_block_size: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        max_admission_blocks_per_request: int | None = None,
        needs_kv_cache_zeroing: bool = False,
    ) -> None:
        if not isinstance(max_admission_blocks_per_request, int) or (
            max_admission_blocks_per_request <= 0
        ):
            raise ValueError(
                f"max_admission_blocks_per_request={max_admission_blocks_per_request!r}: "
                "a HiSparse resident group needs its admission window (a positive int)"
            )
        # NOTE: explicit arguments, not **kwargs (mypyc forwards **kwargs wrongly).
        super().__init__(
            kv_cache_spec,
            block_pool,
            enable_caching,
            kv_cache_group_id,
            scheduler_block_size,
            dcp_world_size,
            pcp_world_size,
            max_admission_blocks_per_request,
        )
        self.max_admission_blocks_per_request: int = max_admission_blocks_per_request
        self.residency_changes: dict[str, dict[int, KVCacheBlock]] = {}
        self._tracks_new_block_ids = False

    def _num_pages(self, request_id: str) -> int:
        blocks = self.req_to_blocks.get(request_id)
        return 0 if blocks is None else len(blocks)

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
        """GPU pages the request still needs for ``num_tokens`` tokens.

        With an import (``total_computed_tokens`` past the local ones) the imported
        pages stay host-only but the last, which must be resident and writable (one
        block unless it is already); past the import, one block per new page. Else
        the pages past the host prefix and the pages held (at most the admission
        window's under ``apply_admission_cap``).

        Raises:
            ValueError: for prefix hits (a resident group has none).
        """
        if len(new_computed_blocks):
            raise ValueError(f"group {self.kv_cache_group_id} (HiSparse resident) takes no hits")
        existing = self._num_pages(request_id)
        required = cdiv(num_tokens, self.block_size)
        if total_computed_tokens > num_local_computed_tokens:
            imported_pages = cdiv(total_computed_tokens, self.block_size)
            needs_tail = self.get_resident_page(request_id, imported_pages - 1) is None
            return int(needs_tail) + max(required - max(imported_pages, existing), 0)
        host_pages = cdiv(num_local_computed_tokens, self.block_size)
        if apply_admission_cap:
            required = min(required, self.max_admission_blocks_per_request)
        return max(required - max(existing, host_pages), 0)

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """Pad the imported pages with the null block (host-only) and give the last
        one a writable GPU block unless it is resident already."""
        if num_external_computed_tokens <= 0:
            raise ValueError(
                f"num_external_computed_tokens={num_external_computed_tokens}: an import "
                "needs tokens"
            )
        num_tokens = num_local_computed_tokens + num_external_computed_tokens
        blocks = self.req_to_blocks[request_id]
        tail_page = (num_tokens - 1) // self.block_size
        if len(blocks) <= tail_page:
            blocks.extend([self._null_block] * (tail_page + 1 - len(blocks)))
        if self.get_resident_page(request_id, tail_page) is None:
            blocks[tail_page] = self.block_pool.get_new_blocks(1)[0]

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Admit the request with its host prefix hit as host-only pages (null
        blocks) and tell the coordinator (``commit_computed_blocks``)."""
        if len(new_computed_blocks):
            raise ValueError(f"group {self.kv_cache_group_id} (HiSparse resident) takes no hits")
        req_blocks = self.req_to_blocks[request_id]
        if req_blocks:
            raise ValueError(f"request {request_id!r} already has blocks; hits come first")
        num_host_pages = cdiv(num_local_computed_tokens, self.block_size)
        req_blocks.extend([self._null_block] * num_host_pages)
        self.num_cached_block[request_id] = 0
        _hisparse_coordinator(self, self.coordinator).commit_computed_blocks(
            request_id, num_host_pages
        )

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """A GPU block for each new page up to ``num_tokens`` tokens."""
        req_blocks = self.req_to_blocks[request_id]
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Tell the coordinator (``free``), forget the request, and return its
        residency row (changes applied) without its leading null blocks."""
        _hisparse_coordinator(self, self.coordinator).free(request_id)
        row = self.get_residency_row(request_id)
        self.residency_changes.pop(request_id, None)
        super().pop_blocks_for_free(request_id)
        return trim_null_head(row)

    def adopt_resident_page(self, request_id: str, block_idx: int, block: KVCacheBlock) -> bool:
        """Read host-only page ``block_idx`` from ``block`` (a GPU copy of it) from
        now on; False (nothing changes) past the table or if the page is resident."""
        if block_idx >= self._num_pages(request_id):
            return False
        if self.get_resident_page(request_id, block_idx) is not None:
            return False
        self.residency_changes.setdefault(request_id, {})[block_idx] = block
        return True

    def drop_resident_page(self, request_id: str, block_idx: int) -> KVCacheBlock | None:
        """Stop reading page ``block_idx`` from the GPU; the block it was read from
        (None if it was host-only)."""
        block = self.get_resident_page(request_id, block_idx)
        if block is not None:
            self.residency_changes.setdefault(request_id, {})[block_idx] = self._null_block
        return block

    def get_resident_page(self, request_id: str, block_idx: int) -> KVCacheBlock | None:
        """The GPU block page ``block_idx`` is read from, None if host-only or past
        the table."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or block_idx >= len(blocks):
            return None
        block = blocks[block_idx]
        changes = self.residency_changes.get(request_id)
        if changes:
            block = changes.get(block_idx, block)
        return None if block.is_null else block

    def get_residency_row(self, request_id: str, start: int = 0) -> list[KVCacheBlock]:
        """The request's pages from ``start`` with the changes applied (host-only
        pages as the null block)."""
        blocks = self.req_to_blocks.get(request_id)
        row = [] if blocks is None else blocks[start:]
        changes = self.residency_changes.get(request_id)
        if not changes:
            return row
        return [changes.get(i, block) for i, block in enumerate(row, start)]
