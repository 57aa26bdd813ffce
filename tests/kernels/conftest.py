"""Kernel tests: run the Triton kernels in the interpreter on CPU unless told otherwise.

``TRITON_INTERPRET`` must be set before any module defining a ``@triton.jit``
kernel is imported, so it is set here, when pytest loads this file and before
it imports the test modules of this directory. ``TRITON_INTERPRET=0`` runs the
same tests compiled on CUDA (``kernels/bench.py`` does that).

Hypothesis profiles ``kernels-ci`` / ``kernels-nightly`` (picked by
``HYPOTHESIS_PROFILE`` like the stateful tests) are applied to the kernel
tests only, never ``load_profile``-ed.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from typing import Any

from kernel_helpers import INTEGRITY_TOTALS, profile_name


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print the KV-integrity counts (steps, tokens checked, prefix hits, preemptions)."""
    for name, counts in sorted(INTEGRITY_TOTALS.items()):
        terminalreporter.write_line(
            f"kv integrity [{name}, {profile_name()}]: "
            + ", ".join(f"{value} {key}" for key, value in counts.items())
        )
