"""kvcache's third-party dependencies, and the one line a missing one gets.

``python -m kvcache`` (or the ``kvcache`` command) run by a Python that lacks a
dependency (outside the project's ``.venv``, say) should not answer with an
import traceback: ``check_dependencies`` (run first by ``kvcache/__init__``)
imports each dependency, and when one is missing *and this process is the
command line*, prints one line naming it and what to install, and exits 2.
Imported as a library, kvcache raises the ``ModuleNotFoundError`` as usual,
with the same advice in its message.

This module is never compiled and imports nothing of kvcache.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

DEPENDENCIES = {
    "cbor2": "cbor2>=5.4",
    "xxhash": "xxhash>=3.0",
    "mypy_extensions": "mypy_extensions",
}
"""Import name to requirement: kvcache's dependencies (pyproject's)."""

IMPORTED_AT_START = ("cbor2", "mypy_extensions")
"""The dependencies ``import kvcache`` imports (``xxhash`` waits for its first use)."""

OWN_PACKAGES = frozenset({"kvcache", "spec", "kernels", "proofs", "conformance", "tests"})
"""Top-level names of this repository: a missing one is a bug, not a missing dependency."""

CLI_EXIT = 2
"""The exit status of a usage error, a missing dependency included."""

ROOT = Path(__file__).resolve().parent.parent


def is_command_line() -> bool:
    """Whether this process is ``python -m kvcache`` or the ``kvcache`` command."""
    if Path(sys.argv[0]).name == "kvcache":
        return True
    argv: list[str] = [str(arg) for arg in getattr(sys, "orig_argv", [])]
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return i + 1 < len(argv) and argv[i + 1] == "kvcache"
        if arg.startswith("-m"):
            return arg[2:] == "kvcache"
        if arg == "-c" or not arg.startswith("-"):
            return False  # a script or -c code: not the command line
        i += 2 if arg in ("-W", "-X") else 1  # options with a separate value
    return False


def advice(module: str) -> str:
    """What to install (or run) for a missing top-level module ``module``."""
    requirement = DEPENDENCIES.get(module)
    if requirement is None:
        return f"pip install {module}"
    if not (ROOT / "pyproject.toml").is_file():  # an installed kvcache
        return f"pip install '{requirement}' (or reinstall kvcache: pip install kvcache)"
    venv = ROOT / ".venv"
    if (venv / "bin" / "python").is_file() and Path(sys.prefix).resolve() != venv.resolve():
        return f"use the clone's venv: {venv}/bin/python -m kvcache (or . {venv}/bin/activate)"
    return f"pip install -e {ROOT} (or make setup, which makes .venv)"


def missing_line(module: str) -> str:
    """The one line printed for a missing module ``module``."""
    return f"kvcache: missing dependency '{module}': {advice(module)}"


def third_party(exc: ModuleNotFoundError) -> str | None:
    """The top-level name of the third-party module ``exc`` misses, or None
    (no name, or a module of this repository: a bug, not a dependency)."""
    if not exc.name:
        return None
    top = exc.name.partition(".")[0]
    return None if top in OWN_PACKAGES else top


def check_dependencies() -> None:
    """Import kvcache's dependencies; on the command line, a missing one is one
    line on stderr and exit status 2, elsewhere a ``ModuleNotFoundError`` that
    says what to install."""
    for module in IMPORTED_AT_START:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.partition(".")[0] != module:
                raise
            if is_command_line():
                print(missing_line(module), file=sys.stderr)
                raise SystemExit(CLI_EXIT) from None
            raise ModuleNotFoundError(
                f"No module named '{module}' (kvcache needs it: {advice(module)})", name=module
            ) from exc
