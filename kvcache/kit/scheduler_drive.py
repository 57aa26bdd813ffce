"""vLLM's own ``Scheduler`` driven on a kvcache manager and on vLLM's, step by step.

Two schedulers are built from one offline ``VllmConfig`` (the hand-written
``tests/data/tiny_llama/config.json``, no tokenizer, vLLM's CPU platform):
vLLM's stock one, and one whose ``KVCacheManager`` is kvcache's (the name
``KVCacheManager`` in ``vllm.v1.core.sched.scheduler`` patched while it is
constructed: the README's "Drop-in with vLLM's Scheduler"). Both receive the
same request stream and the same model-runner outputs (one sampled token per
request that finished its prefill; requests finish on ``max_tokens``) for a few
hundred steps, and every step's ``SchedulerOutput`` (new requests with their
block ids, cached requests with new block ids, scheduled tokens, encoder
inputs, common-prefix blocks, preempted and finished ids, blocks to zero), the
engine outputs and the prefix-cache stats must be identical (``compare``).

Streams: shared prefixes with preemption under a small pool; multimodal
requests (``mm_features`` with ``PlaceholderRange``, shared images); prompt
embeddings (vLLM's ``Request`` hashes them itself, so kvcache's own embedding
hashing is not exercised here); and a hybrid full + sliding-window layout with
two KV-cache groups.

The same code drives vLLM 0.25.1's Scheduler on ``kvcache.KVCacheManager``
(``tests/scheduler/test_vllm_scheduler.py``) and vLLM 0.33.0's on
``kvcache.vllm_0_33.KVCacheManager`` (``make conformance-0.33``). Importing this
module imports nothing of vLLM; its functions do.

The model here is text-only, so vLLM sizes no encoder budget; the multimodal
stream gives both schedulers the same encoder budget and encoder cache after
construction (the scheduler-side state a multimodal model would give them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

MODEL_DIR = Path(__file__).resolve().parents[2] / "tests" / "data" / "tiny_llama"
BLOCK_SIZE = 16
MAX_MODEL_LEN = 512
STEPS = 300


@contextlib.contextmanager
def cpu_platform() -> Iterator[None]:
    """Pin vLLM's CPU platform when vLLM detects none (a CPU-only install of the
    reference) and keep the Hugging Face hub offline, restoring both afterwards.

    Modules that imported ``current_platform`` before this ran hold the old
    object, so every such module attribute is repointed too.
    """
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import UnspecifiedPlatform

    resolved = platforms._current_platform
    detected = (
        not isinstance(resolved, UnspecifiedPlatform)
        if resolved is not None
        else not platforms.resolve_current_platform_cls_qualname().endswith("UnspecifiedPlatform")
    )

    old_env = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    hub_constants = sys.modules.get("huggingface_hub.constants")
    old_hub = getattr(hub_constants, "HF_HUB_OFFLINE", None)
    if hub_constants is not None:
        hub_constants.HF_HUB_OFFLINE = True  # type: ignore[attr-defined]
    old = platforms._current_platform
    repointed = []
    if not detected:
        cpu = CpuPlatform()
        platforms._current_platform = cpu
        for module in list(sys.modules.values()):
            # The module's own namespace: getattr would run a lazy module's __getattr__.
            namespace = getattr(module, "__dict__", None) or {}
            if old is not None and namespace.get("current_platform") is old:
                module.current_platform = cpu  # type: ignore[attr-defined]
                repointed.append(module)
    try:
        yield
    finally:
        if not detected:
            platforms._current_platform = old
        for module in repointed:
            module.current_platform = old  # type: ignore[attr-defined]
        if hub_constants is not None:
            hub_constants.HF_HUB_OFFLINE = old_hub  # type: ignore[attr-defined]
        if old_env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old_env


@dataclasses.dataclass(frozen=True)
class Stream:
    """One scenario: pool layout and size, and how requests are made."""

    name: str
    num_blocks: int
    hybrid: bool = False
    multimodal: bool = False
    embeds: bool = False
    num_requests: int = 48


STREAMS = [
    Stream("shared_prefix_preemption", num_blocks=40, num_requests=64),
    Stream("multimodal", num_blocks=48, multimodal=True, num_requests=64),
    Stream("prompt_embeds", num_blocks=48, embeds=True, num_requests=56),
    Stream("hybrid_full_swa", num_blocks=64, hybrid=True, num_requests=64),
]


def _vllm_config(num_blocks: int, events_endpoint: str | None = None) -> Any:
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.config.kv_events import KVEventsConfig

    model_config = ModelConfig(
        model=str(MODEL_DIR),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=MAX_MODEL_LEN,
        enable_prompt_embeds=True,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=128,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        watermark=0.0,
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    cache_config.num_gpu_blocks = num_blocks
    events = None
    if events_endpoint is not None:
        events = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=events_endpoint, topic="kv"
        )
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_events_config=events,
    )


def _kv_cache_config(stream: Stream) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    attn: dict[str, Any] = dict(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float32
    )
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn"], FullAttentionSpec(**attn))]
    if stream.hybrid:
        window = SlidingWindowSpec(**attn, sliding_window=2 * BLOCK_SIZE)
        groups.append(KVCacheGroupSpec(["model.layers.1.self_attn"], window))
    return KVCacheConfig(num_blocks=stream.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def build_scheduler(
    stream: Stream, manager_cls: type | None, events_endpoint: str | None = None
) -> Any:
    """vLLM's ``Scheduler``; with ``manager_cls`` (a kvcache manager class), that
    manager swapped in, else vLLM's own. With ``events_endpoint`` (a ZMQ address),
    KV-cache events are on and vLLM's ``ZmqEventPublisher`` binds there."""
    import vllm.v1.core.sched.scheduler as scheduler_module
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config = _vllm_config(stream.num_blocks, events_endpoint)
    register_all_kvcache_specs(vllm_config)

    def make() -> Any:
        return scheduler_module.Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=_kv_cache_config(stream),
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK_SIZE,
            log_stats=True,
        )

    if manager_cls is not None:
        # The one-line drop-in: vLLM's scheduler module names kvcache's manager.
        with mock.patch.object(scheduler_module, "KVCacheManager", manager_cls):
            scheduler = make()
        if not isinstance(scheduler.kv_cache_manager, manager_cls):
            raise SchedulerDiffers(f"the scheduler did not build {manager_cls.__name__}")
    else:
        scheduler = make()
    if stream.multimodal:
        scheduler.max_num_encoder_input_tokens = 256
        scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=512)
    return scheduler


# ---------------------------------------------------------------- the request stream


def request_stream(stream: Stream, seed: int) -> list[tuple[int, Callable[[Any], Any]]]:
    """``(arrival step, factory)`` pairs; each factory builds a fresh vLLM ``Request``
    (given the block hasher), so both schedulers get equal, unshared objects."""
    import torch
    from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 900) for _ in range(rng.choice((16, 40, 64)))] for _ in range(3)]
    hidden = 64  # the tiny model's hidden size
    embed_bank = [
        torch.randn(200, hidden, generator=torch.Generator().manual_seed(i)) for i in range(3)
    ]
    out: list[tuple[int, Callable[[Any], Any]]] = []
    step = 0
    for i in range(stream.num_requests):
        step += rng.choice((0, 0, 1, 2, 5))
        prefix = rng.choice(prefixes)
        tail = [rng.randrange(3, 900) for _ in range(rng.randrange(1, 120))]
        tokens = (prefix + tail)[: MAX_MODEL_LEN // 2]
        max_tokens = rng.randrange(2, 48)
        request_id = f"{stream.name}-{i}"
        mm_spec: list[tuple[str, int, int]] = []
        if stream.multimodal and rng.random() < 0.7:
            length = rng.choice((8, 20, 33))
            offset = rng.randrange(0, max(1, len(tokens) - length))
            if offset + length <= len(tokens):
                mm_spec.append((f"image-{rng.randrange(4)}-{length}", offset, length))
        embeds: tuple[int, int, int] | None = None
        if stream.embeds and rng.random() < 0.6:
            # (bank, start, length): requests sharing a bank slice share a prefix
            # that only their embeddings tell apart from other banks.
            embeds = (rng.randrange(3), 0, rng.randrange(20, 160))

        def factory(
            block_hasher: Any,
            tokens: list[int] = tokens,
            max_tokens: int = max_tokens,
            request_id: str = request_id,
            mm_spec: list[tuple[str, int, int]] = mm_spec,
            embeds: tuple[int, int, int] | None = embeds,
            arrival: int = step,
        ) -> Any:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            features = [
                MultiModalFeatureSpec(
                    data=MultiModalKwargsItem.dummy(),
                    modality="image",
                    identifier=identifier,
                    mm_position=PlaceholderRange(offset=offset, length=length),
                )
                for identifier, offset, length in mm_spec
            ]
            prompt_embeds = None
            prompt_token_ids: list[int] | None = list(tokens)
            if embeds is not None:
                bank, start, length = embeds
                prompt_embeds = embed_bank[bank][start : start + length].clone()
                prompt_token_ids = None
            return Request(
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                sampling_params=params,
                pooling_params=None,
                arrival_time=float(arrival),
                prompt_embeds=prompt_embeds,
                mm_features=features or None,
                block_hasher=block_hasher,
            )

        out.append((step, factory))
    return out


# ---------------------------------------------------------------- the model runner and snapshots


def _token(request_id: str, position: int) -> int:
    """The token the fake model samples: a fixed function of request and position."""
    return 3 + (sum(map(ord, request_id)) * 31 + position * 7) % 890


def model_output(scheduler: Any, output: Any) -> Any:
    """One sampled token for each scheduled request whose prompt is fully computed."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([_token(req_id, request.num_tokens)] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def _ids(block_ids: Any) -> Any:
    return None if block_ids is None else [list(group) for group in block_ids]


def snapshot(output: Any) -> dict[str, Any]:
    """The parts of a ``SchedulerOutput`` the KV-cache manager decides or shapes."""
    cached = output.scheduled_cached_reqs
    return {
        "new": [
            (
                r.req_id,
                r.prompt_token_ids,
                _ids(r.block_ids),
                r.num_computed_tokens,
                [f.identifier for f in r.mm_features],
                r.prompt_embeds is not None,
            )
            for r in output.scheduled_new_reqs
        ],
        "cached": (
            list(cached.req_ids),
            sorted(cached.resumed_req_ids),
            [_ids(b) for b in cached.new_block_ids],
            list(cached.num_computed_tokens),
            list(cached.num_output_tokens),
        ),
        "num_scheduled_tokens": dict(output.num_scheduled_tokens),
        "total": output.total_num_scheduled_tokens,
        "encoder_inputs": {k: list(v) for k, v in output.scheduled_encoder_inputs.items()},
        "common_prefix": list(output.num_common_prefix_blocks),
        "finished": sorted(output.finished_req_ids),
        "preempted": sorted(output.preempted_req_ids or ()),
        "zero": output.new_block_ids_to_zero,
        "free_mm": list(output.free_encoder_mm_hashes),
    }


def engine_snapshot(outputs: Any) -> Any:
    """Per client: each request's new tokens and finish reason, and the stats that
    come from the KV-cache manager (usage, prefix-cache queries and hits)."""
    result = []
    for client, engine_outputs in sorted(outputs.items()):
        stats = engine_outputs.scheduler_stats
        prefix = None
        if stats is not None:
            p = stats.prefix_cache_stats
            prefix = (round(stats.kv_cache_usage, 12), p.requests, p.queries, p.hits,
                      p.preempted_requests, p.preempted_queries, p.preempted_hits)  # fmt: skip
        result.append((
            client,
            [(o.request_id, list(o.new_token_ids), str(o.finish_reason))
             for o in engine_outputs.outputs],
            prefix,
        ))  # fmt: skip
    return result


def run(stream: Stream, manager_cls: type | None, seed: int) -> Iterator[tuple[Any, Any]]:
    """Drive one scheduler (``build_scheduler``); yield each step's (scheduler
    snapshot, engine snapshot)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    scheduler = build_scheduler(stream, manager_cls)
    pending = request_stream(stream, seed)
    for step in range(STEPS):
        while pending and pending[0][0] <= step:
            scheduler.add_request(pending.pop(0)[1](hasher))
        output = scheduler.schedule()
        engine = scheduler.update_from_output(output, model_output(scheduler, output))
        yield snapshot(output), engine_snapshot(engine)
        if not pending and not scheduler.has_unfinished_requests():
            break


def published_events(
    stream: Stream, manager_cls: type | None, seed: int, endpoint: str
) -> list[list[Any]]:
    """Run ``stream`` on vLLM's Scheduler with KV-cache events published by vLLM's
    own ``ZmqEventPublisher`` at ``endpoint`` (an ``ipc://`` path or a 127.0.0.1
    port), and return what a subscriber decodes with vLLM's ``KVEventBatch``
    decoder: the events of each batch, in order.

    A subscriber joins a PUB socket asynchronously, so empty probe batches are
    published until one arrives (at most ``PROBES`` tries); the stream's batches
    then follow, and their sequence numbers must have no gap. Every loop is
    bounded by a count and the sockets are closed on the way out.

    Raises:
        SchedulerDiffers: when no probe arrives, a batch is missing, or a payload
            does not decode (what vLLM's subscribers would see).
    """
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    scheduler = build_scheduler(stream, manager_cls, endpoint)
    sub: Any = zmq.Context.instance().socket(zmq.SUB)
    batches: list[list[Any]] = []
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(endpoint)
        for _ in range(PROBES):  # the join handshake
            scheduler.kv_event_publisher.publish(KVEventBatch(ts=0.0, events=[]))
            if sub.poll(20):
                break
        else:
            raise SchedulerDiffers(f"{stream.name}: no probe batch reached the subscriber")
        pending = request_stream(stream, seed)
        for step in range(STEPS):
            while pending and pending[0][0] <= step:
                scheduler.add_request(pending.pop(0)[1](hasher))
            output = scheduler.schedule()
            scheduler.update_from_output(output, model_output(scheduler, output))
            if not pending and not scheduler.has_unfinished_requests():
                break
        scheduler.shutdown()  # the publisher thread sends what it holds, then stops
        last_seq = None
        for _ in range(STEPS * 4 + PROBES):
            if not sub.poll(1000):
                break
            _topic, seq_bytes, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if last_seq is not None and seq != last_seq + 1:
                raise SchedulerDiffers(f"{stream.name}: batch {last_seq + 1} never arrived")
            last_seq = seq
            try:
                batch = decoder.decode(payload)
            except msgspec.DecodeError as exc:  # ValidationError included
                raise SchedulerDiffers(
                    f"{stream.name}: batch {seq} does not decode as vLLM's KVEventBatch: {exc}"
                ) from exc
            if batch.events:
                batches.append(list(batch.events))
    finally:
        sub.close(linger=0)
    return batches


PROBES = 250
"""Empty batches published, at most, before a subscriber is known to have joined."""


class SchedulerDiffers(AssertionError):
    """vLLM's Scheduler decided differently on kvcache than on vLLM's own manager."""


@dataclasses.dataclass
class Comparison:
    """What one stream did, identically on both managers."""

    stream: str
    steps: int = 0
    preemptions: int = 0
    requests: int = 0
    finished: int = 0
    hits: int = 0
    encoder_inputs: int = 0
    embed_requests: int = 0

    def summary(self) -> str:
        """One line, as the tests print it."""
        return (
            f"vllm scheduler on kvcache [{self.stream}]: {self.steps} steps, "
            f"{self.preemptions} preemptions, {self.requests} requests, {self.finished} "
            f"finished, {self.hits} prefix-hit tokens: identical"
        )


def compare(stream: Stream, manager_cls: type, seed: int = 7) -> Comparison:
    """Run ``stream`` on vLLM's Scheduler with ``manager_cls`` and with vLLM's own
    manager, step by step.

    Raises:
        SchedulerDiffers: at the first step whose ``SchedulerOutput`` or engine
            outputs differ.
    """
    result = Comparison(stream.name)
    requests: set[str] = set()
    for step, ((ours, ours_engine), (theirs, theirs_engine)) in enumerate(
        zip(run(stream, manager_cls, seed), run(stream, None, seed), strict=True)
    ):
        if ours != theirs:
            raise SchedulerDiffers(f"{stream.name}: SchedulerOutput differs at step {step}")
        if ours_engine != theirs_engine:
            raise SchedulerDiffers(f"{stream.name}: engine outputs differ at step {step}")
        result.steps += 1
        result.preemptions += len(theirs["preempted"])
        requests.update(theirs["num_scheduled_tokens"])
        result.encoder_inputs += len(theirs["encoder_inputs"])
        result.embed_requests += sum(1 for new in theirs["new"] if new[5])
        for _client, outs, prefix in theirs_engine:
            result.hits += prefix[3] if prefix else 0
            result.finished += sum(1 for _rid, _tokens, reason in outs if reason != "None")
    result.requests = len(requests)
    return result
