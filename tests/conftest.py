"""Shared test setup: Hypothesis profiles, the vLLM reference fixture, the conformance summary.

Hypothesis profiles (pick one with ``HYPOTHESIS_PROFILE``; ``make`` uses ``ci``):

* ``dev``     — quick local runs (the default outside ``make``);
* ``ci``      — what ``make verify`` / CI run: derandomized, so a CI failure
  reproduces with the same command;
* ``nightly`` — long fuzzing runs.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "nightly",
    max_examples=5000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

EXPECTED_VLLM_VERSION = "0.25.1"


def in_ci() -> bool:
    """Whether we run under CI (``CI=true``), where a missing reference is a failure."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def vllm_reference() -> ModuleType:
    """The conformance adapter around the real vLLM 0.25.1.

    Fails under CI when vLLM cannot be imported (the reference must be there);
    skips locally, where ``make conformance`` installs it.
    """
    reason = None
    try:
        from conformance import vllm_adapter
    except Exception as exc:  # ImportError, or vLLM failing at import time
        reason = f"vLLM {EXPECTED_VLLM_VERSION} is not importable: {type(exc).__name__}: {exc}"
    else:
        if vllm_adapter.VLLM_VERSION != EXPECTED_VLLM_VERSION:
            reason = (
                f"vLLM {vllm_adapter.VLLM_VERSION} is installed; the reference is "
                f"{EXPECTED_VLLM_VERSION}"
            )
    if reason is not None:
        hint = "run `make conformance` (installs the reference into .venv)"
        if in_ci():
            pytest.fail(f"{reason}; CI requires it: {hint}", pytrace=False)
        pytest.skip(f"{reason}; {hint}")
    return vllm_adapter


@pytest.fixture(scope="session")
def subject_impl() -> str:
    """Name of the implementation under test (``$KVCACHE_CONFORMANCE_IMPL``, default kvcache)."""
    from conformance.sides import subject_impl as impl

    name = impl()
    if name != "vllm":
        import importlib

        try:
            module = importlib.import_module(name)
        except Exception as exc:
            pytest.fail(f"implementation {name!r} is not importable: {exc!r}", pytrace=False)
        if not hasattr(module, "KVCacheManager"):
            pytest.fail(f"implementation {name!r} has no KVCacheManager", pytrace=False)
    return name


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print the conformance counts (sequences, calls, mismatches) when any ran."""
    import sys

    driver = sys.modules.get("conformance.driver")
    if driver is not None and driver.STATS.sequences:
        terminalreporter.write_line(driver.STATS.summary())
