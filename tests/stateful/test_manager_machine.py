"""Model-based test of ``kvcache.KVCacheManager`` against ``spec.KVCacheManager``.

The machine plays vLLM 0.25.1's scheduler (``vllm/v1/core/sched/scheduler.py``):
it admits waiting requests with their prefix hits, schedules running ones
(chunked prefill, speculative drafts, lookahead slots), advances them after a
step, preempts, finishes, loads KV from a (pretend) connector and reports
failed loads. Every manager call is made on both managers with the same
arguments; one ``Request`` object is shared by both (neither mutates it, the
machine does, as the scheduler would).

Run it with ``HYPOTHESIS_PROFILE=nightly`` for the long run (profiles:
``tests/stateful/conftest.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
import pprint
from collections import deque
from typing import Any, ClassVar

import hypothesis.strategies as st
from hypothesis import assume, event, note, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import kvcache
import spec
from kvcache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    LoRARequest,
    MultiModalFeatureSpec,
    PlaceholderRange,
    PrefixCacheStats,
    Request,
    RequestStatus,
    get_request_block_hasher,
    sha256,
)
from spec import effectiveness, pure

from .runner import run_machine

ALPHABET = 3  # token ids 0..2: a tiny alphabet, so prefixes repeat and hits happen
MAX_LIVE_REQUESTS = 6
MAX_PROMPT_LEN = 24
WAITING_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
FINISHED_STATES = sorted(s for s in RequestStatus if RequestStatus.is_finished(s))
# Weighted choices (repeats make the common case common). Extra keys are drawn
# for half the new requests only, so unrelated requests still share prefixes.
EXTRA_KEYS: dict[str, list[Any]] = {
    "lora": ["", "", "lora-a", "lora-b"],
    "salt": ["", "salt"],
    "num_mm": [0, 0, 1, 2],
}
LORA_IDS = {"lora-a": 1, "lora-b": 2}
ADMISSION_MODES = ["async_load", "connector_not_ready", "sync", "sync", "sync", "sync"]
RELEASE_MODES = ["defer", "free", "pop_and_free"]


# ---------------------------------------------------------------- normalisation


def _eagle_windows(lookup: effectiveness.Lookup) -> list[tuple[int, effectiveness.Group]]:
    """The sliding-window groups under EAGLE, with their index in ``lookup.groups``."""
    return [(i, g) for i, g in enumerate(lookup.groups)
            if g.kind.startswith("sliding_window") and g.eagle]


def _short_run_allows(lookup: effectiveness.Lookup, L: int) -> bool:
    """vLLM's flaw 18 as a rule on ``L``: false when a sliding-window EAGLE group whose
    blocks are smaller than the alignment, searched as vLLM searches it at ``L`` (one
    EAGLE step further), finds no window run and so takes its short-run path, which
    aligns the leading run before the EAGLE drop and then again, ending below ``L``,
    where dropping first and aligning once (vLLM's other path) reaches ``L``. The
    search is the spec's ``pure.sliding_window_hit_range``, which conformance holds
    to real vLLM; the correct value is computed here from the leading run alone."""
    held = lookup.holdings("pool")
    for i, group in _eagle_windows(lookup):
        size, unit = group.block_size, lookup.alignment
        if size >= unit:
            continue
        step = lookup.eagle_step[i] if lookup.eagle_step else size
        cap = (L + step) // size  # blocks the search sees at this candidate
        cached = {k for k in range(cap) if (k + 1) * size in held[i]}
        needed = pure.num_contiguous_blocks_for_hit(group.span, size, True)
        first, found = pure.sliding_window_hit_range(range(cap), cached, cap, needed, True,
                                                     size, unit)
        lead = 0
        while lead in cached:
            lead += 1
        dropped_first = pure.align_num_hit_blocks(max(lead - 1, 0), size, unit)
        if first == 0 and found * size < L <= dropped_first * size:
            return False
    return True


def _one_token_window_allows(lookup: effectiveness.Lookup, L: int) -> bool:
    """vLLM's flaw 19 as a rule on ``L``: in a hybrid layout, a candidate the fixed
    point reaches in a later round is searched again, without the EAGLE drop, for
    every group whose drop it has verified; a one-token window then needs its block
    ending at ``L``, which its hit (anchored at the EAGLE block after ``L``) never
    read. Stated for every hybrid layout, so a one-token window's hit at ``L`` is
    excused without that block even where vLLM needs no second round."""
    if len(lookup.groups) < 2:
        return True
    held = lookup.holdings("pool")
    return all(L == 0 or L in held[i] for i, g in _eagle_windows(lookup) if g.span <= 1)


#: vLLM's known lookup flaws, each a rule a realized hit obeys in every release
#: (docs/divergences.md, "More quirks" 18 and 19). Not ``effectiveness.LOSS_RULES``:
#: those are what a correct manager meets; these are what vLLM gets wrong.
KNOWN_FLAWS: tuple[effectiveness.LossRule, ...] = (
    effectiveness.LossRule(
        "vllm_short_run_align_before_drop",
        "a sliding-window EAGLE group's short leading run is aligned before its EAGLE "
        "drop and after it, one alignment unit short (flaw 18)", _short_run_allows),
    effectiveness.LossRule(
        "vllm_one_token_window_research",
        "a one-token window's verified EAGLE group, searched again without the drop in a "
        "later round of the hybrid fixed point, needs its block ending at the hit (flaw 19)",
        _one_token_window_allows),
)


def known_flaws(lookup: effectiveness.Lookup, realized: int) -> list[str]:
    """The names of vLLM's known flaws (``KNOWN_FLAWS``) that explain a lookup's
    unexplained loss: judged again with them as rules after ``LOSS_RULES``, the lookup
    loses nothing more. Empty when some loss remains, which is then a finding."""
    verdict = effectiveness.explain(lookup, realized, effectiveness.LOSS_RULES + KNOWN_FLAWS)
    if verdict.unexplained:
        return []
    return [rule.name for rule in KNOWN_FLAWS if rule.name in verdict.losses]


def block_ids(blocks: Any) -> tuple[list[int], ...] | None:
    """``KVCacheBlocks`` (either package) -> ids per group; None stays None."""
    return None if blocks is None else blocks.get_block_ids()


def ids_of(blocks: list[Any]) -> list[int]:
    """kvcache's ``KVCacheBlock`` list (or spec's ids) -> ids."""
    return [b if isinstance(b, int) else b.block_id for b in blocks]


def events_of(events: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(type(e).__name__, dataclasses.asdict(e)) for e in events]


def stats_of(stats: Any) -> dict[str, Any] | None:
    return None if stats is None else dataclasses.asdict(stats)


def draw_tokens(data: st.DataObject, min_size: int, max_size: int, label: str) -> list[int]:
    """A token list drawn as its length and one integer (its base-3 digits): two
    choices instead of one per token, so examples can run many more steps
    before Hypothesis' per-example choice budget ends them."""
    size = data.draw(st.integers(min_size, max_size), label=f"len({label})")
    code = data.draw(st.integers(0, ALPHABET**size - 1), label=label)
    return [code // ALPHABET**i % ALPHABET for i in range(size)]


def by_arrival(request_ids: list[str]) -> list[str]:
    """Request ids ("r<n>") oldest first."""
    return sorted(request_ids, key=lambda rid: int(rid[1:]))


def outcome(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """("ok", result) or ("raise", exception type): to compare failing calls."""
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as e:
        return "raise", type(e)


def refused(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn``'s result, or the ValueError it raised (where vLLM asserts)."""
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        return e


def state_diff(expected: dict[str, Any], actual: dict[str, Any]) -> str:
    """Readable unified diff of two abstract states (spec first)."""
    lines = []
    for key in sorted(set(expected) | set(actual)):
        if expected.get(key) != actual.get(key):
            a = pprint.pformat(expected.get(key), width=100).splitlines()
            b = pprint.pformat(actual.get(key), width=100).splitlines()
            lines.append(f"--- {key}")
            lines.extend(difflib.unified_diff(a, b, "spec", "kvcache", lineterm="", n=2))
    return "\n".join(lines)


# ---------------------------------------------------------------- the machine


class ManagerMachine(RuleBasedStateMachine):
    """Compares kvcache to spec, assumed perfect.

    ``self.spec`` and ``self.impl`` are the two managers; every rule makes the
    same calls on both and compares what they return, and the invariant compares
    their whole abstract state. The machine's own state is the scheduler's:
    ``requests`` (id -> Request; status and computed-token count live on the
    Request), ``running`` (the running queue, oldest first), ``scheduled``
    (id -> tokens of the step in flight), ``external`` (id -> hit tokens, for
    requests whose step in flight loads KV from a connector) and ``deferred``
    (popped block lists not yet returned to each pool).

    Nothing compared is shared: the Request's ``block_hashes`` come from kvcache's
    hasher, while spec hashes the request itself (``spec/vocab.py``), so the pool
    keys of the abstract states, the events (spec's own classes, compared field by
    field) and the stats (spec's own ``PrefixCacheStats``) are spec's values; the
    invariant also compares each live request's hashes with spec's, byte for byte.
    """

    spec_manager_cls: Any = spec.KVCacheManager
    impl_manager_cls: Any = kvcache.KVCacheManager
    #: Switches of the requests' block hasher (a release profile's tagged_extra_keys,
    #: mm_keys_by_window; tests/stateful/test_profile_machines.py sets them).
    hasher_switches: ClassVar[dict[str, bool]] = {}
    #: Steps and examples run in this process (read by the test and the report hook).
    counters: ClassVar[dict[str, int]] = {"steps": 0, "examples": 0}

    def __init__(self) -> None:
        super().__init__()
        self.requests: dict[str, Request] = {}
        self.live: dict[str, Request] = {}
        self.running: list[str] = []
        self.scheduled: dict[str, int] = {}
        self.external: dict[str, int] = {}
        self.deferred: deque[tuple[list[int], list[Any]]] = deque()
        self.families: set[tuple[tuple[int, ...], str, str, tuple[Any, ...]]] = set()
        self.next_id = 0
        self.spec_state: dict[str, Any] = {}  # as of the last invariant check

    # ------------------------------------------------------------ setup

    @initialize(
        num_blocks=st.integers(2, 24),
        block_size=st.integers(1, 4),
        enable_caching=st.sampled_from([False, True, True]),
        watermark=st.sampled_from([0.0, 0.1, 0.3]),
        use_eagle=st.booleans(),
        log_stats=st.booleans(),
        max_model_len=st.integers(8, 64),
        max_num_batched_tokens=st.integers(2, 64),
        data=st.data(),
    )
    def init_managers(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        watermark: float,
        use_eagle: bool,
        log_stats: bool,
        max_model_len: int,
        max_num_batched_tokens: int,
        data: st.DataObject,
    ) -> None:
        self.counters["examples"] += 1
        # vLLM refuses to start unless the pool holds one max_model_len sequence.
        max_model_len = max(2, min(max_model_len, (num_blocks - 1) * block_size))
        layer = FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=8, dtype="float16"
        )
        kwargs: dict[str, Any] = dict(
            max_model_len=max_model_len,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_caching=enable_caching,
            use_eagle=use_eagle,
            log_stats=log_stats,
            enable_kv_cache_events=True,
            watermark=watermark,
        )
        note(f"KVCacheManager(num_blocks={num_blocks}, block_size={block_size}, {kwargs})")

        def config() -> KVCacheConfig:
            return KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer.0"], layer)])

        self.spec = self.spec_manager_cls(config(), **kwargs)
        self.impl = self.impl_manager_cls(config(), **kwargs)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.token_budget = max_num_batched_tokens
        self.hasher = get_request_block_hasher(block_size, sha256, **self.hasher_switches)
        # Start with a few waiting requests, so the first steps have work to do.
        for _ in range(data.draw(st.integers(1, 3), label="num_first_requests")):
            self.new_request(data)

    # ------------------------------------------------------------ views of the machine

    def ids_with(self, *states: RequestStatus, computed: bool | None = None) -> list[str]:
        return sorted(
            rid
            for rid, r in self.live.items()
            if r.status in states and (computed is None or (r.num_computed_tokens > 0) == computed)
        )

    def live_ids(self) -> list[str]:
        return sorted(self.live)

    def idle_running_ids(self) -> list[str]:
        return sorted(rid for rid in self.running if rid not in self.scheduled)

    def can_add(self) -> bool:
        return len(self.live) < MAX_LIVE_REQUESTS

    def has_fresh_waiting(self) -> bool:
        return bool(self.ids_with(*WAITING_STATES, computed=False))

    def has_loaded_waiting(self) -> bool:
        return bool(self.ids_with(*WAITING_STATES, computed=True))

    def has_loading(self) -> bool:
        return bool(self.ids_with(RequestStatus.WAITING_FOR_REMOTE_KVS))

    def has_idle_running(self) -> bool:
        return bool(self.idle_running_ids())

    def has_scheduled(self) -> bool:
        return bool(self.scheduled)

    def has_running(self) -> bool:
        return bool(self.running)

    def has_live(self) -> bool:
        return bool(self.live)

    def has_holders(self) -> bool:
        """Some live request holds blocks (queries about tables have something to see)."""
        return any(self.spec_state["req_to_blocks"][0].get(rid) for rid in self.live)

    def has_cached(self) -> bool:
        return bool(self.spec_state["cached"])

    def has_events(self) -> bool:
        return bool(self.spec.block_pool.kv_event_queue)

    def has_new_block_ids(self) -> bool:
        return any(self.spec_state["new_block_ids"])

    def has_stats(self) -> bool:
        """Lookups were recorded (with log_stats), or requests run (without)."""
        stats = self.spec.prefix_cache_stats
        if stats is None:
            return self.has_running()
        return stats_of(stats) != stats_of(PrefixCacheStats())  # spec's own class: by fields

    def has_requests(self) -> bool:
        return bool(self.requests)

    def has_deferred(self) -> bool:
        return bool(self.deferred)

    # ------------------------------------------------------------ shared steps

    def draw_chunk(self, data: st.DataObject, num_wanted: int) -> int:
        """Tokens the scheduler gives a request this step: all it wants within the
        token budget, or a shorter chunk (long-prefill threshold, spent budget)."""
        num_max = min(num_wanted, self.token_budget)
        if data.draw(st.booleans(), label="whole"):
            return num_max
        return data.draw(st.integers(1, num_max), label="chunk")

    def compare_allocation(self, request: Request, **kwargs: Any) -> bool:
        """allocate_slots on both with the same arguments, except that each side
        gets its own hits (``hits=(spec_hits, impl_hits)``); True if granted."""
        spec_hits, impl_hits = kwargs.pop("hits", (None, None))
        shown = {k: v for k, v in kwargs.items() if v}
        kw = kwargs
        spec_new = refused(self.spec.allocate_slots, request, new_computed_blocks=spec_hits, **kw)
        impl_new = refused(self.impl.allocate_slots, request, new_computed_blocks=impl_hits, **kw)
        if isinstance(spec_new, ValueError) or isinstance(impl_new, ValueError):
            # A step vLLM asserts on (the engine stops there; e.g. a Mamba prefill
            # checkpoint past the hashed tokens when drafts outnumber a hash block):
            # both sides refuse it with ValueError and agree on what is left.
            note(f"allocate_slots({request.request_id}, {shown}) -> {spec_new!r} / {impl_new!r}")
            assert isinstance(spec_new, ValueError) and isinstance(impl_new, ValueError)
            event("allocate_slots", "refused as vLLM asserts")
            self.states_agree()
            assume(False)  # no engine goes on from here
        note(f"allocate_slots({request.request_id}, {shown}) -> {block_ids(spec_new)}")
        assert block_ids(impl_new) == block_ids(spec_new)
        event("allocate_slots", "refused" if spec_new is None else "granted")
        return spec_new is not None

    def release(self, request: Request, how: str) -> None:
        """Release a request's blocks as the scheduler does: ``free``, or
        ``pop_blocks_for_free`` and ``block_pool.free_blocks(reversed(...))``
        now (``pop_and_free``) or after a later step (``defer``)."""
        rid = request.request_id
        self.scheduled.pop(rid, None)
        self.external.pop(rid, None)
        if rid in self.running:
            self.running.remove(rid)
        if how == "free":
            self.spec.free(request)
            self.impl.free(request)
            return
        spec_blocks = self.spec.pop_blocks_for_free(request)
        impl_blocks = self.impl.pop_blocks_for_free(request)
        note(f"pop_blocks_for_free({rid}) -> {spec_blocks} ({how})")
        assert ids_of(impl_blocks) == spec_blocks
        if how == "pop_and_free":
            self.spec.block_pool.free_blocks(reversed(spec_blocks))
            self.impl.block_pool.free_blocks(reversed(impl_blocks))
        elif spec_blocks:
            self.deferred.append((spec_blocks, impl_blocks))

    def preempt_request(self, request: Request, how: str) -> None:
        """``_preempt_request``: release the blocks and send the request back to waiting."""
        note(f"preempt({request.request_id}, {how})")
        self.release(request, how)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1

    def finish(self, request: Request, status: RequestStatus, how: str) -> None:
        """``_free_request``: the request ends (any state) and its blocks go back."""
        note(f"finish({request.request_id}, {status.name}, {how})")
        self.release(request, how)
        request.status = status
        del self.live[request.request_id]
        self.remember(request)

    def start_running(self, request: Request, num_new_tokens: int) -> None:
        self.remember(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request.request_id)
        self.scheduled[request.request_id] = num_new_tokens

    def remember(self, request: Request) -> None:
        """Offer the request's tokens and keys as a prefix for later requests."""
        lora = request.lora_request
        self.families.add(
            (
                tuple(request.all_token_ids),
                lora.lora_name if lora else "",
                request.cache_salt or "",
                tuple(
                    (f.identifier, f.mm_position.offset, f.mm_position.length)
                    for f in request.mm_features
                ),
            )
        )

    def new_request(self, data: st.DataObject) -> None:
        """Draw a request; half the time it extends a prefix of a sequence run
        earlier, with that sequence's LoRA, salt and multimodal items."""
        max_len = min(self.max_model_len - 1, getattr(self, "max_prompt_len", MAX_PROMPT_LEN))
        if self.families and data.draw(st.booleans(), label="share_prefix"):
            base, lora_name, cache_salt, base_mm = data.draw(
                st.sampled_from(sorted(self.families)), label="family"
            )
            if data.draw(st.booleans(), label="repeat"):
                tokens = list(base[:max_len])  # the same prompt again: whole-prompt hits
            else:
                cut = data.draw(st.integers(0, len(base)), label="cut")
                tokens = (list(base[:cut]) + draw_tokens(data, 1, max_len, "tail"))[:max_len]
            mm = [m for m in base_mm if m[1] + m[2] <= len(tokens)]
        else:
            tokens = draw_tokens(data, 1, max_len, "tokens")
            lora_name = cache_salt = ""
            mm = []
            start = 0
            num_mm = 0
            if data.draw(st.booleans(), label="extra_keys"):
                lora_name = data.draw(st.sampled_from(EXTRA_KEYS["lora"]), label="lora")
                cache_salt = data.draw(st.sampled_from(EXTRA_KEYS["salt"]), label="cache_salt")
                num_mm = data.draw(st.sampled_from(EXTRA_KEYS["num_mm"]), label="num_mm")
            for _ in range(num_mm):
                if start >= len(tokens):
                    break
                offset = data.draw(st.integers(start, len(tokens) - 1), label="mm_offset")
                length = data.draw(st.integers(1, len(tokens) - offset), label="mm_length")
                identifier = data.draw(st.sampled_from(["img-a", "img-b"]), label="mm_id")
                mm.append((identifier, offset, length))
                start = offset + length
        skip_read = data.draw(st.integers(0, 7), label="skip_read") == 7
        rid = f"r{self.next_id}"
        self.next_id += 1
        request = Request(
            rid,
            tokens,
            block_hasher=self.hasher,
            cache_salt=cache_salt or None,
            lora_request=LoRARequest(lora_name, LORA_IDS[lora_name]) if lora_name else None,
            mm_features=[
                MultiModalFeatureSpec(identifier, PlaceholderRange(offset, length))
                for identifier, offset, length in mm
            ],
            skip_reading_prefix_cache=skip_read,
        )
        note(
            f"{rid} = Request({tokens}, lora={lora_name!r}, salt={cache_salt!r}, mm={mm}, "
            f"skip_reading_prefix_cache={skip_read})"
        )
        self.requests[rid] = self.live[rid] = request

    # ------------------------------------------------------------ admission

    @precondition(lambda self: self.can_add())
    @rule(data=st.data())
    def add_request(self, data: st.DataObject) -> None:
        """A request arrives (the scheduler's add_request: no manager call yet)."""
        self.new_request(data)

    @precondition(lambda self: self.has_fresh_waiting())
    @rule(data=st.data())
    def get_computed_blocks(self, data: st.DataObject) -> None:
        """Admit waiting requests in arrival order (the scheduler's waiting loop):
        find each one's prefix hits, then allocate_slots with them, synchronously
        (maybe with connector tokens) or for an async KV load; or pass over it
        (the connector is not ready). The loop stops at the first refusal. The
        step in flight may complete first."""
        if self.scheduled and data.draw(st.booleans(), label="step_done"):
            self.complete_step(data)
        for rid in by_arrival(self.ids_with(*WAITING_STATES, computed=False)):
            if not data.draw(st.booleans(), label=f"consider {rid}"):
                continue
            request = self.requests[rid]
            spec_hits, spec_num_hits = self.spec.get_computed_blocks(request)
            impl_hits, impl_num_hits = self.impl.get_computed_blocks(request)
            note(f"get_computed_blocks({rid}) -> {block_ids(spec_hits)}, {spec_num_hits}")
            assert (block_ids(impl_hits), impl_num_hits) == (block_ids(spec_hits), spec_num_hits)
            event("prefix hit", "yes" if spec_num_hits else "no")
            self.judge_lookup(request, spec_num_hits)
            mode = data.draw(st.sampled_from(ADMISSION_MODES), label="mode")
            if mode == "connector_not_ready":
                continue
            if not self.admit(data, request, (spec_hits, impl_hits), spec_num_hits, mode):
                return

    def judge_lookup(self, request: Request, num_hits: int) -> None:
        """The lookup's effectiveness (``spec.effectiveness``, from the spec's pool):
        no hit past what the pool holds, no loss below what the named rules leave.
        Equality cannot see a loss both sides share; this can. The known release
        flaws: vLLM 0.25.1's Mamba group under EAGLE peeks a block past its hit
        (``mamba_no_eagle_margin`` off; ledger ``bug-mamba-eagle-long-hit``), and every
        release's sliding-window EAGLE losses, stated as rules (``KNOWN_FLAWS``;
        docs/divergences.md, "More quirks" 18 and 19): a loss they explain is named, any
        other loss fails."""
        lookup = self.spec.effectiveness_lookup(request)
        if lookup is None:
            return
        verdict = effectiveness.explain(lookup, num_hits)
        event("lookup loss", ",".join(verdict.losses) or "none")
        if verdict.false_hit and self.known_false_hit(lookup):
            event("lookup loss", "known false hit (0.25.1 Mamba + EAGLE)")
            return
        assert not verdict.false_hit, f"{request.request_id}: false hit {verdict}"
        flaws = known_flaws(lookup, num_hits) if verdict.unexplained else []
        if flaws:
            event("lookup loss", "known vLLM flaw: " + ",".join(flaws))
            return
        assert not verdict.unexplained, f"{request.request_id}: unexplained loss {verdict}"

    def known_false_hit(self, lookup: Any) -> bool:
        """A release flaw the profile reproduces (see ``judge_lookup``): a Mamba group
        under EAGLE in 0.25.1. Under EAGLE means ``use_eagle``, or the group's own
        ``is_eagle_group`` flag, which 0.25.1 honours without ``use_eagle`` (ledger
        ``eagle-flag-needs-use-eagle``): CI's seed 7557259882434308570 met it with a
        'none' Mamba group so flagged beside full attention; after the full group's
        block was evicted, the lookup hit 2 tokens holding no full-attention block,
        on real vLLM 0.25.1 too."""
        profile = getattr(self.spec, "profile", None)
        return not getattr(profile, "mamba_no_eagle_margin", True) and any(
            g.kind == "mamba" and (g.eagle or self.spec.use_eagle) for g in lookup.groups
        )

    def admit(
        self, data: st.DataObject, request: Request, hits: Any, num_hits: int, mode: str
    ) -> bool:
        num_tokens = request.num_tokens
        # The scheduler passes has_scheduled_reqs=bool(self.running) (enables the watermark).
        arguments: dict[str, Any] = dict(has_scheduled_reqs=bool(self.running))
        if mode == "sync":
            # Hits and connector tokens leave at least the last token to compute.
            num_external = 0
            if data.draw(st.booleans(), label="unusual"):
                num_external = data.draw(st.integers(0, num_tokens - 1 - num_hits), label="ext")
                arguments.update(
                    num_lookahead_tokens=data.draw(st.integers(0, 3), label="lookahead"),
                    full_sequence_must_fit=data.draw(st.booleans(), label="full_seq_must_fit"),
                    has_scheduled_reqs=data.draw(st.booleans(), label="has_scheduled_reqs"),
                )
            num_computed = num_hits + num_external
            num_new_tokens = self.draw_chunk(data, num_tokens - num_computed)
        else:
            num_external = data.draw(st.integers(1, num_tokens - num_hits), label="external")
            num_computed = num_hits + num_external
            num_new_tokens = 0
            arguments.update(
                delay_cache_blocks=True,
                reserved_blocks=data.draw(st.integers(0, 3), label="reserved"),
                full_sequence_must_fit=data.draw(st.booleans(), label="full_seq_must_fit"),
                has_scheduled_reqs=data.draw(st.booleans(), label="has_scheduled_reqs"),
            )
        granted = self.compare_allocation(
            request,
            hits=hits,
            num_new_tokens=num_new_tokens,
            num_new_computed_tokens=num_hits,
            num_external_computed_tokens=num_external,
            **arguments,
        )
        if not granted:
            return False
        request.num_computed_tokens = num_computed
        if mode == "async_load":
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            return True
        self.start_running(request, num_new_tokens)
        if num_external:
            self.external[request.request_id] = num_hits
        return True

    @precondition(lambda self: self.has_loading())
    @rule(data=st.data())
    def cache_blocks(self, data: st.DataObject) -> None:
        """An async KV load ends (``_update_waiting_for_remote_kv``): cache what
        arrived; after a failure only the blocks before the first invalid one."""
        rid = data.draw(st.sampled_from(self.ids_with(RequestStatus.WAITING_FOR_REMOTE_KVS)))
        request = self.requests[rid]
        failed = data.draw(st.booleans(), label="failed")
        if failed:
            first_invalid = data.draw(
                st.integers(0, (request.num_computed_tokens - 1) // self.block_size),
                label="first_invalid",
            )
            request.num_computed_tokens = first_invalid * self.block_size
        note(f"kv load of {rid} ends (failed={failed}), {request.num_computed_tokens} computed")
        if failed and request.num_computed_tokens == 0:
            self.spec.free(request)
            self.impl.free(request)
        else:
            self.spec.cache_blocks(request, request.num_computed_tokens)
            self.impl.cache_blocks(request, request.num_computed_tokens)
        if request.num_computed_tokens == request.num_tokens:
            request.num_computed_tokens -= 1  # the last token is recomputed for its logits
        request.status = (
            RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
        )

    @precondition(lambda self: self.has_loaded_waiting())
    @rule(data=st.data())
    def allocate_slots_after_kv_load(self, data: st.DataObject) -> None:
        """Schedule a waiting request whose KV was loaded: no new hits."""
        rid = data.draw(st.sampled_from(self.ids_with(*WAITING_STATES, computed=True)))
        request = self.requests[rid]
        num_new_tokens = self.draw_chunk(data, request.num_tokens - request.num_computed_tokens)
        granted = self.compare_allocation(
            request,
            hits=(self.spec.empty_kv_cache_blocks, self.impl.empty_kv_cache_blocks),
            num_new_tokens=num_new_tokens,
            num_lookahead_tokens=data.draw(st.integers(0, 3), label="lookahead"),
            full_sequence_must_fit=data.draw(st.booleans(), label="full_sequence_must_fit"),
            has_scheduled_reqs=data.draw(st.booleans(), label="has_scheduled_reqs"),
        )
        if granted:
            self.start_running(request, num_new_tokens)

    # ------------------------------------------------------------ running requests

    @precondition(lambda self: self.has_running())
    @rule(data=st.data())
    def allocate_slots(self, data: st.DataObject) -> None:
        """Schedule running requests in queue order (the scheduler's running loop):
        each one's next prefill chunk, or its decode with draft tokens. When
        refused, preempt the newest running request and retry, until it fits or
        the request preempted itself, which ends the loop. The step in flight
        completes first, unless the scheduler runs ahead (async scheduling)."""
        if not self.has_idle_running() or data.draw(st.booleans(), label="step_done"):
            self.complete_step(data)
        for rid in list(self.running):
            if rid in self.scheduled or rid not in self.running:
                continue
            if not data.draw(st.booleans(), label=f"schedule {rid}"):
                continue
            if not self.schedule_running(data, self.requests[rid]):
                return

    def schedule_running(self, data: st.DataObject, request: Request) -> bool:
        computed, num_tokens = request.num_computed_tokens, request.num_tokens
        decoding = computed >= num_tokens - 1
        num_drafts = data.draw(st.integers(0, 3), label="drafts") if decoding else 0
        # The scheduler keeps positions below max_model_len (one token sampled per step).
        max_new = min(num_tokens + num_drafts - computed, self.max_model_len - computed - 1)
        num_new_tokens = self.draw_chunk(data, max_new)
        arguments: dict[str, Any] = dict(num_new_tokens=num_new_tokens)
        if data.draw(st.booleans(), label="unusual"):
            arguments.update(
                num_lookahead_tokens=data.draw(st.integers(0, 3), label="lookahead"),
                delay_cache_blocks=data.draw(st.booleans(), label="delay_cache_blocks"),
                full_sequence_must_fit=data.draw(st.booleans(), label="full_sequence_must_fit"),
                reserved_blocks=data.draw(st.integers(0, 3), label="reserved"),
                has_scheduled_reqs=data.draw(st.booleans(), label="has_scheduled_reqs"),
            )
        while not self.compare_allocation(request, **arguments):
            victim = self.requests[self.running[-1]]
            self.preempt_request(victim, data.draw(st.sampled_from(RELEASE_MODES), label="how"))
            if victim is request:
                return False
        self.scheduled[request.request_id] = num_new_tokens
        return True

    @precondition(lambda self: self.has_scheduled())
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        """The model step completes for every scheduled request
        (``update_from_output``): computed counts advance; past the prompt a
        request samples one token plus its accepted drafts (rejected drafts are
        un-computed). A connector load may have failed: the request then falls
        back to its first invalid block, whose blocks onwards may be evicted."""
        self.complete_step(data)

    def complete_step(self, data: st.DataObject) -> None:
        for rid in sorted(self.scheduled):
            request = self.requests[rid]
            num_scheduled = self.scheduled.pop(rid)
            num_hit_tokens = self.external.pop(rid, None)
            if num_hit_tokens is not None and data.draw(st.booleans(), label="load_failed"):
                self.fail_kv_load(data, request, num_hit_tokens)
                continue
            computed, num_tokens = request.num_computed_tokens, request.num_tokens
            if computed + num_scheduled < num_tokens:
                request.num_computed_tokens = computed + num_scheduled
                note(f"step {rid}: prefill chunk, {request.num_computed_tokens} computed")
                continue
            num_drafts = computed + num_scheduled - num_tokens
            max_accepted = min(num_drafts, self.max_model_len - num_tokens - 1)
            num_accepted = data.draw(st.integers(0, max(max_accepted, 0)), label="accepted")
            new_tokens = draw_tokens(data, num_accepted + 1, num_accepted + 1, "sampled")
            request.num_computed_tokens = num_tokens + num_accepted
            request.append_output_token_ids(new_tokens)
            note(f"step {rid}: sampled {new_tokens}, {request.num_computed_tokens} computed")
            if request.num_tokens >= self.max_model_len:
                self.finish(request, RequestStatus.FINISHED_LENGTH_CAPPED, "free")

    def fail_kv_load(self, data: st.DataObject, request: Request, num_hit_tokens: int) -> None:
        """``_update_requests_with_invalid_blocks`` for a synchronous load."""
        first_loaded = num_hit_tokens // self.block_size
        last_loaded = (request.num_computed_tokens - 1) // self.block_size
        first_invalid = data.draw(st.integers(first_loaded, last_loaded), label="first_invalid")
        request.num_computed_tokens = first_invalid * self.block_size
        (table,) = self.spec.get_block_ids(request.request_id)
        to_evict = set(table[first_invalid:])
        evict = data.draw(st.booleans(), label="fail_policy")
        note(f"kv load of {request.request_id} failed at block {first_invalid}, evict={evict}")
        if evict:
            note(f"evict_blocks({to_evict})")
            self.spec.evict_blocks(to_evict)
            self.impl.evict_blocks(to_evict)

    @precondition(lambda self: self.has_running())
    @rule(data=st.data(), how=st.sampled_from(RELEASE_MODES))
    def preempt(self, data: st.DataObject, how: str) -> None:
        """Preempt a running request (``_preempt_request``)."""
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.preempt_request(self.requests[rid], how)

    @precondition(lambda self: self.has_live())
    @rule(
        data=st.data(),
        status=st.sampled_from(FINISHED_STATES),
        how=st.sampled_from(RELEASE_MODES),
    )
    def free(self, data: st.DataObject, status: RequestStatus, how: str) -> None:
        """Finish or abort a request in any state (``_free_request``)."""
        self.finish(self.requests[data.draw(st.sampled_from(self.live_ids()))], status, how)

    @precondition(lambda self: self.has_deferred())
    @rule()
    def free_deferred_blocks(self) -> None:
        """The step fencing the oldest deferred free completed
        (``_drain_deferred_frees``): ``block_pool.free_blocks(reversed(blocks))``."""
        spec_blocks, impl_blocks = self.deferred.popleft()
        note(f"block_pool.free_blocks(reversed({spec_blocks}))")
        self.spec.block_pool.free_blocks(reversed(spec_blocks))
        self.impl.block_pool.free_blocks(reversed(impl_blocks))

    @precondition(lambda self: self.has_cached())
    @rule(data=st.data())
    def evict_blocks(self, data: st.DataObject) -> None:
        """evict_blocks with any valid ids, the null block's included."""
        to_evict = set(
            data.draw(st.lists(st.integers(0, self.num_blocks - 1), max_size=2), label="ids")
        )
        note(f"evict_blocks({to_evict})")
        self.spec.evict_blocks(to_evict)
        self.impl.evict_blocks(to_evict)

    # ------------------------------------------------------------ queries and housekeeping

    @precondition(lambda self: self.has_running())
    @rule()
    def new_step_starts(self) -> None:
        note("new_step_starts()")
        self.spec.new_step_starts()
        self.impl.new_step_starts()

    @precondition(lambda self: self.has_cached())
    @rule()
    def reset_prefix_cache(self) -> None:
        spec_ok = self.spec.reset_prefix_cache()
        impl_ok = self.impl.reset_prefix_cache()
        note(f"reset_prefix_cache() -> {spec_ok}")
        assert impl_ok == spec_ok
        event("reset_prefix_cache", str(spec_ok))

    @precondition(lambda self: self.has_events())
    @rule()
    def take_events(self) -> None:
        spec_events = events_of(self.spec.take_events())
        impl_events = events_of(self.impl.take_events())
        note(f"take_events() -> {[name for name, _ in spec_events]}")
        assert impl_events == spec_events

    @precondition(lambda self: self.has_new_block_ids())
    @rule()
    def take_new_block_ids(self) -> None:
        spec_ids = self.spec.take_new_block_ids()
        impl_ids = self.impl.take_new_block_ids()
        note(f"take_new_block_ids() -> {spec_ids}")
        assert impl_ids == spec_ids

    @precondition(lambda self: self.has_holders())
    @rule(data=st.data())
    def get_num_common_prefix_blocks(self, data: st.DataObject) -> None:
        """Any live request's id (the scheduler passes its first running one)."""
        rid = data.draw(st.sampled_from(self.live_ids()))
        spec_num = self.spec.get_num_common_prefix_blocks(rid)
        impl_num = self.impl.get_num_common_prefix_blocks(rid)
        note(f"get_num_common_prefix_blocks({rid}) -> {spec_num}")
        assert impl_num == spec_num
        event("common prefix", "yes" if spec_num[0] else "no")

    @precondition(lambda self: self.has_stats())
    @rule()
    def make_prefix_cache_stats(self) -> None:
        spec_stats = stats_of(self.spec.make_prefix_cache_stats())
        impl_stats = stats_of(self.impl.make_prefix_cache_stats())
        note(f"make_prefix_cache_stats() -> {spec_stats}")
        assert impl_stats == spec_stats

    @precondition(lambda self: self.has_holders())
    @rule()
    def usage(self) -> None:
        spec_usage = self.spec.usage
        impl_usage = self.impl.usage
        note(f"usage -> {spec_usage}")
        assert impl_usage == spec_usage

    @precondition(lambda self: self.has_holders())
    @rule(data=st.data())
    def get_block_ids(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from([*sorted(self.requests), "unknown"]))
        spec_ids = self.spec.get_block_ids(rid)
        impl_ids = self.impl.get_block_ids(rid)
        note(f"get_block_ids({rid}) -> {spec_ids}")
        assert impl_ids == spec_ids
        assert block_ids(self.impl.get_blocks(rid)) == block_ids(self.spec.get_blocks(rid))

    @precondition(lambda self: self.has_holders())
    @rule(data=st.data())
    def get_block_ids_for_computed_tokens(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        num_computed = data.draw(st.integers(0, self.max_model_len), label="num_computed")
        spec_ids = self.spec.get_block_ids_for_computed_tokens(rid, num_computed)
        impl_ids = self.impl.get_block_ids_for_computed_tokens(rid, num_computed)
        note(f"get_block_ids_for_computed_tokens({rid}, {num_computed}) -> {spec_ids}")
        assert impl_ids == spec_ids

    @precondition(lambda self: self.has_holders())
    @rule(data=st.data())
    def remove_skipped_blocks(self, data: st.DataObject) -> None:
        """As ``_connector_finished`` calls it (a no-op for full attention)."""
        request = self.requests[data.draw(st.sampled_from(self.live_ids()))]
        args = (request.request_id, request.num_computed_tokens, request.num_prompt_tokens)
        note(f"remove_skipped_blocks{args}")
        self.spec.remove_skipped_blocks(*args)
        self.impl.remove_skipped_blocks(*args)

    # ------------------------------------------------------------ invalid calls

    @precondition(lambda self: self.has_holders())
    @rule(data=st.data())
    def allocate_slots_without_tokens(self, data: st.DataObject) -> None:
        """num_new_tokens=0 and no external tokens: ValueError in both."""
        request = self.requests[data.draw(st.sampled_from(self.live_ids()))]
        note(f"allocate_slots({request.request_id}, num_new_tokens=0) -> ValueError")
        spec_out = outcome(self.spec.allocate_slots, request, 0)
        impl_out = outcome(self.impl.allocate_slots, request, 0)
        assert spec_out == impl_out == ("raise", ValueError)

    @precondition(lambda self: self.has_cached())
    @rule(data=st.data())
    def evict_blocks_out_of_range(self, data: st.DataObject) -> None:
        """An id past the pool (with valid ones): ValueError in both, nothing evicted."""
        bad = data.draw(st.integers(self.num_blocks, self.num_blocks + 3), label="bad_id")
        valid = data.draw(st.lists(st.integers(1, self.num_blocks - 1), max_size=2), label="ids")
        to_evict = {bad, *valid}
        note(f"evict_blocks({to_evict}) -> ValueError")
        spec_out = outcome(self.spec.evict_blocks, to_evict)
        impl_out = outcome(self.impl.evict_blocks, to_evict)
        assert spec_out == impl_out == ("raise", ValueError)

    # ------------------------------------------------------------ the invariant

    @invariant()
    def states_agree(self) -> None:
        self.counters["steps"] += 1
        self.spec_state = spec_state = self.spec.abstract_state()
        impl_state = self.impl.abstract_state()
        assert impl_state == spec_state, "abstract states differ:\n" + state_diff(
            spec_state, impl_state
        )
        # Not part of abstract_state, but the scheduler reads it as an attribute.
        assert stats_of(self.impl.prefix_cache_stats) == stats_of(self.spec.prefix_cache_stats)
        # The requests' hashes are kvcache's (its hasher); spec computes its own.
        for rid, request in self.live.items():
            spec_hashes = self.spec.block_pool.block_hashes(request)
            assert request.block_hashes == spec_hashes, f"block hashes of {rid} differ"
        self.spec.check_invariants()
        self.impl.check_invariants()


def test_manager_machine(stateful_settings: settings, record_property: Any) -> None:
    """kvcache agrees with spec under the profile's budget (see conftest.py).

    Each run draws a fresh seed (or takes ``STATEFUL_SEED``) and names it on failure.
    """
    run_machine(ManagerMachine, stateful_settings, record_property)
