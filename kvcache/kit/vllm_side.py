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

from kvcache.kit.config import GroupConfig, ManagerConfig
from kvcache.kit.sides import (
    Adapter,
    AdapterDoesNotFit,
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


#: Every release line the kit knows, oldest first. A version of no line is driven
#: by the line ``inferred_line`` reads off the installed vLLM (with a note).
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


def _version_key(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _lookup_arity(manager_cls: Any) -> int | None:
    """How many values ``get_computed_blocks`` returns, read from its return
    annotation (``tuple[KVCacheBlocks, int, int]``: 3), or None if it has none."""
    annotation = inspect.signature(manager_cls.get_computed_blocks).return_annotation
    args = getattr(annotation, "__args__", None)
    if args is not None:  # an evaluated tuple[...]
        return len(args)
    if not isinstance(annotation, str):
        return None
    text = annotation.replace(" ", "").strip("'\"")  # a quoted annotation, too
    if not text.startswith("tuple[") or not text.endswith("]"):
        return None
    depth, values = 0, 1
    for ch in text[len("tuple[") : -1]:
        depth += ch == "["
        depth -= ch == "]"
        values += ch == "," and depth == 0
    return values


def inferred_line(version: str, manager_cls: Any, kv_cache_config_cls: type) -> ReleaseLine:
    """The release line of the installed vLLM, read off its classes: the four API
    facts the kit drives by (the constructor's name for the in-flight token budget,
    the lookup's arity, whether the scheduler records prefix-cache stats at
    admission, where the retention interval lives).

    Raises:
        AdapterDoesNotFit: a fact cannot be read (it says which).
    """
    params = inspect.signature(manager_cls.__init__).parameters
    if "max_num_batched_tokens" in params:
        renamed: tuple[tuple[str, str], ...] = ()
    elif "max_in_flight_tokens" in params:
        renamed = (("max_num_batched_tokens", "max_in_flight_tokens"),)
    else:
        raise AdapterDoesNotFit(
            f"the adapter for vLLM {version} does not fit: KVCacheManager.__init__ takes "
            f"neither max_num_batched_tokens nor max_in_flight_tokens ({', '.join(params)})"
        )
    arity = _lookup_arity(manager_cls)
    if arity not in (2, 3):
        raise AdapterDoesNotFit(
            f"the adapter for vLLM {version} does not fit: cannot tell how many values "
            f"get_computed_blocks returns (annotation "
            f"{inspect.signature(manager_cls.get_computed_blocks).return_annotation!r})"
        )
    fields = getattr(kv_cache_config_cls, "__dataclass_fields__", {})
    return ReleaseLine(
        f"{'.'.join(version.split('.')[:2])}.x",
        version,
        renamed_kwargs=renamed,
        lookup_values=arity,
        stats_at_admission=hasattr(manager_cls, "record_prefix_cache_stats"),
        retention_in_kv_cache_config="prefix_cache_retention_interval" in fields,
    )


def describe_line(line: ReleaseLine) -> str:
    """The line's four facts, in words (the note ``release_line`` prints)."""
    ctor = dict(line.renamed_kwargs).get("max_num_batched_tokens", "max_num_batched_tokens")
    return (
        f"constructor takes {ctor}, get_computed_blocks returns {line.lookup_values} values, "
        + ("stats recorded at admission" if line.stats_at_admission else "stats in the lookup")
        + ", retention interval in "
        + ("KVCacheConfig" if line.retention_in_kv_cache_config else "the environment")
    )


def release_line(
    version: str,
    manager_cls: Any = None,
    kv_cache_config_cls: type | None = None,
) -> tuple[ReleaseLine, str]:
    """The release line for a vLLM version, and a note when it is not a known line.

    A version of no known line is driven by the facts ``inferred_line`` reads off
    ``manager_cls`` and ``kv_cache_config_cls`` (the installed vLLM's classes),
    with a note naming them. Without the classes (a version not installed here),
    the newest known line at or below it is a guess, and the note says so.
    """
    for line in RELEASE_LINES:
        if line.matches(version):
            return line, ""
    if manager_cls is not None and kv_cache_config_cls is not None:
        line = inferred_line(version, manager_cls, kv_cache_config_cls)
        return line, (
            f"vLLM {version}: no release line of the kit "
            f"({', '.join(li.name for li in RELEASE_LINES)}); driving it with the API "
            f"facts read off the installed package: {describe_line(line)}"
        )
    key = _version_key(version)
    below = [li for li in RELEASE_LINES if _version_key(li.reference_version) <= key]
    line = below[-1] if below else RELEASE_LINES[0]
    return line, (
        f"vLLM {version} is not a release line the kit knows "
        f"({', '.join(li.name for li in RELEASE_LINES)}); guessing it behaves like {line.name}"
    )


#: The versions whose fit ``VllmAdapter.check_fit`` has checked in this process.
_FITTED: set[str] = set()


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
    if "session_id" in fields and not REQUEST_TAKES_SESSION_ID:
        raise HarnessError(
            f"vLLM {VLLM_VERSION}'s Request has no session_id (vLLM 0.28.0's request field)"
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
    ``kvcache.kit.conformance`` (0.33.0 against its own profile) and
    ``kvcache.kit.profile_check`` (any release against its profile, whose adapters keep
    it: ``lookup_keeping_boundary``) turn it on.

    ``takes_session_id``: whether the release's ``Request`` has a ``session_id``
    (0.28.0 on); the driver draws none for a release without one.
    """

    stores_shared_prefix_boundary = False
    takes_session_id = REQUEST_TAKES_SESSION_ID

    def __init__(self, version: str = VLLM_VERSION) -> None:
        self.name = "vllm"
        self.factory = KVCacheManager
        self.version = version
        self.line, self.note = release_line(
            version, KVCacheManager, vllm_kv_cache_interface.KVCacheConfig
        )
        self._state_readable = True
        if version == VLLM_VERSION and version not in _FITTED:
            self.check_fit()
            _FITTED.add(version)
            if self.note:
                print(self.note, file=sys.stderr)

    def check_fit(self) -> None:
        """Build one small manager and make one lookup, as every run will.

        Raises:
            AdapterDoesNotFit: that failed; the message names the call and the error,
                so a command stops at once instead of spending its budget on
                managers that cannot be built.
        """
        config = ManagerConfig(
            num_blocks=8, groups=(GroupConfig("full", 16),), max_model_len=128
        )
        step = "KVCacheManager(...)"
        try:
            self.init_hashes(config, "0")
            manager = self.build_manager(config)
            step = "Request(...)"
            request = self.build_request(
                config, {"request_id": "fit", "prompt_token_ids": list(range(40))}
            )
            step = "get_computed_blocks(request)"
            self.get_computed_blocks(manager, request)
        except Exception as exc:
            raise AdapterDoesNotFit(
                f"the adapter for vLLM {self.version} ({self.line.name}: "
                f"{describe_line(self.line)}) does not fit: {step} raised "
                f"{type(exc).__name__}: {exc}"
            ) from None

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
