"""vLLM 0.25.1's own ``Scheduler`` runs on ``kvcache.KVCacheManager`` unchanged.

The driver is ``kvcache.kit.scheduler_drive`` (its docstring says what is
compared): for each stream, vLLM's stock scheduler and one whose
``KVCacheManager`` is kvcache's get the same requests and model outputs, and
every step's ``SchedulerOutput``, engine outputs and prefix-cache stats must be
identical. ``make conformance-0.33`` runs the same streams on vLLM 0.33.0's
Scheduler with ``kvcache.vllm_0_33.KVCacheManager``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import kvcache as K
from kvcache.kit import scheduler_drive
from kvcache.kit.scheduler_drive import STREAMS, Stream

pytestmark = [pytest.mark.conformance, pytest.mark.usefixtures("vllm_reference")]


@pytest.fixture(scope="module")
def cpu_platform() -> Iterator[None]:
    """vLLM's CPU platform and an offline hub while the module's tests run."""
    with scheduler_drive.cpu_platform():
        yield


@pytest.mark.parametrize("stream", STREAMS, ids=[s.name for s in STREAMS])
def test_vllm_scheduler_on_kvcache_matches_stock(stream: Stream, cpu_platform: None) -> None:
    """Step by step, vLLM's Scheduler on kvcache makes the same decisions as on vLLM."""
    result = scheduler_drive.compare(stream, K.KVCacheManager, seed=7)
    print(result.summary())
    assert result.requests == stream.num_requests and result.finished == stream.num_requests
    assert result.hits > 0  # the stream really shares prefixes
    assert result.preemptions > 0  # the pool is small enough to preempt
    assert (result.encoder_inputs > 0) == stream.multimodal
    assert (result.embed_requests > 0) == stream.embeds


EVENT_STREAMS = [s for s in STREAMS if s.name in ("shared_prefix_preemption", "hybrid_full_swa")]


@pytest.mark.parametrize("stream", EVENT_STREAMS, ids=[s.name for s in EVENT_STREAMS])
def test_published_kv_events_decode_as_stock(
    stream: Stream, cpu_platform: None, tmp_path: Path
) -> None:
    """The README's drop-in with KV-cache events on: vLLM's ZmqEventPublisher sends
    kvcache's events over ipc, a subscriber decodes them with vLLM's own
    ``KVEventBatch`` decoder, and the decoded stream equals stock vLLM's event for
    event (types, hashes, parents, tokens, block size, LoRA, medium, group)."""
    ours = scheduler_drive.published_events(
        stream, K.KVCacheManager, 7, f"ipc://{tmp_path}/kvcache.ipc"
    )
    stock = scheduler_drive.published_events(stream, None, 7, f"ipc://{tmp_path}/stock.ipc")
    kinds = {type(e).__name__ for batch in stock for e in batch}
    assert {"BlockStored", "BlockRemoved"} <= kinds  # evictions happen under the small pool
    assert len(ours) == len(stock)
    for i, (a, b) in enumerate(zip(ours, stock, strict=True)):
        assert a == b, f"batch {i} differs"
