"""The spec registry of vLLM 0.33.0 (``vllm.v1.kv_cache_spec_registry``), over kvcache.

vLLM picks each KV-cache group's single-type manager from a registry: a spec
class maps to a manager class and to the base class its layers group with
(``uniform_type_base_spec``); a lookup walks the spec's MRO to the nearest
registered class; 0.33.0 adds *role* managers, which take precedence for a group
whose ``KVCacheGroupSpec.role`` is registered (vLLM registers one, for HiSparse
source groups; kvcache has it built in: ``HiSparseSourceManager``).

kvcache knows its built-in kinds by class name (kvcache's and vLLM's spec
classes alike: ``single_type_kv_cache_manager.get_manager_class_for_kv_cache_spec``),
so this registry holds what code registers on top of them: custom spec classes
(``register`` / the ``register_kv_cache_spec`` decorator) and role managers. The
manager lookup consults it first (a role manager, then the nearest registered
class of the spec's MRO; registrations vLLM code made in vLLM's own registry for
kvcache's managers count too), then the built-in kinds; ``get_manager_class``
answers for both, as vLLM's registry does for its built-ins and custom classes.

A registered manager must be a kvcache ``SingleTypeKVCacheManager`` subclass (it is
built with kvcache's constructor arguments). Registrations are process-wide, as in
vLLM. This module is vocabulary: it is never compiled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from kvcache.kv_cache_interface import SPEC_MODULES, KVCacheSpecValueError

__all__ = [
    "KVCacheSpecMetadata",
    "KVCacheSpecRegistry",
    "register_kv_cache_spec",
]

_T = TypeVar("_T", bound=type)


@dataclass(frozen=True)
class KVCacheSpecMetadata:
    """One registration: the spec class, its manager and the base it groups with."""

    kvcache_spec_cls: type
    manager_class: type
    uniform_type_base_spec: type


_REGISTERED: dict[type, KVCacheSpecMetadata] = {}
_ROLE_MANAGERS: dict[str, type] = {}

# Built-in kinds: spec class name -> the class name its layers group with (vLLM 0.33.0's
# register_all_kvcache_specs; MLA, R-SWA, hidden-state and sink group as full attention).
_BUILTIN_BASES: Mapping[str, str] = {
    "FullAttentionSpec": "FullAttentionSpec",
    "SlidingWindowSpec": "SlidingWindowSpec",
    "SlidingWindowMLASpec": "SlidingWindowMLASpec",
    "CircularBufferSpec": "CircularBufferSpec",
    "HiSparseResidentSpec": "HiSparseResidentSpec",
    "HiSparseHotSpec": "HiSparseHotSpec",
    "MambaSpec": "MambaSpec",
    "ChunkedLocalAttentionSpec": "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec": "CrossAttentionSpec",
    "MLAAttentionSpec": "FullAttentionSpec",
    "TQFullAttentionSpec": "FullAttentionSpec",
    "RSWASpec": "FullAttentionSpec",
    "HiddenStateCacheSpec": "FullAttentionSpec",
    "SinkFullAttentionSpec": "FullAttentionSpec",
}


def _role_name(role: object) -> str | None:
    """A group role as its string value (vLLM's ``KVCacheGroupRole`` is a str enum)."""
    if role is None:
        return None
    value = getattr(role, "value", role)
    return value if isinstance(value, str) else None


def _check_manager_class(manager_class: object) -> type:
    from kvcache.single_type_kv_cache_manager import SingleTypeKVCacheManager

    if not isinstance(manager_class, type) or not issubclass(
        manager_class, SingleTypeKVCacheManager
    ):
        raise KVCacheSpecValueError(
            f"manager_class={manager_class!r} must be a subclass of kvcache's "
            "SingleTypeKVCacheManager"
        )
    return manager_class


def _vllm_registrations() -> tuple[dict[str, type], dict[type, type]]:
    """Role and spec-class registrations of vLLM's registry whose manager is a kvcache
    manager class (``{}`` when vLLM's registry module is not loaded): what vLLM code
    registered for kvcache's managers. vLLM's module is read, never imported here."""
    import sys

    module = sys.modules.get("vllm.v1.kv_cache_spec_registry")
    if module is None:
        return {}, {}
    from kvcache.single_type_kv_cache_manager import SingleTypeKVCacheManager

    def ours(manager: object) -> bool:
        return isinstance(manager, type) and issubclass(manager, SingleTypeKVCacheManager)

    roles = getattr(module, "_REGISTRY_ROLE_MANAGERS", {})
    specs = getattr(module, "_REGISTRY_KVCACHESPEC_LIST", {})
    return (
        {str(getattr(r, "value", r)): m for r, m in roles.items() if ours(m)},
        {c: e.manager_class for c, e in specs.items() if ours(e.manager_class)},
    )


class KVCacheSpecRegistry:
    """vLLM 0.33.0's ``KVCacheSpecRegistry`` API (class methods; process-wide state)."""

    @classmethod
    def register(
        cls,
        kvcache_spec_cls: type,
        manager_class: type | None = None,
        uniform_type_base_spec: type | None = None,
    ) -> None:
        """Register ``kvcache_spec_cls`` with its manager and grouping base (default:
        itself). Registering the same triple again is a no-op.

        Raises:
            KVCacheSpecValueError: no ``manager_class`` (or not a kvcache manager), a
                base that ``kvcache_spec_cls`` does not subclass, or a registration
                conflicting with an earlier one (vLLM asserts in these cases).
        """
        if manager_class is None:
            raise KVCacheSpecValueError(
                f"register({kvcache_spec_cls!r}): manager_class is required"
            )
        manager_class = _check_manager_class(manager_class)
        base = kvcache_spec_cls if uniform_type_base_spec is None else uniform_type_base_spec
        if not isinstance(kvcache_spec_cls, type) or not issubclass(kvcache_spec_cls, base):
            raise KVCacheSpecValueError(
                f"kvcache_spec_cls={kvcache_spec_cls!r} must subclass its "
                f"uniform_type_base_spec={base!r}"
            )
        entry = KVCacheSpecMetadata(kvcache_spec_cls, manager_class, base)
        earlier = _REGISTERED.get(kvcache_spec_cls)
        if earlier is not None and earlier != entry:
            raise KVCacheSpecValueError(
                f"conflicting registration for {kvcache_spec_cls.__name__}: already "
                f"{earlier.manager_class.__name__} / {earlier.uniform_type_base_spec.__name__}"
            )
        _REGISTERED[kvcache_spec_cls] = entry

    @classmethod
    def register_role_manager(cls, role: object, manager_class: type) -> None:
        """Use ``manager_class`` for every group whose ``role`` is ``role`` (0.33.0).

        Raises:
            KVCacheSpecValueError: a role that is no string, a manager that is not
                kvcache's, or a different manager already registered for the role.
        """
        name = _role_name(role)
        if name is None:
            raise KVCacheSpecValueError(f"role={role!r} must be a string (a group role)")
        manager_class = _check_manager_class(manager_class)
        earlier = _ROLE_MANAGERS.get(name)
        if earlier is not None and earlier is not manager_class:
            raise KVCacheSpecValueError(
                f"conflicting manager registration for group role {name!r}: already "
                f"{earlier.__name__}"
            )
        _ROLE_MANAGERS[name] = manager_class

    @classmethod
    def registered_manager_class(cls, kvcache_spec: object, role: object = None) -> type | None:
        """The manager that a registration (not a built-in kind) gives: the role's
        manager, else the nearest registered class of the spec's MRO; None if none.

        Registrations in vLLM's own registry (``vllm.v1.kv_cache_spec_registry``, if
        vLLM code already imported it) count too, for a custom spec class (not one of
        vLLM's own) or a role whose registered manager is a kvcache manager class.
        """
        name = _role_name(role)
        vllm_roles, vllm_specs = _vllm_registrations()
        if name is not None:
            for roles in (_ROLE_MANAGERS, vllm_roles):
                if name in roles:
                    return roles[name]
        for base in type(kvcache_spec).__mro__:
            entry = _REGISTERED.get(base)
            if entry is not None:
                return entry.manager_class
            if base in vllm_specs and base.__module__ not in SPEC_MODULES:
                return vllm_specs[base]
        return None

    @classmethod
    def get_manager_class(cls, kvcache_spec: object, role: object = None) -> type | None:
        """The manager class kvcache builds for a group of ``kvcache_spec`` (and
        ``role``): a registration first, else the built-in kind's; None if neither."""
        registered = cls.registered_manager_class(kvcache_spec, role)
        if registered is not None:
            return registered
        from kvcache.single_type_kv_cache_manager import get_manager_class_for_kv_cache_spec

        try:
            return get_manager_class_for_kv_cache_spec(kvcache_spec)  # type: ignore[arg-type]
        except NotImplementedError:
            return None

    @classmethod
    def get_uniform_type_base_spec(cls, kvcache_spec: object) -> type | None:
        """The class the spec's layers group with: the nearest registered class's
        base, else the built-in kind's base (in the spec's own family: kvcache's or
        vLLM's classes); None for an unknown spec."""
        mro = type(kvcache_spec).__mro__
        for base in mro:
            entry = _REGISTERED.get(base)
            if entry is not None:
                return entry.uniform_type_base_spec
            if base.__module__ in SPEC_MODULES and base.__name__ in _BUILTIN_BASES:
                wanted = _BUILTIN_BASES[base.__name__]
                return next(
                    (c for c in mro if c.__name__ == wanted and c.__module__ == base.__module__),
                    None,
                )
        return None

    @classmethod
    def check_kv_cache_spec_registry(cls, kv_cache_spec: Mapping[str, Any]) -> None:
        """Check every layer's spec has a grouping base and a manager.

        Raises:
            ValueError: naming the first layer whose spec type is unknown.
        """
        for layer_name, spec in kv_cache_spec.items():
            if cls.get_uniform_type_base_spec(spec) is None:
                raise ValueError(
                    f"unsupported KV cache spec type for layer {layer_name}: {type(spec)}; "
                    "register it with register_kv_cache_spec"
                )
            if cls.get_manager_class(spec) is None:
                raise ValueError(
                    f"no manager for the KV cache spec type of layer {layer_name}: "
                    f"{type(spec)}; register it with register_kv_cache_spec"
                )

    @classmethod
    def unregister(cls, kvcache_spec_cls: type | None = None, role: object = None) -> None:
        """Drop a spec class's (or a role's) registration (kvcache's addition, for tests
        and plug-ins that unload; vLLM has no way to undo a registration)."""
        if kvcache_spec_cls is not None:
            _REGISTERED.pop(kvcache_spec_cls, None)
        name = _role_name(role)
        if name is not None:
            _ROLE_MANAGERS.pop(name, None)


def register_kv_cache_spec(
    manager_class: type | None = None, uniform_type_base_spec: type | None = None
) -> Callable[[_T], _T]:
    """Class decorator registering a spec class (``KVCacheSpecRegistry.register``)."""

    def decorator(kvcache_spec_cls: _T) -> _T:
        KVCacheSpecRegistry.register(kvcache_spec_cls, manager_class, uniform_type_base_spec)
        return kvcache_spec_cls

    return decorator
