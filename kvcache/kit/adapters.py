"""Build a manager and its requests for a workload, for each implementation.

Implementation names are the kit's (``kvcache.kit.sides.resolve_adapter``):
``kvcache``, ``spec``, ``vllm`` (the real vLLM, when installed), a package
name, or ``module:factory`` for a third party, where ``factory`` has
``KVCacheManager``'s constructor signature (or is an ``Adapter``). The same
names work for every command: bench, simulate, record, replay, fuzz.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from kvcache.kit.config import ManagerConfig
from kvcache.kit.sides import BUILTIN_IMPLS, resolve_adapter
from kvcache.kit.workloads import Impl, RequestSpec, Workload

__all__ = ["BUILTIN_IMPLS", "make_impl", "request_args", "vllm_available"]


def request_args(spec: RequestSpec) -> dict[str, Any]:
    """A workload request as the fields of a trace's request record."""
    args: dict[str, Any] = {
        "request_id": spec.request_id,
        "prompt_token_ids": list(spec.prompt_token_ids),
        "max_tokens": spec.max_output_tokens,
    }
    if spec.cache_salt is not None:
        args["cache_salt"] = spec.cache_salt
    if spec.lora is not None:
        args["lora"] = list(spec.lora)
    return args


def vllm_available() -> bool:
    """Whether the real vLLM can be imported here."""
    try:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        importlib.import_module("vllm.v1.core.kv_cache_manager")
    except Exception:
        return False
    return True


def make_impl(name: str, workload: Workload) -> Impl:
    """An ``Impl`` for ``workload``: kvcache, spec, vllm, a package or ``module:factory``.

    Raises:
        ValueError: for an unknown name or a factory that cannot be imported.
    """
    adapter = resolve_adapter(name)
    config = ManagerConfig.from_workload(workload)
    adapter.init_hashes(config, "0")
    manager = adapter.build_manager(config)

    def new_request(spec: RequestSpec) -> Any:
        return adapter.build_request(config, request_args(spec))

    def set_status(request: Any, status: str) -> None:
        request.status = adapter.status(status)

    return Impl(adapter.name, manager, new_request, set_status)
