"""Which build of kvcache's core is imported: compiled (mypyc) or pure Python.

The core modules (``CORE_MODULES``) may exist twice side by side: the ``.py``
source, the readable and patchable truth, and a mypyc-compiled extension of it
(``setup.py``; ``make setup`` builds it in place). Python's own import system
prefers an extension over a source of the same name, so choosing the source
needs a hook: ``select_build`` (run by ``kvcache/__init__`` before anything
else is imported) puts ``PureSourceFinder`` first on ``sys.meta_path`` when

- ``KVCACHE_PURE=1`` asks for the sources (``KVCACHE_SELF_CHECK=1`` too), or
- the compiled modules are stale: the sources no longer match the digest the
  build recorded in ``_compiled.sha256`` (a warning says so; rebuild with
  ``make setup``), or
- there are none (or not all of them).

Otherwise the compiled modules load as usual, and with them the C extensions
(``C_EXTENSIONS``), which the sources never use. One process holds one build
(``kvcache.COMPILED`` says which), except for ``import_pure_copy``, which the
benchmark uses to time both builds in one process.

This module is never compiled itself.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

CORE_MODULES = (
    "kv_cache_math",
    "kv_cache_utils",
    "block_pool",
    "single_type_kv_cache_manager",
    "kv_cache_coordinator",
    "kv_cache_manager",
)
"""The modules mypyc compiles (``kvcache/<name>.py``), dependencies first.

The vocabulary (``kv_cache_interface``, ``request``, ``kv_events``, ``metrics``)
stays interpreted on purpose: compiled code checks an argument's type at the call
only when the annotation names a *compiled* class, so with the vocabulary
interpreted, vLLM's own ``KVCacheConfig``, specs, ``Request`` and events pass
through the compiled managers as they do through the pure ones (drop-in). So does
``hisparse`` (vLLM 0.33.0's HiSparse managers, whose argument order differs from the
compiled base class's: see its docstring)."""

C_EXTENSIONS = ("_blockhash",)
"""C extension modules built with the compiled core (``kvcache/<name>.c``, no Python
source): ``_blockhash``, the keyless sha256 block-hash chain (``kv_cache_utils``).
They load only with the compiled core, never with the sources (``PureSourceFinder``
refuses them: the pure build is pure Python), and their C sources are part of the
compiled build's digest (``source_digest``), so a stale one is not used either."""

PURE_ENV = "KVCACHE_PURE"
"""Set to 1 to import the pure-Python sources even where a compiled build exists."""

SELF_CHECK_ENV = "KVCACHE_SELF_CHECK"
"""Also selects the sources: the self-check mode patches methods on instances,
which compiled instances do not allow (``kvcache.kv_cache_manager``)."""

DIGEST_FILE = "_compiled.sha256"
"""Written by the build next to the sources: the digest they were compiled from."""

PACKAGE_DIR = Path(__file__).resolve().parent


def source_digest(package_dir: Path = PACKAGE_DIR) -> str:
    """SHA-256 over the core modules' and the C extensions' names and source bytes."""
    digest = hashlib.sha256()
    for name in CORE_MODULES:
        digest.update(name.encode() + b"\0")
        digest.update((package_dir / f"{name}.py").read_bytes())
    for name in C_EXTENSIONS:
        digest.update(f"{name}.c".encode() + b"\0")
        digest.update((package_dir / f"{name}.c").read_bytes())
    return digest.hexdigest()


def has_compiled_modules(package_dir: Path = PACKAGE_DIR) -> bool:
    """Whether an extension module of every core module sits next to the sources."""
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    return all(
        any((package_dir / f"{name}{suffix}").is_file() for suffix in suffixes)
        for name in CORE_MODULES
    )


def compiled_is_current(package_dir: Path = PACKAGE_DIR) -> bool:
    """Whether the compiled modules were built from the sources as they are now."""
    try:
        recorded = (package_dir / DIGEST_FILE).read_text().strip()
        return recorded == source_digest(package_dir)
    except OSError:  # no digest, or a source missing (an install without the C source)
        return False


class PureSourceFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder loading ``kvcache.<core module>`` from its ``.py`` source."""

    def __init__(self, package_dir: Path = PACKAGE_DIR) -> None:
        self.package_dir = package_dir

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        """A source spec for kvcache's own modules; None (look elsewhere) for the rest.

        Every ``kvcache.<name>`` with a ``<name>.py`` source is taken, not only
        ``CORE_MODULES``: an extension left from an older build of a module that is
        no longer compiled must not be picked up either.

        Raises:
            ModuleNotFoundError: for the ``C_EXTENSIONS``, which the sources do without.
        """
        package, _, name = fullname.rpartition(".")
        if package == "kvcache" and name in C_EXTENSIONS:
            raise ModuleNotFoundError(f"{fullname}: not with the pure build", name=fullname)
        if package != "kvcache" or not (self.package_dir / f"{name}.py").is_file():
            return None
        return importlib.util.spec_from_file_location(
            fullname, self.package_dir / f"{name}.py"
        )


def _use_sources() -> None:
    if not any(isinstance(f, PureSourceFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, PureSourceFinder())


def select_build() -> None:
    """Arrange for the core modules to load from the build chosen (module docstring)."""
    if any(os.environ.get(env, "0") not in ("", "0") for env in (PURE_ENV, SELF_CHECK_ENV)):
        _use_sources()
    elif not has_compiled_modules():
        _use_sources()  # the pure install: no C extension left from a build loads either
    elif not compiled_is_current():
        warnings.warn(
            "kvcache: the compiled build is stale (kvcache/*.py or kvcache/*.c changed "
            "since it was built); importing the pure-Python sources. Rebuild with "
            "`make setup`.",
            RuntimeWarning,
            stacklevel=3,
        )
        _use_sources()


def is_compiled(module: ModuleType) -> bool:
    """Whether ``module`` was loaded from a compiled extension."""
    spec = module.__spec__
    return spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader)


def import_pure_copy() -> dict[str, ModuleType]:
    """Import a second, pure-Python copy of the core modules; return them by name.

    The copy is built under the usual names, then the modules already imported
    (compiled or not) are put back, so the rest of the process keeps its build
    and the copy's classes refer only to each other. For timing both builds in
    one process (``kvcache.kit.bench``); nothing else should need it.
    """
    package = sys.modules["kvcache"]
    # The C extensions too: the copy must not find the loaded build's in sys.modules.
    names = [f"kvcache.{name}" for name in (*CORE_MODULES, *C_EXTENSIONS)]
    saved_modules = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    saved_attrs = {
        name: package.__dict__.pop(name) for name in CORE_MODULES if name in package.__dict__
    }
    finder = PureSourceFinder()
    sys.meta_path.insert(0, finder)
    try:
        copy = {name: importlib.import_module(f"kvcache.{name}") for name in CORE_MODULES}
    finally:
        sys.meta_path.remove(finder)
        for name in names:
            sys.modules.pop(name, None)
        for name in CORE_MODULES:
            package.__dict__.pop(name, None)
        sys.modules.update(saved_modules)
        package.__dict__.update(saved_attrs)
    return copy


_pure_copy: dict[str, ModuleType] | None = None


def pure_copy() -> dict[str, ModuleType]:
    """``import_pure_copy()``, made once per process."""
    global _pure_copy
    if _pure_copy is None:
        _pure_copy = import_pure_copy()
    return _pure_copy
