"""Replay a fixed program of a state machine's own rules: directed examples.

Hypothesis finds a situation that needs many coordinated steps (a pool in a
given order, then one particular admission) only by luck, and which examples a
derandomized budget runs changes with any edit of the machine's source. A
*program* pins such a situation down: a list of ``Step``s, each one rule of
the machine called with the values its draws should take. ``replay`` runs it
on a fresh machine exactly as Hypothesis runs a generated one (rule
preconditions must hold; every invariant is checked after the initialize
steps and after each rule; ``teardown`` at the end), inside a one-example
Hypothesis test, so ``note``/``event``/``assume`` work and a failure prints the
notes as the program that failed.

A step scripts draws by label (``data.draw(strategy, label=...)``; ``None`` for
an unlabelled draw): a plain value is returned for every draw of that label, a
``Seq`` gives one value per draw, in order. Any draw the step does not script
is left to Hypothesis, and replay's single example is the simplest one (each
such draw returns its strategy's simplest value: False, the lower bound nearest
zero, the first element, an empty list). A scripted label the rule never drew,
or a ``Seq`` not used up, fails the replay: the program no longer matches the
machine and must be updated.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis.errors import UnsatisfiedAssumption
from hypothesis.stateful import RuleBasedStateMachine

# One example (the simplest: every unscripted draw at its simplest), run as is.
_REPLAY = settings(
    max_examples=1,
    database=None,
    deadline=None,
    derandomize=True,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)


@dataclass(frozen=True)
class Seq:
    """Scripted values for successive draws of one label."""

    values: tuple[Any, ...]

    def __init__(self, *values: Any) -> None:
        object.__setattr__(self, "values", values)


@dataclass
class Step:
    """One rule call: ``rule`` by name, its non-data ``args``, its scripted ``draws``."""

    rule: str
    args: dict[str, Any] = field(default_factory=dict)
    draws: dict[str | None, Any] = field(default_factory=dict)
    #: Checked on the machine after the step and its invariants: that the
    #: program still reaches the situation it was written for.
    expect: Callable[[Any], bool] | None = None


def tokens(label: str, *values: list[int], alphabet: int = 3) -> dict[str, Seq]:
    """The draws of ``draw_tokens(data, ..., label)`` that produce each of ``values``
    (one call per token list, in order)."""
    codes = (sum(t * alphabet**i for i, t in enumerate(prompt)) for prompt in values)
    return {f"len({label})": Seq(*map(len, values)), label: Seq(*codes)}


class ScriptedData:
    """Stands in for ``st.data()``: scripted labels get their values, any other
    draw goes to Hypothesis' data object."""

    def __init__(self, data: st.DataObject, draws: dict[str | None, Any]) -> None:
        self._data = data
        self._constant = {label: v for label, v in draws.items() if not isinstance(v, Seq)}
        self._queued = {label: list(v.values) for label, v in draws.items() if isinstance(v, Seq)}
        self._unused = set(draws)

    def draw(self, strategy: st.SearchStrategy[Any], label: str | None = None) -> Any:
        if label in self._constant:
            value = self._constant[label]
        elif label in self._queued:
            assert self._queued[label], f"the script has no value left for draw {label!r}"
            value = self._queued[label].pop(0)
        else:
            return self._data.draw(strategy, label=label)
        self._unused.discard(label)
        note(f"Draw ({label}): {value!r} (scripted)")
        return value

    def check_used_up(self, rule: str) -> None:
        left = {label for label, values in self._queued.items() if values}
        assert not self._unused and not left, (
            f"{rule}: scripted draws never made: {sorted(map(str, self._unused | left))}"
        )


def replay(machine_cls: type[RuleBasedStateMachine], program: list[Step]) -> None:
    """Run ``program`` on a fresh ``machine_cls``; raises what the machine raises."""

    @_REPLAY
    @given(st.data())
    def run(data: st.DataObject) -> None:
        machine = machine_cls()
        runtimes: dict[str, float] = defaultdict(float)
        try:
            machine.check_invariants(_REPLAY, note, runtimes)
            for number, step in enumerate(program):
                method = getattr(machine, step.rule)
                pending = machine._initialize_rules_to_run  # as Hypothesis' own runner
                initializer = next((r for r in pending if r.function.__name__ == step.rule), None)
                if initializer is not None:
                    pending.remove(initializer)
                else:
                    rule = getattr(method, "hypothesis_stateful_rule", None)
                    assert rule is not None, f"step {number}: {step.rule} is not a pending rule"
                    assert not pending, f"step {number}: initialize rules not run yet: {pending}"
                    assert all(p(machine) for p in rule.preconditions), (
                        f"step {number}: the preconditions of {step.rule} do not hold"
                    )
                scripted = ScriptedData(data, step.draws)
                args = dict(step.args)
                if "data" in inspect.signature(method).parameters:
                    args["data"] = scripted
                note(f"step {number}: state.{step.rule}({step.args})")
                try:
                    method(**args)
                except UnsatisfiedAssumption:
                    # Hypothesis would drop the example; a program must stay valid.
                    raise AssertionError(f"step {number}: {step.rule} rejected it") from None
                scripted.check_used_up(step.rule)
                machine.check_invariants(_REPLAY, note, runtimes)
                if step.expect is not None:
                    assert step.expect(machine), f"step {number} ({step.rule}) missed its target"
        finally:
            machine.teardown()

    run()
