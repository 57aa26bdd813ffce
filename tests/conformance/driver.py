"""Random scheduler-like call sequences run in lockstep on vLLM and an implementation.

``Lockstep`` sends every call to the reference (vLLM 0.25.1) and to the
subject, compares results, exceptions and the abstract state after each call,
and records the reference's view as a trace. ``RandomScheduler`` decides the
calls the way vLLM's ``Scheduler`` would make them (``vllm/v1/core/sched/
scheduler.py``): prefix lookups only for waiting requests with no computed
tokens, chunked prefill, decode with draft tokens, preemption when an
allocation fails, async KV loads (``delay_cache_blocks``), deferred frees, plus
the admin calls (evict, reset, events, stats). ``shrink`` cuts a failing
sequence down to a minimal replayable trace.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conformance.sides import HarnessError, ManagerConfig, Side, make_side
from conformance.trace import TRACE_FORMAT, results_equal, short, state_diff, write_trace

FAILURE_DIR = Path(__file__).resolve().parents[2] / "build" / "conformance-failures"


# ---------------------------------------------------------------- outcomes


def outcome(side: Side, op: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """``{"ok": result}`` or ``{"raises": type name, "message": text}``.

    A ``HarnessError`` (a call the harness cannot express) is not an outcome;
    it propagates.
    """
    try:
        return {"ok": side.call(op, args)}
    except HarnessError:
        raise
    except Exception as exc:
        return {"raises": type(exc).__name__, "message": str(exc)[:300]}


def compare_outcomes(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether ``actual`` conforms to the reference outcome ``expected``.

    Returns ``(ok, note)``: ``note`` is ``"assert->ValueError"`` when vLLM's
    ``AssertionError`` met the subject's ``ValueError`` or
    ``NotImplementedError`` (allowed, counted),
    else a description of the difference, else ``""``.
    """
    if "raises" in expected:
        if "raises" not in actual:
            return False, f"vLLM raised {expected['raises']}, got result {short(actual['ok'])}"
        if expected["raises"] == actual["raises"]:
            return True, ""
        if expected["raises"] == "AssertionError" and actual["raises"] in SUBJECT_FOR_ASSERT:
            return True, "assert->" + str(actual["raises"])
        return False, (
            f"vLLM raised {expected['raises']}, got {actual['raises']}: {actual.get('message')}"
        )
    if "raises" in actual:
        return False, (
            f"vLLM returned {short(expected['ok'])}, got {actual['raises']}: "
            f"{actual.get('message')}"
        )
    if not results_equal(expected["ok"], actual["ok"]):
        return False, f"vLLM returned {short(expected['ok'])}, got {short(actual['ok'])}"
    return True, ""


# Where vLLM only asserts, an implementation may validate (docs/divergences.md).
SUBJECT_FOR_ASSERT = ("ValueError", "NotImplementedError")


class Mismatch(Exception):
    """The subject diverged from vLLM at call ``index``."""

    def __init__(self, index: int, op: str, args: Mapping[str, Any], detail: str) -> None:
        super().__init__(f"call #{index} {op}({short(dict(args), 300)}): {detail}")
        self.index = index
        self.op = op
        self.call_args = dict(args)
        self.detail = detail


class DriverError(Exception):
    """vLLM itself disagreed with what the driver expected (a harness bug)."""


@dataclass
class Stats:
    """What the conformance runs did, for the pytest summary line."""

    sequences: int = 0
    calls: int = 0
    mismatching_sequences: int = 0
    assert_as_value_error: int = 0
    events: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"conformance: {self.sequences} sequences, {self.calls} calls, "
            f"{self.mismatching_sequences} mismatches "
            f"({self.assert_as_value_error} vLLM asserts met by ValueError)"
        )


STATS = Stats()


# ---------------------------------------------------------------- lockstep


class Lockstep:
    """Runs each call on the reference and (when given) the subject, and compares."""

    def __init__(
        self,
        config: ManagerConfig,
        subject: str | None,
        hash_seed: str = "0",
        stats: Stats | None = None,
        record_state: bool = True,
    ) -> None:
        self.config = config
        self.hash_seed = hash_seed
        self.reference = make_side("vllm", config, hash_seed)
        self.subject = None if subject is None else make_side(subject, config, hash_seed)
        self.records: list[dict[str, Any]] = []
        self.stats = stats if stats is not None else Stats()
        self.record_state = record_state

    def config_record(self, **extra: Any) -> dict[str, Any]:
        from conformance.vllm_adapter import VLLM_VERSION

        return {
            "kind": "config",
            "format": TRACE_FORMAT,
            "manager": self.config.to_record(),
            "pythonhashseed": self.hash_seed,
            "vllm_version": VLLM_VERSION,
            **extra,
        }

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        """One call on both sides; returns vLLM's outcome.

        Raises:
            Mismatch: the subject's outcome or state differs from vLLM's.
        """
        index = len(self.records)
        expected = outcome(self.reference, op, args)
        record: dict[str, Any] = {"op": op, "args": args, **expected}
        record.pop("message", None)
        self.records.append(record)
        self.stats.calls += 1
        self.observe(op, expected)
        if self.subject is not None:
            actual = outcome(self.subject, op, args)
            ok, note = compare_outcomes(expected, actual)
            if not ok:
                raise Mismatch(index, op, args, note)
            if note:
                self.stats.assert_as_value_error += 1
        state = self.check_state(index, op, args)
        if self.record_state:
            record["state"] = state
        return expected

    def ok(self, op: str, **args: Any) -> Any:
        """A call vLLM must accept; returns its result."""
        expected = self.call(op, **args)
        if "raises" in expected:
            raise DriverError(f"vLLM raised {expected['raises']} on {op}({args}): {expected}")
        return expected["ok"]

    def raises(self, op: str, **args: Any) -> str:
        """A call vLLM must reject; returns the exception type name."""
        expected = self.call(op, **args)
        if "raises" not in expected:
            raise DriverError(f"vLLM accepted {op}({args}) -> {expected}")
        return str(expected["raises"])

    def check_state(
        self, index: int = -1, op: str = "<init>", args: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Compare abstract states and free counts; returns vLLM's state."""
        expected = self.reference.state()
        if self.subject is not None:
            actual = self.subject.state()
            diff = state_diff(expected, actual)
            free_ref = self.reference.manager.block_pool.get_num_free_blocks()
            free_sub = self.subject.manager.block_pool.get_num_free_blocks()
            if free_ref != free_sub:
                diff.append(f"  get_num_free_blocks(): expected {free_ref}, got {free_sub}")
            check_invariants = getattr(self.subject.manager, "check_invariants", None)
            if check_invariants is not None and not diff:
                try:
                    check_invariants()
                except AssertionError as exc:
                    diff.append(f"  {self.subject.name} check_invariants() failed: {exc}")
            if diff:
                raise Mismatch(
                    index, op, args or {}, "state differs after the call:\n" + "\n".join(diff)
                )
        return expected

    def observe(self, op: str, expected: Mapping[str, Any]) -> None:
        """Count the paths vLLM took, so tests can check the driver reaches them."""
        events = self.stats.events
        events[op] += 1
        if "raises" in expected:
            events["raises:" + str(expected["raises"])] += 1
            return
        result = expected["ok"]
        if op == "get_computed_blocks" and result["num_computed_tokens"] > 0:
            events["prefix_hit"] += 1
        elif op == "allocate_slots" and result is None:
            events["allocate_none"] += 1
        elif op == "reset_prefix_cache":
            events[f"reset_{result}"] += 1
        elif op == "take_events":
            for event in result:
                events["event:" + event["type"]] += 1


# ---------------------------------------------------------------- random driver


@dataclass
class Req:
    """The driver's (scheduler's) view of one request."""

    request_id: str
    num_prompt_tokens: int
    num_tokens: int
    max_tokens: int
    num_output_tokens: int = 0
    status: str = "WAITING"
    num_computed_tokens: int = 0
    num_preemptions: int = 0


def random_config(
    rng: random.Random,
    enable_caching: bool,
    watermark: float,
    num_groups: int = 1,
    group_kinds: tuple[str, ...] = (),
) -> ManagerConfig:
    """A small pool: 2-24 blocks of 1-4 tokens, so that hits and evictions happen.

    ``group_kinds`` (default all "full") sets ``num_groups`` to its length.
    """
    if group_kinds:
        num_groups = len(group_kinds)
    # vLLM asserts on chunked local attention with EAGLE, or next to groups of
    # other block sizes, when caching (docs/divergences.md): not generated.
    chunked_local = enable_caching and "chunked_local" in group_kinds
    if num_groups == 1:
        block_sizes: tuple[int, ...] = (rng.randint(1, 4),)
    elif chunked_local:
        block_sizes = (rng.randint(1, 4),) * num_groups
    else:
        base = rng.choice([1, 2])
        block_sizes = tuple(base * rng.choice([1, 2]) for _ in range(num_groups))
    return ManagerConfig(
        num_blocks=rng.randint(2, 24),
        block_sizes=block_sizes,
        max_model_len=rng.choice([64, 64, rng.randint(6, 24)]),
        enable_caching=enable_caching,
        watermark=watermark,
        log_stats=rng.random() < 0.9,
        enable_kv_cache_events=rng.random() < 0.9,
        use_eagle=rng.random() < 0.15 and not chunked_local,
        max_num_batched_tokens=rng.choice([None, 32]),
        hash_fn=rng.choice(["sha256", "sha256", "sha256", "sha256_cbor", "xxhash"]),
        group_kinds=group_kinds,
        window=rng.randint(1, 12),
    )


class RandomScheduler:
    """Makes the calls a vLLM scheduler would, with random choices at each step."""

    MAX_LIVE_REQUESTS = 6

    def __init__(self, rng: random.Random, run: Lockstep) -> None:
        self.rng = rng
        self.run = run
        self.config = run.config
        self.block_size = run.config.scheduler_block_size
        self.live: dict[str, Req] = {}
        self.running: list[str] = []
        self.all_ids: list[str] = []
        self.added: list[dict[str, Any]] = []
        self.deferred: list[int] = []
        self.next_handle = 0
        self.lookahead = 0 if rng.random() < 0.6 else rng.randint(1, 3)
        self.full_sequence_must_fit = rng.random() < 0.3
        self.stems = [
            [rng.randrange(3) for _ in range(rng.randint(0, 3 * self.block_size + 1))]
            for _ in range(3)
        ]

    # ------------------------------------------------------------ helpers

    def waiting(self) -> list[str]:
        return [r for r, q in self.live.items() if q.status in ("WAITING", "PREEMPTED")]

    def remote(self) -> list[str]:
        return [r for r, q in self.live.items() if q.status == "WAITING_FOR_REMOTE_KVS"]

    def chunk(self, remaining: int) -> int:
        """Tokens scheduled out of ``remaining``: often all, else a random chunk."""
        if remaining <= 1 or self.rng.random() < 0.6:
            return remaining
        return self.rng.randint(1, remaining)

    def lookahead_tokens(self) -> int:
        return self.lookahead if self.rng.random() < 0.9 else self.rng.randint(0, 3)

    # ------------------------------------------------------------ actions

    def step(self) -> None:
        rng = self.rng
        actions: list[tuple[float, Callable[[], None]]] = [
            (0.5, self.evict_blocks),
            (0.25, self.reset_prefix_cache),
            (1.5, lambda: self.run.ok("take_events")),
            (0.8, lambda: self.run.ok("take_new_block_ids")),
            (0.4, lambda: self.run.ok("new_step_starts")),
            (0.5, lambda: self.run.ok("make_prefix_cache_stats")),
            (0.4, lambda: self.run.ok("usage")),
            (0.2, self.invalid_call),
        ]
        if len(self.live) < self.MAX_LIVE_REQUESTS:
            actions.append((3.0, self.add_request))
        if self.waiting():
            actions.append((4.0, self.schedule_waiting))
        if self.running:
            actions.append((6.0, self.schedule_running))
            actions.append((0.8, self.preempt_random))
            actions.append((1.0, self.common_prefix))
            actions.append((0.3, self.remove_skipped_blocks))
        if self.remote():
            actions.append((2.0, self.finish_remote_load))
        if self.live:
            actions.append((1.0, self.finish_random))
            actions.append((0.8, self.query_blocks))
        if self.deferred:
            actions.append((1.0, self.drain_deferred))
        weights = [w for w, _ in actions]
        rng.choices([a for _, a in actions], weights)[0]()

    def add_request(self) -> None:
        rng = self.rng
        request_id = f"r{len(self.all_ids)}"
        if self.added and rng.random() < 0.15:
            args = dict(rng.choice(self.added), request_id=request_id)
        else:
            stem = rng.choice(self.stems)
            tail = [rng.randrange(3) for _ in range(rng.randint(0, 2 * self.block_size + 1))]
            prompt = (stem + tail)[: self.config.max_model_len - 1] or [rng.randrange(3)]
            args = {"request_id": request_id, "prompt_token_ids": prompt}
            args["max_tokens"] = rng.randint(1, 12)
            if rng.random() < 0.15:
                args["lora"] = rng.choice([["lora-a", 1], ["lora-b", 2]])
            if rng.random() < 0.1:
                args["cache_salt"] = rng.choice(["salt-x", "salt-y"])
            if rng.random() < 0.15:
                args["mm_features"] = self.random_mm_features(len(prompt))
            if rng.random() < 0.05:
                args["skip_reading_prefix_cache"] = True
        self.added.append(args)
        self.all_ids.append(request_id)
        self.run.ok("add_request", **args)
        prompt_len = len(args["prompt_token_ids"])
        self.live[request_id] = Req(request_id, prompt_len, prompt_len, args["max_tokens"])

    def random_mm_features(self, prompt_len: int) -> list[list[Any]]:
        """1-2 sorted, non-overlapping placeholder ranges inside the prompt."""
        features: list[list[Any]] = []
        start = 0
        for _ in range(self.rng.randint(1, 2)):
            if start >= prompt_len:
                break
            offset = self.rng.randint(start, prompt_len - 1)
            length = self.rng.randint(1, min(2 * self.block_size, prompt_len - offset))
            features.append([self.rng.choice(["img-0", "img-1"]), offset, length])
            start = offset + length
        return features

    def schedule_waiting(self) -> None:
        """Admit a waiting or preempted request (the scheduler's WAITING loop)."""
        rng = self.rng
        req = self.live[rng.choice(self.waiting())]
        rid = req.request_id
        if req.num_computed_tokens == 0:
            hit = self.run.ok("get_computed_blocks", request_id=rid)
            num_hit_tokens = hit["num_computed_tokens"]
            which = "last"
        else:  # after an async KV load: no new lookup
            num_hit_tokens = 0
            which = "empty"
        num_external = 0
        load_async = False
        room = req.num_tokens - req.num_computed_tokens - num_hit_tokens
        if req.num_computed_tokens == 0 and rng.random() < 0.15:
            if rng.random() < 0.4 and room >= 1:
                load_async = True
                num_external = rng.randint(1, room)
            elif room >= 2:
                num_external = rng.randint(1, room - 1)
        total = req.num_computed_tokens + num_hit_tokens + num_external
        num_new_tokens = 0 if load_async else self.chunk(req.num_tokens - total)
        has_scheduled = bool(self.running) if rng.random() < 0.85 else rng.random() < 0.5
        blocks = self.run.ok(
            "allocate_slots",
            request_id=rid,
            num_new_tokens=num_new_tokens,
            num_new_computed_tokens=num_hit_tokens,
            new_computed_blocks=which,
            num_lookahead_tokens=0 if load_async else self.lookahead_tokens(),
            num_external_computed_tokens=num_external,
            delay_cache_blocks=load_async or rng.random() < 0.05,
            full_sequence_must_fit=self.full_sequence_must_fit != (rng.random() < 0.1),
            reserved_blocks=0 if rng.random() < 0.85 else rng.randint(1, 3),
            has_scheduled_reqs=has_scheduled,
        )
        if blocks is None:
            return
        if load_async:
            req.status = "WAITING_FOR_REMOTE_KVS"
            req.num_computed_tokens = total
            self.run.ok(
                "update_request", request_id=rid, status=req.status, num_computed_tokens=total
            )
            return
        req.status = "RUNNING"
        self.running.append(rid)
        self.computed(req, num_new_tokens, total, num_draft_tokens=0)

    def schedule_running(self) -> None:
        """Schedule a running request: a prefill chunk, or a decode with drafts."""
        rng = self.rng
        rid = rng.choice(self.running)
        req = self.live[rid]
        remaining = req.num_tokens - req.num_computed_tokens
        cap = self.config.max_model_len - req.num_computed_tokens - 1
        num_new_tokens = min(self.chunk(remaining), cap)
        num_draft_tokens = 0
        if remaining == 1 and rng.random() < (0.4 if self.lookahead else 0.1):
            num_draft_tokens = min(rng.randint(1, 3), cap - num_new_tokens)
        if num_new_tokens <= 0:
            return
        while True:
            blocks = self.run.ok(
                "allocate_slots",
                request_id=rid,
                num_new_tokens=num_new_tokens + num_draft_tokens,
                num_lookahead_tokens=self.lookahead_tokens(),
            )
            if blocks is not None:
                break
            if rng.random() < 0.3:
                return  # the scheduler gives up on this request for this step
            victim = self.running[-1] if rng.random() < 0.7 else rng.choice(self.running)
            self.preempt(victim)
            if victim == rid:
                return
        self.computed(
            req, num_new_tokens + num_draft_tokens, req.num_computed_tokens, num_draft_tokens
        )

    def computed(
        self, req: Req, num_scheduled: int, num_computed_before: int, num_draft_tokens: int
    ) -> None:
        """After a step: advance computed tokens, and sample if the prefill is done."""
        rng = self.rng
        num_computed = num_computed_before + num_scheduled
        if num_computed < req.num_tokens:
            req.num_computed_tokens = num_computed
            self.run.ok(
                "update_request",
                request_id=req.request_id,
                status=req.status,
                num_computed_tokens=num_computed,
            )
            return
        num_accepted = rng.randint(0, num_draft_tokens)
        num_computed -= num_draft_tokens - num_accepted
        req.num_computed_tokens = num_computed
        self.run.ok(
            "update_request",
            request_id=req.request_id,
            status=req.status,
            num_computed_tokens=num_computed,
        )
        new_tokens = [rng.randrange(2) for _ in range(num_accepted + 1)]
        self.run.ok(
            "append_output_token_ids",
            request_id=req.request_id,
            token_ids=new_tokens[0] if len(new_tokens) == 1 and rng.random() < 0.5 else new_tokens,
        )
        req.num_tokens += len(new_tokens)
        req.num_output_tokens += len(new_tokens)
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            self.finish(req.request_id, "FINISHED_LENGTH_CAPPED")
        elif rng.random() < 0.05:
            self.finish(req.request_id, "FINISHED_STOPPED")

    def free_request_blocks(self, rid: str) -> None:
        """``free``, or ``pop_blocks_for_free`` now and ``free_blocks`` later."""
        if self.rng.random() < 0.75:
            self.run.ok("free", request_id=rid)
            return
        handle = self.next_handle
        self.next_handle += 1
        self.run.ok("pop_blocks_for_free", request_id=rid, handle=handle)
        self.deferred.append(handle)

    def preempt(self, rid: str) -> None:
        req = self.live[rid]
        self.running.remove(rid)
        self.free_request_blocks(rid)
        req.status = "PREEMPTED"
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.run.ok(
            "update_request",
            request_id=rid,
            status="PREEMPTED",
            num_computed_tokens=0,
            num_preemptions=req.num_preemptions,
        )

    def preempt_random(self) -> None:
        self.preempt(self.rng.choice(self.running))

    def finish(self, rid: str, status: str) -> None:
        self.live.pop(rid)
        if rid in self.running:
            self.running.remove(rid)
        self.run.ok("update_request", request_id=rid, status=status)
        self.free_request_blocks(rid)

    def finish_random(self) -> None:
        self.finish(self.rng.choice(sorted(self.live)), "FINISHED_ABORTED")

    def finish_remote_load(self) -> None:
        """The connector reports an async KV load done (sometimes with failed blocks)."""
        rng = self.rng
        req = self.live[rng.choice(self.remote())]
        rid = req.request_id
        if rng.random() < 0.8:
            self.run.ok("cache_blocks", request_id=rid, num_computed_tokens=req.num_computed_tokens)
            if req.num_computed_tokens == req.num_tokens:
                req.num_computed_tokens = req.num_tokens - 1
        else:  # invalid blocks: keep the longest valid block-aligned prefix
            bs = self.block_size
            num_valid_blocks = min(req.num_computed_tokens, req.num_tokens - 1) // bs
            req.num_computed_tokens = rng.randint(0, num_valid_blocks) * bs
            self.run.ok(
                "update_request", request_id=rid, num_computed_tokens=req.num_computed_tokens
            )
            if req.num_computed_tokens:
                self.run.ok(
                    "cache_blocks", request_id=rid, num_computed_tokens=req.num_computed_tokens
                )
            else:
                self.run.ok("free", request_id=rid)
        req.status = "PREEMPTED" if req.num_preemptions else "WAITING"
        self.run.ok(
            "update_request",
            request_id=rid,
            status=req.status,
            num_computed_tokens=req.num_computed_tokens,
        )

    def drain_deferred(self) -> None:
        for _ in range(self.rng.randint(1, len(self.deferred))):
            self.run.ok("free_blocks", handle=self.deferred.pop(0))

    def evict_blocks(self) -> None:
        n = self.config.num_blocks
        block_ids = sorted(self.rng.sample(range(n), self.rng.randint(1, min(3, n))))
        self.run.ok("evict_blocks", block_ids=block_ids)

    def reset_prefix_cache(self) -> None:
        self.run.ok("reset_prefix_cache")

    def common_prefix(self) -> None:
        if self.rng.random() < 0.05:
            rid = self.rng.choice(self.all_ids)  # vLLM then records an empty entry
        else:
            rid = self.rng.choice(self.running)
        self.run.ok("get_num_common_prefix_blocks", request_id=rid)

    def remove_skipped_blocks(self) -> None:
        req = self.live[self.rng.choice(self.running)]
        self.run.ok(
            "remove_skipped_blocks",
            request_id=req.request_id,
            total_computed_tokens=req.num_computed_tokens,
            num_prompt_tokens=req.num_prompt_tokens,
        )

    def query_blocks(self) -> None:
        req = self.live[self.rng.choice(sorted(self.live))]
        op = self.rng.choice(["get_block_ids", "get_blocks", "get_block_ids_for_computed_tokens"])
        if op == "get_block_ids_for_computed_tokens":
            self.run.ok(op, request_id=req.request_id, num_computed_tokens=req.num_computed_tokens)
        else:
            self.run.ok(op, request_id=req.request_id)

    def invalid_call(self) -> None:
        """Calls vLLM rejects before changing anything."""
        if self.live and self.rng.random() < 0.5:
            rid = self.rng.choice(sorted(self.live))
            self.run.raises("allocate_slots", request_id=rid, num_new_tokens=0)
        else:
            bad_id = self.config.num_blocks + self.rng.randint(0, 3)
            self.run.raises("evict_blocks", block_ids=[bad_id])

    def drain(self) -> None:
        """Finish everything, then check the pool comes back whole."""
        for rid in sorted(self.live):
            self.finish(rid, "FINISHED_ABORTED")
        while self.deferred:
            self.run.ok("free_blocks", handle=self.deferred.pop(0))
        for op in ("take_events", "take_new_block_ids", "make_prefix_cache_stats", "usage"):
            self.run.ok(op)
        self.run.ok("reset_prefix_cache")
        self.run.ok("take_events")


@dataclass
class SequenceResult:
    """One random sequence: its seed, config, calls, and the first mismatch if any."""

    seed: int
    config: ManagerConfig
    run: Lockstep
    mismatch: Mismatch | None


def run_sequence(
    seed: int,
    enable_caching: bool,
    watermark: float,
    subject: str | None,
    stats: Stats | None = None,
    num_groups: int = 1,
    num_steps: tuple[int, int] = (20, 120),
    group_kinds: tuple[str, ...] = (),
) -> SequenceResult:
    """Generate and run one seeded random sequence in lockstep."""
    rng = random.Random(seed)
    config = random_config(rng, enable_caching, watermark, num_groups, group_kinds)
    run = Lockstep(config, subject, stats=stats, record_state=False)
    scheduler = RandomScheduler(rng, run)
    mismatch = None
    try:
        run.check_state()
        for _ in range(rng.randint(*num_steps)):
            scheduler.step()
        scheduler.drain()
    except Mismatch as exc:
        mismatch = exc
    run.stats.sequences += 1
    if mismatch is not None:
        run.stats.mismatching_sequences += 1
    return SequenceResult(seed, config, run, mismatch)


# ---------------------------------------------------------------- replay and shrinking


Call = tuple[str, dict[str, Any]]


def replay_lockstep(
    config: ManagerConfig,
    calls: Sequence[Call],
    subject: str,
    allowed_raises: Sequence[bool],
    hash_seed: str = "0",
) -> tuple[bool, Mismatch | None, Lockstep]:
    """Replay ``calls`` in lockstep; returns (valid, mismatch, run).

    The sequence is invalid when vLLM rejects a call it accepted in the
    original (``allowed_raises[i]`` is False) or the harness cannot make it.
    """
    run = Lockstep(config, subject, hash_seed)
    try:
        run.check_state()
    except Mismatch as exc:
        return True, exc, run
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


def shrink(
    config: ManagerConfig,
    calls: Sequence[Call],
    subject: str,
    mismatch_op: str,
    hash_seed: str = "0",
    budget_s: float = 60.0,
) -> list[Call]:
    """Greedy chunk-removal shrinking of a failing call list (delta debugging).

    Keeps a candidate when it is still a valid scheduler sequence for vLLM and
    still mismatches at a call of the same op.
    """
    records = list(calls)
    _, exc, run = replay_lockstep(config, records, subject, [True] * len(records), hash_seed)
    if exc is None:
        return records
    records = records[: exc.index + 1]
    raised = ["raises" in r for r in run.records[: exc.index + 1]]
    deadline = time.monotonic() + budget_s
    chunk = max(1, len(records) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        changed = False
        i = 0
        while i < len(records) and time.monotonic() < deadline:
            candidate = records[:i] + records[i + chunk :]
            candidate_raised = raised[:i] + raised[i + chunk :]
            valid, exc, _ = replay_lockstep(config, candidate, subject, candidate_raised, hash_seed)
            if valid and exc is not None and exc.op == mismatch_op:
                records = candidate[: exc.index + 1]
                raised = candidate_raised[: exc.index + 1]
                changed = True
            else:
                i += chunk
        if not changed:
            chunk //= 2
    return records


def record_reference(
    config: ManagerConfig, calls: Sequence[Call], hash_seed: str = "0", **extra: Any
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run ``calls`` on vLLM alone and return (config record, call records with states)."""
    run = Lockstep(config, None, hash_seed)
    for op, args in calls:
        run.call(op, **args)
    return run.config_record(**extra), run.records


def write_failure(
    result: SequenceResult,
    subject: str,
    shrink_budget_s: float = 60.0,
    directory: Path = FAILURE_DIR,
) -> Path:
    """Shrink a mismatching sequence and write it as a replayable trace under build/."""
    assert result.mismatch is not None
    calls = [(r["op"], r["args"]) for r in result.run.records]
    small = shrink(
        result.config, calls, subject, result.mismatch.op, result.run.hash_seed, shrink_budget_s
    )
    config_record, records = record_reference(
        result.config,
        small,
        result.run.hash_seed,
        seed=result.seed,
        note=f"shrunk from a random sequence; {subject} mismatches at the last call",
    )
    path = directory / f"{subject}-seed-{result.seed}.jsonl"
    write_trace(path, config_record, records)
    return path


def describe_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    """A trace's calls as a readable program, one line each."""
    lines = []
    for i, record in enumerate(calls):
        args = ", ".join(f"{k}={short(v, 120)}" for k, v in record["args"].items())
        result = (
            f"raises {record['raises']}" if "raises" in record else short(record.get("ok"), 160)
        )
        lines.append(f"  #{i:<3} {record['op']}({args}) -> {result}")
    return "\n".join(lines)


def replay_trace(
    config_record: Mapping[str, Any], records: Sequence[Mapping[str, Any]], impl: str
) -> Mismatch | None:
    """Replay a recorded trace on ``impl`` alone; the first divergence, or None."""
    config = ManagerConfig.from_record(config_record["manager"])
    try:
        side = make_side(impl, config, str(config_record.get("pythonhashseed", "0")))
    except Exception as exc:
        return Mismatch(-1, "KVCacheManager", config.to_record(), f"construction failed: {exc!r}")
    for index, record in enumerate(records):
        op, args = record["op"], record["args"]
        expected = {k: record[k] for k in ("ok", "raises") if k in record}
        actual = outcome(side, op, args)
        ok, note = compare_outcomes(expected, actual)
        if not ok:
            return Mismatch(index, op, args, note)
        if "state" in record:
            diff = state_diff(record["state"], side.state())
            if diff:
                return Mismatch(
                    index, op, args, "state differs after the call:\n" + "\n".join(diff)
                )
    return None
