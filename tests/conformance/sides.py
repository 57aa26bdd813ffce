"""One side of a conformance comparison: a KV-cache manager driven by named calls.

A ``Side`` owns one ``KVCacheManager`` plus the request objects it was given,
and executes calls named as in a trace (``"allocate_slots"``, ``"free"``, ...)
with JSON arguments, returning results in canonical form (``trace.canon``).
Subclasses say how to build the config, the requests and the abstract state:

* ``conformance.vllm_adapter.VllmSide`` drives the real vLLM 0.25.1;
* ``PackageSide`` drives any package that follows ``docs/contract.md`` —
  kvcache's vocabulary (``kvcache.kv_cache_interface``, ``kvcache.request``,
  ``kvcache.kv_cache_utils``), a ``KVCacheManager`` with vLLM's signatures,
  and ``KVCacheManager.abstract_state()`` — such as ``kvcache`` or ``spec``.

To point the suite at another implementation, set ``KVCACHE_CONFORMANCE_IMPL``
to its package name (see ``make_side``), or subclass ``Side``.
"""

from __future__ import annotations

import importlib
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from conformance.trace import canon, canon_state

IMPL_ENV = "KVCACHE_CONFORMANCE_IMPL"
DEFAULT_IMPL = "kvcache"


@dataclass(frozen=True)
class ManagerConfig:
    """Everything needed to build the same ``KVCacheManager`` on both sides.

    ``block_sizes`` has one entry per KV-cache group (all full attention);
    group ``i`` gets ``num_kv_heads = i + 1`` so that groups with equal block
    sizes still have distinct specs, as vLLM's hybrid coordinator requires.
    """

    num_blocks: int
    block_sizes: tuple[int, ...]
    max_model_len: int
    enable_caching: bool = True
    watermark: float = 0.0
    log_stats: bool = True
    enable_kv_cache_events: bool = True
    use_eagle: bool = False
    max_num_batched_tokens: int | None = None
    hash_fn: str = "sha256"
    head_size: int = 8
    hash_block_size_override: int | None = None
    group_kinds: tuple[str, ...] = ()
    window: int = 4

    def group_kind(self, group: int) -> str:
        """Kind of group ``group``: "full", "sliding_window" or "chunked_local"."""
        return self.group_kinds[group] if self.group_kinds else "full"

    @property
    def scheduler_block_size(self) -> int:
        """LCM of the group block sizes (vLLM's ``resolve_kv_cache_block_sizes``)."""
        return math.lcm(*self.block_sizes)

    @property
    def hash_block_size(self) -> int:
        """GCD of the group block sizes when caching, else the scheduler block size."""
        if self.hash_block_size_override is not None:
            return self.hash_block_size_override
        if len(self.block_sizes) == 1 or not self.enable_caching:
            return self.scheduler_block_size
        return math.gcd(*self.block_sizes)

    def to_record(self) -> dict[str, Any]:
        """JSON form, for the first line of a trace."""
        record = asdict(self)
        record["block_sizes"] = list(self.block_sizes)
        record["group_kinds"] = list(self.group_kinds)
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ManagerConfig:
        """Inverse of ``to_record``; ignores keys that are not fields."""
        names = set(cls.__dataclass_fields__)
        kwargs = {k: v for k, v in record.items() if k in names}
        kwargs["block_sizes"] = tuple(kwargs["block_sizes"])
        kwargs["group_kinds"] = tuple(kwargs.get("group_kinds", ()))
        return cls(**kwargs)


class HarnessError(Exception):
    """A call the harness itself cannot make (unknown request id, unknown op)."""


def with_hash_seed(seed: str, init: Callable[[], None]) -> None:
    """Run ``init`` (an ``init_none_hash`` call) with ``PYTHONHASHSEED=seed``."""
    old = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = seed
    try:
        init()
    finally:
        if old is None:
            del os.environ["PYTHONHASHSEED"]
        else:
            os.environ["PYTHONHASHSEED"] = old


class Side(ABC):
    """A manager plus its requests, driven by ``call(op, args)``."""

    name: str = "?"

    def __init__(self, config: ManagerConfig, hash_seed: str = "0") -> None:
        self.config = config
        self.requests: dict[str, Any] = {}
        self.last_computed: dict[str, Any] = {}
        self.popped: dict[int, list[Any]] = {}
        self.init_hashes(hash_seed)
        self.manager = self.build_manager()

    # ------------------------------------------------------------ hooks

    @abstractmethod
    def init_hashes(self, hash_seed: str) -> None:
        """Initialise the package's ``NONE_HASH`` for ``config.hash_fn``."""

    @abstractmethod
    def build_manager(self) -> Any:
        """A fresh ``KVCacheManager`` for ``self.config``."""

    @abstractmethod
    def build_request(self, args: Mapping[str, Any]) -> Any:
        """A request object for the ``add_request`` arguments."""

    @abstractmethod
    def status(self, name: str) -> Any:
        """The package's ``RequestStatus`` member called ``name``."""

    @abstractmethod
    def abstract_state(self) -> dict[str, Any]:
        """The manager's state in the form of ``docs/contract.md``."""

    # ------------------------------------------------------------ driving

    def call(self, op: str, args: Mapping[str, Any]) -> Any:
        """Run one named call and return its canonical result (exceptions propagate)."""
        handler = getattr(self, "op_" + op, None)
        if handler is None:
            raise HarnessError(f"unknown op {op!r}")
        return handler(args)

    def state(self) -> dict[str, Any]:
        """Canonical abstract state."""
        return canon_state(self.abstract_state())

    def request(self, args: Mapping[str, Any]) -> Any:
        try:
            return self.requests[args["request_id"]]
        except KeyError:
            raise HarnessError(f"unknown request {args['request_id']!r}") from None

    @staticmethod
    def block_id(block: Any) -> int:
        """Id of a block object (kvcache, vLLM) or of an int block (spec)."""
        return block if isinstance(block, int) else int(block.block_id)

    # ------------------------------------------------------------ requests

    def op_add_request(self, args: Mapping[str, Any]) -> Any:
        request_id = args["request_id"]
        if request_id in self.requests:
            raise HarnessError(f"request {request_id!r} added twice")
        request = self.build_request(args)
        self.requests[request_id] = request
        return canon(list(request.block_hashes))

    def op_append_output_token_ids(self, args: Mapping[str, Any]) -> Any:
        request = self.request(args)
        token_ids = args["token_ids"]
        request.append_output_token_ids(
            token_ids if isinstance(token_ids, int) else list(token_ids)
        )
        return canon(list(request.block_hashes))

    def op_update_request(self, args: Mapping[str, Any]) -> Any:
        request = self.request(args)
        if "status" in args:
            request.status = self.status(args["status"])
        if "num_computed_tokens" in args:
            request.num_computed_tokens = args["num_computed_tokens"]
        if "num_preemptions" in args:
            request.num_preemptions = args["num_preemptions"]
        return None

    # ------------------------------------------------------------ manager calls

    def op_get_computed_blocks(self, args: Mapping[str, Any]) -> Any:
        blocks, num_computed_tokens = self.manager.get_computed_blocks(self.request(args))
        self.last_computed[args["request_id"]] = blocks
        return {
            "block_ids": canon(blocks.get_block_ids()),
            "num_computed_tokens": num_computed_tokens,
        }

    def op_allocate_slots(self, args: Mapping[str, Any]) -> Any:
        request = self.request(args)
        which = args.get("new_computed_blocks", "none")
        if which == "last":
            if args["request_id"] not in self.last_computed:
                raise HarnessError(f"no get_computed_blocks result for {args['request_id']!r}")
            new_computed_blocks = self.last_computed[args["request_id"]]
        elif which == "empty":
            new_computed_blocks = self.manager.empty_kv_cache_blocks
        else:
            new_computed_blocks = None
        blocks = self.manager.allocate_slots(
            request,
            args["num_new_tokens"],
            num_new_computed_tokens=args.get("num_new_computed_tokens", 0),
            new_computed_blocks=new_computed_blocks,
            num_lookahead_tokens=args.get("num_lookahead_tokens", 0),
            num_external_computed_tokens=args.get("num_external_computed_tokens", 0),
            delay_cache_blocks=args.get("delay_cache_blocks", False),
            num_encoder_tokens=args.get("num_encoder_tokens", 0),
            full_sequence_must_fit=args.get("full_sequence_must_fit", False),
            reserved_blocks=args.get("reserved_blocks", 0),
            has_scheduled_reqs=args.get("has_scheduled_reqs", True),
        )
        return None if blocks is None else canon(blocks.get_block_ids())

    def op_free(self, args: Mapping[str, Any]) -> Any:
        self.manager.free(self.request(args))
        return None

    def op_pop_blocks_for_free(self, args: Mapping[str, Any]) -> Any:
        blocks = list(self.manager.pop_blocks_for_free(self.request(args)))
        self.popped[args["handle"]] = blocks
        return [self.block_id(b) for b in blocks]

    def op_free_blocks(self, args: Mapping[str, Any]) -> Any:
        """``block_pool.free_blocks(reversed(popped))``, as the scheduler's deferred free."""
        try:
            blocks = self.popped.pop(args["handle"])
        except KeyError:
            raise HarnessError(f"unknown popped-blocks handle {args['handle']!r}") from None
        self.manager.block_pool.free_blocks(reversed(blocks))
        return None

    def op_evict_blocks(self, args: Mapping[str, Any]) -> Any:
        self.manager.evict_blocks(set(args["block_ids"]))
        return None

    def op_reset_prefix_cache(self, args: Mapping[str, Any]) -> Any:
        return bool(self.manager.reset_prefix_cache())

    def op_take_events(self, args: Mapping[str, Any]) -> Any:
        return canon(list(self.manager.take_events()))

    def op_take_new_block_ids(self, args: Mapping[str, Any]) -> Any:
        return canon(list(self.manager.take_new_block_ids()))

    def op_get_num_common_prefix_blocks(self, args: Mapping[str, Any]) -> Any:
        return canon(list(self.manager.get_num_common_prefix_blocks(args["request_id"])))

    def op_new_step_starts(self, args: Mapping[str, Any]) -> Any:
        self.manager.new_step_starts()
        return None

    def op_make_prefix_cache_stats(self, args: Mapping[str, Any]) -> Any:
        return canon(self.manager.make_prefix_cache_stats())

    def op_usage(self, args: Mapping[str, Any]) -> Any:
        return float(self.manager.usage)

    def op_get_num_free_blocks(self, args: Mapping[str, Any]) -> Any:
        return int(self.manager.block_pool.get_num_free_blocks())

    def op_get_block_ids(self, args: Mapping[str, Any]) -> Any:
        return canon(self.manager.get_block_ids(args["request_id"]))

    def op_get_blocks(self, args: Mapping[str, Any]) -> Any:
        return canon(self.manager.get_blocks(args["request_id"]).get_block_ids(allow_none=True))

    def op_get_block_ids_for_computed_tokens(self, args: Mapping[str, Any]) -> Any:
        return canon(
            self.manager.get_block_ids_for_computed_tokens(
                args["request_id"], args["num_computed_tokens"]
            )
        )

    def op_cache_blocks(self, args: Mapping[str, Any]) -> Any:
        self.manager.cache_blocks(self.request(args), args["num_computed_tokens"])
        return None

    def op_remove_skipped_blocks(self, args: Mapping[str, Any]) -> Any:
        self.manager.remove_skipped_blocks(
            args["request_id"], args["total_computed_tokens"], args.get("num_prompt_tokens")
        )
        return None


class PackageSide(Side):
    """A package following docs/contract.md (``kvcache``, ``spec``, or another)."""

    def __init__(self, package: str, config: ManagerConfig, hash_seed: str = "0") -> None:
        self.name = package
        self.package = importlib.import_module(package)
        self.kv_cache_interface = importlib.import_module("kvcache.kv_cache_interface")
        self.request_module = importlib.import_module("kvcache.request")
        self.kv_cache_utils = importlib.import_module("kvcache.kv_cache_utils")
        super().__init__(config, hash_seed)

    def hash_fn(self) -> Callable[[Any], bytes]:
        fn: Callable[[Any], bytes] = self.kv_cache_utils.get_hash_fn_by_name(self.config.hash_fn)
        return fn

    def init_hashes(self, hash_seed: str) -> None:
        hash_fn = self.hash_fn()
        with_hash_seed(hash_seed, lambda: self.kv_cache_utils.init_none_hash(hash_fn))

    def build_manager(self) -> Any:
        kvi = self.kv_cache_interface
        cfg = self.config
        groups = [
            kvi.KVCacheGroupSpec([f"layers.{i}.attn"], self.build_spec(i, block_size))
            for i, block_size in enumerate(cfg.block_sizes)
        ]
        kv_cache_config = kvi.KVCacheConfig(
            num_blocks=cfg.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
        )
        return self.package.KVCacheManager(
            kv_cache_config,
            max_model_len=cfg.max_model_len,
            scheduler_block_size=cfg.scheduler_block_size,
            hash_block_size=cfg.hash_block_size,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_caching=cfg.enable_caching,
            use_eagle=cfg.use_eagle,
            log_stats=cfg.log_stats,
            enable_kv_cache_events=cfg.enable_kv_cache_events,
            watermark=cfg.watermark,
        )

    def build_spec(self, group: int, block_size: int) -> Any:
        kvi = self.kv_cache_interface
        cfg = self.config
        common = {
            "block_size": block_size,
            "num_kv_heads": group + 1,
            "head_size": cfg.head_size,
            "dtype": "float16",
        }
        kind = cfg.group_kind(group)
        if kind == "sliding_window":
            return kvi.SlidingWindowSpec(**common, sliding_window=cfg.window)
        if kind == "chunked_local":
            return kvi.ChunkedLocalAttentionSpec(**common, attention_chunk_size=cfg.window)
        return kvi.FullAttentionSpec(**common)

    def build_request(self, args: Mapping[str, Any]) -> Any:
        rq = self.request_module
        lora = args.get("lora")
        return rq.Request(
            request_id=args["request_id"],
            prompt_token_ids=list(args["prompt_token_ids"]),
            sampling_params=None,
            pooling_params=None,
            arrival_time=0.0,
            mm_features=[
                rq.MultiModalFeatureSpec(
                    identifier=identifier,
                    mm_position=rq.PlaceholderRange(offset=offset, length=length),
                    modality="image",
                    data=None,
                )
                for identifier, offset, length in args.get("mm_features", [])
            ],
            lora_request=(
                None if lora is None else rq.LoRARequest(lora[0], lora[1], lora_path="/x")
            ),
            cache_salt=args.get("cache_salt"),
            block_hasher=self.kv_cache_utils.get_request_block_hasher(
                self.config.hash_block_size, self.hash_fn()
            ),
            skip_reading_prefix_cache=bool(args.get("skip_reading_prefix_cache", False)),
        )

    def status(self, name: str) -> Any:
        return self.request_module.RequestStatus[name]

    def abstract_state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.manager.abstract_state()
        return state


SideFactory = Callable[[ManagerConfig, str], Side]

# Extra named sides (tests register deliberately broken ones here).
SIDE_FACTORIES: dict[str, SideFactory] = {}


def make_side(impl: str, config: ManagerConfig, hash_seed: str = "0") -> Side:
    """The side called ``impl``: ``"vllm"`` (the reference), a name registered in
    ``SIDE_FACTORIES``, or the name of a package that follows docs/contract.md."""
    if impl in SIDE_FACTORIES:
        return SIDE_FACTORIES[impl](config, hash_seed)
    if impl == "vllm":
        from conformance.vllm_adapter import VllmSide

        return VllmSide(config, hash_seed)
    return PackageSide(impl, config, hash_seed)


def subject_impl() -> str:
    """The implementation under test: ``$KVCACHE_CONFORMANCE_IMPL``, default kvcache."""
    return os.environ.get(IMPL_ENV, DEFAULT_IMPL)
