"""Build a manager and its requests for a workload, for each implementation.

Implementations: ``kvcache`` (this package), ``spec`` (the oracle), ``vllm``
(the real vLLM 0.25.1, when installed), or ``module:factory`` for a third
party: ``factory(workload) -> kvcache.kit.workloads.Impl``.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from kvcache.kit.workloads import GroupLayout, Impl, RequestSpec, Workload

BUILTIN_IMPLS = ("kvcache", "spec", "vllm")


def _group_spec(lib: Any, layout: GroupLayout, dtype: Any) -> Any:
    common = {"block_size": layout.block_size, "num_kv_heads": 1, "head_size": 64, "dtype": dtype}
    if layout.kind == "full":
        return lib.FullAttentionSpec(**common)
    if layout.kind == "sliding_window":
        return lib.SlidingWindowSpec(**common, sliding_window=layout.sliding_window)
    if layout.kind == "chunked_local":
        return lib.ChunkedLocalAttentionSpec(
            **common, attention_chunk_size=layout.attention_chunk_size
        )
    if layout.kind == "mamba":
        return lib.MambaSpec(
            block_size=layout.block_size,
            shapes=((16, 64),),
            dtypes=(dtype,),
            mamba_cache_mode=layout.mamba_cache_mode,
        )
    raise ValueError(f"unknown group kind={layout.kind!r}")


def _manager_kwargs(workload: Workload) -> dict[str, Any]:
    return {
        "max_model_len": workload.max_model_len,
        "scheduler_block_size": workload.scheduler_block_size,
        "hash_block_size": workload.hash_block_size,
        "max_num_batched_tokens": workload.token_budget,
        "enable_caching": workload.enable_caching,
    }


def _package_impl(name: str, workload: Workload) -> Impl:
    import kvcache as vocab

    package = importlib.import_module(name)
    vocab.init_none_hash(vocab.sha256)
    groups = [
        vocab.KVCacheGroupSpec([f"layer.{i}"], _group_spec(vocab, g, "float16"))
        for i, g in enumerate(workload.groups)
    ]
    config = vocab.KVCacheConfig(workload.num_blocks, [], groups)
    manager = package.KVCacheManager(config, **_manager_kwargs(workload))
    hasher = vocab.get_request_block_hasher(workload.hash_block_size, vocab.sha256)

    def new_request(spec: RequestSpec) -> Any:
        return vocab.Request(
            spec.request_id,
            list(spec.prompt_token_ids),
            cache_salt=spec.cache_salt,
            block_hasher=hasher,
        )

    def set_status(request: Any, status: str) -> None:
        request.status = vocab.RequestStatus[status]

    return Impl(name, manager, new_request, set_status)


def _vllm_impl(workload: Workload) -> Impl:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import torch
    import vllm.v1.kv_cache_interface as vki
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request, RequestStatus

    init_none_hash(sha256)
    groups = [
        vki.KVCacheGroupSpec([f"layer.{i}"], _group_spec(vki, g, torch.float16))
        for i, g in enumerate(workload.groups)
    ]
    config = vki.KVCacheConfig(workload.num_blocks, [], groups)
    manager = KVCacheManager(config, **_manager_kwargs(workload))
    hasher = get_request_block_hasher(workload.hash_block_size, sha256)

    def new_request(spec: RequestSpec) -> Any:
        return Request(
            spec.request_id,
            list(spec.prompt_token_ids),
            SamplingParams(max_tokens=spec.max_output_tokens),
            None,
            cache_salt=spec.cache_salt,
            block_hasher=hasher,
        )

    def set_status(request: Any, status: str) -> None:
        request.status = RequestStatus[status]

    return Impl("vllm", manager, new_request, set_status)


def vllm_available() -> bool:
    """Whether the real vLLM 0.25.1 can be imported here."""
    try:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        importlib.import_module("vllm.v1.core.kv_cache_manager")
    except Exception:
        return False
    return True


def make_impl(name: str, workload: Workload) -> Impl:
    """An ``Impl`` for ``workload``: kvcache, spec, vllm, or ``module:factory``.

    Raises:
        ValueError: for an unknown name or a factory that cannot be imported.
    """
    if name in ("kvcache", "spec"):
        return _package_impl(name, workload)
    if name == "vllm":
        return _vllm_impl(workload)
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"impl={name!r}: cannot load the factory ({exc})") from exc
        impl = factory(workload)
        if not isinstance(impl, Impl):
            raise ValueError(f"impl={name!r}: factory returned {type(impl).__name__}, not Impl")
        return impl
    raise ValueError(f"unknown impl={name!r}; use kvcache, spec, vllm or module:factory")
