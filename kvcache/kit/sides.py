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
The adapters and what they share (config and request building, the errors) are
in ``kvcache.kit.adapter_base``; this module re-exports every name of it.

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
import time
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any, cast

from kvcache.kit.adapter_base import (
    REPORT_MODES,
    RETENTION_ENV,
    Adapter,
    AdapterDoesNotFit,
    CannotBuild,
    HarnessError,
    ProfileAdapter,
    ReleaseProfileAdapter,
    SpecAdapter,
    SpecProfileAdapter,
    SpecReleaseAdapter,
    _package_version,
    build_group_spec,
    build_kv_cache_config,
    prompt_embeds_tensor,
    request_fields_0_33,
    request_token_ids,
    retention_env,
    with_hash_seed,
)
from kvcache.kit.config import ManagerConfig
from kvcache.kit.oracle import spec_package
from kvcache.kit.trace import canon, canon_state

__all__ = [
    "ADAPTERS",
    "BUILTIN_IMPLS",
    "REPORT_MODES",
    "RETENTION_ENV",
    "Adapter",
    "AdapterDoesNotFit",
    "CannotBuild",
    "HarnessError",
    "ProfileAdapter",
    "ReleaseProfileAdapter",
    "Side",
    "SpecAdapter",
    "SpecProfileAdapter",
    "SpecReleaseAdapter",
    "Stopwatch",
    "build_group_spec",
    "build_kv_cache_config",
    "chain_seed",
    "make_side",
    "prompt_embeds_tensor",
    "request_fields_0_33",
    "request_token_ids",
    "resolve_adapter",
    "retention_env",
    "set_chain_seed",
    "with_hash_seed",
]

BUILTIN_IMPLS = ("kvcache", "spec", "vllm", "kvcache-0.33", "spec-0.33")


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
    if name.startswith("kvcache@"):  # kvcache's KVCacheManager(profile=RELEASE)
        return ReleaseProfileAdapter(name.partition("@")[2])
    if name.startswith("spec@"):  # the spec's KVCacheManager(profile=RELEASE)
        return SpecReleaseAdapter(name.partition("@")[2])
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


def make_side(
    name: str, config: ManagerConfig, hash_seed: str = "0", states: bool = True
) -> Side:
    """A fresh side for implementation ``name`` (see ``resolve_adapter``); ``states``:
    whether its abstract states will be read (below level ``exact`` they are not)."""
    return resolve_adapter(name).side(config, hash_seed, states)
