"""What the injected-bug tests share: run a stateful machine on a fixed budget.

``tests/test_injected_bugs.py`` (``ManagerMachine``) and
``tests/test_injected_bugs_hybrid.py`` (``HybridMachine``) plant one bug at a
time in kvcache and expect ``machine_failure`` to return an error; unpatched,
it must return None.

The budget is the same examples on every run, whatever else the process ran
before: shrinking and the example database are off, and the seed is pinned
(``@seed``). ``derandomize`` alone would seed Hypothesis with a digest of the
machine class's source, so any edit of the class, even of a comment, would
draw other examples and a bug caught late in the budget could come and go.
Situations too rare for a budget to be sure of are the machine's directed
programs (``tests/stateful/programs.py``), replayed before the budget, or unit
tests (``unit_failure``, e.g. ``tests/unit/test_fast_kills.py``).

Every catch is timed (``timed_catch``): what caught the bug lives in
``tests/unit``, ``tests/stateful`` or ``tests/reliability``, and must catch it
within ``CATCH_LIMIT_S`` seconds of CPU; the session summary (``tests/conftest.py``)
prints the slowest catches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis.errors import HypothesisException
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test
from stateful.programs import Step, replay

SEED = 0
CATCH_LIMIT_S = 60.0
"""CPU seconds within which the fast selection must catch each planted bug."""

CATCHES: list[tuple[str, float, float]] = []
"""``(bug, CPU seconds, wall seconds)`` of every catch in this session."""


def budget(max_examples: int, stateful_step_count: int = 150) -> settings:
    """A fixed budget: the first failing example stops it (no shrinking)."""
    return settings(
        max_examples=max_examples,
        stateful_step_count=stateful_step_count,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )


def machine_failure(
    machine_cls: type[RuleBasedStateMachine],
    budget: settings,
    programs: Sequence[Sequence[Step]] = (),
) -> BaseException | None:
    """Replay ``programs``, then run the machine on ``budget``; the first error
    raised, or None if all passed."""

    @seed(SEED)
    def machine() -> RuleBasedStateMachine:
        return machine_cls()

    try:
        for program in programs:
            replay(machine_cls, list(program))
        run_state_machine_as_test(machine, settings=budget)
    except HypothesisException:
        raise  # a health check or misuse is not a caught bug
    except Exception as error:
        return error
    return None


def raised_in(error: BaseException) -> str:
    """Path of the frame that raised ``error``."""
    tb = error.__traceback__
    assert tb is not None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename


def unit_failure(*tests: Callable[[], object]) -> BaseException | None:
    """Run plain test functions in order; the first error raised, or None."""
    import pytest

    for test in tests:
        try:
            test()
        except pytest.skip.Exception:
            continue
        except Exception as error:
            return error
    return None


def timed_catch(bug: str, catch: Callable[[], BaseException | None]) -> BaseException | None:
    """``catch()``, recorded in ``CATCHES`` with its seconds when it returns an error."""
    wall, cpu = time.perf_counter(), time.process_time()
    error = catch()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if error is not None:
        CATCHES.append((bug, cpu, wall))
        assert cpu < CATCH_LIMIT_S, f"{bug}: caught only after {cpu:.0f} s of CPU"
    return error


def catch_by_all(
    bug: str, catchers: Sequence[Callable[[], BaseException | None]]
) -> BaseException | None:
    """Run every catcher on the planted ``bug``; each must fail. The first one's error.

    A planted bug is listed with the tests meant to catch it; one of them passing on the
    bug is a gap in that test even when another catches it, so every one must fail.
    """

    def every_catcher() -> BaseException | None:
        errors = [catch() for catch in catchers]
        missed = [i for i, error in enumerate(errors) if error is None]
        assert not missed, f"directed tests {missed} missed: {bug}"
        return errors[0]

    return timed_catch(bug, every_catcher)


def catch_summary() -> str:
    """One line: how many planted bugs were caught, the slowest three (CPU seconds)."""
    slowest = sorted(CATCHES, key=lambda c: -c[1])[:3]
    listed = ", ".join(f"{cpu:.2f} s ({bug})" for bug, cpu, _ in slowest)
    return f"injected bugs: {len(CATCHES)} caught, slowest {listed}"
