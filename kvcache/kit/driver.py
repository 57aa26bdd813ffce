"""Random scheduler-like call sequences run in lockstep on a reference and a subject.

``Lockstep`` sends every call to the reference (vLLM 0.25.1, or the ``spec``
oracle) and to the subject, compares results, exceptions and the abstract state
after each call, and records the reference's view as a trace.
``RandomScheduler`` decides the calls the way vLLM's ``Scheduler`` would make
them (``vllm/v1/core/sched/scheduler.py``): prefix lookups only for waiting
requests with no computed tokens, chunked prefill (split at block multiples
when a Mamba group caches in "align" mode), decode with draft tokens and
lookahead slots, encoder tokens for cross attention, preemption when an
allocation fails, async KV loads (``delay_cache_blocks``), deferred frees,
plus the admin calls (evict, reset, events, stats). ``shrink`` cuts a failing
sequence down to a minimal replayable trace; ``replay_trace`` replays one.

The code lives in modules by job, and this module re-exports every name of them,
so ``from kvcache.kit.driver import ...`` keeps working: ``lockstep`` (outcomes,
``Mismatch``, ``Stats``, ``Lockstep``), ``families`` (``Family``, ``FAMILIES``,
``random_config``), ``scheduler`` (``RandomScheduler``), ``shrinking``
(``run_sequence``, ``replay_lockstep``, ``shrink``, ``write_counterexample``) and
``replay`` (``replay_trace``).
"""

from __future__ import annotations

from kvcache.kit.families import (
    CP_GEOMETRY_KEPT,
    FAMILIES,
    Family,
    random_config,
    random_group,
    release_cp_geometry,
)
from kvcache.kit.lockstep import (
    EXCEPTION_ALIASES,
    LOOKUP_OPS,
    PROMPT_EMBEDS_DRAWN,
    SUBJECT_FOR_ASSERT,
    DriverError,
    Lockstep,
    Mismatch,
    Stats,
    _how,
    _torch_importable,
    assert_allowance,
    compare_outcomes,
    make_judge,
    outcome,
    outcome_part,
    outcome_way,
    side_line,
    state_part,
    state_way,
)
from kvcache.kit.replay import (
    ReplayResult,
    replay_trace,
    trace_line,
)
from kvcache.kit.scheduler import (
    CHECKPOINT_IN_DRAFTS_RAISES,
    CONNECTOR_LOOKUP_RATE,
    DRAFTS_PAST_HASHES_RATE,
    REQUEST_FIELDS_0_33,
    RandomScheduler,
    Req,
    draw_request_fields_0_33,
    full_report_works,
)
from kvcache.kit.shrinking import (
    FINISHED,
    Call,
    SequenceResult,
    cannot_build_entry,
    describe_call,
    describe_calls,
    record_reference,
    replay_lockstep,
    run_sequence,
    same_failure,
    scheduler_could_make,
    shrink,
    write_counterexample,
)

__all__ = [
    "CHECKPOINT_IN_DRAFTS_RAISES",
    "CONNECTOR_LOOKUP_RATE",
    "CP_GEOMETRY_KEPT",
    "DRAFTS_PAST_HASHES_RATE",
    "EXCEPTION_ALIASES",
    "FAMILIES",
    "FINISHED",
    "LOOKUP_OPS",
    "PROMPT_EMBEDS_DRAWN",
    "REQUEST_FIELDS_0_33",
    "SUBJECT_FOR_ASSERT",
    "Call",
    "DriverError",
    "Family",
    "Lockstep",
    "Mismatch",
    "RandomScheduler",
    "ReplayResult",
    "Req",
    "SequenceResult",
    "Stats",
    "_how",
    "_torch_importable",
    "assert_allowance",
    "cannot_build_entry",
    "compare_outcomes",
    "describe_call",
    "describe_calls",
    "draw_request_fields_0_33",
    "full_report_works",
    "make_judge",
    "outcome",
    "outcome_part",
    "outcome_way",
    "random_config",
    "random_group",
    "record_reference",
    "release_cp_geometry",
    "replay_lockstep",
    "replay_trace",
    "run_sequence",
    "same_failure",
    "scheduler_could_make",
    "shrink",
    "side_line",
    "state_part",
    "state_way",
    "trace_line",
    "write_counterexample",
]
