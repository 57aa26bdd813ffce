"""The ledger's rules, second part: differences in what is cached and freed.

The expected-result rules that recognise a state difference (``recognise_state``:
which blocks carry which hash, which are freed, in which order) and the results
that follow from it at a later call: Mamba states freed early, EAGLE and
fine-grained caching, partial tails, context-parallel block sizes, entries that
``evict_blocks`` dropped coming back, retention boundaries. ``CACHING_STATE`` and
``FREEING_STATE`` are the state parts of each kind (the judge splits a state
difference by them). The base classes are in ``kvcache.kit.ledger_rules``;
``RULES`` in ``kvcache.kit.ledger`` names every rule.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvcache.kit.config import ManagerConfig, fine_grained_hits
from kvcache.kit.ledger_rules import (
    Context,
    Outcome,
    Rule,
    _hit_blocks,
    _hit_tokens,
    _ok,
    _stored_event,
)
from kvcache.kit.trace import pool_key_hex, results_equal

#: State parts that caching alone changes (which blocks carry which hash).
CACHING_STATE = frozenset({"block_hash", "cached", "num_cached_block"})
#: State parts that freeing alone changes.
FREEING_STATE = frozenset({"free_queue", "get_num_free_blocks", "ref_cnt", "req_to_blocks"})


def _same_shape(old: Outcome, new: Outcome) -> bool:
    """Whether two allocation results hand out as many blocks per group (the ids
    may differ)."""
    o, n = _ok(old), _ok(new)
    if not (isinstance(o, dict) and isinstance(n, dict)):
        return False
    a, b = o.get("tuple"), n.get("tuple")
    return (
        isinstance(a, list)
        and isinstance(b, list)
        and len(a) == len(b)
        and all(len(x) == len(y) for x, y in zip(a, b, strict=True))
    )


def _pairs(state: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = state.get(key)
    pairs = value.get("dict") if isinstance(value, dict) else None
    if not isinstance(pairs, list):
        return {}
    return {json.dumps(k, sort_keys=True): v for k, v in pairs}


def _only_unhashed(old: Mapping[str, Any], new: Mapping[str, Any], blocks: set[Any]) -> bool:
    """Whether ``block_hash`` and ``cached`` differ only in that ``blocks`` carry
    hashes (and cache entries) on the old side and none on the new side."""
    ids = {json.dumps(b) for b in blocks}
    o, n = _pairs(old, "block_hash"), _pairs(new, "block_hash")
    for key in set(o) | set(n):
        if o.get(key) != n.get(key) and not (key in ids and key not in n):
            return False
    o, n = _pairs(old, "cached"), _pairs(new, "cached")
    for key in set(o) | set(n):
        before = set(o.get(key) or [])
        after = set(n.get(key) or [])
        if not after <= before or not before - after <= blocks:
            return False
    return True


class MambaFreedOnProcessedTokens(Rule):
    """0.25.1's Mamba manager frees state only below ``num_computed_tokens -
    num_speculative_blocks``; 0.33.0 frees below the processed tokens (computed
    minus in flight, which the kit's scheduler never has). Recognised where the new
    side's Mamba blocks are the old side's with more of them nulled (or an empty
    entry where the old side has none), everything else alike but the hashes of
    the blocks so freed (freed before the allocation caches them, they stay
    unhashed). Asked about the freeing part alone (``diff_keys`` without
    ``block_hash``/``cached``), it leaves the hashes to the caching entry."""

    def recognise_state(
        self,
        ctx: Context,
        op: str,
        diff_keys: Sequence[str],
        old: Mapping[str, Any],
        new: Mapping[str, Any],
    ) -> bool:
        if op not in ("allocate_slots", "remove_skipped_blocks"):
            return False
        if not diff_keys or not set(diff_keys) <= FREEING_STATE | {"block_hash", "cached"}:
            return False
        if not set(diff_keys) & FREEING_STATE:
            return False
        groups = ctx.config.groups
        hedged = {
            i for i, g in enumerate(groups) if g.kind == "mamba" and g.num_speculative_blocks > 0
        }
        o, n = old.get("req_to_blocks"), new.get("req_to_blocks")
        if not hedged or not isinstance(o, list) or not isinstance(n, list) or len(o) != len(n):
            return False
        freed_more = False
        freed: set[Any] = set()
        for i, (a, b) in enumerate(zip(o, n, strict=True)):
            if i not in hedged:
                if a != b:
                    return False
                continue
            if not isinstance(a, dict) or not isinstance(b, dict) or not set(a) <= set(b):
                return False
            for rid, blocks in b.items():
                before = a.get(rid)
                if before is None:
                    if blocks:
                        return False
                    freed_more = True
                    continue
                if len(before) != len(blocks):
                    return False
                if any(x != y and y != 0 for x, y in zip(before, blocks, strict=True)):
                    return False
                freed.update(x for x, y in zip(before, blocks, strict=True) if x != y)
                freed_more = freed_more or before != blocks
        # Hash differences are this rule's to explain only when it is asked to
        # (the judge's split hands it the freeing part alone; the caching part
        # then belongs to another entry).
        hashes_asked = bool(set(diff_keys) & {"block_hash", "cached"})
        return freed_more and (not hashes_asked or _only_unhashed(old, new, freed))

    def recognise(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> bool:
        """An allocation whose blocks differ (not their number): a state block the
        new side freed just before allocating is handed out again; or one that fails
        on the old side only (the block it needed is that state block)."""
        o, n = _ok(old), _ok(new)
        if op != "allocate_slots" or not any(
            g.kind == "mamba" and g.num_speculative_blocks > 0 for g in ctx.config.groups
        ):
            return False
        if "ok" in old and o is None and isinstance(n, dict):
            return True
        return _same_shape(old, new)


def _num_cached_not_more(old: Mapping[str, Any], new: Mapping[str, Any], fewer: bool) -> bool:
    """Whether each request's ``num_cached_block`` on the new side is at most
    (``fewer``) or at least the old side's."""
    o, n = old.get("num_cached_block"), new.get("num_cached_block")
    if not isinstance(o, list) or not isinstance(n, list) or len(o) != len(n):
        return False
    for a, b in zip(o, n, strict=True):
        if not isinstance(a, dict) or not isinstance(b, dict):
            return False
        for rid in set(a) | set(b):
            x, y = int(a.get(rid, 0)), int(b.get(rid, 0))
            if (y > x) if fewer else (y < x):
                return False
    return True


class CachingStateRule(Rule):
    """A rule whose state differences are in what is cached alone (``CACHING_STATE``),
    wherever its layout condition ``applies``; with ``fewer_cached`` set, only where
    each request's ``num_cached_block`` on the new side is at most (True) or at least
    (False) the old side's."""

    #: The direction ``num_cached_block`` may differ in; None: either.
    fewer_cached: bool | None = None

    def applies(self, ctx: Context) -> bool:
        """Whether the layout (``ctx.config``) has this entry's behaviour at all."""
        return False

    def recognise_state(
        self,
        ctx: Context,
        op: str,
        diff_keys: Sequence[str],
        old: Mapping[str, Any],
        new: Mapping[str, Any],
    ) -> bool:
        return (
            self.applies(ctx)
            and bool(diff_keys)
            and set(diff_keys) <= CACHING_STATE
            and (
                self.fewer_cached is None
                or _num_cached_not_more(old, new, fewer=self.fewer_cached)
            )
        )


class EagleFlagNeedsUseEagle(CachingStateRule):
    """Groups flagged ``is_eagle_group`` drop the last hit block (and cache one
    block past the aligned boundary) in 0.25.1 even with ``use_eagle`` off; 0.33.0
    does either only when ``use_eagle`` is on, so it caches no more."""

    fewer_cached = True

    def applies(self, ctx: Context) -> bool:
        return not ctx.config.use_eagle and any(g.is_eagle_group for g in ctx.config.groups)

    def recognise(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> bool:
        o, n = _hit_tokens(old), _hit_tokens(new)
        return op == "get_computed_blocks" and self.applies(ctx) and o is not None and n is not None


class MambaFineGrainedHits(CachingStateRule):
    """Under ``fine_grained_hits``: 0.33.0 caches every group up to the computed
    tokens (0.25.1: rounded down to the scheduler block size), registers prompt
    tails inside Mamba blocks, and hits end on hash-block boundaries."""

    def applies(self, ctx: Context) -> bool:
        return fine_grained_hits(ctx.config)

    def recognise(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> bool:
        if not self.applies(ctx):
            return False
        if op == "get_computed_blocks":
            return _hit_tokens(old) is not None and _hit_tokens(new) is not None
        if op == "allocate_slots":  # other blocks, as other blocks were cached and freed
            return _same_shape(old, new)
        return op == "take_events"


class MambaPartialTailCopy(Rule):
    """An align-mode Mamba group with blocks larger than the hash block: 0.33.0
    registers the prompt's last hash boundary inside a state block as a partial
    entry, and the request's next step writes on a copy of that block (the cached
    one stays held). Recognised at an allocation after which the new side holds
    more blocks and a block has more holders, nothing else differing."""

    def recognise_state(
        self,
        ctx: Context,
        op: str,
        diff_keys: Sequence[str],
        old: Mapping[str, Any],
        new: Mapping[str, Any],
    ) -> bool:
        hash_block = ctx.config.hash_block_size
        if not ctx.config.enable_caching or not any(
            g.kind == "mamba" and g.mamba_cache_mode == "align" and g.block_size > hash_block
            for g in ctx.config.groups
        ):
            return False
        if op != "allocate_slots" or not {"free_queue", "ref_cnt"} <= set(diff_keys):
            return False
        if not set(diff_keys) <= CACHING_STATE | FREEING_STATE:
            return False
        o, n = old.get("free_queue"), new.get("free_queue")
        return isinstance(o, list) and isinstance(n, list) and len(n) < len(o)


class PcpNotScaled(Rule):
    """0.33.0 scales a block by ``dcp_world_size`` only (not ``pcp_world_size``):
    with pcp > 1 a cached config cannot be built (its hash block size is the
    0.25.1 block), an uncached one allocates smaller blocks."""

    def cannot_build(self, config: ManagerConfig, reason: str) -> bool:
        return config.pcp_world_size > 1 and "hash_block_size" in reason

    def recognise(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> bool:
        return ctx.config.pcp_world_size > 1

    def recognise_state(
        self,
        ctx: Context,
        op: str,
        diff_keys: Sequence[str],
        old: Mapping[str, Any],
        new: Mapping[str, Any],
    ) -> bool:
        return ctx.config.pcp_world_size > 1


class MambaNotDcpSharded(Rule):
    """0.33.0 scales a block by ``dcp_world_size`` only for ``dcp_sharded`` specs,
    which Mamba's is not: beside dcp > 1 its blocks stay ``block_size`` tokens."""

    def recognise(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> bool:
        return ctx.config.dcp_world_size > 1 and ctx.has_mamba

    def recognise_state(
        self,
        ctx: Context,
        op: str,
        diff_keys: Sequence[str],
        old: Mapping[str, Any],
        new: Mapping[str, Any],
    ) -> bool:
        return ctx.config.dcp_world_size > 1 and ctx.has_mamba


#: Hex digits of the group-id suffix of a pool key (hash bytes + 4-byte group id).
_GROUP_SUFFIX = 8


def _held_by_group(state: Mapping[str, Any], groups: set[int]) -> set[int]:
    """Block ids some request holds in one of ``groups`` (``req_to_blocks``)."""
    lists = state.get("req_to_blocks")
    held: set[int] = set()
    if not isinstance(lists, list):
        return held
    for gid, per_request in enumerate(lists):
        if gid in groups and isinstance(per_request, dict):
            for blocks in per_request.values():
                held.update(b for b in blocks if isinstance(b, int) and b != 0)
    return held


def _hash_presence_only(
    old: Mapping[str, Any], new: Mapping[str, Any], allowed: set[int], direction: str
) -> set[int] | None:
    """The blocks whose ``block_hash`` and ``cached`` entries are on one side only,
    when every difference is of that kind and concerns ``allowed`` blocks
    (``direction``: ``"new"`` only extra entries on the new side, ``"any"`` either
    side); ``None`` when the states differ otherwise."""
    o, n = _pairs(old, "block_hash"), _pairs(new, "block_hash")
    moved: set[int] = set()
    for key in set(o) | set(n):
        if o.get(key) == n.get(key):
            continue
        block = json.loads(key)
        if not isinstance(block, int) or block not in allowed:
            return None
        if key in o and key in n:  # hashed on both sides, differently: not presence
            return None
        if direction == "new" and key in o:
            return None
        moved.add(block)
    oc, nc = _pairs(old, "cached"), _pairs(new, "cached")
    for key in set(oc) | set(nc):
        before, after = set(oc.get(key) or []), set(nc.get(key) or [])
        if not before ^ after <= moved:
            return None
        if direction == "new" and not before <= after:
            return None
    return moved


class MambaPromptBoundaryRekey(Rule):
    """0.33.0's align-mode Mamba manager registers the state block at the prompt's
    last hash boundary on every caching step whose cacheable length is that
    boundary, unless the block is keyed there already. After ``evict_blocks``
    dropped that entry from a block the request still holds, 0.33.0 puts it back
    at the request's next allocation; 0.25.1 (whose cached-block count is already
    past the block) leaves it unhashed. Recognised where only extra Mamba-group
    entries appear on the new side, each on a block an earlier ``evict_blocks``
    named, still held in that Mamba group, under a hash another group has cached."""

    def recognise_state(
        self,
        ctx: Context,
        op: str,
        diff_keys: Sequence[str],
        old: Mapping[str, Any],
        new: Mapping[str, Any],
    ) -> bool:
        if op != "allocate_slots" or not diff_keys:
            return False
        if not set(diff_keys) <= {"block_hash", "cached"}:
            return False
        mamba = {
            i
            for i, g in enumerate(ctx.config.groups)
            if g.kind == "mamba" and g.mamba_cache_mode == "align"
        }
        if not mamba or not ctx.evicted:
            return False
        held = _held_by_group(old, mamba) & _held_by_group(new, mamba) & ctx.evicted
        moved = _hash_presence_only(old, new, held, direction="new")
        if not moved:
            return False
        old_keys = [json.loads(k).get("bytes", "") for k in _pairs(old, "cached")]
        old_hashes = {k[:-_GROUP_SUFFIX] for k in old_keys if isinstance(k, str)}
        for key, blocks in _pairs(new, "cached").items():
            if not set(blocks) & moved:
                continue
            hex_key = json.loads(key).get("bytes", "")
            if not isinstance(hex_key, str) or len(hex_key) <= _GROUP_SUFFIX:
                return False
            if int(hex_key[-_GROUP_SUFFIX:], 16) not in mamba:
                return False
            if hex_key[:-_GROUP_SUFFIX] not in old_hashes:
                return False
        return True

    def recognise(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> bool:
        """The same re-key seen in events (where ``sub-block-prefix-entries`` hides
        the state's extra entry): the new side's events are the old side's, in
        order, plus ``BlockStored`` events of one block each for an align-mode
        Mamba group, after an ``evict_blocks`` (the old side's fields compared,
        the new side's extra fields left out)."""
        o, n = _ok(old), _ok(new)
        if op != "take_events" or not ctx.evicted:
            return False
        if not isinstance(o, list) or not isinstance(n, list) or len(n) <= len(o):
            return False
        groups = ctx.config.groups

        def rekey(event: Any) -> bool:
            stored = _stored_event(event, groups)
            return (
                stored is not None
                and stored.group.kind == "mamba"
                and stored.group.mamba_cache_mode == "align"
                and stored.block_hashes is not None
                and len(stored.block_hashes) == 1
            )

        def same(a: Any, b: Any) -> bool:  # b may carry fields a lacks (event-new-fields)
            if not isinstance(a, dict) or not isinstance(b, dict) or a.get("type") != b.get("type"):
                return False
            fields = b.get("fields", {})
            return all(results_equal(v, fields.get(k)) for k, v in a.get("fields", {}).items())

        i = 0
        for event in n:
            if i < len(o) and same(o[i], event):
                i += 1
            elif not rekey(event):
                return False
        return i == len(o)


def _prompt_tail_keys(ctx: Context, rid: str, gid: int) -> dict[int, str]:
    """Where 0.33.0's full-attention group ``gid`` registers request ``rid``'s prompt
    tail (the prompt's last hash boundary inside a block): block index -> pool key
    (the old side's hash there plus the group-id suffix). Empty when the boundary
    ends a block or is unknown."""
    request, hashes = ctx.requests.get(rid), ctx.hashes.get(rid)
    if request is None or not hashes:
        return {}
    prompt = request.get("prompt_token_ids") or request.get("prompt_embeds") or ()
    hash_block = ctx.config.hash_block_size
    block_size = ctx.config.groups[gid].block_size
    limits = {len(prompt) - 1, *((len(prompt),) if ctx.config.use_eagle else ())}
    keys: dict[int, str] = {}
    for limit in limits:
        boundary = min(limit // hash_block, len(hashes)) * hash_block
        if boundary > 0 and boundary % block_size:
            keys[boundary // block_size] = pool_key_hex(hashes[boundary // hash_block - 1], gid)
    return keys


class PromptTailEntryResurrected(Rule):
    """0.33.0's full-attention manager re-registers the prompt-tail partial entry on
    every caching step unless the block is keyed there already, so an entry that
    ``evict_blocks`` dropped comes back at the request's next allocation.
    Recognised where the new side only has extra entries, each on a block an
    earlier ``evict_blocks`` named, held by a request in a full-attention group
    whose blocks span several hash blocks, at the index of that request's prompt
    tail, keyed by the prompt-tail hash with that group's id, on a block 0.25.1
    counts as cached already."""

    def recognise_state(
        self,
        ctx: Context,
        op: str,
        diff_keys: Sequence[str],
        old: Mapping[str, Any],
        new: Mapping[str, Any],
    ) -> bool:
        if op not in ("allocate_slots", "cache_blocks") or not diff_keys or not ctx.evicted:
            return False
        if not set(diff_keys) <= {"block_hash", "cached"}:
            return False
        hash_block = ctx.config.hash_block_size
        tail_groups = {
            i
            for i, g in enumerate(ctx.config.groups)
            if g.kind == "full" and g.block_size > hash_block
        }
        if not tail_groups:
            return False
        held = _held_by_group(old, tail_groups) & _held_by_group(new, tail_groups) & ctx.evicted
        moved = _hash_presence_only(old, new, held, direction="new")
        if not moved:
            return False
        expected: dict[int, set[str]] = {}  # block -> the keys a prompt tail puts there
        tables, counts = new.get("req_to_blocks"), old.get("num_cached_block")
        if not isinstance(tables, list) or not isinstance(counts, list):
            return False
        for gid in tail_groups:
            per_request = tables[gid] if gid < len(tables) else None
            cached = counts[gid] if gid < len(counts) else None
            if not isinstance(per_request, dict) or not isinstance(cached, dict):
                continue
            for rid, blocks in per_request.items():
                for index, key in _prompt_tail_keys(ctx, str(rid), gid).items():
                    if index < len(blocks) and int(cached.get(rid, 0)) > index:
                        expected.setdefault(blocks[index], set()).add(key)
        new_hashes = _pairs(new, "block_hash")
        for block in moved:
            value = new_hashes.get(json.dumps(block))
            if not isinstance(value, dict) or value.get("bytes") not in expected.get(block, ()):
                return False
        old_cached = _pairs(old, "cached")
        for key, blocks in _pairs(new, "cached").items():
            extra = set(blocks or []) - set(old_cached.get(key) or [])
            hex_key = json.loads(key).get("bytes")
            if any(hex_key not in expected.get(b, ()) for b in extra):
                return False
        return True


class RetentionEagleBoundaries(Rule):
    """With a retention interval and EAGLE, which sliding-window tails and Mamba
    states a cached prompt keeps at its replay boundary: 0.25.1 keeps the tail
    ending one block above the boundary ``(prompt - 1)`` rounds down to, the block
    an EAGLE lookup matches and then drops, so the tail a resend needs (one block
    lower) is missing; 0.33.0 keeps the tails below the post-drop positions of both
    a resend and a longer sibling. Recognised at a caching call where only the
    presence of block hashes (and their cache entries) differs, on blocks requests
    hold in sliding-window or Mamba groups."""

    def recognise_state(
        self,
        ctx: Context,
        op: str,
        diff_keys: Sequence[str],
        old: Mapping[str, Any],
        new: Mapping[str, Any],
    ) -> bool:
        if op not in ("allocate_slots", "cache_blocks"):
            return False
        if not diff_keys or not set(diff_keys) <= {"block_hash", "cached"}:
            return False
        if ctx.config.prefix_cache_retention_interval is None or not ctx.has_eagle:
            return False
        sparse = {
            i for i, g in enumerate(ctx.config.groups) if g.kind in ("sliding_window", "mamba")
        }
        held = _held_by_group(old, sparse) & _held_by_group(new, sparse)
        return bool(_hash_presence_only(old, new, held, direction="any"))

    def recognise(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> bool:
        """The same choice seen one allocation later (where ``sub-block-prefix-entries``
        hides the extra hashes): a window block hashed on one side only is freed to
        the other end of the free queue, so an allocation hands out as many blocks
        per group, other ids in a sliding-window or Mamba group (and, where the
        block so freed went to another group, there too)."""
        if op != "allocate_slots" or ctx.config.prefix_cache_retention_interval is None:
            return False
        if not ctx.has_eagle or not _same_shape(old, new):
            return False
        groups = ctx.config.groups
        pairs = zip(_ok(old)["tuple"], _ok(new)["tuple"], strict=True)
        differing = [i for i, (a, b) in enumerate(pairs) if a != b]
        return any(
            groups[i].kind in ("sliding_window", "mamba") for i in differing if i < len(groups)
        )


class RetentionEagleLater(RetentionEagleBoundaries):
    """Where ``sub-block-prefix-entries`` hides the differing hashes, the same choice
    surfaces in events or in a later hit: events that differ only in sliding-window
    and Mamba groups' ``BlockStored``/``BlockRemoved``; a hit whose per-group blocks
    agree as far as both go (one side's hit reaches further)."""

    def recognise(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> bool:
        if op == "allocate_slots":
            return super().recognise(ctx, op, args, old, new)
        if ctx.config.prefix_cache_retention_interval is None or not ctx.has_eagle:
            return False
        groups = ctx.config.groups
        if op == "take_events":
            o, n = _ok(old), _ok(new)
            if not isinstance(o, list) or not isinstance(n, list):
                return False

            def kept(events: list[Any]) -> list[tuple[Any, Any]]:
                out = []
                for e in events:
                    fields = e.get("fields", {}) if isinstance(e, dict) else {}
                    g = fields.get("group_idx")
                    if isinstance(g, int) and 0 <= g < len(groups) and groups[g].kind in (
                        "sliding_window",
                        "mamba",
                    ):
                        continue
                    out.append((e.get("type") if isinstance(e, dict) else None, g))
                return out

            return kept(o) == kept(n) and o != n
        if op == "get_computed_blocks":
            a, b = _hit_blocks(old), _hit_blocks(new)
            if a is None or b is None or len(a) != len(b):
                return False
            return all(x[: len(y)] == y[: len(x)] for x, y in zip(a, b, strict=True))
        return False
