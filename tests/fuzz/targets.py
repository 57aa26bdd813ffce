"""Fuzz targets for HypoFuzz (``make fuzz``): Hypothesis tests that run until stopped.

Not collected by ``pytest`` on its own (the file name has no ``test_`` prefix):
``make fuzz`` passes it to ``hypothesis fuzz`` explicitly. Two targets:

* ``TestManagerMachine`` — the stateful machine of
  ``tests/stateful/test_manager_machine.py`` (kvcache against spec, one
  full-attention group), as a ``TestCase`` HypoFuzz can drive;
* ``test_random_scheduler_matches_reference`` — the kit's random scheduler
  (``kvcache.kit.driver``) over every layout family, with Hypothesis making
  every random choice, so that HypoFuzz can mutate and shrink the sequences.
  ``KVCACHE_FUZZ_IMPL`` picks the subject (any ``--impl`` name, default
  kvcache) and ``KVCACHE_FUZZ_REFERENCE`` what it must match (default spec).

Run with ``HYPOTHESIS_PROFILE=fuzz`` (``make fuzz`` does): the example
database is then ``$KVCACHE_FUZZ_DB`` — a directory (shared by every worker
that mounts it) or ``redis://host:port/db`` — see tests/conftest.py and the
docs/kit.md, "Fuzzing campaigns".
"""

from __future__ import annotations

import os
import random

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from kvcache.kit.driver import FAMILIES, run_sequence
from kvcache.kit.trace import short

SUBJECT = os.environ.get("KVCACHE_FUZZ_IMPL", "kvcache")
REFERENCE = os.environ.get("KVCACHE_FUZZ_REFERENCE", "spec")
FUZZ_SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


# Parametrized (one fixed id) only so that pytest's Hypothesis plugin keys the
# example database by node id, as HypoFuzz does: failures HypoFuzz saves then
# replay under plain pytest (KVCACHE_FUZZ_PHASES=reuse), whatever the subject.
@pytest.mark.parametrize("subject", [pytest.param(SUBJECT, id="subject")])
@FUZZ_SETTINGS
@given(family=st.sampled_from(sorted(FAMILIES)), rng=st.randoms(use_true_random=False))
def test_random_scheduler_matches_reference(subject: str, family: str, rng: random.Random) -> None:
    result = run_sequence(0, family, subject, REFERENCE, rng=rng)
    assert result.mismatch is None, (
        f"{subject} diverges from {REFERENCE} ({family}, config {result.config}): "
        f"{short(str(result.mismatch), 2000)}"
    )


def _machine_test_case() -> type:
    from stateful.test_manager_machine import ManagerMachine

    case: type = ManagerMachine.TestCase
    case.settings = settings(FUZZ_SETTINGS, stateful_step_count=200)  # type: ignore[attr-defined]
    return case


TestManagerMachine = _machine_test_case()
