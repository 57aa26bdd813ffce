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


def test_a_program_after_the_kit_drove_another_hash_function() -> None:
    """``pytest tests`` runs tests/conformance first, in this process: the kit's sides
    hash with their trace's function (here xxhash), and the process's chain must be
    as it was once they are done, or kvcache's requests here no longer hash as spec."""
    from kvcache import kv_cache_utils
    from kvcache.kit.config import ManagerConfig
    from kvcache.kit.driver import Lockstep

    before = kv_cache_utils.NONE_HASH
    config = ManagerConfig.full_attention(8, 2, 8, hash_fn="xxhash")
    run = Lockstep(config, "kvcache", "spec")  # compares states: the pool keys are spec's
    run.ok("add_request", request_id="a", prompt_token_ids=[1, 2, 3, 4, 5])
    run.ok("get_computed_blocks", request_id="a")
    run.ok("allocate_slots", request_id="a", num_new_tokens=5, new_computed_blocks="last")
    run.ok("free", request_id="a")
    assert before == kv_cache_utils.NONE_HASH, "the kit left its chain behind"
    replay(HybridMachine, [*SETUP, admit("r0", mode="sync", whole=True)])
