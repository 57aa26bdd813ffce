"""Block residency metrics: kvcache's pool and collector give vLLM 0.25.1's figures.

One seeded random sequence of scheduler calls (admissions with prefix hits,
frees, pool pressure that evicts cached blocks, ``evict_blocks``,
``reset_prefix_cache``) runs on vLLM's manager with vLLM's
``KVCacheMetricsCollector`` and on kvcache's with kvcache's collector (and with
vLLM's, which kvcache must drive unchanged). The clock (``time.monotonic_ns``)
is a step counter and ``random`` is seeded identically before each run, with a
sample rate of 0.5, so the same allocations are sampled only if both pools
report the same allocations in the same order. After every call the followed
blocks (birth, last access, access history) and the drained eviction events
must be equal.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable
from typing import Any

import pytest

import kvcache as K
from kvcache.kit.config import ManagerConfig
from kvcache.kit.sides import Adapter, Side
from kvcache.kv_cache_metrics import KVCacheMetricsCollector

pytestmark = pytest.mark.usefixtures("vllm_reference")

SAMPLE_RATE = 0.5


class Clock:
    """``time.monotonic_ns`` replaced by a value the test advances per call."""

    def __init__(self) -> None:
        self.now = 1_000_000_000

    def __call__(self) -> int:
        return self.now


def script(seed: int, steps: int) -> list[tuple[str, dict[str, Any]]]:
    """A seeded sequence of (op, args): requests from a 2-token alphabet share
    prefixes; the pool is small, so admissions evict cached blocks."""
    rng = random.Random(seed)
    bases = [[rng.randrange(2) for _ in range(8)] for _ in range(3)]
    ops: list[tuple[str, dict[str, Any]]] = []
    running: list[str] = []
    for i in range(steps):
        roll = rng.random()
        if roll < 0.55 or not running:
            rid = f"r{i}"
            prompt = [*rng.choice(bases)[:rng.randint(1, 8)], rng.randrange(2)]
            ops.append(("add", {"request_id": rid, "prompt_token_ids": prompt}))
            running.append(rid)
        elif roll < 0.85:
            ops.append(("free", {"request_id": running.pop(rng.randrange(len(running)))}))
        elif roll < 0.95:
            ops.append(("evict_blocks", {"block_ids": rng.sample(range(1, 12), 3)}))
        else:
            ops.append(("reset_prefix_cache", {}))
    return ops


def vllm_side(config: ManagerConfig, collector: Any) -> Side:
    from vllm.v1 import kv_cache_interface as V
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvcache.kit.vllm_side import VllmAdapter, build_kv_cache_config

    class WithCollector(VllmAdapter):
        def build_manager(self, config: ManagerConfig) -> Any:
            import torch

            kv_cache_config = build_kv_cache_config(V, config, torch.float16)
            return KVCacheManager(
                kv_cache_config, **config.manager_kwargs(), metrics_collector=collector
            )

    return Side(WithCollector(), config)


def kvcache_side(config: ManagerConfig, collector: Any) -> Side:
    factory = functools.partial(K.KVCacheManager, metrics_collector=collector)
    return Side(Adapter("kvcache", factory), config)


def snapshot(collector: Any) -> dict[str, Any]:
    return {
        "followed": {
            block_id: (s.birth_time_ns, s.last_access_ns, list(s.access_history))
            for block_id, s in sorted(collector.block_metrics.items())
        },
        "events": [
            (e.lifetime_seconds, e.idle_seconds, e.reuse_gaps_seconds)
            for e in collector.drain_events()
        ],
    }


def run(
    make_side: Callable[[ManagerConfig, Any], Side],
    collector: Any,
    config: ManagerConfig,
    ops: list[tuple[str, dict[str, Any]]],
    clock: Clock,
    seed: int,
) -> list[Any]:
    """Every call's result and the collector's figures after it."""
    side = make_side(config, collector)
    random.seed(seed)
    trail: list[Any] = []
    for step, (op, args) in enumerate(ops):
        clock.now = 1_000_000_000 + step * 250_000_000
        if op == "add":
            side.call("add_request", args)
            hit = side.call("get_computed_blocks", {"request_id": args["request_id"]})
            n = len(args["prompt_token_ids"]) - hit["num_computed_tokens"]
            result = side.call("allocate_slots", {
                "request_id": args["request_id"], "num_new_tokens": n,
                "num_new_computed_tokens": hit["num_computed_tokens"],
                "new_computed_blocks": "last",
            })
            if result is not None:
                side.call("cache_blocks", {"request_id": args["request_id"],
                                           "num_computed_tokens": len(args["prompt_token_ids"])})
            trail.append((op, hit, result))
        else:
            trail.append((op, side.call(op, args)))
        trail.append(snapshot(collector))
    return trail


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_residency_figures_equal_vllms(
    monkeypatch: pytest.MonkeyPatch, seed: int, caching: bool
) -> None:
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector as VllmCollector

    clock = Clock()
    monkeypatch.setattr(time, "monotonic_ns", clock)
    config = ManagerConfig.full_attention(12, 2, 64, enable_caching=caching)
    ops = script(seed, 160)
    expected = run(vllm_side, VllmCollector(SAMPLE_RATE), config, ops, clock, seed)
    ours = run(kvcache_side, KVCacheMetricsCollector(SAMPLE_RATE), config, ops, clock, seed)
    theirs_on_ours = run(kvcache_side, VllmCollector(SAMPLE_RATE), config, ops, clock, seed)
    # The sequence must exercise what it checks: sampling, hits, evictions.
    figures = [t for t in expected if isinstance(t, dict)]
    assert any(f["followed"] for f in figures)
    if caching:  # hits (two or more remembered accesses) and evictions
        assert any(len(s[2]) > 1 for f in figures for s in f["followed"].values())
        assert any(f["events"] for f in figures)
    assert ours == expected
    assert theirs_on_ours == expected


def test_collector_rejects_a_bad_sample_rate_as_vllm_does() -> None:
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector as VllmCollector

    for rate in (0.0, 1.5, -1.0):
        with pytest.raises(AssertionError):
            VllmCollector(rate)
        with pytest.raises(AssertionError):
            KVCacheMetricsCollector(rate)
        with pytest.raises(ValueError, match="sample_rate"):
            KVCacheMetricsCollector(rate)
