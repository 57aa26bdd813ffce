"""Prefix-cache hit statistics (vLLM 0.25.1's ``PrefixCacheStats`` fields)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PrefixCacheStats:
    """Hit counts since the last ``KVCacheManager.make_prefix_cache_stats`` call.

    ``queries`` and ``hits`` count tokens; requests that were preempted before
    are counted apart in the ``preempted_*`` fields.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Add one lookup of ``num_tokens`` tokens that hit ``num_hits`` of them."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


@dataclass
class PrefixCacheStatsBySource(PrefixCacheStats):
    """vLLM 0.32.0's and later stats (the ``stats_hits_by_source`` switch): 0.25.1's
    fields plus ``hits_by_source``, hits per cache tier, filled by connectors only
    (local lookups leave it empty)."""

    hits_by_source: dict[str, int] = field(default_factory=dict)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled through the module function: the class carries vLLM's name,
        # PrefixCacheStats, which pickle would resolve to 0.25.1's class.
        return _stats_by_source, (dataclasses.astuple(self),)


PrefixCacheStatsBySource.__name__ = PrefixCacheStatsBySource.__qualname__ = "PrefixCacheStats"


def _stats_by_source(values: tuple[Any, ...]) -> PrefixCacheStatsBySource:
    """A ``PrefixCacheStatsBySource`` from its field values (unpickling)."""
    return PrefixCacheStatsBySource(*values)


@dataclass
class KVCacheEvictionEvent:
    """One sampled block leaving the prefix cache (``KVCacheMetricsCollector``):
    how long it lived since allocation, how long since its last hit, and the
    gaps between its last few hits, in seconds."""

    lifetime_seconds: float
    idle_seconds: float
    reuse_gaps_seconds: tuple[float, ...]
