"""Optional compiled build of kvcache's core with mypyc (docs/verification.md, "Two builds").

``pip install`` (editable or not) compiles ``kvcache/*.py`` (not the kit, not
``__init__``/``__main__``) into C extension modules placed next to the sources,
plus one shared library ``kvcache/_core__mypyc*.so``, and builds the hand-written
C extension ``kvcache/_blockhash.c`` (keyless sha256 block-hash chains, linked
with OpenSSL's libcrypto; used only with the compiled core). Everything here is
optional: without mypy, without a C compiler, or with ``KVCACHE_BUILD_PURE=1``,
the install succeeds with the pure-Python package (the extensions are marked
``optional``, so a compile failure only skips them).

The build also writes ``kvcache/_compiled.sha256``, the digest of the compiled
sources (the C extension's too); ``kvcache/__init__`` loads the compiled modules
only while the sources still match it (an edited source silently running stale
compiled code would make every test lie), and ``KVCACHE_PURE=1`` selects the
sources regardless.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# kvcache/_builds.py alone, without importing the package (and its dependencies).
_spec = importlib.util.spec_from_file_location("_kvcache_builds", ROOT / "kvcache" / "_builds.py")
assert _spec is not None and _spec.loader is not None
_builds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_builds)
CORE_MODULES, C_EXTENSIONS, DIGEST_FILE, source_digest = (
    _builds.CORE_MODULES,
    _builds.C_EXTENSIONS,
    _builds.DIGEST_FILE,
    _builds.source_digest,
)


class BuildExtWithDigest(build_ext):
    """build_ext that records which sources the compiled modules came from."""

    def run(self) -> None:
        super().run()
        if not self.extensions:
            return
        if not _builds.has_compiled_modules(ROOT / "kvcache") and self.inplace:
            print("kvcache: no compiled modules built (no C compiler?)", file=sys.stderr)
            return
        digest = source_digest(ROOT / "kvcache")
        targets = [ROOT / "kvcache" / DIGEST_FILE]
        if not self.inplace:
            targets.append(Path(self.build_lib) / "kvcache" / DIGEST_FILE)
        for target in targets:
            if target.parent.is_dir():
                target.write_text(digest + "\n")


def compiled_extensions() -> list[object]:
    """mypyc's extensions for the core modules and the C extensions, or none
    (pure-Python install)."""
    if os.environ.get("KVCACHE_BUILD_PURE", "0") not in ("", "0"):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("kvcache: mypy not available, installing the pure-Python build", file=sys.stderr)
        return []
    paths = [f"kvcache/{name}.py" for name in CORE_MODULES]
    extensions = mypycify(paths, group_name="kvcache._core", opt_level="3", debug_level="0")
    # The C extensions load only with the compiled core (kvcache/_builds.py): built with it.
    # Without OpenSSL's headers the build skips them, and the core hashes with hashlib.
    extensions += [
        Extension(
            f"kvcache.{name}",
            [f"kvcache/{name}.c"],
            libraries=["crypto"],
        )
        for name in C_EXTENSIONS
    ]
    for ext in extensions:
        ext.optional = True  # no compiler: skip, keep the pure build
    return list(extensions)


setup(ext_modules=compiled_extensions(), cmdclass={"build_ext": BuildExtWithDigest})
