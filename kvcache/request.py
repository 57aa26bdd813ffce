"""The request as the KV-cache manager sees it.

Mirrors vLLM 0.25.1's ``vllm.v1.request.Request``: the parts the manager
reads (token ids, status, computed-token count, preemption count, the block
hashes kept up to date by a ``block_hasher``, and the prefix-cache isolation
keys: ``cache_salt``, LoRA adapter, multimodal features, prompt embeddings),
plus, with vLLM's initial values, the attributes vLLM's ``Scheduler`` keeps
on a request.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcache.kv_cache_utils import request_num_tokens

if TYPE_CHECKING:
    from kvcache.kv_cache_utils import BlockHash


class RequestStatus(enum.IntEnum):
    """Lifecycle states, in vLLM's order; everything after PREEMPTED is finished."""

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """Whether ``status`` is one of the finished states."""
        return status > RequestStatus.PREEMPTED


@dataclass(frozen=True)
class LoRARequest:
    """The LoRA adapter of a request; its name enters every block hash."""

    lora_name: str
    lora_int_id: int
    lora_path: str = "/"

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}")

    @property
    def adapter_id(self) -> int:
        """Integer id of the adapter (reported in ``BlockStored.lora_id``)."""
        return self.lora_int_id


@dataclass(frozen=True)
class PlaceholderRange:
    """Where a multimodal item's placeholder tokens sit in the prompt.

    ``is_embed``: optional boolean mask (a torch tensor of ``length``) of the
    positions that receive embeddings; None means all of them.
    """

    offset: int
    length: int
    is_embed: Any = None

    def get_num_embeds(self) -> int:
        """Positions that receive an embedding: ``length``, or the mask's count."""
        if self.is_embed is None:
            return self.length
        return int(self.is_embed.sum())


@dataclass(frozen=True)
class MultiModalFeatureSpec:
    """One multimodal item: its content hash (``identifier``) and placeholder range."""

    identifier: str
    mm_position: PlaceholderRange
    modality: str = "image"
    data: Any = None
    mm_hash: str | None = None


class FinishReason(enum.IntEnum):
    """Why a request finished, with vLLM's values (``vllm.v1.engine.FinishReason``)."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    def __str__(self) -> str:
        return self.name.lower()


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,  # prompt longer than the model allows
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.WAITING_FOR_STREAMING_REQ: FinishReason.STOP,
    RequestStatus.FINISHED_REPETITION: FinishReason.REPETITION,
}


@dataclass(frozen=True)
class RequestEvent:
    """A timestamped lifecycle event of one request (vLLM's ``EngineCoreEvent`` fields)."""

    type: Any
    timestamp: float


class Request:
    """A generation request: prompt, outputs so far, and prefix-cache keys.

    ``block_hashes`` holds one hash per full ``hash_block_size`` block of
    ``all_token_ids``; the ``block_hasher`` extends it whenever tokens are
    appended. ``sampling_params``/``pooling_params`` are accepted for
    signature compatibility with vLLM and consulted only for
    ``skip_reading_prefix_cache``, ``max_tokens`` and ``kv_transfer_params``.

    ``prompt_embeds`` (a torch tensor, one row per prompt position) may come
    with or instead of ``prompt_token_ids``; without token ids the prompt's
    token ids read as zeros, as in vLLM, and the embeddings alone tell prompts
    apart: each block's hash then carries a digest of its embedding rows.

    The scheduler-side attributes vLLM 0.25.1's ``Scheduler`` reads or writes
    (``max_tokens``, ``resumable``, ``streaming_queue``, ``is_prefill_chunk``,
    ``num_output_placeholders``, ``events``, ...) exist with vLLM's initial
    values; the manager itself never reads them.
    """

    def __init__(
        self,
        request_id: object,  # checked below (object: the compiled build would raise first)
        prompt_token_ids: list[int] | None,
        sampling_params: Any = None,
        pooling_params: Any = None,
        client_index: int = 0,
        arrival_time: float | None = None,
        mm_features: list[MultiModalFeatureSpec] | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
        skip_reading_prefix_cache: bool | None = None,
        *,
        prompt_embeds: Any = None,
        prompt_is_token_ids: list[bool] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        resumable: bool = False,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
        abort_immediately: bool = False,
    ) -> None:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        num_prompt_tokens = _num_prompt_tokens(prompt_token_ids, prompt_embeds)
        if getattr(sampling_params, "structured_outputs", None) is not None:
            raise NotImplementedError(
                "sampling_params.structured_outputs is set: structured output requests "
                "are not modelled by kvcache.Request; use vLLM's Request"
            )
        self.request_id = request_id
        self.client_index = client_index
        self.priority = priority
        self.arrival_time = 0.0 if arrival_time is None else arrival_time
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.lora_request = lora_request
        self.cache_salt = cache_salt
        self.mm_features: list[MultiModalFeatureSpec] = list(mm_features or [])
        self.status = RequestStatus.WAITING
        self.prompt_token_ids = None if prompt_token_ids is None else list(prompt_token_ids)
        self.prompt_embeds = prompt_embeds
        self.prompt_is_token_ids = prompt_is_token_ids
        # Digest of each (start, end) slice of prompt_embeds, filled by the block hasher.
        self._prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = {}
        self.num_prompt_tokens = num_prompt_tokens
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = (
            [0] * num_prompt_tokens if self.prompt_token_ids is None
            else list(self.prompt_token_ids)
        )
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # What vLLM's Scheduler keeps on the request (its initial values).
        self.max_tokens: int | None = (
            1 if pooling_params is not None else getattr(sampling_params, "max_tokens", None)
        )
        extra_args = getattr(sampling_params, "extra_args", None)
        self.kv_transfer_params: dict[str, Any] | None = (
            extra_args.get("kv_transfer_params") if isinstance(extra_args, Mapping) else None
        )
        # reasoning_ended / reasoning_parser_kwargs belong to a structured-output
        # request, which is not modelled: accepted for vLLM's signature, unused.
        self.structured_output_request: Any = None
        self.trace_headers = trace_headers
        self.resumable = resumable
        self.streaming_queue: deque[Any] | None = None
        self.abort_immediately = abort_immediately
        self.events: list[RequestEvent] = []
        self.stop_reason: int | str | None = None
        self.num_output_placeholders = 0
        self.async_tokens_to_discard = 0
        self.next_decode_eligible_step = 0
        self.last_sched_seq = 0
        self.is_prefill_chunk = False
        self.num_nans_in_logits = 0
        self.prefill_stats: Any = None
        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()
        if skip_reading_prefix_cache is None:
            skip_reading_prefix_cache = self.get_skip_reading_prefix_cache()
        self.skip_reading_prefix_cache = skip_reading_prefix_cache

    def get_skip_reading_prefix_cache(self) -> bool:
        """The params' ``skip_reading_prefix_cache``: the sampling params' when set,
        else the pooling params', else False (vLLM's precedence)."""
        for params in (self.sampling_params, self.pooling_params):
            value = getattr(params, "skip_reading_prefix_cache", None)
            if value is not None:
                return bool(value)
        return False

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt followed by outputs (read-only view)."""
        return self._all_token_ids

    @property
    def output_token_ids(self) -> Sequence[int]:
        """Generated tokens (read-only view)."""
        return self._output_token_ids

    if TYPE_CHECKING:

        @property
        def num_tokens(self) -> int:
            """Prompt plus output tokens."""
            return len(self._all_token_ids)

    else:
        # NOTE: the body is a compiled function (``request_num_tokens``): the
        # manager reads it every step, and an interpreted property is a Python
        # frame (~850 instructions a read, compiled; ~300 this way).
        num_tokens = property(request_num_tokens, doc="Prompt plus output tokens.")

    @property
    def num_tokens_with_spec(self) -> int:
        """Tokens plus not-yet-verified draft tokens."""
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self._output_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Append generated token(s) and hash any block they complete."""
        if isinstance(token_ids, int):
            self._output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
        else:
            self._output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Extend ``block_hashes`` with the hashes of newly completed blocks."""
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def is_finished(self) -> bool:
        """Whether the request reached a finished status."""
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        """vLLM's finish reason for the current status (None while unfinished)."""
        return _FINISHED_REASONS.get(self.status)

    @property
    def use_structured_output(self) -> bool:
        """Whether the request has a structured-output grammar (never, here)."""
        return self.structured_output_request is not None

    @property
    def num_encoder_inputs(self) -> int:
        """Number of multimodal items."""
        return len(self.mm_features)

    @property
    def has_encoder_inputs(self) -> bool:
        """Whether the request has multimodal items."""
        return bool(self.mm_features)

    def get_num_encoder_embeds(self, input_id: int) -> int:
        """Embedding positions of multimodal item ``input_id``."""
        return self.mm_features[input_id].mm_position.get_num_embeds()

    def record_event(self, event_type: Any, timestamp: float | None = None) -> None:
        """Note a lifecycle event (``time.monotonic()`` when no timestamp is given)."""
        self.events.append(
            RequestEvent(event_type, time.monotonic() if timestamp is None else timestamp)
        )

    def take_events(self) -> list[RequestEvent] | None:
        """Drain the recorded events (None when there are none)."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def take_prefill_stats(self) -> Any:
        """Hand over ``prefill_stats`` once (None afterwards)."""
        stats, self.prefill_stats = self.prefill_stats, None
        return stats

    def __lt__(self, other: Request) -> bool:
        """Priority-queue order: priority, then arrival time, then request id."""
        mine = (self.priority, self.arrival_time, self.request_id)
        theirs = (other.priority, other.arrival_time, other.request_id)
        if mine != theirs:
            return mine < theirs
        return id(self) < id(other)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"status={self.status.name}, num_computed_tokens={self.num_computed_tokens})"
        )


def _num_prompt_tokens(prompt_token_ids: Sequence[int] | None, prompt_embeds: Any) -> int:
    """Prompt length from the token ids and/or the embeddings (one row per token).

    Raises:
        ValueError: when both are None, or their lengths differ.
    """
    if prompt_embeds is not None and not hasattr(prompt_embeds, "__len__"):
        raise TypeError(
            f"prompt_embeds must be a tensor with one row per prompt token, got "
            f"{type(prompt_embeds).__name__}"
        )
    if prompt_token_ids is None:
        if prompt_embeds is None:
            raise ValueError(
                "prompt_token_ids=None and prompt_embeds=None: a request needs one of them"
            )
        return len(prompt_embeds)
    if prompt_embeds is not None and len(prompt_embeds) != len(prompt_token_ids):
        raise ValueError(
            f"prompt_token_ids has {len(prompt_token_ids)} tokens but prompt_embeds has "
            f"{len(prompt_embeds)} rows"
        )
    return len(prompt_token_ids)
