"""The hybrid machine with issue 14's kinds: kvcache against spec.

``NewKindsMachine`` is ``HybridMachine`` (``test_hybrid_machine.py``) that also
draws, for every full-attention or sliding-window group, its MLA variant
(``MLAAttentionSpec``: full attention whose fresh blocks are reported for
zeroing and whose events say ``mla_attention``; ``SlidingWindowMLASpec``: a
sliding window whose events say ``sliding_window_mla``), and, for a layout of
one full-attention group, decode / prefill context parallelism
(``dcp_world_size``, ``pcp_world_size``: a block spans ``block_size * dcp *
pcp`` tokens; ``scheduler_block_size`` and ``hash_block_size`` are that size).
A subclass, so ``HybridMachine``'s own examples stay what they were.
"""

from __future__ import annotations

from typing import Any, ClassVar

from hypothesis import settings

from kvcache import init_none_hash, sha256

from .programs import Step, replay, tokens
from .runner import run_machine
from .test_hybrid_machine import HybridMachine, admit, computed, extend, finish, start

# Examples of the CI profile for this machine (the hybrid machine runs 400).
CI_EXAMPLES = 120


class NewKindsMachine(HybridMachine):
    """``HybridMachine`` drawing MLA variants and context parallelism too."""

    counters: ClassVar[dict[str, int]] = {"steps": 0, "examples": 0}
    NEW_KINDS: ClassVar[bool] = True


# Directed programs (``programs.py``): situations the budget may miss.
PROGRAMS: dict[str, list[Step]] = {
    # One sliding-window MLA group (window 3, block size 1): r0's blocks are
    # cached, and their BlockStored event says ``sliding_window_mla``, window 3.
    "sliding-window MLA blocks are stored under their own kind": [
        start(13, 1, ["swa"], window=3, mla=True, **tokens("tokens", [0, 1, 2, 0])),
        admit("r0", mode="sync", whole=True),
        finish("r0"),
        Step("take_events"),
    ],
    # One full-attention group under dcp 2 (block size 1: blocks of 2 tokens). r1
    # repeats r0's 8 tokens: the hit stops at 6 (3 blocks), short of the last token.
    "a context-parallel hit counts blocks of block_size * dcp tokens": [
        start(13, 1, ["full"], dcp=2, **tokens("tokens", [0, 1, 2, 0, 1, 2, 0, 1])),
        admit("r0", mode="sync", whole=True),
        finish("r0"),
        extend([0, 1, 2, 0, 1, 2, 0, 1], []),
        admit("r1", mode="sync", whole=True, expect=computed("r1", 6)),
    ],
    # One MLA group: its fresh blocks are reported for zeroing, as full attention's.
    "MLA blocks are reported for zeroing": [
        start(13, 1, ["full"], mla=True, **tokens("tokens", [0, 1, 2, 0])),
        admit("r0", mode="sync", whole=True),
        Step("take_new_block_ids"),
    ],
}


def test_new_kinds_program() -> None:
    """kvcache agrees with spec on each directed program."""
    init_none_hash(sha256)
    for name in sorted(PROGRAMS):
        replay(NewKindsMachine, PROGRAMS[name])


def test_new_kinds_machine(stateful_settings: settings, record_property: Any) -> None:
    """kvcache agrees with spec on layouts with MLA groups and context parallelism."""
    init_none_hash(sha256)  # other tests may have seeded the chain with another function
    run_machine(NewKindsMachine, stateful_settings, record_property, share=CI_EXAMPLES)
