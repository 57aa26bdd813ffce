"""Bounded exhaustive comparison of kvcache with spec (assumed perfect).

Every sequence of scheduler calls up to depth k, over tiny layouts, breadth first.
A state is both managers plus the requests (one ``Request`` object shared by both,
as the scheduler would); states are deduplicated by the spec's ``abstract_state()``
plus each request's tokens, computed-token count and status, so depth k covers every
call sequence of length <= k. After every manager call both sides must return the
same thing (ids, not block objects; or raise the same error type), have equal
``abstract_state()`` and pass ``check_invariants()``; after every step the block
tables must satisfy the slot facts of ``proofs/slots.py`` (below).

Calls (one step each; ``a``/``b`` are the two request slots):
  add(slot, prompt)          a request arrives (no manager call);
  admit(slot, chunk)         get_computed_blocks, then allocate_slots with the hits and
                             1 or all remaining tokens, as the scheduler admits;
  run(slot, chunk)           allocate_slots for a running request: 1 or all remaining
                             tokens (a decode step is the 1 token sampled last step);
  free(slot)                 free (the request finishes, any state);
  preempt(slot)              free (or, where the layout says, pop_blocks_for_free and
                             the pool's free_blocks), back to waiting with nothing
                             computed;
  evict(block)               evict_blocks({block});
  reset                      reset_prefix_cache;
  new_step                   new_step_starts.
A granted allocation completes its step at once: the tokens are computed; when that
reaches the request's length, each token of the alphabet is sampled in its own branch,
and a request reaching ``max_model_len`` finishes (free). ``take_new_block_ids`` and
``take_events`` are drained and compared after every step, and
``get_num_common_prefix_blocks`` of the first running request (slot order) asked.

Slot facts, per KV-cache group: every live token (computed, not skipped by the
group's attention) has a slot inside the pool and outside the null block, and two
requests' tokens share a slot only when both computed the same full prefix block.

Each layout is searched to its own ``depth`` (a count, never a duration), so the
same commit explores the same states and makes the same calls on any machine; the
depths are sized to take about 3 minutes of one core in all.

``python -m proofs.exhaustive [--shallower N] [LAYOUT_SUBSTRING]`` prints one line per
layout; ``--shallower N`` searches every layout N steps less deep (``make verify`` runs
the search so, about 3x fewer states per step, on the compiled build too: its classes
pickle like the pure ones). The last line names the kvcache build searched;
``KVCACHE_EXPECT_COMPILED=1`` makes the pure build an error. ``--release R`` builds
both sides under R's profile; ``--layouts later|all`` takes ``LATER_LAYOUTS`` (EAGLE
drafters, whose hits drop a block and whose allocations ask a lookahead slot; a sliding
window beside Mamba, preempted by ``pop_blocks_for_free``), which reach rules of the
later releases that ``LAYOUTS`` cannot.
``--teeth`` measures what the search can see: each switch R turns on is turned back in
the spec alone, and the search must find the difference; the switches it cannot see
are printed ``NOT SEEN``.
"""

from __future__ import annotations

import pickle
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import kvcache
import spec
import spec.profile
from kvcache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    Request,
    RequestStatus,
    SlidingWindowSpec,
    get_request_block_hasher,
    sha256,
)
from proofs.slots import live_token_slot, share_slot
from spec import pure

ALPHABET = (0, 1)
PROMPTS = ((0, 1), (0, 1, 1), (1,))
SLOTS = ("a", "b")
CHUNKS = ("one", "all")
MAX_MODEL_LEN = 4
WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
ATTN: dict[str, Any] = {"num_kv_heads": 1, "head_size": 8, "dtype": "float16"}

Action = tuple[Any, ...]


class Mismatch(AssertionError):
    """kvcache and spec disagree, or an invariant or slot fact fails."""


@dataclass(frozen=True)
class Layout:
    """One tiny configuration of the managers."""

    name: str
    specs: tuple[KVCacheSpec, ...]
    num_blocks: int
    depth: int
    """Every call sequence up to this many steps is explored."""
    enable_caching: bool = True
    watermark: float = 0.0
    release: str = "0.25.1"
    """The vLLM release both managers follow (``--release``)."""
    use_eagle: bool = False
    """An EAGLE drafter: hits drop a block, and every allocation asks one lookahead slot."""
    pop_on_preempt: bool = False
    """Preempt as vLLM 0.33.0's scheduler may: ``pop_blocks_for_free``, then the pool's
    ``free_blocks`` of the popped blocks, last first (else ``free``)."""
    turned_back: str = ""
    """A switch of ``release`` turned off on the spec's side alone (``--turn-back``): the
    search must then find a difference, or the layouts cannot see that switch's rule."""

    @property
    def block_size(self) -> int:
        """The hash and scheduler block size (the smallest group block size)."""
        return min(s.block_size for s in self.specs)

    def managers(self) -> tuple[Any, Any]:
        """A fresh (spec, kvcache) manager pair."""
        groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(self.specs)]
        kwargs: dict[str, Any] = {
            "max_model_len": MAX_MODEL_LEN, "scheduler_block_size": self.block_size,
            "hash_block_size": self.block_size, "enable_caching": self.enable_caching,
            "enable_kv_cache_events": True, "watermark": self.watermark,
            "use_eagle": self.use_eagle,
        }
        off = (self.turned_back,) if self.turned_back else ()
        spec_profile = spec.profile.Profile(self.release, **dict.fromkeys(off, False))
        return (spec.KVCacheManager(KVCacheConfig(self.num_blocks, [], groups), **kwargs,
                                    profile=spec_profile),
                kvcache.KVCacheManager(KVCacheConfig(self.num_blocks, [], groups), **kwargs,
                                       profile=self.release))


def _full(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, **ATTN)


def _mamba_align(block_size: int) -> MambaSpec:
    return MambaSpec(block_size=block_size, shapes=((2,),), dtypes=("float16",),
                     mamba_cache_mode="align")


# Depths: about 3x more states per step; the hybrids (about 30 s each at depth 7 on
# one core) and the single-group layouts (deeper, cheaper per state) take similar time.
LAYOUTS = (
    Layout("full attention, block 1, 3 blocks", (_full(1),), 4, depth=8),
    Layout("full attention, block 2, 3 blocks", (_full(2),), 4, depth=8),
    Layout("full attention, block 1, 3 blocks, caching off", (_full(1),), 4, depth=9,
           enable_caching=False),
    Layout("full attention, block 1, 2 blocks, watermark 1", (_full(1),), 3, depth=9,
           watermark=0.34),
    Layout("full + sliding window 2, block 1, 4 blocks",
           (_full(1), SlidingWindowSpec(block_size=1, sliding_window=2, **ATTN)), 5, depth=7),
    # Block size 1: every prefill chunk ends on a scheduler block, as align mode requires.
    Layout("full + Mamba align, block 1, 4 blocks", (_full(1), _mamba_align(1)), 5, depth=7),
)

#: Layouts for rules of the later releases that ``LAYOUTS`` cannot reach: an EAGLE
#: drafter (its peek past the candidate, Mamba's margin) and a sliding window beside
#: Mamba (which attention groups report fresh blocks for zeroing), preempted through
#: ``pop_blocks_for_free`` (the null blocks it leaves out). ``make
#: exhaustive-releases`` searches them beside ``LAYOUTS`` under every release; ``make
#: proofs`` does not.
LATER_LAYOUTS = (
    Layout("full attention, EAGLE, block 1, 3 blocks", (_full(1),), 4, depth=8,
           use_eagle=True),
    Layout("full + sliding window 2, EAGLE, block 1, 4 blocks",
           (_full(1), SlidingWindowSpec(block_size=1, sliding_window=2, **ATTN)), 5, depth=9,
           use_eagle=True),  # (the lookahead slot fills 4 blocks fast: few states)
    Layout("full + Mamba align, EAGLE, block 1, 4 blocks", (_full(1), _mamba_align(1)), 5,
           depth=7, use_eagle=True),
    Layout("sliding window 2 + Mamba align, preempt by pop, block 1, 4 blocks",
           (SlidingWindowSpec(block_size=1, sliding_window=2, **ATTN), _mamba_align(1)), 5,
           depth=7, pop_on_preempt=True),
)


@dataclass
class State:
    """Both managers and the live requests (by slot), and the calls that led here."""

    spec: Any
    impl: Any
    requests: dict[str, Request]
    path: tuple[str, ...] = ()
    abstract: dict[str, Any] | None = None
    """The spec's ``abstract_state()`` as of the last check (None: stale)."""

    def key(self) -> tuple[Any, ...]:
        """Canonical: the spec's abstract state and each request's tokens, computed
        count and status."""
        requests = tuple((slot, tuple(r.all_token_ids), r.num_computed_tokens, int(r.status))
                         for slot, r in sorted(self.requests.items()))
        abstract = self.spec.abstract_state() if self.abstract is None else self.abstract
        return _freeze(abstract), requests


def _freeze(value: Any) -> Any:
    """Hashable, order-independent form of nested dicts and lists."""
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _ids(value: Any) -> Any:
    """Block objects and KVCacheBlocks -> ids, recursively, so results compare."""
    if value is None or isinstance(value, bool | int | str | bytes):
        return value
    if hasattr(value, "get_block_ids"):
        return value.get_block_ids()
    if hasattr(value, "block_id"):
        return value.block_id
    if isinstance(value, list | tuple):
        return type(value)(_ids(v) for v in value)
    return repr(value)


@dataclass
class Explorer:
    """Breadth-first search over one layout."""

    layout: Layout
    hasher: Callable[[Request], list[Any]] = field(init=False)
    seen: set[tuple[Any, ...]] = field(default_factory=set)
    num_calls: int = 0

    def __post_init__(self) -> None:
        self.hasher = get_request_block_hasher(self.layout.block_size, sha256)

    # ------------------------------------------------------------ calls

    def call(self, state: State, what: str, name: str, *args: Any, check: bool = True,
             **kwargs: Any) -> Any:
        """``name`` on both managers (same arguments but each side's own hits); compare
        the results, then (unless ``check`` is False: the caller checks after its next
        call) the abstract states and the invariants. Returns both results."""
        self.num_calls += 1
        state.abstract = None
        spec_hits = kwargs.pop("spec_hits", None)
        impl_hits = kwargs.pop("impl_hits", None)
        extra_spec = {"new_computed_blocks": spec_hits} if spec_hits is not None else {}
        extra_impl = {"new_computed_blocks": impl_hits} if impl_hits is not None else {}
        spec_out = _outcome(getattr(state.spec, name), *args, **kwargs, **extra_spec)
        impl_out = _outcome(getattr(state.impl, name), *args, **kwargs, **extra_impl)
        if _ids(spec_out[1]) != _ids(impl_out[1]) or spec_out[0] != impl_out[0]:
            raise Mismatch(f"{what}: spec -> {_show(spec_out)}, kvcache -> {_show(impl_out)}")
        if check:
            self.check(state, what)
        return spec_out[1], impl_out[1]

    def check(self, state: State, what: str) -> None:
        """Equal abstract states, and both sides' invariants."""
        spec_state, impl_state = state.spec.abstract_state(), state.impl.abstract_state()
        if spec_state != impl_state:
            diff = {k: (spec_state[k], impl_state.get(k)) for k in spec_state
                    if spec_state[k] != impl_state.get(k)}
            raise Mismatch(f"{what}: abstract_state differs (spec, kvcache): {diff}")
        for side, manager in (("spec", state.spec), ("kvcache", state.impl)):
            try:
                manager.check_invariants()
            except AssertionError as exc:
                raise Mismatch(f"{what}: {side}.check_invariants(): {exc}") from exc
        state.abstract = spec_state

    # ------------------------------------------------------------ the search

    def actions(self, state: State) -> Iterator[Action]:
        """Every call the scheduler could make next."""
        for slot in SLOTS:
            request = state.requests.get(slot)
            if request is None:
                for prompt in PROMPTS:
                    yield ("add", slot, prompt)
                continue
            if request.status in WAITING:
                for chunk in CHUNKS:
                    yield ("admit", slot, chunk)
            elif request.num_computed_tokens < request.num_tokens:
                for chunk in CHUNKS:
                    yield ("run", slot, chunk)
            yield ("free", slot)
            if request.status == RequestStatus.RUNNING:
                yield ("preempt", slot)
        for block_id in range(self.layout.num_blocks):
            yield ("evict", block_id)
        yield ("reset",)
        yield ("new_step",)

    def freeze(self, state: State) -> bytes:
        """``state`` as bytes (``thaw`` makes an independent copy): faster than deepcopy.
        The requests' hasher (a closure) is left out and put back by ``thaw``."""
        state.abstract = None
        for request in state.requests.values():
            request._block_hasher = None
        try:
            return pickle.dumps(state, pickle.HIGHEST_PROTOCOL)
        finally:
            for request in state.requests.values():
                request._block_hasher = self.hasher

    def thaw(self, frozen: bytes) -> State:
        """A fresh copy of a frozen state."""
        state: State = pickle.loads(frozen)
        for request in state.requests.values():
            request._block_hasher = self.hasher
        return state

    def apply(self, frozen: bytes, action: Action) -> list[State]:
        """The successors of the frozen state after ``action`` (several when a token is
        sampled)."""
        state = self.thaw(frozen)
        state.path = (*state.path, _describe(action))
        what = " -> ".join(state.path)
        kind = action[0]
        if kind == "add":
            _, slot, prompt = action
            # The slot names the request: a new one may reuse a finished one's id.
            state.requests[slot] = Request(slot, list(prompt), block_hasher=self.hasher)
            return [state]
        if kind in ("admit", "run"):
            return self.schedule(state, action, what)
        if kind in ("free", "preempt"):
            request = state.requests[action[1]]
            if kind == "preempt" and self.layout.pop_on_preempt:
                popped = self.call(state, what, "pop_blocks_for_free", request, check=False)
                for manager, blocks in zip((state.spec, state.impl), popped, strict=True):
                    manager.block_pool.free_blocks(reversed(blocks))
                self.check(state, what)
            else:
                self.call(state, what, "free", request)
            if kind == "free":
                del state.requests[action[1]]
            else:
                request.status = RequestStatus.PREEMPTED
                request.num_computed_tokens = 0
                request.num_preemptions += 1
        elif kind == "evict":
            self.call(state, what, "evict_blocks", {action[1]})
        elif kind == "reset":
            self.call(state, what, "reset_prefix_cache")
        else:
            self.call(state, what, "new_step_starts")
        self.drain(state, what)
        return [state]

    def schedule(self, state: State, action: Action, what: str) -> list[State]:
        """``admit`` or ``run``: allocate, and if granted, complete the step."""
        kind, slot, chunk = action
        request = state.requests[slot]
        hits: dict[str, Any] = {}
        num_hits = 0
        if kind == "admit":
            (spec_hits, num_hits), (impl_hits, _) = self.call(
                state, what, "get_computed_blocks", request)
            hits = {"spec_hits": spec_hits, "impl_hits": impl_hits,
                    "num_new_computed_tokens": num_hits}
        num_left = request.num_tokens - request.num_computed_tokens - num_hits
        num_new = 1 if chunk == "one" else num_left
        if self.layout.use_eagle:
            hits["num_lookahead_tokens"] = 1
        granted, _ = self.call(state, what, "allocate_slots", request, num_new, **hits)
        if granted is None:
            self.drain(state, what)
            return [state]
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens += num_hits + num_new
        if request.num_computed_tokens < request.num_tokens:
            self.drain(state, what)
            return [state]
        successors = []
        frozen = self.freeze(state)
        for token in ALPHABET:
            branch = self.thaw(frozen)
            branch.path = (*branch.path, f"sample {token}")
            branch_request = branch.requests[slot]
            branch_request.append_output_token_ids(token)
            if branch_request.num_tokens >= MAX_MODEL_LEN:
                self.call(branch, what, "free", branch_request)
                del branch.requests[slot]
            self.drain(branch, what)
            successors.append(branch)
        return successors

    def drain(self, state: State, what: str) -> None:
        """The per-step queues (new block ids, events) and, with a request running, the
        common prefix blocks of the first; then the slot facts. These calls change no
        abstract state, so one check covers them."""
        self.call(state, what, "take_new_block_ids", check=False)
        self.call(state, what, "take_events", check=False)
        running = [r.request_id for _, r in sorted(state.requests.items())
                   if r.status == RequestStatus.RUNNING]
        if running:  # the scheduler asks for cascade attention's common prefix each step
            self.call(state, what, "get_num_common_prefix_blocks", running[0], check=False)
        self.check(state, what)
        check_slots(state, self.layout, what)

    def explore(self, max_depth: int) -> tuple[int, bool]:
        """Deepen until ``max_depth`` or no new state; return the last depth fully
        explored and whether the reachable states are exhausted."""
        root_spec, root_impl = self.layout.managers()
        frontier = [State(root_spec, root_impl, {})]
        self.seen = {frontier[0].key()}
        for depth in range(1, max_depth + 1):
            next_frontier = []
            for state in frontier:
                frozen = self.freeze(state)
                for action in self.actions(state):
                    for successor in self.apply(frozen, action):
                        key = successor.key()
                        if key not in self.seen:
                            self.seen.add(key)
                            next_frontier.append(successor)
            frontier = next_frontier
            if not frontier:
                return depth, True
        return max_depth, False


def check_slots(state: State, layout: Layout, what: str) -> None:
    """The slot facts (module docstring) on every group's block tables."""
    for group, group_spec in enumerate(layout.specs):
        block_size = group_spec.block_size
        live: list[tuple[str, Request, list[int], int]] = []
        for slot, request in sorted(state.requests.items()):
            table = state.spec.get_block_ids(request.request_id)[group]
            num_computed = request.num_computed_tokens
            first = _num_skipped(group_spec, num_computed)
            for pos in range(first, num_computed):
                if pos >= len(table) * block_size or not table[pos // block_size] > 0:
                    raise Mismatch(f"{what}: {slot}'s live token {pos} has no block in group "
                                   f"{group}: table {table}")
                token_slot = live_token_slot(table, pos, block_size, layout.num_blocks)
                if not block_size <= token_slot < layout.num_blocks * block_size:
                    raise Mismatch(f"{what}: {slot}'s live token {pos} has slot {token_slot}, "
                                   f"outside blocks 1..{layout.num_blocks - 1}")
                live.append((slot, request, table, pos))
        for i, (slot_a, req_a, table_a, pos_a) in enumerate(live):
            for slot_b, req_b, table_b, pos_b in live[i + 1:]:
                if slot_a == slot_b or not share_slot(table_a, pos_a, table_b, pos_b,
                                                      block_size):
                    continue
                end = (pos_a // block_size + 1) * block_size
                if (pos_a != pos_b or req_a.all_token_ids[:end] != req_b.all_token_ids[:end]
                        or end > min(req_a.num_computed_tokens, req_b.num_computed_tokens)):
                    raise Mismatch(f"{what}: {slot_a}@{pos_a} and {slot_b}@{pos_b} share a slot "
                                   f"in group {group} without sharing a computed prefix block")


def _num_skipped(group_spec: KVCacheSpec, num_computed: int) -> int:
    """Leading tokens the group's attention no longer reads (they hold no live slot)."""
    if isinstance(group_spec, SlidingWindowSpec):
        return pure.num_skipped_tokens_sliding_window(num_computed, group_spec.sliding_window)
    if isinstance(group_spec, MambaSpec):  # only the latest state is live
        return max(0, pure.num_skipped_tokens_mamba(num_computed))
    return 0


def _outcome(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as exc:  # compared by type: both sides must fail alike
        return "raise", type(exc).__name__


def _show(out: tuple[str, Any]) -> str:
    return f"{out[0]} {_ids(out[1])!r}"


def _describe(action: Action) -> str:
    kind, *args = action
    return f"{kind}({', '.join(map(str, args))})"


@dataclass
class Report:
    """The outcome for one layout."""

    layout: str
    depth: int
    exhausted: bool
    num_states: int
    num_calls: int
    seconds: float
    mismatch: str | None = None

    def line(self) -> str:
        """One line for the run's output: the bound reached, no timing (the lines
        are the same on every run of a commit)."""
        status = "counterexample" if self.mismatch else (
            f"every reachable state by depth {self.depth}" if self.exhausted
            else f"exhausted to depth {self.depth}")
        return f"{self.layout}: {status}, {self.num_states} states, {self.num_calls} calls"


def run(layouts: tuple[Layout, ...] = LAYOUTS) -> list[Report]:
    """Explore every layout to its depth."""
    reports = []
    for layout in layouts:
        explorer = Explorer(layout)
        t0 = time.monotonic()
        mismatch = None
        depth, exhausted = 0, False
        try:
            depth, exhausted = explorer.explore(layout.depth)
        except Mismatch as exc:
            mismatch = str(exc)
        reports.append(Report(layout.name, depth, exhausted, len(explorer.seen),
                              explorer.num_calls, time.monotonic() - t0, mismatch))
    return reports


def teeth(layouts: tuple[Layout, ...]) -> list[tuple[str, str | None]]:
    """Each switch the layouts' release turns on, turned back
    on the spec's side alone, searched over ``layouts``: (switch, the first layout's
    counterexample, or None where the search sees no difference, so the layouts cannot
    tell that switch's rule from 0.25.1's)."""
    release = layouts[0].release
    found: list[tuple[str, str | None]] = []
    for switch in spec.profile.SWITCHES:
        if switch not in spec.profile.ON[release]:
            continue
        flipped = tuple(replace(layout, turned_back=switch) for layout in layouts)
        mismatch = next((f"{r.layout}: {r.mismatch}" for r in run(flipped) if r.mismatch), None)
        found.append((switch, mismatch))
    return found


def main(argv: list[str]) -> int:
    """Print one line per layout (and each counterexample); 1 on a counterexample,
    2 on bad arguments or an unexpected build. The seconds go to stderr: they are no
    part of the verdict. ``--teeth`` prints instead which of the release's switches the
    search sees (each turned back in the spec alone), and fails only on bad arguments."""
    import argparse
    import os

    parser = argparse.ArgumentParser(prog="python -m proofs.exhaustive")
    parser.add_argument("only", nargs="?", default="", help="layouts whose name has this")
    parser.add_argument("--shallower", type=int, default=0, metavar="N",
                        help="search every layout N steps less deep (default 0)")
    parser.add_argument("--release", default="0.25.1", choices=spec.profile.RELEASES,
                        help="the vLLM release both managers follow (default 0.25.1)")
    parser.add_argument("--layouts", default="base", choices=("base", "later", "all"),
                        help="LAYOUTS (make proofs' set, the default), LATER_LAYOUTS, or both")
    parser.add_argument("--turn-back", default="", choices=("", *spec.profile.SWITCHES),
                        metavar="SWITCH", help="turn this switch off in the spec alone")
    parser.add_argument("--teeth", action="store_true",
                        help="turn back each of the release's switches in turn, and print "
                             "which the search sees")
    args = parser.parse_args(argv)
    build = "compiled" if kvcache.COMPILED else "pure"
    if os.environ.get("KVCACHE_EXPECT_COMPILED") == "1" and not kvcache.COMPILED:
        print("KVCACHE_EXPECT_COMPILED=1 but kvcache's pure build is loaded", file=sys.stderr)
        return 2
    chosen = {"base": LAYOUTS, "later": LATER_LAYOUTS, "all": LAYOUTS + LATER_LAYOUTS}
    layouts = tuple(replace(layout, depth=layout.depth - args.shallower, release=args.release,
                            turned_back=args.turn_back)
                    for layout in chosen[args.layouts] if args.only in layout.name)
    if not layouts or min(layout.depth for layout in layouts) < 1:
        parser.error(f"no layout to search (only={args.only!r}, shallower={args.shallower})")
    if args.teeth:
        found = teeth(layouts)
        for switch, mismatch in found:
            print(f"{switch}: " + ("seen; " + mismatch[:300] if mismatch else "NOT SEEN"))
        print(f"TEETH {sum(m is not None for _, m in found)} of {len(found)} switches of "
              f"vLLM {args.release} seen ({len(layouts)} layouts, {args.shallower} shallower)")
        return 0
    reports = run(layouts)
    for report in reports:
        print(report.line())
        print(f"{report.layout}: {report.seconds:.0f}s", file=sys.stderr)
        if report.mismatch:
            print(f"  {report.mismatch}")
    depth = min(r.depth for r in reports)
    print(f"TOTAL depth {depth} states {sum(r.num_states for r in reports)} "
          f"calls {sum(r.num_calls for r in reports)} (kvcache {build} build, "
          f"vLLM {args.release})")
    return 1 if any(r.mismatch for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
