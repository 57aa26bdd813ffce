"""The adapters: how the kit builds one implementation's manager and requests.

An ``Adapter`` turns a ``ManagerConfig`` and a trace's request records into an
implementation's own objects, in kvcache's vocabulary (``kvcache.KVCacheConfig``,
``kvcache.Request``: the same fields as vLLM's) around a manager factory.
``SpecAdapter`` drives the spec (which hashes requests itself),
``ProfileAdapter`` and ``SpecProfileAdapter`` kvcache and the spec under a later
release's profile (``kvcache.vllm_0_33``). The helpers that build a config's
specs, a request's fields and the hash chain's seed are shared with other
vocabularies (``kvcache.kit.vllm_side``); so are the errors a side or an adapter
raises (``HarnessError``, ``AdapterDoesNotFit``, ``CannotBuild``).

``kvcache.kit.sides`` names the implementations (``resolve_adapter``), drives an
adapter's manager (``Side``) and re-exports every name of this module.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvcache.kit.config import GroupConfig, ManagerConfig
from kvcache.kit.oracle import spec_package

if TYPE_CHECKING:
    from kvcache.kit.sides import Side


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

    def side(self, config: ManagerConfig, hash_seed: str = "0", states: bool = True) -> Side:
        """A fresh side driving this adapter's manager (``kvcache.kit.protocol``: another).
        ``states``: whether the kit will read its abstract states (an in-process side
        computes one only when read; a process is told not to send them)."""
        from kvcache.kit.sides import Side  # sides imports this module

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


def lookup_keeping_boundary(manager: Any, request: Any) -> tuple[Any, int]:
    """A 0.25.1-shaped lookup ``(blocks, num_computed_tokens)`` of a manager that also
    tells its shared-prefix boundary (``shared_prefix_boundary``: kvcache's and the
    spec's), kept on the request as a release's scheduler keeps its lookup's third
    value (0.26.0 on; 0 before, and without a junction)."""
    blocks, num_computed_tokens = manager.get_computed_blocks(request)
    request.shared_prefix_boundary = manager.shared_prefix_boundary(request, num_computed_tokens)
    return blocks, int(num_computed_tokens)


class SpecAdapter(Adapter):
    """The spec: it hashes requests itself (never reading ``request.block_hashes``), so
    its manager is told the trace's hash algorithm and seed; ``spec_profile`` is the
    release profile it is built with (None: the spec's default)."""

    hash_seed = "0"
    spec_profile: Any = None

    def init_hashes(self, config: ManagerConfig, hash_seed: str) -> None:
        super().init_hashes(config, hash_seed)  # for the requests' own (kvcache) hasher
        self.hash_seed = hash_seed

    def build_manager(self, config: ManagerConfig) -> Any:
        kv_cache_config = build_kv_cache_config(
            self.kv_cache_interface, config, "float16"
        )
        return self.factory(kv_cache_config, **config.manager_kwargs(),
                            caching_hash_algo=config.hash_fn, hash_seed=self.hash_seed,
                            prefix_cache_retention_interval=config.prefix_cache_retention_interval,
                            profile=self.spec_profile)


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


class ReleaseProfileAdapter(Adapter):
    """kvcache's own ``KVCacheManager(profile=release)``, any release of the table, held
    to that vLLM release as an equal (``release_line``): its requests hashed by the
    release's rules (``tagged_extra_keys``, ``mm_keys_by_window``, the NONE_HASH seed)
    and, where the release's scheduler counts prefix-cache stats at admission, counted
    there (``record_prefix_cache_stats``). kvcache's 0.25.1-shaped API stays: the vLLM
    side's adapter reads its release's API into the kit's shape.

    ``profile`` replaces the release's own (the release's with a switch flipped, for a
    check's teeth). Its lookups keep the shared-prefix boundary on the request as the
    release's scheduler does (``lookup_keeping_boundary``): against vLLM R the vLLM side
    must keep it too (``VllmAdapter.stores_shared_prefix_boundary``, which
    ``profile_check`` sets).

    Raises:
        ValueError: for a release kvcache has no profile of.
    """

    def __init__(self, release: str, profile: Any = None) -> None:
        from functools import partial

        from kvcache import KVCacheManager
        from kvcache.profile import Profile

        self.profile = Profile(release) if profile is None else profile
        super().__init__(f"kvcache@{release}", partial(KVCacheManager, profile=self.profile),
                         _package_version())  # fmt: skip
        self.release_line = ".".join(release.split(".")[:2])

    def init_hashes(self, config: ManagerConfig, hash_seed: str) -> None:
        hash_fn = self.hash_fn(config.hash_fn)
        fixed = self.profile.none_hash_fixed_seed
        with_hash_seed(hash_seed, lambda: self.kv_cache_utils.init_none_hash(hash_fn, fixed))

    def get_computed_blocks(self, manager: Any, request: Any) -> tuple[Any, int]:
        return lookup_keeping_boundary(manager, request)

    def admitted(self, manager: Any, request: Any, num_hit_tokens: int) -> None:
        manager.record_prefix_cache_stats(request, num_hit_tokens)  # a no-op before 0.27.0

    def block_hasher(self, config: ManagerConfig) -> Callable[[Any], list[Any]]:
        hasher: Callable[[Any], list[Any]] = self.kv_cache_utils.get_request_block_hasher(
            config.hash_block_size, self.hash_fn(config.hash_fn),
            self.profile.tagged_extra_keys, self.profile.mm_keys_by_window,
            config.num_hash_lookahead_tokens,
        )  # fmt: skip
        return hasher


class SpecReleaseAdapter(SpecAdapter, ReleaseProfileAdapter):
    """The spec's ``KVCacheManager(profile=release)`` (``spec@R``), held to vLLM R as
    kvcache's profile is (``ReleaseProfileAdapter``: the same requests, hashed by the
    release's rules, the lookup's boundary kept, stats at admission): the oracle
    itself against that release, not only through kvcache. ``profile`` (kvcache's, a
    switch flipped for a check's teeth) becomes the spec's with the same switches.

    Raises:
        ValueError: for a release the spec has no profile of.
    """

    def __init__(self, release: str, profile: Any = None) -> None:
        super().__init__(release, profile)  # ReleaseProfileAdapter's
        spec = spec_package()
        self.name = f"spec@{release}"
        self.factory = spec.KVCacheManager
        self.spec_profile = spec.profile.Profile(release, **{
            name: bool(getattr(self.profile, name)) for name in spec.profile.SWITCHES})


class SpecProfileAdapter(SpecAdapter):
    """The spec under another release's profile (``spec/profile.py``), with that
    release's request hasher (``drop_in``'s) and scheduler duty (stats at admission):
    the independent check of ``ProfileAdapter`` without that vLLM installed."""

    def __init__(self, name: str, release: str, release_line: str, module: str) -> None:
        spec = spec_package()
        super().__init__(name, spec.KVCacheManager, _package_version())
        self.release = self.spec_profile = release
        self.release_line = release_line
        self.drop_in = importlib.import_module(module)

    def init_hashes(self, config: ManagerConfig, hash_seed: str) -> None:
        hash_fn = self.hash_fn(config.hash_fn)
        with_hash_seed(hash_seed, lambda: self.drop_in.init_none_hash(hash_fn))
        self.hash_seed = hash_seed

    def get_computed_blocks(self, manager: Any, request: Any) -> tuple[Any, int]:
        return lookup_keeping_boundary(manager, request)

    def admitted(self, manager: Any, request: Any, num_hit_tokens: int) -> None:
        manager.record_prefix_cache_stats(request, num_hit_tokens)

    def block_hasher(self, config: ManagerConfig) -> Callable[[Any], list[Any]]:
        hasher: Callable[[Any], list[Any]] = self.drop_in.get_request_block_hasher(
            config.hash_block_size, self.hash_fn(config.hash_fn), config.num_hash_lookahead_tokens
        )
        return hasher


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvcache")
    except PackageNotFoundError:
        return "dev"
