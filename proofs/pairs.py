"""The functions ``crosshair diffbehavior`` compares: for each ``manifest.PAIRS`` entry,
``<name>__oracle`` and ``<name>__subject`` run the real function on arguments in the
pair's domain and return None elsewhere (diffbehavior ignores ``pre:``).

The wrappers keep the wrapped function's signature (``functools.wraps``), which is
what CrossHair reads to build symbolic arguments; a pair's ``types`` replace generic
annotations (``Sequence[H]``) with concrete ones (``list[int]``), which CrossHair
explores faster.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from proofs.manifest import PAIRS


def resolve(dotted: str) -> Callable[..., Any]:
    """The function at ``package.module.function``."""
    module_name, _, attr = dotted.rpartition(".")
    fn: Callable[..., Any] = getattr(importlib.import_module(module_name), attr)
    return fn


def restricted(fn: Callable[..., Any], domain: Callable[..., bool],
               types: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """``fn`` on ``domain``, None elsewhere; ``types`` overrides parameter annotations."""

    @functools.wraps(fn)
    def on_domain(*args: Any) -> Any:
        if not domain(*args):
            return None
        return fn(*args)

    if types:
        signature = inspect.signature(fn)
        on_domain.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[p.replace(annotation=types.get(p.name, p.annotation))
                        for p in signature.parameters.values()])
    return on_domain


def _register() -> None:
    for pair in PAIRS:
        for role, target in (("oracle", pair.oracle), ("subject", pair.subject)):
            globals()[f"{pair.name}__{role}"] = restricted(resolve(target), pair.domain,
                                                           pair.types)


_register()
