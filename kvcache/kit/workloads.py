"""Deterministic workloads and a small vLLM-like scheduler that drives a manager.

The scheduler follows the shape of vLLM 0.25.1's ``Scheduler.schedule``:
running requests first (decode or the next prefill chunk, preempting the most
recently admitted request when blocks run out), then waiting requests in order
(prefix-cache lookup, admission under the token budget). Generated tokens come
from a hash of (request, position), so every implementation sees the same run
as long as it returns the same results; ``simulate`` returns a digest of every
result to check that.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: prompt, output length and arrival step."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_output_tokens: int
    arrival_step: int
    cache_salt: str | None = None
    lora: tuple[str, int] | None = None


@dataclass(frozen=True)
class GroupLayout:
    """One KV-cache group: ``kind`` is full | sliding_window | chunked_local | mamba."""

    kind: str
    block_size: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    mamba_cache_mode: str = "none"


@dataclass(frozen=True)
class Workload:
    """A named workload: pool, groups, scheduler limits and requests."""

    name: str
    num_blocks: int
    groups: tuple[GroupLayout, ...]
    max_model_len: int
    token_budget: int
    max_num_seqs: int
    requests: Sequence[RequestSpec]
    enable_caching: bool = True

    @property
    def scheduler_block_size(self) -> int:
        """LCM of the group block sizes."""
        import math

        return math.lcm(*(g.block_size for g in self.groups))

    @property
    def hash_block_size(self) -> int:
        """GCD of the group block sizes (the scheduler size for one group)."""
        import math

        if len(self.groups) == 1:
            return self.scheduler_block_size
        return math.gcd(*(g.block_size for g in self.groups))


def chat_requests(
    num_requests: int, seed: int, vocab: int = 32000, max_model_len: int = 4096
) -> tuple[RequestSpec, ...]:
    """Chat traffic: 8 shared system prompts (200–1,000 tokens), a user turn of
    20–400 tokens, 20–250 output tokens, a few arrivals per step."""
    rng = random.Random(seed)
    system_prompts = [
        tuple(rng.randrange(vocab) for _ in range(rng.randint(200, 1000))) for _ in range(8)
    ]
    specs = []
    step = 0
    for i in range(num_requests):
        step += rng.choice((0, 0, 1, 1, 2))
        prompt = rng.choice(system_prompts) + tuple(
            rng.randrange(vocab) for _ in range(rng.randint(20, 400))
        )
        output = rng.randint(20, 250)
        prompt = prompt[: max_model_len - output - 1]
        specs.append(RequestSpec(f"req-{i}", prompt, output, step))
    return tuple(specs)


def long_context_requests(
    num_requests: int, seed: int, vocab: int = 32000
) -> tuple[RequestSpec, ...]:
    """Long documents (4k–16k tokens) asked several questions each: big shared prefixes."""
    rng = random.Random(seed)
    docs = [tuple(rng.randrange(vocab) for _ in range(rng.randint(4000, 16000))) for _ in range(6)]
    specs = []
    for i in range(num_requests):
        prompt = rng.choice(docs) + tuple(rng.randrange(vocab) for _ in range(rng.randint(10, 60)))
        specs.append(RequestSpec(f"doc-{i}", prompt, rng.randint(10, 80), i * 3))
    return tuple(specs)


def make_workload(name: str, num_requests: int = 2000, seed: int = 0) -> Workload:
    """The named benchmark workloads (issue 7): chat, chat-nocache, chat-swa,
    chat-mamba, long-context."""
    full = GroupLayout("full", 16)
    if name in ("chat", "chat-nocache", "chat-swa", "chat-mamba"):
        groups: tuple[GroupLayout, ...] = (full,)
        if name == "chat-swa":
            groups = (full, GroupLayout("sliding_window", 16, sliding_window=64))
        if name == "chat-mamba":
            groups = (full, GroupLayout("mamba", 16, mamba_cache_mode="align"))
        return Workload(
            name=name,
            num_blocks=1024,
            groups=groups,
            max_model_len=4096,
            token_budget=2048,
            max_num_seqs=128,
            requests=chat_requests(num_requests, seed),
            enable_caching=name != "chat-nocache",
        )
    if name == "long-context":
        return Workload(
            name=name,
            num_blocks=4096,
            groups=(full,),
            max_model_len=32768,
            token_budget=2048,
            max_num_seqs=32,
            requests=long_context_requests(max(1, num_requests // 10), seed),
        )
    raise ValueError(
        f"unknown workload name={name!r}; choose chat, chat-nocache, chat-swa, "
        "chat-mamba or long-context"
    )


WORKLOAD_NAMES = ("chat", "chat-nocache", "chat-swa", "chat-mamba", "long-context")


@dataclass
class Impl:
    """What the simulation needs from an implementation.

    Attributes:
        name: Label for reports.
        manager: A ``KVCacheManager`` (vLLM's API).
        new_request: ``(spec) -> request`` object of that implementation.
        set_status: ``(request, "WAITING" | "RUNNING" | "PREEMPTED") -> None``.
    """

    name: str
    manager: Any
    new_request: Callable[[RequestSpec], Any]
    set_status: Callable[[Any, str], None]


@dataclass
class SimResult:
    """Outcome of one simulation: timings per manager method and a result digest."""

    name: str
    digest: str
    method_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    method_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    steps: int = 0
    preemptions: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0
    series: list[tuple[int, float, int, int, int]] = field(default_factory=list)
    #: Hits and prompt tokens at each request's first admission only (re-admissions
    #: after a preemption are in ``hit_tokens`` / ``prompt_tokens``).
    first_hit_tokens: int = 0
    first_prompt_tokens: int = 0
    #: Steps from arrival to first admission, one entry per admitted request.
    queue_steps: list[int] = field(default_factory=list)
    #: Requests that ran to their last output token.
    finished: int = 0
    #: Per step, running totals: (prefix-hit tokens, prompt tokens admitted, preemptions).
    totals: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def manager_seconds(self) -> float:
        """Total time spent inside manager calls."""
        return sum(self.method_seconds.values())


def _output_token(request_id: str, position: int) -> int:
    digest = hashlib.blake2b(f"{request_id}:{position}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") % 32000


def _block_ids(blocks: Any) -> Any:
    return None if blocks is None else blocks.get_block_ids()


#: ``observe(step, op, request_id, result)``: every call whose result enters the digest.
Observer = Callable[[int, str, str, str], None]
#: ``progress(step, arrived, running, waiting)``: called every 256 steps.
Progress = Callable[[int, int, int, int], None]


def simulate(
    workload: Workload,
    impl: Impl,
    max_steps: int = 1_000_000,
    check_every: int = 0,
    observe: Observer | None = None,
    progress: Progress | None = None,
) -> SimResult:
    """Run the workload's scheduler loop on ``impl`` until every request finishes.

    Args:
        workload: What to run.
        impl: Which implementation.
        max_steps: Stop after this many steps even if requests remain.
        check_every: Call ``manager.check_invariants()`` every this many steps (0: never).
        observe: Called with each result that enters the digest, so that two runs
            can be compared call by call (``kvcache.kit.sweeps``).
        progress: Called every 256 steps, for progress lines on long runs.

    Returns:
        Timings of every manager call, a digest of every result (equal digests
        mean the implementations behaved identically), and per-step series
        ``(step, usage, free blocks, running, waiting)`` and running totals
        ``(hit tokens, prompt tokens, preemptions)``.
    """
    m = impl.manager
    res = SimResult(impl.name, "")
    sha = hashlib.sha256()
    perf = time.perf_counter
    secs = res.method_seconds
    calls = res.method_calls
    pending: Iterator[RequestSpec] = iter(workload.requests)
    next_spec = next(pending, None)
    waiting: list[tuple[RequestSpec, Any]] = []
    running: list[tuple[RequestSpec, Any]] = []
    budget_total = workload.token_budget
    step = 0
    arrived = 0
    while (next_spec is not None or waiting or running) and step < max_steps:
        while next_spec is not None and next_spec.arrival_step <= step:
            waiting.append((next_spec, impl.new_request(next_spec)))
            arrived += 1
            next_spec = next(pending, None)
        if progress is not None and step % 256 == 0:
            progress(step, arrived, len(running), len(waiting))
        t = perf()
        m.new_step_starts()
        secs["new_step_starts"] += perf() - t
        calls["new_step_starts"] += 1
        budget = budget_total
        scheduled: list[tuple[RequestSpec, Any, int]] = []
        # 1. Running requests, oldest first; preempt the newest on failure.
        i = 0
        while i < len(running) and budget > 0:
            spec, req = running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while True:
                t = perf()
                out = m.allocate_slots(req, num_new)
                secs["allocate_slots"] += perf() - t
                calls["allocate_slots"] += 1
                text = repr(_block_ids(out))
                sha.update(text.encode())
                if observe is not None:
                    observe(step, "allocate_slots", spec.request_id, text)
                if out is not None:
                    scheduled.append((spec, req, num_new))
                    budget -= num_new
                    i += 1
                    break
                victim_spec, victim = running.pop()
                t = perf()
                m.free(victim)
                secs["free"] += perf() - t
                calls["free"] += 1
                impl.set_status(victim, "PREEMPTED")
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
                res.preemptions += 1
                waiting.insert(0, (victim_spec, victim))
                if victim is req:
                    break
        # 2. Waiting requests in order, while budget and seats last.
        while waiting and budget > 0 and len(running) < workload.max_num_seqs:
            spec, req = waiting[0]
            t = perf()
            found = m.get_computed_blocks(req)  # 2 values, or 3 (0.26.0 on: + a boundary)
            secs["get_computed_blocks"] += perf() - t
            hits, num_hit = found[0], found[1]
            calls["get_computed_blocks"] += 1
            num_new = min(req.num_tokens - num_hit, budget)
            t = perf()
            out = m.allocate_slots(req, num_new, num_hit, hits, has_scheduled_reqs=bool(scheduled))
            secs["allocate_slots"] += perf() - t
            calls["allocate_slots"] += 1
            text = f"{num_hit}{_block_ids(out)}"
            sha.update(text.encode())
            if observe is not None:
                observe(step, "get_computed_blocks+allocate_slots", spec.request_id, text)
            if out is None:
                break
            waiting.pop(0)
            impl.set_status(req, "RUNNING")
            req.num_computed_tokens = num_hit
            res.hit_tokens += num_hit
            res.prompt_tokens += req.num_tokens
            if req.num_preemptions == 0:
                res.first_hit_tokens += num_hit
                res.first_prompt_tokens += req.num_tokens
                res.queue_steps.append(step - spec.arrival_step)
            running.append((spec, req))
            scheduled.append((spec, req, num_new))
            budget -= num_new
        # 3. "Run the model": advance, sample, finish.
        for spec, req, num_new in scheduled:
            req.num_computed_tokens += num_new
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk: no token sampled yet
            if req.num_output_tokens >= spec.max_output_tokens:
                t = perf()
                m.free(req)
                secs["free"] += perf() - t
                calls["free"] += 1
                running.remove((spec, req))
                res.finished += 1
                continue
            req.append_output_token_ids(_output_token(spec.request_id, req.num_tokens))
        if check_every and step % check_every == 0:
            m.check_invariants()
        res.series.append(
            (step, m.usage, m.block_pool.get_num_free_blocks(), len(running), len(waiting))
        )
        res.totals.append((res.hit_tokens, res.prompt_tokens, res.preemptions))
        step += 1
    res.steps = step
    res.digest = sha.hexdigest()
    return res
