"""Where the kit finds the ``spec/`` oracle, under the name it is installed by.

The repository keeps the oracle at the top (``spec/``), and code run from the
repository root (the tests, the proofs, ``make``) imports it as ``spec``. The
installed distribution claims only kvcache's own names, so a wheel ships that
directory as the package ``kvcache_spec`` (and ``kernels/`` as
``kvcache_kernels``): an environment with kvcache installed has no top-level
``spec`` or ``kernels`` to shadow another project's (Hugging Face's ``kernels``,
which transformers probes at import).

``spec_package`` returns the repository's ``spec`` when that is what ``import
spec`` would load (the directory beside this ``kvcache`` package), so a test
and the kit share one module object; otherwise the installed ``kvcache_spec``.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

INSTALLED_NAME = "kvcache_spec"
"""The oracle's import name in an installed distribution (pyproject's package-dir)."""


def spec_package() -> ModuleType:
    """The oracle package: the source checkout's ``spec`` if ``import spec`` finds the
    one beside this kvcache, else the installed ``kvcache_spec``.

    Raises:
        ModuleNotFoundError: when neither is there (a broken install).
    """
    beside = Path(__file__).resolve().parents[2] / "spec" / "__init__.py"
    try:
        found = importlib.util.find_spec("spec")
    except (ImportError, ValueError):
        found = None
    if found is not None and found.origin and Path(found.origin).resolve() == beside:
        return importlib.import_module("spec")
    return importlib.import_module(INSTALLED_NAME)


def spec_module(name: str) -> ModuleType:
    """One module of the oracle (``"pure"``, ``"vocab"``, ...), from ``spec_package``."""
    return importlib.import_module(f"{spec_package().__name__}.{name}")
