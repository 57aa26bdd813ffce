"""One random sequence run in lockstep, and a failing one shrunk to a trace.

``run_sequence`` draws a config and runs a ``RandomScheduler`` on it;
``replay_lockstep`` replays a call list; ``shrink`` cuts a failing list down while it
fails the same way (``same_failure``) and a scheduler could make it
(``scheduler_could_make``); ``write_counterexample`` writes the result as a
replayable trace. Part of ``kvcache.kit.driver``, which re-exports every name.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcache.kit.config import ManagerConfig
from kvcache.kit.families import FAMILIES, Family, random_config
from kvcache.kit.ledger import REFERENCE_LINE, Judge, release_line_of
from kvcache.kit.lockstep import LOOKUP_OPS, Lockstep, Mismatch, Stats
from kvcache.kit.scheduler import RandomScheduler
from kvcache.kit.sides import CannotBuild, HarnessError
from kvcache.kit.trace import short, write_trace


@dataclass
class SequenceResult:
    """One random sequence: its seed, config, calls, and the first mismatch if any."""

    seed: int
    family: str
    config: ManagerConfig
    run: Lockstep | None
    mismatch: Mismatch | None
    #: Why a side could not build the manager ("cannot build: ..."), if it could not.
    cannot_build: str | None = None
    #: The ledger entry that explains ``cannot_build``, if one does.
    cannot_build_known: str | None = None

    @property
    def unknown(self) -> bool:
        """A divergence no ledger entry explains (a known one is reported, not failed)."""
        return self.mismatch is not None and not self.mismatch.known


def run_sequence(
    seed: int,
    family: Family | str,
    subject: str | None,
    reference: str = "vllm",
    stats: Stats | None = None,
    num_steps: tuple[int, int] = (20, 120),
    record_state: bool = False,
    rng: random.Random | None = None,
    make_run: Callable[..., Lockstep] = Lockstep,
) -> SequenceResult:
    """Generate and run one seeded random sequence of ``family`` in lockstep.

    ``rng`` replaces ``random.Random(seed)`` as the source of every choice
    (Hypothesis passes its own, so that it can shrink and mutate the choices);
    ``make_run`` builds the lockstep (``kvcache.kit.levels``: another level, features).
    """
    if isinstance(family, str):
        family = FAMILIES[family]
    stats = stats if stats is not None else Stats()
    rng = rng if rng is not None else random.Random(seed)
    config = random_config(rng, family)
    stats.sequences += 1
    stats.count_config(family.name, config)
    run: Lockstep | None = None
    mismatch = None
    try:
        run = make_run(config, subject, reference, stats=stats, record_state=record_state)
        run.check_state()
        scheduler = RandomScheduler(rng, run)
        for _ in range(rng.randint(*num_steps)):
            scheduler.step()
        scheduler.drain()
    except Mismatch as exc:
        mismatch = exc
    except CannotBuild as exc:
        stats.cannot_build[family.name] += 1
        known = cannot_build_entry(config, exc, subject, reference)
        return SequenceResult(seed, family.name, config, None, None, str(exc), known)
    if mismatch is not None and not mismatch.known:
        stats.mismatching_sequences += 1
    return SequenceResult(seed, family.name, config, run, mismatch)


def cannot_build_entry(config: ManagerConfig, exc: CannotBuild, *impls: str | None) -> str | None:
    """The ledger entry that explains why one side cannot build ``config``: the
    installed vLLM of a later release line (a layout it dropped), or, beside it, the
    side that behaves like 0.25.1 (``impls``: a layout the later release added)."""
    if exc.impl == "vllm":
        refused_by = "new"
    elif "vllm" in impls:
        refused_by = "old"
    else:
        return None
    from kvcache.kit.sides import resolve_adapter

    version = resolve_adapter("vllm").version
    line = release_line_of(version)
    if line == REFERENCE_LINE:
        return None
    return Judge(config, line, old_is_expected=True).cannot_build(exc.reason, refused_by)


# ---------------------------------------------------------------- replay and shrinking


Call = tuple[str, dict[str, Any]]


def replay_lockstep(
    config: ManagerConfig,
    calls: Sequence[Call],
    subject: str,
    reference: str,
    allowed_raises: Sequence[bool],
    hash_seed: str = "0",
    make_run: Callable[..., Lockstep] = Lockstep,
) -> tuple[bool, Mismatch | None, Lockstep | None]:
    """Replay ``calls`` in lockstep; returns (valid, mismatch, run).

    The sequence is invalid when the reference rejects a call it accepted in
    the original (``allowed_raises[i]`` is False) or the harness cannot make it.
    """
    try:
        run = make_run(config, subject, reference, hash_seed, record_state=False)
        run.check_state()
    except Mismatch as exc:
        return True, exc, None
    except CannotBuild:
        return False, None, None
    for i, (op, args) in enumerate(calls):
        try:
            expected = run.call(op, **args)
        except HarnessError:
            return False, None, run
        except Mismatch as exc:
            return True, exc, run
        if "raises" in expected and not allowed_raises[i]:
            return False, None, run
    return True, None, run


FINISHED = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED", "FINISHED_IGNORED")


def scheduler_could_make(calls: Sequence[Call], admitted: Sequence[bool] | None = None) -> bool:
    """Whether a call list keeps the scheduler's rules, so a shrunk sequence stays one
    a real scheduler could make.

    Checked: calls on a request come after its ``add_request``; a prefix lookup
    (either of ``LOOKUP_OPS``, the connector's fallback after the connector lookup
    too) only for a waiting or preempted request with no computed tokens and no
    allocation since its status last changed; an
    allocation with ``new_computed_blocks="last"`` right after a lookup of that
    request; nothing but the free (a KV producer's ``finalize_partial_tail_offloads``
    before it) once a request finished, nothing after the free; ``free_blocks``
    only of a popped (or taken copies') handle, once; computed tokens only where the
    request holds slots (a status update may not compute more tokens than its
    allocations since its last admission made room for). ``admitted[i]``: call
    ``i`` is an allocation that succeeded in the original sequence (default: all).
    """
    status: dict[str, str] = {}
    computed: dict[str, int] = {}
    looked_up: set[str] = set()
    allocated: set[str] = set()  # allocated since its status last changed
    freed: set[str] = set()
    popped: set[Any] = set()
    for i, (op, args) in enumerate(calls):
        rid = str(args.get("request_id"))
        if op == "add_request":
            if rid in status:
                return False
            status[rid], computed[rid] = "WAITING", 0
            continue
        if op == "take_kv_cache_block_copies":
            popped.add(args.get("handle"))
            continue
        if op == "finalize_partial_tail_offloads":  # a finished request, before its free
            if rid not in status or rid in freed or status[rid] not in FINISHED:
                return False
            continue
        if op == "free_blocks":
            if args.get("handle") not in popped:
                return False
            popped.discard(args.get("handle"))
            continue
        if "request_id" not in args or op == "get_num_common_prefix_blocks":
            continue
        if rid not in status or rid in freed:
            return False
        finished = status[rid] in FINISHED
        if op == "update_request":
            if finished:
                return False
            status[rid] = args.get("status", status[rid])
            computed[rid] = args.get("num_computed_tokens", computed[rid])
            looked_up.discard(rid)
            if "status" in args:
                allocated.discard(rid)
        elif op in ("free", "pop_blocks_for_free"):
            if op == "pop_blocks_for_free":
                popped.add(args.get("handle"))
            if finished:
                freed.add(rid)
            looked_up.discard(rid)
        elif finished:
            return False
        elif op in LOOKUP_OPS:
            if status[rid] not in ("WAITING", "PREEMPTED") or computed[rid] != 0:
                return False
            if rid in allocated:  # admitted: the scheduler's status update comes first
                return False
            looked_up.add(rid)
        elif op == "allocate_slots":
            if args.get("new_computed_blocks") == "last" and rid not in looked_up:
                return False
            looked_up.discard(rid)
            if admitted is None or admitted[i]:
                allocated.add(rid)
    return not unbacked_updates(calls, admitted)


def unbacked_updates(calls: Sequence[Call], admitted: Sequence[bool] | None = None) -> list[int]:
    """Indices of the ``update_request`` calls that set more computed tokens than the
    request's allocations since its last free made room for (``scheduler_could_make``
    refuses them): what removing an allocation strands. The shrinker drops them with
    the allocation, as the step they record never ran."""
    slots: dict[str, int] = {}
    computed: dict[str, int] = {}
    stranded = []
    for i, (op, args) in enumerate(calls):
        rid = str(args.get("request_id"))
        if op == "update_request" and "num_computed_tokens" in args:
            if args["num_computed_tokens"] > slots.get(rid, 0):
                stranded.append(i)
                continue
            computed[rid] = args["num_computed_tokens"]
        elif op in ("free", "pop_blocks_for_free"):
            slots[rid] = computed[rid] = 0
        elif op == "allocate_slots" and (admitted is None or admitted[i]):
            made = computed.get(rid, 0) + sum(
                int(args.get(key) or 0) for key in _SLOT_ARGS
            )
            slots[rid] = max(slots.get(rid, 0), made)
    return stranded


#: The ``allocate_slots`` counts that make room past the computed tokens.
_SLOT_ARGS = (
    "num_new_computed_tokens",
    "num_external_computed_tokens",
    "num_new_tokens",
    "num_lookahead_tokens",
)


def same_failure(a: Mismatch, b: Mismatch) -> bool:
    """The same failure: the same call kind, the same kind of difference on the same
    field in the same way (``Mismatch.way``), the same ledger entry."""
    return (a.op, a.part, a.way, a.known) == (b.op, b.part, b.way, b.known)


def shrink(
    config: ManagerConfig,
    calls: Sequence[Call],
    subject: str,
    reference: str,
    hash_seed: str = "0",
    budget_s: float = 60.0,
    make_run: Callable[..., Lockstep] = Lockstep,
) -> list[Call]:
    """Greedy chunk-removal shrinking of a failing call list (delta debugging).

    Keeps a candidate when a scheduler could make it (``scheduler_could_make``),
    it is still a valid sequence for the reference, and it still fails the same
    way (``same_failure``: same op, same field differing the same way, same ledger
    entry).
    """
    records = list(calls)
    allowed = [True] * len(records)
    _, exc, run = replay_lockstep(config, records, subject, reference, allowed, hash_seed, make_run)
    if exc is None or run is None:
        return records if exc is None else []
    original = exc
    records = records[: exc.index + 1]
    raised = ["raises" in r for r in run.records[: exc.index + 1]]
    admitted = [
        r["op"] == "allocate_slots" and r.get("ok") is not None
        for r in run.records[: exc.index + 1]
    ]
    deadline = time.monotonic() + budget_s
    chunk = max(1, len(records) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        changed = False
        i = 0
        while i < len(records) and time.monotonic() < deadline:
            candidate = records[:i] + records[i + chunk :]
            candidate_raised = raised[:i] + raised[i + chunk :]
            candidate_admitted = admitted[:i] + admitted[i + chunk :]
            stranded = set(unbacked_updates(candidate, candidate_admitted))
            if stranded:  # an allocation went: so do the steps it made room for
                keep = [j for j in range(len(candidate)) if j not in stranded]
                candidate = [candidate[j] for j in keep]
                candidate_raised = [candidate_raised[j] for j in keep]
                candidate_admitted = [candidate_admitted[j] for j in keep]
            if not scheduler_could_make(candidate, candidate_admitted):
                i += chunk
                continue
            valid, exc, _ = replay_lockstep(
                config, candidate, subject, reference, candidate_raised, hash_seed, make_run
            )
            if valid and exc is not None and same_failure(exc, original):
                records = candidate[: exc.index + 1]
                raised = candidate_raised[: exc.index + 1]
                admitted = candidate_admitted[: exc.index + 1]
                changed = True
            else:
                i += chunk
        if not changed:
            chunk //= 2
    return records


def record_reference(
    config: ManagerConfig,
    calls: Sequence[Call],
    reference: str = "vllm",
    hash_seed: str = "0",
    make_run: Callable[..., Lockstep] = Lockstep,
    **extra: Any,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run ``calls`` on the reference alone; returns (trace header, records with states)."""
    run = make_run(config, None, reference, hash_seed)
    for op, args in calls:
        run.call(op, **args)
    return run.header(**extra), run.records


def write_counterexample(
    result: SequenceResult,
    subject: str,
    reference: str,
    path: Path,
    shrink_budget_s: float = 60.0,
    make_run: Callable[..., Lockstep] = Lockstep,
    **extra: Any,
) -> tuple[Path, int]:
    """Shrink a mismatching sequence and write it as a replayable trace.

    Returns the path and the number of calls kept.
    """
    assert result.mismatch is not None
    calls: list[Call] = []
    if result.run is not None:
        calls = [(r["op"], r["args"]) for r in result.run.records]
    hash_seed = result.run.hash_seed if result.run is not None else "0"
    small = shrink(result.config, calls, subject, reference, hash_seed, shrink_budget_s, make_run)
    header, records = record_reference(
        result.config,
        small,
        reference,
        hash_seed,
        make_run,
        source=f"random sequence: family {result.family}, seed {result.seed}, shrunk",
        note=f"{subject} diverges from {reference} at the last call",
        **extra,
    )
    write_trace(path, header, records)
    return path, len(records)


def describe_call(index: int, record: Mapping[str, Any]) -> str:
    args = ", ".join(f"{k}={short(v, 120)}" for k, v in record["args"].items())
    result = f"raises {record['raises']}" if "raises" in record else short(record.get("ok"), 160)
    return f"  #{index:<4} {record['op']}({args}) -> {result}"


def describe_calls(calls: Sequence[Mapping[str, Any]], first_index: int = 0) -> str:
    """A trace's calls as a readable program, one line each."""
    return "\n".join(describe_call(first_index + i, r) for i, r in enumerate(calls))
