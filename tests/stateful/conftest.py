"""Hypothesis profiles of the stateful tests, and a report of the steps they ran.

``HYPOTHESIS_PROFILE`` (default ``ci``) picks ``stateful-ci``,
``stateful-nightly`` or ``stateful-mutation`` (``make mutation``: a short,
derandomized run per mutant, no example database; it pins ``STATEFUL_SEED``, default 0,
and ``MUTATION_EXAMPLES`` sets its budget). The profiles carry a ``stateful-``
prefix and are applied to the machines only (never ``load_profile``-ed), so they cannot clobber the
global profiles of ``tests/conftest.py``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings

MUTATION_EXAMPLES = int(os.getenv("MUTATION_EXAMPLES", "20"))
_COMMON: dict[str, Any] = dict(
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.large_base_example,
        HealthCheck.data_too_large,
    ],
)
# ci: about 75 s on one core of a 2-core runner; nightly: 10x the examples, 1.5x the steps.
settings.register_profile("stateful-ci", max_examples=600, stateful_step_count=200, **_COMMON)
settings.register_profile("stateful-nightly", max_examples=6000, stateful_step_count=300, **_COMMON)
# mutation: 1-2 s per machine, the same examples every run (docs/mutation.md).
settings.register_profile(
    "stateful-mutation",
    max_examples=MUTATION_EXAMPLES,
    stateful_step_count=100,
    phases=[Phase.explicit, Phase.generate],  # a failure kills the mutant: no need to shrink it
    **{**_COMMON, "derandomize": True, "database": None},
)


if os.getenv("HYPOTHESIS_PROFILE") == "mutation":
    os.environ.setdefault("STATEFUL_SEED", "0")


def profile_name() -> str:
    name = os.getenv("HYPOTHESIS_PROFILE", "ci")
    return name if name in ("ci", "nightly", "mutation") else "ci"


@pytest.fixture
def stateful_settings() -> settings:
    """The settings of the profile named by ``HYPOTHESIS_PROFILE``."""
    return settings.get_profile(f"stateful-{profile_name()}")


_totals: dict[str, int] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        for key, value in report.user_properties:
            if key == "stateful_seed":
                _totals[key] = int(value)
            elif key.startswith("stateful_"):
                _totals[key] = _totals.get(key, 0) + int(value)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _totals:
        terminalreporter.write_line(
            f"stateful [{profile_name()}]: {_totals.get('stateful_examples', 0)} test cases, "
            f"{_totals.get('stateful_steps', 0)} steps checked "
            f"(STATEFUL_SEED={_totals.get('stateful_seed')})"
        )
