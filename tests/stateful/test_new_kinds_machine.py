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

from kvcache import RequestStatus, init_none_hash, sha256

from .programs import Seq, Step, replay, tokens
from .runner import run_machine
from .test_hybrid_machine import HybridMachine, admit, computed, extend, finish, start

# Examples of the CI profile for this machine (the hybrid machine runs 400).
CI_EXAMPLES = 120


class NewKindsMachine(HybridMachine):
    """``HybridMachine`` drawing MLA variants and context parallelism too."""

    counters: ClassVar[dict[str, int]] = {"steps": 0, "examples": 0}
    NEW_KINDS: ClassVar[bool] = True


# Directed programs (``programs.py``): situations the budget may miss.


def short_window_program(window: int) -> list[Step]:
    """CI seed 9678266326026999476: a sliding window (block 1, ``window`` tokens) under
    EAGLE beside R-SWA (block 2), scheduler block 2. r3's 3 tokens (2 from a connector)
    are cached; r4 repeats them plus one."""

    def request(*values: int, **draws: Any) -> dict[str, Any]:
        return {**tokens("tokens", list(values)), "extra_keys": False, "skip_read": 0, **draws}

    layout = {"context-parallel layout": False, "kinds": ["swa", "rswa"],
              "block_factor": Seq(1, 2), "window": window, "mla": False, "rswa_window": 1,
              "caching": True, "use_eagle": False, "eagle_group": Seq(True, False),
              "retention": None, "rswa_blocks": 12, "num_first_requests": 1}
    sizes = dict(num_blocks=33, base_block_size=1, watermark=0.0, log_stats=False,
                 max_model_len=16, max_num_batched_tokens=2)
    return [
        Step("init_managers", sizes, {**layout, **request(0)}),
        Step("add_request", {}, request(0)),
        Step("add_request", {}, request(0)),
        Step("add_request", {}, request(0, 0, 0)),
        Step("free", dict(status=RequestStatus.FINISHED_STOPPED, how="defer"), {None: "r0"}),
        Step("add_request", {}, request(0, 0, 0, 0, share_prefix=False)),
        Step("get_computed_blocks", {}, {
            "consider r1": False, "consider r2": False, "consider r3": True, "mode": "sync",
            "unusual": True, "ext": 2, "lookahead": 0, "full_seq_must_fit": False,
            "has_scheduled_reqs": False, "whole": False, "chunk": 1, "consider r4": True}),
    ]


PROGRAMS: dict[str, list[Step]] = {
    # Window 4: r4's window hit is r3's leading run of 3 blocks (short of a window):
    # vLLM aligns it to 2 tokens, drops the EAGLE block, aligns again: 0 tokens,
    # where 2 were reachable (a loss both sides share: the judge names it known).
    "a sliding-window EAGLE hit from a short run loses an alignment unit (vLLM)":
        short_window_program(4),
    # Window 1: r4 hits 2 tokens with no block of the window's own, anchored at
    # the EAGLE block after them (cached): not a false hit.
    "a one-token window under EAGLE resumes with no block of its own":
        short_window_program(1),

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
