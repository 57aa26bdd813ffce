"""kvcache's HiSparse kinds against the spec's (vLLM 0.33.0, switch ``hisparse_groups``).

Two independent implementations of vLLM 0.33.0's HiSparse managers, the pool's
unpin / reuse watchers / shared event queue and the retained-hit trim, kvcache's
(``kvcache/hisparse.py``) and the spec's (``spec/single_type_kv_cache_manager.py``),
are driven by the same seeded random sequences: scheduler calls (lookups,
admissions with external tokens, steps, frees, evictions, cache resets) and the
calls vLLM's ``HiSparseCoordinator`` (``vllm/v1/hisparse/coordinator.py``, outside
the core, modelled by neither) makes: bind the host pool, take the managers'
callbacks (commit, publish when ready, pending import, free), publish host blocks,
adopt and drop resident pages, require the hot region, unpin pages and lose them
when the pool reuses their blocks. ``StandIn`` is that coordinator, one instance
per side, with a plain policy of its own; both sides take the same decisions as
long as their states agree, and after every call every observable is compared:
block tables, residency rows and changes, hot regions, free queues, reference
counts, cached blocks, events, hit lengths, allocation results and the calls the
managers made to their coordinator.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

import kvcache
import kvcache.kv_cache_utils as kcu
import spec
from kvcache import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, Request, sha256
from kvcache.kv_cache_interface import HiSparseHotSpec, HiSparseResidentSpec

BS = 4
MAX_LEN = 64
NUM_SEQUENCES = 200
NUM_STEPS = 60

HISPARSE = ("HiSparseSourceManager", "HiSparseResidentManager", "HiSparseHotManager")


def kind(manager: Any) -> str:
    """A manager's kind by vLLM's class name: kvcache's class, or the spec's row."""
    rules = getattr(manager, "rules", None)
    return rules.name if rules is not None else type(manager).__name__


@dataclass
class RoleGroupSpec(KVCacheGroupSpec):
    """A group with vLLM 0.33.0's ``role`` field."""

    role: str = "default"


def full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype="float32")


def layout(kind: str, num_blocks: int) -> KVCacheConfig:
    """``"resident"``: source, indexer, resident and hot groups; ``"hot"``: no resident
    group (the hot region is then needed from the start)."""
    groups = [
        RoleGroupSpec(["source"], full(), role="hisparse_source"),
        RoleGroupSpec(["indexer"], full(), role="hisparse_indexer"),
    ]
    if kind == "resident":
        groups.append(KVCacheGroupSpec(["resident"], HiSparseResidentSpec(block_size=BS,
                                                                          page_size=64)))
    groups.append(KVCacheGroupSpec(
        ["hot"], HiSparseHotSpec(block_size=BS, page_size=64, blocks_per_request=2)))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)


class StandIn:
    """vLLM's HiSparseCoordinator's part, plainly: it records the managers' callbacks
    and, when the driver says so, publishes, adopts, drops, unpins and loses pages.
    ``ids`` turns one side's blocks into ids (kvcache: objects; spec: ints)."""

    def __init__(self, side: World) -> None:
        self.side = side
        managers = side.managers
        self.source = next(m for m in managers if kind(m) == HISPARSE[0])
        self.resident_managers = tuple(m for m in managers if kind(m) == HISPARSE[1])
        self.hot_managers = tuple(m for m in managers if kind(m) == HISPARSE[2])
        self.gpu_pool = side.km.block_pool
        self.log: list[tuple[Any, ...]] = []
        self.publications: dict[str, tuple[Any, int, Any, Any]] = {}
        self.clean_pages: dict[str, int] = {}  # pages published, hence durable on host
        self.unpinned: dict[str, set[int]] = {}
        self.owners: dict[int, set[tuple[str, int]]] = {}  # unpinned block -> readers
        self.blocks: dict[int, Any] = {}  # block id -> that side's block
        for m in (self.source, *self.resident_managers, *self.hot_managers):
            m.coordinator = self

    # -------------------------------------------------- called by the managers

    def commit_computed_blocks(self, request_id: str, num_host_pages: int) -> None:
        self.log.append(("commit", request_id, num_host_pages))

    def publish_when_ready(self, request: Any, num_tokens: int, retention_interval: Any,
                           *, replay_boundaries: Any) -> None:
        # The boundaries matter only with a retention interval (full attention, the
        # host group's kind, ignores them): kvcache computes them only then.
        boundaries = None if retention_interval is None else tuple(replay_boundaries)
        self.log.append(("publish_when_ready", request.request_id, num_tokens,
                         retention_interval, boundaries))
        self.publications[request.request_id] = (request, num_tokens, retention_interval,
                                                 replay_boundaries)

    def record_pending_host_import(self, request_id: str, num_tokens: int) -> None:
        self.log.append(("pending_import", request_id, num_tokens))

    def free(self, request_id: str) -> None:
        """As vLLM's: unpinned pages are forgotten, clean ones unpinned (they stay
        readable in the pool), both dropped; the rest the manager frees."""
        self.log.append(("free", request_id))
        self.publications.pop(request_id, None)
        unpinned = self.unpinned.pop(request_id, set())
        clean = self.clean_pages.pop(request_id, 0)
        for m in self.resident_managers:
            row = m.get_residency_row(request_id)
            for page in reversed(range(len(row))):
                block = m.get_resident_page(request_id, page)
                if block is None:
                    continue
                if page in unpinned:
                    self.owners.get(self.side.bid(block), set()).discard((request_id, page))
                elif page < clean:
                    m.block_pool.unpin_blocks([block], self.on_reuse)
                else:
                    continue
                m.drop_resident_page(request_id, page)

    def on_reuse(self, block: Any) -> None:
        """The pool handed out an unpinned block: its readers lose the page."""
        block_id = self.side.bid(block)
        self.log.append(("reused", block_id))
        for request_id, page in sorted(self.owners.pop(block_id, set())):
            for m in self.resident_managers:
                m.drop_resident_page(request_id, page)
            self.unpinned.get(request_id, set()).discard(page)
            for hot in self.hot_managers:
                hot.require_hot(request_id)

    # -------------------------------------------------- driven by the test

    def publish(self, request_id: str, num_pages: int) -> None:
        """The first ``num_pages`` pages became durable: cache them on the host."""
        if request_id not in self.publications:
            return
        request, num_tokens, interval, boundaries = self.publications[request_id]
        num_tokens = min(num_tokens, num_pages * BS)
        self.clean_pages[request_id] = max(self.clean_pages.get(request_id, 0),
                                           num_tokens // BS)
        self.source.publish_blocks(request, num_tokens, interval,
                                   replay_boundaries=boundaries)

    def adopt(self, request_id: str, page: int, reuse_copy: bool) -> None:
        """Read a host-only page from a GPU copy: an unpinned block still readable
        (pinned again) or a fresh one."""
        for m in self.resident_managers:
            if reuse_copy and self.owners:
                block = self.blocks[min(self.owners)]
                if m.adopt_resident_page(request_id, page, block):
                    m.block_pool.touch([block])
            elif self.gpu_pool.get_num_free_blocks() > 0:
                block = self.gpu_pool.get_new_blocks(1)[0]
                self.blocks[self.side.bid(block)] = block
                if not m.adopt_resident_page(request_id, page, block):
                    self.gpu_pool.free_blocks([block])

    def drop(self, request_id: str, page: int) -> None:
        """Stop reading a page from the GPU; a pinned block is released."""
        for m in self.resident_managers:
            block = m.drop_resident_page(request_id, page)
            if block is None:
                continue
            if page in self.unpinned.get(request_id, set()):
                self.unpinned[request_id].discard(page)
                self.owners.get(self.side.bid(block), set()).discard((request_id, page))
            else:
                m.block_pool.free_blocks([block])

    def unpin(self, request_id: str, page: int) -> None:
        """Release a resident page's pin; it stays readable until reused."""
        if page in self.unpinned.get(request_id, set()):
            return
        for m in self.resident_managers:
            block = m.get_resident_page(request_id, page)
            if block is None:
                continue
            block_id = self.side.bid(block)
            self.blocks[block_id] = block
            self.owners.setdefault(block_id, set()).add((request_id, page))
            self.unpinned.setdefault(request_id, set()).add(page)
            m.block_pool.unpin_blocks([block], self.on_reuse)

    def require_hot(self, request_id: str) -> None:
        for hot in self.hot_managers:
            hot.require_hot(request_id)


class World:
    """One side: its KVCacheManager, bound to a stand-in and a host pool."""

    def __init__(self, impl: Any, config: KVCacheConfig, caching: bool, host_blocks: int,
                 bid: Callable[[Any], int]) -> None:
        self.km = impl.KVCacheManager(
            config, max_model_len=MAX_LEN, scheduler_block_size=BS, hash_block_size=BS,
            max_num_batched_tokens=3 * BS, enable_caching=caching, enable_kv_cache_events=True,
            prefix_cache_retention_interval=None, profile="0.33.0")
        self.managers = getattr(self.km, "coordinator", self.km).single_type_managers
        self.bid = bid
        self.coord = StandIn(self)
        self.coord.source.bind_host_pool(host_blocks)

    def ids(self, blocks: Any) -> list[int]:
        return [self.bid(b) for b in blocks]

    def pools(self) -> list[Any]:
        return [self.km.block_pool, self.coord.source.block_pool]


def kvcache_side(config: KVCacheConfig, caching: bool, host_blocks: int) -> World:
    return World(kvcache, config, caching, host_blocks, lambda b: b.block_id)


def spec_side(config: KVCacheConfig, caching: bool, host_blocks: int) -> World:
    return World(spec, config, caching, host_blocks, int)


def pool_state(side: World, pool: Any) -> dict[str, Any]:
    """Free queue, reference counts and cached blocks of one pool, as ids."""
    if isinstance(pool, spec.BlockPool):
        return {"free": list(pool.free_queue),
                "ref": {b: c for b, c in enumerate(pool.ref_cnt) if b and c},
                "cached": sorted(pool.block_hash), "medium": pool.medium}
    return {"free": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            "ref": {b.block_id: b.ref_cnt for b in pool.blocks if b.block_id and b.ref_cnt},
            "cached": sorted(b.block_id for b in pool.blocks if b.block_hash is not None),
            "medium": pool.medium}


def observe(side: World) -> dict[str, Any]:
    """Everything both sides must agree on, as plain data."""
    seen: dict[str, Any] = {"pools": [pool_state(side, p) for p in side.pools()],
                            "log": list(side.coord.log)}
    side.coord.log.clear()
    for g, m in enumerate(side.managers):
        tables = {r: side.ids(t) for r, t in m.req_to_blocks.items() if t}
        seen[f"tables{g}"] = tables
        seen[f"cached{g}"] = {r: n for r, n in m.num_cached_block.items()}
        if kind(m) == HISPARSE[1]:
            seen[f"rows{g}"] = {r: side.ids(m.get_residency_row(r)) for r in tables}
            seen[f"changes{g}"] = {r: {p: side.bid(b) for p, b in c.items()}
                                   for r, c in m.residency_changes.items() if c}
        if kind(m) == HISPARSE[2]:
            seen[f"hot{g}"] = (sorted(m.hot_required), sorted(r for r in tables if m.has_hot(r)))
    seen["free_count"] = side.km.block_pool.get_num_free_blocks()
    seen["new_block_ids"] = side.km.take_new_block_ids()  # the source reports none
    return seen


def events(side: World) -> list[tuple[Any, ...]]:
    return [(type(e).__name__, getattr(e, "medium", None), getattr(e, "group_idx", None),
             list(getattr(e, "block_hashes", [])), list(getattr(e, "token_ids", [])))
            for e in side.km.take_events()]


def same(what: str, a: Any, b: Any, trace: list[str]) -> None:
    assert a == b, f"{what}: kvcache {a!r} != spec {b!r}\nafter: " + "\n".join(trace[-12:])


def attempt(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``; an exception is a result too (its type's name)."""
    try:
        return call(*args, **kwargs)
    except (ValueError, AssertionError, RuntimeError) as error:
        return type(error).__name__


def as_ids(sides: tuple[World, World], out: Any) -> Any:
    """An allocation's result as ids per group (None, or an error's name, as is)."""
    if out is None or isinstance(out, str):
        return out
    side = sides[0] if not isinstance(out, spec.KVCacheBlocks) else sides[1]
    return [side.ids(g) for g in out.blocks]


COVERAGE = ("hit", "host hit longer than the common hit", "commit", "publish_when_ready",
            "pending_import", "free", "reused", "host event", "resident page dropped",
            "adopted page", "hot region")
"""What each batch of sequences must exercise (at least 3 times)."""

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [5] * 16]


def run_sequence(seed: int, seen: Counter[str]) -> None:
    """One random sequence, both sides in step; AssertionError at the first difference.
    ``seen`` counts what the sequence exercised (see ``COVERAGE``)."""
    rng = random.Random(seed)
    kind = rng.choice(["resident", "resident", "hot"])
    config = layout(kind, num_blocks=rng.choice([12, 20, 32]))
    caching = rng.random() < 0.85
    host_blocks = rng.choice([6, 10, 24])
    kcu.init_none_hash(sha256)
    sides = (kvcache_side(config, caching, host_blocks), spec_side(config, caching, host_blocks))
    hasher = kcu.get_request_block_hasher(BS, sha256)
    waiting: list[Request] = []
    running: list[Request] = []
    trace: list[str] = [f"seed {seed}: {kind}, {config.num_blocks} blocks, caching={caching}, "
                        f"{host_blocks} host blocks"]
    for step in range(NUM_STEPS):
        op = rng.choice(["new", "admit", "admit", "step", "step", "step", "free", "publish",
                         "publish", "adopt", "drop", "unpin", "unpin", "hot", "evict", "evict",
                         "reset"])
        if op == "new" or (op == "admit" and not waiting):
            tokens = rng.choice(PREFIXES)[:rng.randint(4, 16)] + [
                rng.randint(20, 23) for _ in range(rng.randint(1, 12))]
            waiting.append(Request(f"r{step}", tokens[:MAX_LEN - 8], block_hasher=hasher))
            continue
        if op == "admit":
            r = waiting.pop(0)
            hits = [attempt(s.km.get_computed_blocks, r) for s in sides]
            if isinstance(hits[0], str) or isinstance(hits[1], str):
                same("lookup", hits[0], hits[1], trace)
                continue
            same("hit blocks", [sides[0].ids(g) for g in hits[0][0].blocks],
                 [sides[1].ids(g) for g in hits[1][0].blocks], trace)
            num_hits = hits[0][1]
            same("hit length", num_hits, hits[1][1], trace)
            seen["host hit longer than the common hit"] += len(hits[1][0].blocks[0]) * BS > num_hits
            seen["hit"] += num_hits > 0
            remaining = r.num_tokens - num_hits
            ext = rng.choice([0, 0, rng.randint(0, max(remaining - 1, 0))])
            new = rng.randint(1, max(remaining - ext, 1))
            kwargs = {"num_external_computed_tokens": ext,
                      "delay_cache_blocks": ext > 0 and rng.random() < 0.5,
                      "full_sequence_must_fit": rng.random() < 0.3}
            trace.append(f"admit {r.request_id} {r.all_token_ids} hits={num_hits} {kwargs} "
                         f"new={new}")
            out = [attempt(s.km.allocate_slots, r, new, num_hits, h[0], **kwargs)
                   for s, h in zip(sides, hits, strict=True)]
            same("admission", as_ids(sides, out[0]), as_ids(sides, out[1]), trace)
            if isinstance(out[0], str):  # both raised alike: the sequence ends here
                same("state", observe(sides[0]), observe(sides[1]), trace)
                return
            if out[0] is None:
                waiting.insert(0, r)
            else:
                r.num_computed_tokens = min(num_hits + ext + new, r.num_tokens)
                running.append(r)
        elif op == "step" and running:
            r = rng.choice(running)
            if r.num_computed_tokens >= r.num_tokens:
                r.append_output_token_ids(rng.randint(20, 23))
            if r.num_tokens >= MAX_LEN:
                continue
            new = rng.randint(1, r.num_tokens - r.num_computed_tokens)
            trace.append(f"step {r.request_id} +{new}")
            out = [attempt(s.km.allocate_slots, r, new) for s in sides]
            same("step", as_ids(sides, out[0]), as_ids(sides, out[1]), trace)
            if isinstance(out[0], str):  # both raised alike: the sequence ends here
                same("state", observe(sides[0]), observe(sides[1]), trace)
                return
            if out[0] is not None:
                r.num_computed_tokens += new
        elif op == "free" and running:
            r = running.pop(rng.randrange(len(running)))
            trace.append(f"free {r.request_id}")
            for s in sides:
                s.km.free(r)
        elif op in ("publish", "adopt", "drop", "unpin", "hot") and running:
            r = rng.choice(running)
            page = rng.randint(0, max(r.num_computed_tokens // BS, 1))
            arg = rng.randint(0, 4)
            reuse = rng.random() < 0.5
            trace.append(f"coordinator {op} {r.request_id} page={page} arg={arg} reuse={reuse}")
            args = {"publish": (page + arg,), "adopt": (page, reuse), "drop": (page,),
                    "unpin": (page,), "hot": ()}[op]
            for s in sides:
                getattr(s.coord, {"hot": "require_hot"}.get(op, op))(r.request_id, *args)
        elif op == "evict":  # mostly a cached device block: the host keeps a longer hit
            which = int(rng.random() < 0.2)
            cached = pool_state(sides[0], sides[0].pools()[which])["cached"]
            size = config.num_blocks if which == 0 else host_blocks
            block_id = rng.choice(cached) if cached else rng.randint(1, size - 1)
            trace.append(f"evict pool {which} block {block_id}")
            for s in sides:
                s.pools()[which].evict_blocks({block_id})
        elif op == "reset":
            trace.append("reset_prefix_cache")
            out = [attempt(s.km.reset_prefix_cache) for s in sides]
            same("reset", out[0], out[1], trace)
        state = observe(sides[0])
        same("state", state, observe(sides[1]), trace)
        stored = events(sides[0])
        same("events", stored, events(sides[1]), trace)
        for call in state["log"]:
            seen[call[0]] += 1
        seen["host event"] += any(e[1] == "CPU" for e in stored)
        seen["resident page dropped"] += any(
            0 in c.values() for g in range(4) for c in state.get(f"changes{g}", {}).values())
        seen["adopted page"] += any(
            any(c.values()) for g in range(4) for c in state.get(f"changes{g}", {}).values())
        seen["hot region"] += any(state.get(f"hot{g}", ([], []))[1] for g in range(4))
    for s in sides[1:]:
        s.km.check_invariants()


@pytest.fixture(autouse=True)
def _none_hash() -> None:
    kcu.init_none_hash(sha256)


@pytest.mark.parametrize("first", range(0, NUM_SEQUENCES, 50))
def test_kvcache_and_the_spec_agree_on_hisparse(first: int) -> None:
    seen: Counter[str] = Counter()
    for seed in range(first, first + 50):
        run_sequence(seed, seen)
    print(sorted(seen.items()))
    missed = [what for what in COVERAGE if seen[what] < 3]
    assert not missed, f"the sequences did not exercise {missed}: {dict(seen)}"
