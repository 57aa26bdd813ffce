"""The reference adapter: the installed vLLM's ``KVCacheManager`` (0.25.1 is the reference).

Builds vLLM's own config (specs with ``torch.float16``), requests
(``SamplingParams``, ``LoRARequest``, ``MultiModalFeatureSpec``, the block
hasher from ``get_request_block_hasher`` over ``vllm.utils.hashing``) from the
same trace arguments that ``Adapter`` turns into kvcache objects, and reads the
abstract state of docs/contract.md out of vLLM's internals. A newer vLLM works
as long as those internals keep their names; if not, only results are compared.

**Release lines.** What changed between vLLM releases at the manager's API is
a ``ReleaseLine`` in ``RELEASE_LINES``: named switches, one entry per release
line, picked by the installed ``vllm.__version__``. Supporting a new release
is one more entry (docs/releases.md says how): rename constructor arguments,
say how many values ``get_computed_blocks`` returns, and whether the
scheduler (not the manager) records prefix-cache stats at admission.

Importing this module imports vLLM (and torch): a few seconds.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch
import vllm
import vllm.utils.hashing as vllm_hashing
import vllm.v1.kv_cache_interface as vllm_kv_cache_interface
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core import kv_cache_utils as vllm_kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request, RequestStatus

from kvcache.kit.config import ManagerConfig
from kvcache.kit.sides import (
    Adapter,
    HarnessError,
    build_kv_cache_config,
    prompt_embeds_tensor,
    request_fields_0_33,
    request_token_ids,
    retention_env,
    with_hash_seed,
)

# 0.33.0 warns through its own loggers (a failed prefix-cache reset, a disabled
# fine-grained hit mode) whatever VLLM_LOGGING_LEVEL says: the kit reports results.
logging.getLogger("vllm").setLevel(logging.ERROR)

VLLM_VERSION: str = vllm.__version__
REFERENCE_VLLM_VERSION = "0.25.1"
#: Whether the installed vLLM's ``Request`` takes 0.33.0's request fields.
REQUEST_TAKES_SESSION_ID = "session_id" in inspect.signature(Request).parameters


@dataclass(frozen=True)
class ReleaseLine:
    """How one vLLM release line's manager is built and driven (named switches).

    Attributes:
        name: The line, e.g. ``"0.33.x"``; it matches versions ``0.33.*``.
        renamed_kwargs: Constructor arguments renamed since 0.25.1 (kit name -> the
            release's name).
        lookup_values: How many values ``get_computed_blocks`` returns (the first two
            are always the blocks and the number of hit tokens).
        stats_at_admission: The scheduler, not the lookup, records prefix-cache
            stats, through ``record_prefix_cache_stats(request, num_hits)`` once
            the request is admitted (its allocation succeeded).
        reference_version: The release of the line the kit was checked with.
        retention_in_kv_cache_config: The prefix-cache retention interval is the
            field ``KVCacheConfig.prefix_cache_retention_interval``, not 0.25.1's
            environment variable ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``.
    """

    name: str
    reference_version: str
    renamed_kwargs: tuple[tuple[str, str], ...] = ()
    lookup_values: int = 2
    stats_at_admission: bool = False
    retention_in_kv_cache_config: bool = False

    def matches(self, version: str) -> bool:
        """Whether ``version`` (``vllm.__version__``) belongs to this line."""
        major_minor = ".".join(self.name.split(".")[:2])
        return version == major_minor or version.startswith(major_minor + ".")

    def manager_kwargs(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The kit's (0.25.1's) constructor arguments under this line's names."""
        renames = dict(self.renamed_kwargs)
        return {renames.get(k, k): v for k, v in kwargs.items()}


#: Every release line the kit knows, oldest first. The newest is used for an
#: unknown newer version (with a warning in ``VllmAdapter.note``).
RELEASE_LINES: tuple[ReleaseLine, ...] = (
    ReleaseLine("0.25.x", "0.25.1"),
    ReleaseLine(
        "0.33.x",
        "0.33.0",
        renamed_kwargs=(("max_num_batched_tokens", "max_in_flight_tokens"),),
        lookup_values=3,
        stats_at_admission=True,
        retention_in_kv_cache_config=True,
    ),
)


def release_line(version: str) -> tuple[ReleaseLine, str]:
    """The release line for a vLLM version, and a note when it is only a guess.

    An unknown version gets the newest line at or below it (the oldest when it
    is older than every line), with a note saying so.
    """
    for line in RELEASE_LINES:
        if line.matches(version):
            return line, ""

    def key(v: str) -> tuple[int, ...]:
        parts = []
        for part in v.split(".")[:3]:
            digits = "".join(ch for ch in part if ch.isdigit())
            parts.append(int(digits or 0))
        return tuple(parts)

    below = [line for line in RELEASE_LINES if key(line.reference_version) <= key(version)]
    line = below[-1] if below else RELEASE_LINES[0]
    return line, (
        f"vLLM {version} is not a release line the kit knows "
        f"({', '.join(li.name for li in RELEASE_LINES)}); driving it as {line.name}"
    )


def vllm_hash_fn(name: str) -> Callable[[Any], bytes]:
    """vLLM's hash function called ``name`` (sha256, sha256_cbor, xxhash, xxhash_cbor)."""
    fn: Callable[[Any], bytes] = getattr(vllm_hashing, name)
    return fn


def build_request(
    args: Mapping[str, Any],
    hash_block_size: int,
    hash_fn: Callable[[Any], bytes],
    num_hash_lookahead_tokens: int = 0,
) -> Request:
    """vLLM's ``Request`` for the fields of a trace's request record (hashed with
    ``num_hash_lookahead_tokens``, vLLM 0.33.0's lookahead hashing, when set)."""
    lookahead = (num_hash_lookahead_tokens,) if num_hash_lookahead_tokens else ()
    lora = args.get("lora")
    skip = bool(args.get("skip_reading_prefix_cache", False))
    fields = request_fields_0_33(args)
    extra: dict[str, Any] = {}
    if fields and not REQUEST_TAKES_SESSION_ID:
        raise HarnessError(
            f"vLLM {VLLM_VERSION}'s Request has no {', '.join(sorted(fields))} "
            "(vLLM 0.33.0's request fields)"
        )
    if "session_id" in fields:
        extra["session_id"] = fields["session_id"]
    report_mode = fields.get("kv_cache_report_mode")
    return Request(
        request_id=args["request_id"],
        prompt_token_ids=request_token_ids(args),
        prompt_embeds=prompt_embeds_tensor(args.get("prompt_embeds")),
        sampling_params=SamplingParams(
            max_tokens=int(args.get("max_tokens") or 16),
            skip_reading_prefix_cache=True if skip else None,
            extra_args=None if report_mode is None else {"kv_cache_report_mode": report_mode},
        ),
        pooling_params=None,
        arrival_time=0.0,
        mm_features=[
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=sys.intern(identifier),  # as in Adapter.build_request
                mm_position=PlaceholderRange(offset=offset, length=length),
            )
            for identifier, offset, length in args.get("mm_features") or []
        ],
        lora_request=None if lora is None else LoRARequest(lora[0], lora[1], lora_path="/x"),
        cache_salt=args.get("cache_salt"),
        block_hasher=vllm_kv_cache_utils.get_request_block_hasher(
            hash_block_size, hash_fn, *lookahead
        ),
        **extra,
    )


def abstract_state(manager: KVCacheManager) -> dict[str, Any]:
    """docs/contract.md's abstract state, read from vLLM's pool and managers."""
    pool = manager.block_pool
    single_type_managers = manager.coordinator.single_type_managers
    cached: dict[bytes, list[int]] = {}
    for key, blocks in pool.cached_block_hash_to_block._cache.items():
        if isinstance(blocks, KVCacheBlock):
            cached[bytes(key)] = [blocks.block_id]
        else:  # dict block_id -> block, oldest first
            cached[bytes(key)] = list(blocks)
    return {
        "num_blocks": pool.num_gpu_blocks,
        "free_queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "ref_cnt": {b.block_id: b.ref_cnt for b in pool.blocks if not b.is_null and b.ref_cnt != 0},
        "block_hash": {
            b.block_id: bytes(b.block_hash) for b in pool.blocks if b.block_hash is not None
        },
        "cached": cached,
        "req_to_blocks": [
            {rid: [b.block_id for b in blocks] for rid, blocks in m.req_to_blocks.items()}
            for m in single_type_managers
        ],
        "num_cached_block": [dict(m.num_cached_block) for m in single_type_managers],
        "new_block_ids": [list(m.new_block_ids) for m in single_type_managers],
    }


class VllmAdapter(Adapter):
    """vLLM's ``KVCacheManager``, built from vLLM's own vocabulary.

    ``stores_shared_prefix_boundary``: on a line whose lookup returns the shared-prefix
    boundary (0.33), put it on the request as that release's scheduler does, where
    sparse retention keeps the junction's tail. Off by default: the cross-release
    census compares with 0.25.1, and no ledger entry covers the junction tails yet;
    ``kvcache.kit.conformance33`` (0.33.0 against its own profile) turns it on.
    """

    stores_shared_prefix_boundary = False

    def __init__(self, version: str = VLLM_VERSION) -> None:
        self.name = "vllm"
        self.factory = KVCacheManager
        self.version = version
        self.line, self.note = release_line(version)
        self._state_readable = True

    def init_hashes(self, config: ManagerConfig, hash_seed: str) -> None:
        hash_fn = vllm_hash_fn(config.hash_fn)
        with_hash_seed(hash_seed, lambda: vllm_kv_cache_utils.init_none_hash(hash_fn))

    def chain_module(self) -> ModuleType:
        """vLLM's ``kv_cache_utils``: its requests chain from vLLM's ``NONE_HASH``."""
        module: ModuleType = vllm_kv_cache_utils
        return module

    def build_manager(self, config: ManagerConfig) -> Any:
        kv_cache_config = build_kv_cache_config(vllm_kv_cache_interface, config, torch.float16)
        kwargs = self.line.manager_kwargs(config.manager_kwargs())
        if self.line.retention_in_kv_cache_config:
            kv_cache_config.prefix_cache_retention_interval = (
                config.prefix_cache_retention_interval
            )
        with retention_env(config):
            return KVCacheManager(kv_cache_config, **kwargs)

    def get_computed_blocks(self, manager: Any, request: Any) -> tuple[Any, int]:
        result = manager.get_computed_blocks(request)
        if len(result) != self.line.lookup_values:
            raise TypeError(
                f"vLLM {self.version} ({self.line.name}): get_computed_blocks returned "
                f"{len(result)} values, expected {self.line.lookup_values}"
            )
        if self.line.lookup_values == 3 and self.stores_shared_prefix_boundary:
            # 0.33.0's scheduler keeps the shared-prefix boundary on the request, where
            # the manager's caching reads it (junction tails under sparse retention).
            request.shared_prefix_boundary = int(result[2])
        return result[0], int(result[1])

    def keep_boundary(self, request: Any, boundary: int) -> None:
        if self.stores_shared_prefix_boundary:
            request.shared_prefix_boundary = boundary

    def admitted(self, manager: Any, request: Any, num_hit_tokens: int) -> None:
        if self.line.stats_at_admission:
            manager.record_prefix_cache_stats(request, num_hit_tokens)

    def build_request(self, config: ManagerConfig, args: Mapping[str, Any]) -> Any:
        return build_request(
            args,
            config.hash_block_size,
            vllm_hash_fn(config.hash_fn),
            config.num_hash_lookahead_tokens,
        )

    def status(self, name: str) -> Any:
        return RequestStatus[name]

    def abstract_state(self, manager: Any) -> dict[str, Any] | None:
        if not self._state_readable:
            return None
        try:
            return abstract_state(manager)
        except AttributeError:  # a vLLM whose internals moved: compare results only
            self._state_readable = False
            return None
