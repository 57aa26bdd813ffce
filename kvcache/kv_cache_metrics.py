"""Sampled block residency metrics (vLLM 0.25.1's ``KVCacheMetricsCollector``).

The ``BlockPool`` reports three moments of a block's life to the collector it
was given: allocation (``get_new_blocks``), a prefix hit (``touch``) and
eviction (a block taken for reuse while caching is on, or ``evict_blocks``);
``reset_prefix_cache`` clears it. A ``sample_rate`` share of allocations is
followed (one ``random.random()`` draw per allocation); when a followed block
is evicted, its lifetime, idle time and reuse gaps become a
``KVCacheEvictionEvent``, which the scheduler drains into its stats.

Clock and sampling are read through the ``time`` and ``random`` modules at
call time (``time.monotonic_ns``, ``random.random``), as vLLM reads them, so
patching either affects both implementations alike.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from typing import Any

from kvcache.metrics import KVCacheEvictionEvent

ACCESS_HISTORY_LEN = 4
"""Hits remembered per followed block (so at most 3 reuse gaps)."""

_NS_PER_S = 1e9


class BlockMetricsState:
    """The life of one followed block: birth, last hit and the recent hits (ns)."""

    def __init__(self) -> None:
        self.birth_time_ns = self.last_access_ns = time.monotonic_ns()
        self.access_history: deque[int] = deque(maxlen=ACCESS_HISTORY_LEN)

    def record_access(self) -> None:
        """A prefix hit now."""
        self.last_access_ns = time.monotonic_ns()
        self.access_history.append(self.last_access_ns)

    def get_lifetime_seconds(self) -> float:
        """Seconds since allocation."""
        return (time.monotonic_ns() - self.birth_time_ns) / _NS_PER_S

    def get_idle_time_seconds(self) -> float:
        """Seconds since the last hit (or allocation, without one)."""
        return (time.monotonic_ns() - self.last_access_ns) / _NS_PER_S

    def get_reuse_gaps_seconds(self) -> list[float]:
        """Seconds between consecutive remembered hits (empty below two hits)."""
        hits = list(self.access_history)
        return [(later - earlier) / _NS_PER_S for earlier, later in itertools.pairwise(hits)]


class KVCacheMetricsCollector:
    """Follows a random ``sample_rate`` share of allocated blocks until eviction.

    Args:
        sample_rate: Probability in (0, 1] that an allocation is followed.

    Raises:
        ValueError: (also an ``AssertionError``, as vLLM asserts) for a
            ``sample_rate`` outside (0, 1].
    """

    def __init__(self, sample_rate: float = 0.01) -> None:
        if not 0 < sample_rate <= 1.0:
            raise SampleRateError(f"sample_rate must be in (0, 1.0], got {sample_rate!r}")
        self.sample_rate = sample_rate
        self.block_metrics: dict[int, BlockMetricsState] = {}
        self._eviction_events: list[KVCacheEvictionEvent] = []

    def should_sample_block(self) -> bool:
        """One draw: whether to follow the block being allocated."""
        return random.random() < self.sample_rate

    def on_block_allocated(self, block: Any) -> None:
        """``block`` was taken from the free queue; maybe start following it."""
        if self.should_sample_block():
            self.block_metrics[block.block_id] = BlockMetricsState()

    def on_block_accessed(self, block: Any) -> None:
        """``block`` was hit by a request (``BlockPool.touch``)."""
        state = self.block_metrics.get(block.block_id)
        if state is not None:
            state.record_access()

    def on_block_evicted(self, block: Any) -> None:
        """``block`` leaves the cache: a followed one yields an eviction event."""
        state = self.block_metrics.pop(block.block_id, None)
        if state is None:
            return
        self._eviction_events.append(
            KVCacheEvictionEvent(
                lifetime_seconds=state.get_lifetime_seconds(),
                idle_seconds=state.get_idle_time_seconds(),
                reuse_gaps_seconds=tuple(state.get_reuse_gaps_seconds()),
            )
        )

    def reset(self) -> None:
        """Forget every followed block and pending event (prefix cache reset)."""
        self.block_metrics.clear()
        self._eviction_events.clear()

    def drain_events(self) -> list[KVCacheEvictionEvent]:
        """The eviction events since the last drain (and forget them)."""
        events, self._eviction_events = self._eviction_events, []
        return events


class SampleRateError(ValueError, AssertionError):
    """A ``sample_rate`` outside (0, 1]: a ``ValueError`` and vLLM's ``AssertionError``."""
