"""``programs.replay`` refuses a program that no longer matches the machine."""

from __future__ import annotations

import pytest

from .programs import Step, replay, tokens
from .test_hybrid_machine import HybridMachine, admit, start

SETUP = [start(9, 1, ["full", "swa"], **tokens("tokens", [0, 1]))]


def test_a_valid_program_passes() -> None:
    replay(HybridMachine, [*SETUP, admit("r0", mode="sync", whole=True)])


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (admit("r0", mode="sync", whole=True, no_such_draw=1), "never made"),
        (Step("decode"), "preconditions of decode"),  # nothing is scheduled
        (admit("r0", mode="sync", whole=True, expect=lambda m: False), "missed its target"),
    ],
)
def test_a_stale_program_fails(step: Step, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        replay(HybridMachine, [*SETUP, step])
