"""The request as the KV-cache manager sees it.

Mirrors the parts of vLLM 0.25.1's ``vllm.v1.request.Request`` that the
manager reads: token ids, status, computed-token count, preemption count, the
block hashes kept up to date by a ``block_hasher``, and the prefix-cache
isolation keys (``cache_salt``, LoRA adapter, multimodal features).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
    """Where a multimodal item's placeholder tokens sit in the prompt."""

    offset: int
    length: int


@dataclass(frozen=True)
class MultiModalFeatureSpec:
    """One multimodal item: its content hash (``identifier``) and placeholder range."""

    identifier: str
    mm_position: PlaceholderRange
    modality: str = "image"
    data: Any = None
    mm_hash: str | None = None


class Request:
    """A generation request: prompt, outputs so far, and prefix-cache keys.

    ``block_hashes`` holds one hash per full ``hash_block_size`` block of
    ``all_token_ids``; the ``block_hasher`` extends it whenever tokens are
    appended. ``sampling_params``/``pooling_params`` are accepted for
    signature compatibility with vLLM and only consulted for
    ``skip_reading_prefix_cache``.
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
    ) -> None:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        if prompt_token_ids is None:
            raise ValueError("prompt_token_ids=None: prompt embeddings are not supported")
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
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()
        if skip_reading_prefix_cache is None:
            skip_reading_prefix_cache = bool(
                getattr(sampling_params, "skip_reading_prefix_cache", None)
                or getattr(pooling_params, "skip_reading_prefix_cache", None)
            )
        self.skip_reading_prefix_cache = skip_reading_prefix_cache

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt followed by outputs (read-only view)."""
        return self._all_token_ids

    @property
    def output_token_ids(self) -> Sequence[int]:
        """Generated tokens (read-only view)."""
        return self._output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self._all_token_ids)

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

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"status={self.status.name}, num_computed_tokens={self.num_computed_tokens})"
        )
