"""Shared pieces of the kernel tests: device, Hypothesis profiles, tolerances.

Imported by ``conftest.py`` (after it sets ``TRITON_INTERPRET``) and by the
test modules of this directory, which pytest puts on ``sys.path``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
from hypothesis import HealthCheck, settings

#: whether @triton.jit kernels run in the interpreter (TRITON_INTERPRET, read by Triton)
INTERPRET: bool = triton.knobs.runtime.interpret

_COMMON: dict[str, Any] = dict(
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# The interpreter runs a Triton program in milliseconds, so the CI profile
# keeps examples few and shapes small; nightly runs ten times as many.
settings.register_profile("kernels-ci", max_examples=25, derandomize=True, **_COMMON)
settings.register_profile("kernels-nightly", max_examples=250, **_COMMON)
settings.register_profile(
    "kernels-integrity-ci", max_examples=6, stateful_step_count=40, derandomize=True, **_COMMON
)
settings.register_profile(
    "kernels-integrity-nightly", max_examples=60, stateful_step_count=80, **_COMMON
)


def profile_name() -> str:
    """``nightly`` when ``HYPOTHESIS_PROFILE=nightly``, else ``ci``."""
    return "nightly" if os.environ.get("HYPOTHESIS_PROFILE") == "nightly" else "ci"


KERNEL_SETTINGS = settings.get_profile(f"kernels-{profile_name()}")
INTEGRITY_SETTINGS = settings.get_profile(f"kernels-integrity-{profile_name()}")


def device() -> torch.device:
    """CPU under the interpreter; otherwise CUDA, which must then be present."""
    if INTERPRET:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(
            "TRITON_INTERPRET is off but CUDA is not available: unset it (the kernel "
            "tests then run in the Triton interpreter on CPU) or run on a GPU"
        )
    return torch.device("cuda")


DEVICE = device()

# (atol, rtol) of a kernel output against the float64 reference: the kernel
# accumulates in fp32 and rounds once to the output dtype.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

#: integrity-test counters per configuration, summed over the run (printed by conftest)
INTEGRITY_TOTALS: dict[str, dict[str, int]] = {}


def record_integrity(name: str, counts: dict[str, int]) -> None:
    totals = INTEGRITY_TOTALS.setdefault(name, {})
    for key, value in counts.items():
        totals[key] = totals.get(key, 0) + value
