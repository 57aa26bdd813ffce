"""Adapters and sides: how the kit builds and drives one implementation.

An **implementation name** (``--impl``) is one of

* ``kvcache`` — this package; ``spec`` — the executable oracle;
* ``vllm`` — the installed vLLM (the 0.25.1 reference, or a newer release);
* ``module:attr`` — your own: ``attr`` is a *manager factory* or an ``Adapter``;
* ``package`` — a package whose ``KVCacheManager`` is a manager factory.

A **manager factory** is any callable with vLLM's constructor signature,
``factory(kv_cache_config, *, max_model_len, scheduler_block_size,
hash_block_size, max_num_batched_tokens, enable_caching, use_eagle, log_stats,
enable_kv_cache_events, watermark) -> manager`` — a ``KVCacheManager`` class
itself is one. It receives kvcache's vocabulary (``kvcache.KVCacheConfig``,
``kvcache.Request``: the same fields as vLLM's) and must return an object with
vLLM 0.25.1's method set (``get_computed_blocks``, ``allocate_slots``, ``free``,
``pop_blocks_for_free``, ``evict_blocks``, ``reset_prefix_cache``,
``take_events``, ``take_new_block_ids``, ``get_num_common_prefix_blocks``,
``new_step_starts``, ``make_prefix_cache_stats``, ``usage``, ``get_blocks``,
``get_block_ids``, ``get_block_ids_for_computed_tokens``, ``cache_blocks``,
``remove_skipped_blocks``, ``empty_kv_cache_blocks``, and
``block_pool.free_blocks`` / ``block_pool.get_num_free_blocks``). Optional:
``abstract_state()`` (docs/contract.md) — with it the whole state is compared
after every call, without it only results; ``check_invariants()``; on the 0.33
line ``take_kv_cache_block_copies()`` (the driver drains it as 0.33.0's scheduler),
and ``take_boundary_state_offloads()`` / ``finalize_partial_tail_offloads(request)``
(compared only when every side has them).

An **Adapter** subclass is for an implementation with another vocabulary
(``kvcache.kit.vllm_side.VllmAdapter`` builds vLLM's own config and requests).

A ``Side`` is one adapter's manager plus its requests, driven by named calls
with JSON arguments (the ops of a trace) and returning canonical results. A side
hashes its requests with its trace's chain (``hash_fn`` and ``PYTHONHASHSEED``)
and leaves the process's chain (``NONE_HASH``, a module global in kvcache as in
vLLM) as it found it: code that hashes in the same process after the kit (other
tests, a user's own requests) sees no change.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any, cast

from kvcache.kit.config import GroupConfig, ManagerConfig
from kvcache.kit.oracle import spec_package
from kvcache.kit.trace import canon, canon_state

BUILTIN_IMPLS = ("kvcache", "spec", "vllm", "kvcache-0.33", "spec-0.33")


class HarnessError(Exception):
    """A call the harness itself cannot make (unknown request id, unknown op)."""


class AdapterDoesNotFit(ValueError):
    """The kit's adapter cannot drive the installed release at all (a constructor, a
    lookup or a fact it reads has changed): said once, before any budget is spent."""


class CannotBuild(Exception):
    """An implementation cannot build the manager for a config at all.

    Not a divergence: a release that dropped a layout (or renamed a constructor
    argument the kit does not map) is reported as "cannot build: <reason>".
    """

    def __init__(self, impl: str, reason: str) -> None:
        super().__init__(f"cannot build: {reason}")
        self.impl = impl
        self.reason = reason


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


_UNSET = object()


def chain_seed(module: ModuleType) -> Any:
    """``module.NONE_HASH``, or a marker when it is not set yet (vLLM sets it only in
    ``init_none_hash``)."""
    return module.__dict__.get("NONE_HASH", _UNSET)


def set_chain_seed(module: ModuleType, value: Any) -> None:
    """Put back a value ``chain_seed`` returned (the marker unsets ``NONE_HASH``)."""
    if value is _UNSET:
        module.__dict__.pop("NONE_HASH", None)
    else:
        module.__dict__["NONE_HASH"] = value


RETENTION_ENV = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"


@contextlib.contextmanager
def retention_env(config: ManagerConfig) -> Iterator[None]:
    """``VLLM_PREFIX_CACHE_RETENTION_INTERVAL`` as ``config`` says (unset for None)
    while a manager is built, since vLLM 0.25.1 (and a drop-in) reads it there;
    the caller's value is restored afterwards."""
    old = os.environ.get(RETENTION_ENV)
    if config.prefix_cache_retention_interval is None:
        os.environ.pop(RETENTION_ENV, None)
    else:
        os.environ[RETENTION_ENV] = str(config.prefix_cache_retention_interval)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(RETENTION_ENV, None)
        else:
            os.environ[RETENTION_ENV] = old


def build_group_spec(lib: Any, group: GroupConfig, head_size: int, dtype: Any) -> Any:
    """``group`` as a spec of ``lib`` (``kvcache.kv_cache_interface`` or vLLM's, which
    name their classes alike). A Mamba group's prefill checkpoint fields (vLLM 0.33.0)
    are passed only when set: a ``MambaSpec`` without them (vLLM 0.25.1's) then raises
    ``TypeError`` naming the field."""
    common = {
        "block_size": group.block_size,
        "num_kv_heads": group.num_kv_heads,
        "head_size": head_size,
        "dtype": dtype,
    }
    if group.kind == "sliding_window":
        return lib.SlidingWindowSpec(**common, sliding_window=group.sliding_window)
    if group.kind == "chunked_local":
        return lib.ChunkedLocalAttentionSpec(
            **common, attention_chunk_size=group.attention_chunk_size
        )
    if group.kind == "mamba":
        checkpoint_fields = {}
        if group.has_checkpoint_fields:
            checkpoint_fields = {
                "num_prefill_checkpoint_blocks": group.num_prefill_checkpoint_blocks,
                "prefill_checkpoint_alignment": group.prefill_checkpoint_alignment,
            }
        return lib.MambaSpec(
            block_size=group.block_size,
            shapes=((2,),),
            dtypes=(dtype,),
            mamba_cache_mode=group.mamba_cache_mode,
            num_speculative_blocks=group.num_speculative_blocks,
            **checkpoint_fields,
        )
    if group.kind == "cross_attention":
        return lib.CrossAttentionSpec(**common)
    if group.kind == "mla":
        return lib.MLAAttentionSpec(**common)
    if group.kind == "sliding_window_mla":
        return lib.SlidingWindowMLASpec(**common, sliding_window=group.sliding_window)
    if group.kind == "rswa":
        return lib.RSWASpec(**common, rswa_window=group.rswa_window)
    if group.kind == "sink":
        return lib.SinkFullAttentionSpec(**common, sink_len=group.sink_len)
    if group.kind == "tq_full":
        return lib.TQFullAttentionSpec(**common)
    if group.kind == "hidden_state":
        return lib.HiddenStateCacheSpec(**common)
    if group.kind == "circular":
        return lib.CircularBufferSpec(**common)
    return lib.FullAttentionSpec(**common)


def build_kv_cache_config(lib: Any, config: ManagerConfig, dtype: Any) -> Any:
    """``lib.KVCacheConfig`` for ``config``: one group per ``GroupConfig``."""
    groups = [
        lib.KVCacheGroupSpec(
            [f"layers.{i}"],
            build_group_spec(lib, group, config.head_size, dtype),
            is_eagle_group=group.is_eagle_group,
        )
        for i, group in enumerate(config.groups)
    ]
    return lib.KVCacheConfig(
        num_blocks=config.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )


def prompt_embeds_tensor(rows: Any) -> Any:
    """A trace's ``prompt_embeds`` rows as a float32 torch tensor (None stays None).

    Raises:
        HarnessError: when torch, which prompt embeddings need, is not installed.
    """
    if rows is None:
        return None
    try:
        import torch
    except ImportError:
        raise HarnessError("a request with prompt_embeds needs torch installed") from None
    return torch.tensor(rows, dtype=torch.float32)


#: ``kv_cache_report_mode`` values of vLLM 0.33.0.
REPORT_MODES = ("incremental", "full")


def request_fields_0_33(args: Mapping[str, Any]) -> dict[str, Any]:
    """The vLLM 0.33.0 request fields a trace's request record sets (``session_id``,
    ``kv_cache_report_mode``), checked; empty for a record without them.

    Raises:
        HarnessError: a field of the wrong type, or an unknown report mode.
    """
    fields: dict[str, Any] = {}
    session = args.get("session_id")
    if session is not None:
        if not isinstance(session, str):
            raise HarnessError(f"session_id={session!r}; expected a str or null")
        fields["session_id"] = session
    mode = args.get("kv_cache_report_mode")
    if mode is not None:
        if mode not in REPORT_MODES:
            raise HarnessError(
                f"kv_cache_report_mode={mode!r}; expected one of {', '.join(REPORT_MODES)}"
            )
        fields["kv_cache_report_mode"] = mode
    return fields


def request_token_ids(args: Mapping[str, Any]) -> list[int] | None:
    """A trace request's token ids (None for a prompt given by embeddings alone)."""
    tokens = args.get("prompt_token_ids")
    return None if tokens is None else list(tokens)


class Adapter:
    """How to build one implementation's manager and requests (kvcache's vocabulary).

    Subclass it for an implementation with its own config and request types
    (see ``VllmAdapter``); otherwise pass a manager factory.
    """

    def __init__(self, name: str, factory: Callable[..., Any], version: str | None = None):
        self.name = name
        self.factory = factory
        self.version = version
        self.kv_cache_interface = importlib.import_module("kvcache.kv_cache_interface")
        self.request_module = importlib.import_module("kvcache.request")
        self.kv_cache_utils = importlib.import_module("kvcache.kv_cache_utils")

    def hash_fn(self, name: str) -> Callable[[Any], bytes]:
        fn: Callable[[Any], bytes] = self.kv_cache_utils.get_hash_fn_by_name(name)
        return fn

    def init_hashes(self, config: ManagerConfig, hash_seed: str) -> None:
        """Initialise ``NONE_HASH`` for ``config.hash_fn`` under ``PYTHONHASHSEED``
        (in ``chain_module``, for the whole process: a ``Side`` restores it)."""
        hash_fn = self.hash_fn(config.hash_fn)
        with_hash_seed(hash_seed, lambda: self.kv_cache_utils.init_none_hash(hash_fn))

    def chain_module(self) -> ModuleType | None:
        """The module whose ``NONE_HASH`` this adapter's requests chain from
        (``init_hashes`` sets it); None when it has none the kit knows of."""
        module: ModuleType | None = getattr(self, "kv_cache_utils", None)
        return module

    def side(self, config: ManagerConfig, hash_seed: str = "0") -> Side:
        """A fresh side driving this adapter's manager (``kvcache.kit.protocol``: another)."""
        return Side(self, config, hash_seed)

    def build_manager(self, config: ManagerConfig) -> Any:
        kv_cache_config = build_kv_cache_config(self.kv_cache_interface, config, "float16")
        with retention_env(config):
            return self.factory(kv_cache_config, **config.manager_kwargs())

    def get_computed_blocks(self, manager: Any, request: Any) -> tuple[Any, int]:
        """The prefix lookup as ``(blocks, num_computed_tokens)`` (0.25.1's shape)."""
        blocks, num_computed_tokens = manager.get_computed_blocks(request)
        return blocks, int(num_computed_tokens)

    def get_computed_blocks_for_connector(
        self, manager: Any, request: Any
    ) -> tuple[Any, int, int, bool]:
        """vLLM 0.33.0's lookup for a KV connector that takes divergent hybrid hits
        (0.33 line): ``(blocks, num_local_hit_tokens, shared_prefix_boundary,
        hit_diverged)``; the boundary is kept on the request as by
        ``get_computed_blocks`` (``keep_boundary``)."""
        blocks, num_local, boundary, diverged = manager.get_computed_blocks_for_connector(request)
        self.keep_boundary(request, int(boundary))
        return blocks, int(num_local), int(boundary), bool(diverged)

    def keep_boundary(self, request: Any, boundary: int) -> None:
        """Keep a lookup's shared-prefix boundary on the request, as 0.33.0's scheduler."""
        request.shared_prefix_boundary = boundary

    def admitted(self, manager: Any, request: Any, num_hit_tokens: int) -> None:
        """The scheduler admitted ``request`` after a lookup that hit ``num_hit_tokens``.

        A no-op for 0.25.1's vocabulary (its manager records prefix-cache stats
        inside the lookup); a release whose scheduler records them at admission
        overrides this.
        """

    def build_request(self, config: ManagerConfig, args: Mapping[str, Any]) -> Any:
        """A request for the fields of a trace's request record."""
        rq = self.request_module
        lora = args.get("lora")
        # NOTE: identifiers are interned because pickle-based block hashes (sha256,
        # xxhash) write a repeated *object* as a back-reference: two equal identifiers
        # in one block hash differently as two str objects (as JSON reads a trace)
        # than as one (as the driver makes them), in vLLM as in kvcache.
        request = rq.Request(
            request_id=args["request_id"],
            prompt_token_ids=request_token_ids(args),
            prompt_embeds=prompt_embeds_tensor(args.get("prompt_embeds")),
            sampling_params=None,
            pooling_params=None,
            arrival_time=0.0,
            mm_features=[
                rq.MultiModalFeatureSpec(
                    identifier=sys.intern(identifier),
                    mm_position=rq.PlaceholderRange(offset=offset, length=length),
                    modality="image",
                    data=None,
                )
                for identifier, offset, length in args.get("mm_features") or []
            ],
            lora_request=(
                None if lora is None else rq.LoRARequest(lora[0], lora[1], lora_path="/x")
            ),
            cache_salt=args.get("cache_salt"),
            block_hasher=self.block_hasher(config),
            skip_reading_prefix_cache=bool(args.get("skip_reading_prefix_cache", False)),
        )
        # vLLM 0.33.0's request fields (kvcache's Request, 0.25.1's vocabulary, has no
        # such parameters; the 0.33.0 profile reads them off the request).
        for name, value in request_fields_0_33(args).items():
            setattr(request, name, value)
        return request

    def block_hasher(self, config: ManagerConfig) -> Callable[[Any], list[Any]]:
        """The requests' block hasher for ``config``'s hash block size and function."""
        hasher: Callable[[Any], list[Any]] = self.kv_cache_utils.get_request_block_hasher(
            config.hash_block_size, self.hash_fn(config.hash_fn)
        )
        return hasher

    def status(self, name: str) -> Any:
        """The ``RequestStatus`` member called ``name``."""
        return self.request_module.RequestStatus[name]

    def abstract_state(self, manager: Any) -> dict[str, Any] | None:
        """docs/contract.md's state, or None when the manager cannot tell it."""
        fn = getattr(manager, "abstract_state", None)
        return None if fn is None else dict(fn())


class SpecAdapter(Adapter):
    """The spec: it hashes requests itself (never reading ``request.block_hashes``), so
    its manager is told the trace's hash algorithm and seed."""

    hash_seed = "0"

    def init_hashes(self, config: ManagerConfig, hash_seed: str) -> None:
        super().init_hashes(config, hash_seed)  # for the requests' own (kvcache) hasher
        self.hash_seed = hash_seed

    def build_manager(self, config: ManagerConfig) -> Any:
        kv_cache_config = build_kv_cache_config(
            self.kv_cache_interface, config, "float16"
        )
        return self.factory(kv_cache_config, **config.manager_kwargs(),
                            caching_hash_algo=config.hash_fn, hash_seed=self.hash_seed,
                            prefix_cache_retention_interval=config.prefix_cache_retention_interval)


class Stopwatch:
    """Records the time spent inside each of its ``with`` blocks in ``durations``.

    A side's ``timing``: each manager call (or property read) in a ``Side``
    handler is such a block, so a benchmark times exactly the calls a replay
    makes and nothing of the kit's own request building or result normalising.
    """

    __slots__ = ("_start", "durations")

    def __init__(self) -> None:
        self.durations: list[float] = []
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc_info: object) -> None:
        self.durations.append(time.perf_counter() - self._start)

    @property
    def seconds(self) -> float:
        """Time inside all blocks."""
        return sum(self.durations)

    @property
    def calls(self) -> int:
        """Blocks timed."""
        return len(self.durations)

    @staticmethod
    def overhead(blocks: int = 20_000) -> float:
        """Seconds one empty ``with`` block adds (the fastest of 5 runs of ``blocks``):
        the stopwatch's own share of each timed call."""
        best = float("inf")
        for _ in range(5):
            stopwatch = Stopwatch()
            for _ in range(blocks):
                with stopwatch:
                    pass
            best = min(best, stopwatch.seconds / blocks)
        return best


class ProfileAdapter(Adapter):
    """kvcache under another release's profile, through that release's drop-in module
    (``kvcache.vllm_0_33``): its constructor names, lookup shape, hasher and
    NONE_HASH rule, and the scheduler duty it moved (stats at admission).

    ``release_line`` tells the driver which vLLM line it behaves like, so that it
    is compared with that release as an equal (no ledger judge between them).
    """

    def __init__(self, name: str, module: str, release_line: str) -> None:
        drop_in = importlib.import_module(module)
        super().__init__(name, drop_in.KVCacheManager, _package_version())
        self.drop_in = drop_in
        self.release_line = release_line
        self.renamed_kwargs = {"max_num_batched_tokens": "max_in_flight_tokens"}

    def init_hashes(self, config: ManagerConfig, hash_seed: str) -> None:
        hash_fn = self.hash_fn(config.hash_fn)
        with_hash_seed(hash_seed, lambda: self.drop_in.init_none_hash(hash_fn))

    def build_manager(self, config: ManagerConfig) -> Any:
        kv_cache_config = build_kv_cache_config(self.kv_cache_interface, config, "float16")
        kwargs = {self.renamed_kwargs.get(k, k): v for k, v in config.manager_kwargs().items()}
        # 0.33.0's retention interval is a field of the config, not an environment variable.
        kv_cache_config.prefix_cache_retention_interval = config.prefix_cache_retention_interval
        return self.factory(kv_cache_config, **kwargs)

    def get_computed_blocks(self, manager: Any, request: Any) -> tuple[Any, int]:
        blocks, num_computed_tokens, boundary = manager.get_computed_blocks(request)
        request.shared_prefix_boundary = int(boundary)  # as 0.33.0's scheduler does
        return blocks, int(num_computed_tokens)

    def admitted(self, manager: Any, request: Any, num_hit_tokens: int) -> None:
        manager.record_prefix_cache_stats(request, num_hit_tokens)

    def block_hasher(self, config: ManagerConfig) -> Callable[[Any], list[Any]]:
        hasher: Callable[[Any], list[Any]] = self.drop_in.get_request_block_hasher(
            config.hash_block_size, self.hash_fn(config.hash_fn), config.num_hash_lookahead_tokens
        )
        return hasher


class SpecProfileAdapter(SpecAdapter):
    """The spec under another release's profile (``spec/profile.py``), with that
    release's request hasher (``drop_in``'s) and scheduler duty (stats at admission):
    the independent check of ``ProfileAdapter`` without that vLLM installed."""

    def __init__(self, name: str, release: str, release_line: str, module: str) -> None:
        spec = spec_package()
        super().__init__(name, spec.KVCacheManager, _package_version())
        self.release = release
        self.release_line = release_line
        self.drop_in = importlib.import_module(module)

    def init_hashes(self, config: ManagerConfig, hash_seed: str) -> None:
        hash_fn = self.hash_fn(config.hash_fn)
        with_hash_seed(hash_seed, lambda: self.drop_in.init_none_hash(hash_fn))
        self.hash_seed = hash_seed

    def build_manager(self, config: ManagerConfig) -> Any:
        kv_cache_config = build_kv_cache_config(
            self.kv_cache_interface, config, "float16"
        )
        return self.factory(kv_cache_config, **config.manager_kwargs(),
                            caching_hash_algo=config.hash_fn, hash_seed=self.hash_seed,
                            prefix_cache_retention_interval=config.prefix_cache_retention_interval,
                            profile=self.release)

    def get_computed_blocks(self, manager: Any, request: Any) -> tuple[Any, int]:
        blocks, num_computed_tokens = manager.get_computed_blocks(request)
        # As 0.33.0's scheduler does with the lookup's third value.
        request.shared_prefix_boundary = manager.shared_prefix_boundary(
            request, num_computed_tokens
        )
        return blocks, int(num_computed_tokens)

    def admitted(self, manager: Any, request: Any, num_hit_tokens: int) -> None:
        manager.record_prefix_cache_stats(request, num_hit_tokens)

    def block_hasher(self, config: ManagerConfig) -> Callable[[Any], list[Any]]:
        hasher: Callable[[Any], list[Any]] = self.drop_in.get_request_block_hasher(
            config.hash_block_size, self.hash_fn(config.hash_fn), config.num_hash_lookahead_tokens
        )
        return hasher


class Side:
    """An adapter's manager plus its requests, driven by ``call(op, args)``.

    ``timing`` wraps every manager call of a handler (a no-op context by
    default; ``kvcache.kit.bench`` puts a ``Stopwatch`` there).
    """

    def __init__(self, adapter: Adapter, config: ManagerConfig, hash_seed: str = "0") -> None:
        self.adapter = adapter
        self.name = adapter.name
        self.config = config
        self.requests: dict[str, Any] = {}
        self.last_computed: dict[str, Any] = {}
        self.popped: dict[int, list[Any]] = {}
        #: The raw return value of the last get_computed_blocks / allocate_slots.
        self.last_raw: Any = None
        self.last_hit_tokens: dict[str, int] = {}
        self.timing: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        # The chain of this side's trace, kept here: the process's is put back at once.
        self.chain_module = adapter.chain_module()
        before = _UNSET if self.chain_module is None else chain_seed(self.chain_module)
        try:
            adapter.init_hashes(config, hash_seed)
            self.none_hash = None if self.chain_module is None else chain_seed(self.chain_module)
        finally:
            if self.chain_module is not None:
                set_chain_seed(self.chain_module, before)
        try:
            with self.hashing():
                self.manager = adapter.build_manager(config)
        except Exception as exc:
            raise CannotBuild(
                adapter.name, f"{adapter.name} rejects the config ({type(exc).__name__}: {exc})"
            ) from exc

    @contextlib.contextmanager
    def hashing(self) -> Iterator[None]:
        """This side's chain installed as the process's ``NONE_HASH`` for the block, the
        caller's put back after: for code that hashes this side's requests outside
        ``call`` (a simulation appending tokens to them itself)."""
        module = self.chain_module
        if module is None:
            yield
            return
        before = chain_seed(module)
        set_chain_seed(module, self.none_hash)
        try:
            yield
        finally:
            set_chain_seed(module, before)

    # ------------------------------------------------------------ driving

    def call(self, op: str, args: Mapping[str, Any]) -> Any:
        """Run one named call and return its canonical result (exceptions propagate)."""
        handler = getattr(self, "op_" + op, None)
        if handler is None:
            raise HarnessError(f"unknown op {op!r}")
        module = self.chain_module  # as ``hashing``, inlined: this runs on every call
        if module is None:
            return handler(args)
        before = chain_seed(module)
        set_chain_seed(module, self.none_hash)
        try:
            return handler(args)
        finally:
            set_chain_seed(module, before)

    def raw_state(self) -> dict[str, Any] | None:
        return self.adapter.abstract_state(self.manager)

    def state(self) -> dict[str, Any] | None:
        """Canonical abstract state, or None when the implementation has none."""
        raw = self.raw_state()
        return None if raw is None else canon_state(raw)

    def num_free_blocks(self) -> int:
        return int(self.manager.block_pool.get_num_free_blocks())

    def check_invariants(self) -> str | None:
        """The implementation's own ``check_invariants()`` failure, if it has one."""
        fn = getattr(self.manager, "check_invariants", None)
        if fn is None:
            return None
        try:
            fn()
        except AssertionError as exc:
            return f"{self.name} check_invariants() failed: {exc}"
        return None

    def request(self, args: Mapping[str, Any]) -> Any:
        try:
            return self.requests[args["request_id"]]
        except KeyError:
            raise HarnessError(f"unknown request {args.get('request_id')!r}") from None

    @staticmethod
    def block_id(block: Any) -> int:
        """Id of a block object (kvcache, vLLM) or of an int block (spec)."""
        return block if isinstance(block, int) else int(block.block_id)

    # ------------------------------------------------------------ requests

    def op_add_request(self, args: Mapping[str, Any]) -> Any:
        request_id = args["request_id"]
        if request_id in self.requests:
            raise HarnessError(f"request {request_id!r} added twice")
        request = self.adapter.build_request(self.config, args)
        self.requests[request_id] = request
        return canon(list(request.block_hashes))

    def op_append_output_token_ids(self, args: Mapping[str, Any]) -> Any:
        request = self.request(args)
        token_ids = args["token_ids"]
        num_hashes = len(request.block_hashes)
        request.append_output_token_ids(
            token_ids if isinstance(token_ids, int) else list(token_ids)
        )
        return canon(list(request.block_hashes)[num_hashes:])  # the blocks it completed

    def op_update_request(self, args: Mapping[str, Any]) -> Any:
        request = self.request(args)
        if "status" in args:
            request.status = self.adapter.status(args["status"])
        if "num_computed_tokens" in args:
            request.num_computed_tokens = args["num_computed_tokens"]
        if "num_preemptions" in args:
            request.num_preemptions = args["num_preemptions"]
        if "num_in_flight_tokens" in args:  # 0.33 line: scheduled, not yet processed
            request.num_in_flight_tokens = args["num_in_flight_tokens"]
        return None

    # ------------------------------------------------------------ manager calls

    def op_get_computed_blocks(self, args: Mapping[str, Any]) -> Any:
        request = self.request(args)
        with self.timing:
            blocks, num_computed_tokens = self.adapter.get_computed_blocks(self.manager, request)
        self.last_computed[args["request_id"]] = blocks
        self.last_hit_tokens[args["request_id"]] = num_computed_tokens
        self.last_raw = (blocks, num_computed_tokens)
        return {
            "block_ids": canon(blocks.get_block_ids()),
            "num_computed_tokens": num_computed_tokens,
        }

    def op_get_computed_blocks_for_connector(self, args: Mapping[str, Any]) -> Any:
        """The connector lookup (0.33 line): its blocks, local hit, boundary and
        ``hit_diverged``; an allocation's ``new_computed_blocks="last"`` takes its
        blocks."""
        request = self.request(args)
        with self.timing:
            blocks, num_local, boundary, diverged = self.adapter.get_computed_blocks_for_connector(
                self.manager, request
            )
        self.last_computed[args["request_id"]] = blocks
        self.last_hit_tokens[args["request_id"]] = num_local
        self.last_raw = (blocks, num_local, boundary, diverged)
        return {
            "block_ids": canon(blocks.get_block_ids()),
            "num_computed_tokens": num_local,
            "shared_prefix_boundary": boundary,
            "hit_diverged": diverged,
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
        num_new_tokens = args["num_new_tokens"]
        num_new_computed_tokens = args.get("num_new_computed_tokens", 0)
        num_lookahead_tokens = args.get("num_lookahead_tokens", 0)
        num_external_computed_tokens = args.get("num_external_computed_tokens", 0)
        delay_cache_blocks = args.get("delay_cache_blocks", False)
        num_encoder_tokens = args.get("num_encoder_tokens", 0)
        full_sequence_must_fit = args.get("full_sequence_must_fit", False)
        reserved_blocks = args.get("reserved_blocks", 0)
        has_scheduled_reqs = args.get("has_scheduled_reqs", True)
        # 0.33 line only: the groups an async load writes (not reported for zeroing)
        zeroing = (
            {"skip_zeroing_group_ids": tuple(args["skip_zeroing_group_ids"])}
            if "skip_zeroing_group_ids" in args
            else {}
        )
        with self.timing:
            blocks = self.manager.allocate_slots(
                request,
                num_new_tokens,
                num_new_computed_tokens=num_new_computed_tokens,
                new_computed_blocks=new_computed_blocks,
                num_lookahead_tokens=num_lookahead_tokens,
                num_external_computed_tokens=num_external_computed_tokens,
                delay_cache_blocks=delay_cache_blocks,
                num_encoder_tokens=num_encoder_tokens,
                full_sequence_must_fit=full_sequence_must_fit,
                reserved_blocks=reserved_blocks,
                has_scheduled_reqs=has_scheduled_reqs,
                **zeroing,
            )
        self.last_raw = blocks
        if blocks is None:
            return None
        if which == "last":  # the scheduler admits the request it looked up
            num_hit_tokens = self.last_hit_tokens.get(args["request_id"], 0)
            with self.timing:
                self.adapter.admitted(self.manager, request, num_hit_tokens)
        return canon(blocks.get_block_ids())

    def op_free(self, args: Mapping[str, Any]) -> Any:
        request = self.request(args)
        with self.timing:
            self.manager.free(request)
        return None

    def op_pop_blocks_for_free(self, args: Mapping[str, Any]) -> Any:
        request = self.request(args)
        with self.timing:
            blocks = list(self.manager.pop_blocks_for_free(request))
        self.popped[args["handle"]] = blocks
        return [self.block_id(b) for b in blocks]

    def op_free_blocks(self, args: Mapping[str, Any]) -> Any:
        """``block_pool.free_blocks(reversed(popped))``, as the scheduler's deferred free."""
        try:
            blocks = self.popped.pop(args["handle"])
        except KeyError:
            raise HarnessError(f"unknown popped-blocks handle {args['handle']!r}") from None
        with self.timing:
            self.manager.block_pool.free_blocks(reversed(blocks))
        return None

    def op_take_kv_cache_block_copies(self, args: Mapping[str, Any]) -> Any:
        """``take_kv_cache_block_copies()`` (0.33 line): the copies as (source, copy) id
        pairs and the retained blocks' ids. The retained blocks are kept under
        ``handle`` for ``free_blocks``, which then frees them in the
        order they came, as 0.33.0's scheduler does (at once, or deferred until the
        step running the copies is processed)."""
        with self.timing:
            copies, retained = self.manager.take_kv_cache_block_copies()
        pairs = [
            [int(c.src_block_id), int(c.dst_block_id)] if hasattr(c, "src_block_id")
            else [int(c[0]), int(c[1])]
            for c in copies
        ]
        retained = list(retained)
        self.popped[args["handle"]] = retained[::-1]  # free_blocks reverses them back
        return {"copies": pairs, "retained": [self.block_id(b) for b in retained]}

    def op_take_boundary_state_offloads(self, args: Mapping[str, Any]) -> Any:
        """``take_boundary_state_offloads()`` (0.33 line): per request id (sorted), the
        Mamba 'align' states offered to a KV connector as [group, block id, tokens]."""
        with self.timing:
            offloads = self.manager.take_boundary_state_offloads()
        return {
            rid: [[int(g), int(b), int(n)] for g, b, n in offloads[rid]]
            for rid in sorted(offloads)
        }

    def op_finalize_partial_tail_offloads(self, args: Mapping[str, Any]) -> Any:
        """``finalize_partial_tail_offloads(request)`` (0.33 line, a KV producer): the
        finishing request's own partial prompt-tail states as [group, block id, tokens]."""
        request = self.request(args)
        with self.timing:
            tails = self.manager.finalize_partial_tail_offloads(request)
        return [[int(g), int(b), int(n)] for g, b, n in tails]

    def op_evict_blocks(self, args: Mapping[str, Any]) -> Any:
        block_ids = set(args["block_ids"])
        with self.timing:
            self.manager.evict_blocks(block_ids)
        return None

    def op_reset_prefix_cache(self, args: Mapping[str, Any]) -> Any:
        with self.timing:
            done = self.manager.reset_prefix_cache()
        return bool(done)

    def op_take_events(self, args: Mapping[str, Any]) -> Any:
        with self.timing:
            events = self.manager.take_events()
        return canon(list(events))

    def op_record_blocks_for_zeroing(self, args: Mapping[str, Any]) -> Any:
        """``record_blocks_for_zeroing(request_id, start_token)`` (0.33 line: after a
        failed async load); what it reports shows in the next ``take_new_block_ids``."""
        with self.timing:
            self.manager.record_blocks_for_zeroing(args["request_id"], args["start_token"])
        return None

    def op_take_new_block_ids(self, args: Mapping[str, Any]) -> Any:
        with self.timing:
            block_ids = self.manager.take_new_block_ids()
        return canon(list(block_ids))

    def op_get_num_common_prefix_blocks(self, args: Mapping[str, Any]) -> Any:
        request_id = args["request_id"]
        with self.timing:
            counts = self.manager.get_num_common_prefix_blocks(request_id)
        return canon(list(counts))

    def op_new_step_starts(self, args: Mapping[str, Any]) -> Any:
        with self.timing:
            self.manager.new_step_starts()
        return None

    def op_make_prefix_cache_stats(self, args: Mapping[str, Any]) -> Any:
        with self.timing:
            stats = self.manager.make_prefix_cache_stats()
        return canon(stats)

    def op_usage(self, args: Mapping[str, Any]) -> Any:
        with self.timing:
            usage = self.manager.usage
        return float(usage)

    def op_get_num_free_blocks(self, args: Mapping[str, Any]) -> Any:
        with self.timing:
            num_free = self.manager.block_pool.get_num_free_blocks()
        return int(num_free)

    def op_get_block_ids(self, args: Mapping[str, Any]) -> Any:
        request_id = args["request_id"]
        with self.timing:
            block_ids = self.manager.get_block_ids(request_id)
        return canon(block_ids)

    def op_get_blocks(self, args: Mapping[str, Any]) -> Any:
        request_id = args["request_id"]
        with self.timing:
            blocks = self.manager.get_blocks(request_id)
        return canon(blocks.get_block_ids(allow_none=True))

    def op_get_block_ids_for_computed_tokens(self, args: Mapping[str, Any]) -> Any:
        request_id, num_computed_tokens = args["request_id"], args["num_computed_tokens"]
        with self.timing:
            block_ids = self.manager.get_block_ids_for_computed_tokens(
                request_id, num_computed_tokens
            )
        return canon(block_ids)

    def op_cache_blocks(self, args: Mapping[str, Any]) -> Any:
        request, num_computed_tokens = self.request(args), args["num_computed_tokens"]
        with self.timing:
            self.manager.cache_blocks(request, num_computed_tokens)
        return None

    def op_remove_skipped_blocks(self, args: Mapping[str, Any]) -> Any:
        request_id, total = args["request_id"], args["total_computed_tokens"]
        num_prompt_tokens = args.get("num_prompt_tokens")
        with self.timing:
            self.manager.remove_skipped_blocks(request_id, total, num_prompt_tokens)
        return None


# ---------------------------------------------------------------- implementation names

#: Extra named adapters (name -> zero-argument constructor).
ADAPTERS: dict[str, Callable[[], Adapter]] = {}


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvcache")
    except PackageNotFoundError:
        return "dev"


def resolve_adapter(name: str) -> Adapter:
    """The adapter an implementation name (``--impl``) stands for.

    Raises:
        ValueError: the name is unknown, or its module or factory cannot be loaded.
    """
    if name in ADAPTERS:
        return ADAPTERS[name]()
    if name.startswith("exec:"):  # a subprocess speaking docs/protocol.md's JSON lines
        from kvcache.kit.exec_side import exec_adapter

        return exec_adapter(name)
    if name == "kvcache":
        import kvcache

        return Adapter("kvcache", kvcache.KVCacheManager, _package_version())
    if name == "kvcache-0.33":
        return ProfileAdapter("kvcache-0.33", "kvcache.vllm_0_33", "0.33")
    if name == "spec-0.33":
        return SpecProfileAdapter("spec-0.33", "0.33.0", "0.33", "kvcache.vllm_0_33")
    if name == "kvcache-pure":
        # The pure-Python build beside whichever build `import kvcache` loaded
        # (kvcache._builds.import_pure_copy): for timing both in one process.
        from kvcache import _builds

        pure = _builds.pure_copy()
        adapter = Adapter("kvcache-pure", pure["kv_cache_manager"].KVCacheManager)
        # The vocabulary is never compiled (kvcache._builds): both builds share it.
        import kvcache.kv_cache_interface
        import kvcache.request

        adapter.kv_cache_interface = pure.get("kv_cache_interface", kvcache.kv_cache_interface)
        adapter.request_module = pure.get("request", kvcache.request)
        adapter.kv_cache_utils = pure["kv_cache_utils"]
        return adapter
    if name == "spec":
        spec = spec_package()
        return SpecAdapter("spec", spec.KVCacheManager, _package_version())
    if name == "vllm":
        try:
            from kvcache.kit.vllm_side import VllmAdapter
        except Exception as exc:
            raise ValueError(
                f"impl='vllm': vLLM cannot be imported here ({type(exc).__name__}: {exc}); "
                "`make reference` installs the 0.25.1 reference into .venv"
            ) from None
        return VllmAdapter()
    module_name, sep, attr = name.partition(":")
    if not module_name or (sep and not attr):
        raise ValueError(
            f"impl={name!r}: use kvcache, spec, vllm, a package name or module:factory"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(
            f"impl={name!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc}); "
            "is it on PYTHONPATH?"
        ) from None
    target = getattr(module, attr or "KVCacheManager", None)
    if target is None:
        what = f"no attribute {attr!r}" if attr else "no KVCacheManager"
        raise ValueError(f"impl={name!r}: module {module_name!r} has {what}")
    if isinstance(target, Adapter):
        return target
    if isinstance(target, type) and issubclass(target, Adapter):
        return cast(Callable[[], Adapter], target)()
    if not callable(target):
        raise ValueError(f"impl={name!r}: {attr or 'KVCacheManager'} is not callable")
    if getattr(target, "PROTOCOL", None) is not None:  # docs/protocol.md's small protocol
        from kvcache.kit.protocol import ProtocolAdapter

        return ProtocolAdapter(name, target)
    return Adapter(name, target, getattr(module, "__version__", None))


def make_side(name: str, config: ManagerConfig, hash_seed: str = "0") -> Side:
    """A fresh side for implementation ``name`` (see ``resolve_adapter``)."""
    return resolve_adapter(name).side(config, hash_seed)
