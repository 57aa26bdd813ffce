"""The 0.33.0 conformance runner under its old name, kept because docs/profiles.md
cites it (``python -m kvcache.kit.conformance33``, ``NOT_IN_0_33``): the runner is
``kvcache.kit.conformance`` with ``--release 0.33.0``; this module only forwards."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvcache.kit.conformance import (
    TARGETS,
    Target,
    both_refuse,
    conformant_families,
    diverged_required,
    family_index,
    family_seed,
    run_family,
    under_release,
)
from kvcache.kit.conformance import main as _main
from kvcache.kit.driver import Family

__all__ = [
    "NOT_IN_0_33",
    "Target",
    "both_refuse",
    "conformant_families",
    "diverged_required",
    "family_index",
    "family_seed",
    "main",
    "run_family",
    "under_0_33",
]

#: The families vLLM 0.33.0 cannot build, with why (``TARGETS["0.33.0"].not_in``).
NOT_IN_0_33: dict[str, str] = TARGETS["0.33.0"].not_in


def under_0_33(family: Family) -> Family:
    """``family`` as the runner drives it under 0.33.0 (``under_release``)."""
    return under_release(family, "0.33.0")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvcache.kit.conformance --release 0.33.0`` with ``argv``."""
    return _main(["--release", "0.33.0", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
