"""The ledger's rules, first part: what a rule is, and the rules on results' shape.

A ``Rule`` is how one ledger entry (``kvcache.kit.ledger``) recognises its
difference; a ``Context`` is what a judge learns along one sequence. The rules
here are the normalisers of what a call returns (stats and event fields, hash
renaming, new block ids, null heads, common-prefix counts), the construction
failures (``cannot_build``), the sub-block prefix entries, and the expected-result
rules on a lookup's hit. The rules on what is cached and freed are in
``kvcache.kit.ledger_state_rules``; ``RULES`` in ``kvcache.kit.ledger`` names
them all, and that module re-exports every rule.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcache.kit.config import GroupConfig, ManagerConfig

Outcome = dict[str, Any]


@dataclass
class Context:
    """What a judge learns along one sequence: the config, requests and hash renaming."""

    config: ManagerConfig
    requests: dict[str, dict[str, Any]] = field(default_factory=dict)
    rename: dict[str, str] = field(default_factory=dict)  # new hash hex -> old hash hex
    rename_int: dict[int, int] = field(default_factory=dict)
    renamed_old: dict[str, str] = field(default_factory=dict)  # old hex -> new hex
    collision: bool = False
    hash_hex_len: int = 0
    evicted: set[int] = field(default_factory=set)  # block ids an evict_blocks call named
    hashes: dict[str, list[str]] = field(default_factory=dict)  # request -> old side's hashes

    @property
    def has_mamba(self) -> bool:
        return any(g.kind == "mamba" for g in self.config.groups)

    @property
    def has_eagle(self) -> bool:
        return self.config.use_eagle or any(g.is_eagle_group for g in self.config.groups)


class Rule:
    """How one entry recognises its difference; the defaults recognise nothing."""

    def outcome(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> tuple[Outcome, Outcome]:
        """Both outcomes rewritten to a common form (normalisers)."""
        return old, new

    def state(
        self, ctx: Context, old: dict[str, Any], new: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Both canonical states rewritten to a common form (normalisers)."""
        return old, new

    def recognise(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> bool:
        """Whether a remaining difference at this call is this entry's behaviour."""
        return False

    def recognise_state(
        self,
        ctx: Context,
        op: str,
        diff_keys: Sequence[str],
        old: Mapping[str, Any],
        new: Mapping[str, Any],
    ) -> bool:
        """Whether a remaining state difference (in ``diff_keys``; ``old`` and ``new``
        the normalised states) is this entry's."""
        return False

    #: Whose construction failure ``cannot_build`` explains: ``"new"`` (the later
    #: release refuses a layout 0.25.1 builds) or ``"old"`` (the 0.25.1 side refuses
    #: a layout the later release adds).
    refused_by = "new"

    def cannot_build(self, config: ManagerConfig, reason: str) -> bool:
        """Whether a construction failure (of the ``refused_by`` side) is this entry's."""
        return False


@dataclass(frozen=True)
class StoredEvent:
    """What the rules read of a ``BlockStored`` event: its group (``group_idx``,
    known to be one of the config's groups), its ``block_size`` and ``block_hashes``
    (``None`` where the field is missing or not an int / a list)."""

    group_idx: int
    group: GroupConfig
    block_size: int | None
    block_hashes: list[Any] | None


def _stored_event(event: Any, groups: Sequence[GroupConfig]) -> StoredEvent | None:
    """``event`` read as a ``BlockStored`` event of one of ``groups``; ``None`` for
    another type, a malformed event or a ``group_idx`` out of range."""
    if not isinstance(event, dict) or event.get("type") != "BlockStored":
        return None
    fields = event.get("fields", {})
    if not isinstance(fields, dict):
        return None
    group = fields.get("group_idx")
    if not isinstance(group, int) or not 0 <= group < len(groups):
        return None
    size, hashes = fields.get("block_size"), fields.get("block_hashes")
    return StoredEvent(
        group_idx=group,
        group=groups[group],
        block_size=size if isinstance(size, int) else None,
        block_hashes=hashes if isinstance(hashes, list) else None,
    )


def _ok(outcome: Outcome) -> Any:
    return outcome.get("ok")


def _with_ok(outcome: Outcome, value: Any) -> Outcome:
    return {**outcome, "ok": value}


class PrefixStatsCounts(Rule):
    COUNTS = (
        "requests",
        "queries",
        "hits",
        "preempted_requests",
        "preempted_queries",
        "preempted_hits",
    )

    def outcome(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> tuple[Outcome, Outcome]:
        if op != "make_prefix_cache_stats" or not isinstance(_ok(old), dict):
            return old, new
        if not isinstance(_ok(new), dict):
            return old, new

        def counts(value: dict[str, Any]) -> list[Any]:
            return [value.get("fields", {}).get(k) for k in self.COUNTS]

        if counts(_ok(old)) == counts(_ok(new)):
            return old, new

        def drop(value: dict[str, Any]) -> dict[str, Any]:
            fields = {k: v for k, v in value.get("fields", {}).items() if k not in self.COUNTS}
            return {**value, "fields": fields}

        return _with_ok(old, drop(_ok(old))), _with_ok(new, drop(_ok(new)))


class StatsNewFields(Rule):
    def outcome(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> tuple[Outcome, Outcome]:
        o, n = _ok(old), _ok(new)
        if op != "make_prefix_cache_stats" or not isinstance(o, dict) or not isinstance(n, dict):
            return old, new
        fields = {k: v for k, v in n.get("fields", {}).items() if k in o.get("fields", {})}
        return old, _with_ok(new, {**n, "fields": fields})


class EventNewFields(Rule):
    def outcome(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> tuple[Outcome, Outcome]:
        o, n = _ok(old), _ok(new)
        if op != "take_events" or not isinstance(o, list) or not isinstance(n, list):
            return old, new
        if len(o) != len(n):
            return old, new
        trimmed = []
        for a, b in zip(o, n, strict=True):
            if isinstance(a, dict) and isinstance(b, dict) and a.get("type") == b.get("type"):
                keep = a.get("fields", {})
                b = {**b, "fields": {k: v for k, v in b.get("fields", {}).items() if k in keep}}
            trimmed.append(b)
        return old, _with_ok(new, trimmed)


class HashRenaming(Rule):
    """Learns new -> old hash pairs where a request's hashes differ, renames the new side."""

    MASK = (1 << 64) - 1

    def learn(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> None:
        if op not in ("add_request", "append_output_token_ids"):
            return
        request = ctx.requests.get(str(args.get("request_id")), {})
        if not any(request.get(k) for k in ("lora", "cache_salt", "mm_features", "prompt_embeds")):
            return  # plain blocks hash alike in every release: no renaming
        o, n = _ok(old), _ok(new)
        if not isinstance(o, list) or not isinstance(n, list) or len(o) != len(n):
            return
        for a, b in zip(o, n, strict=True):
            if not (isinstance(a, dict) and isinstance(b, dict) and "bytes" in a and "bytes" in b):
                continue
            old_hex, new_hex = a["bytes"], b["bytes"]
            if old_hex == new_hex or new_hex in ctx.rename:
                continue
            if ctx.renamed_old.get(old_hex, new_hex) != new_hex:
                ctx.collision = True  # two new hashes for one old one: not a renaming
                continue
            ctx.rename[new_hex] = old_hex
            ctx.hash_hex_len = len(new_hex)
            ctx.renamed_old[old_hex] = new_hex
            new_int = int(new_hex, 16) & self.MASK
            ctx.rename_int[new_int] = int(old_hex, 16) & self.MASK

    def apply(self, ctx: Context, value: Any, in_event: bool = False) -> Any:
        if isinstance(value, dict):
            if set(value) == {"bytes"}:
                return {"bytes": self.rename_hex(ctx, value["bytes"])}
            event = "fields" in value and "type" in value
            out = {}
            for k, v in value.items():
                if in_event and k in ("block_hashes", "parent_block_hash"):
                    v = self.apply_int(ctx, v)
                out[k] = self.apply(ctx, v, in_event=event or (in_event and k == "fields"))
            if set(out) == {"dict"} and isinstance(out["dict"], list):  # keep canon's order
                out["dict"] = sorted(out["dict"], key=lambda kv: json.dumps(kv[0], sort_keys=True))
            return out
        if isinstance(value, list):
            return [self.apply(ctx, v, in_event) for v in value]
        return value

    @staticmethod
    def rename_hex(ctx: Context, hex_value: str) -> str:
        """A hash renamed; a pool key (hash plus group-id suffix) keeps its suffix."""
        if hex_value in ctx.rename:
            return ctx.rename[hex_value]
        size = ctx.hash_hex_len
        if size and len(hex_value) > size and hex_value[:size] in ctx.rename:
            return ctx.rename[hex_value[:size]] + hex_value[size:]
        return hex_value

    def apply_int(self, ctx: Context, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return ctx.rename_int.get(value, value)
        if isinstance(value, list):
            return [self.apply_int(ctx, v) for v in value]
        return value

    def outcome(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> tuple[Outcome, Outcome]:
        if not ctx.rename or "ok" not in new:
            return old, new
        return old, _with_ok(new, self.apply(ctx, new["ok"]))

    def state(
        self, ctx: Context, old: dict[str, Any], new: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        if not ctx.rename:
            return old, new
        renamed: dict[str, Any] = self.apply(ctx, new)
        return old, renamed


class NewBlockIds(Rule):
    def outcome(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> tuple[Outcome, Outcome]:
        if op != "take_new_block_ids" or "ok" not in old or "ok" not in new:
            return old, new
        return _with_ok(old, None), _with_ok(new, None)

    def state(
        self, ctx: Context, old: dict[str, Any], new: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        drop = "new_block_ids"
        return (
            {k: v for k, v in old.items() if k != drop},
            {k: v for k, v in new.items() if k != drop},
        )


class PopNullHead(Rule):
    def outcome(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> tuple[Outcome, Outcome]:
        """Both sides without null blocks: 0.33.0 drops a group's leading nulls but
        keeps the nulls between Mamba states, so only the real blocks compare."""
        o, n = _ok(old), _ok(new)
        if op != "pop_blocks_for_free" or not isinstance(o, list) or not isinstance(n, list):
            return old, new
        return _with_ok(old, [b for b in o if b != 0]), _with_ok(new, [b for b in n if b != 0])


class CommonPrefixZero(Rule):
    def outcome(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> tuple[Outcome, Outcome]:
        o = _ok(old)
        if op != "get_num_common_prefix_blocks" or not isinstance(o, list):
            return old, new
        return _with_ok(old, [0] * len(o)), new

    def state(
        self, ctx: Context, old: dict[str, Any], new: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """0.25.1's lookup leaves an empty ``req_to_blocks`` entry for a request
        with no blocks; 0.33.0 no longer looks."""
        o, n = old.get("req_to_blocks"), new.get("req_to_blocks")
        if not (isinstance(o, list) and isinstance(n, list) and len(o) == len(n)):
            return old, new
        trimmed = [
            {rid: blocks for rid, blocks in a.items() if blocks or rid in b}
            if isinstance(a, dict) and isinstance(b, dict)
            else a
            for a, b in zip(o, n, strict=True)
        ]
        return {**old, "req_to_blocks": trimmed}, new


class CannotBuildMambaAll(Rule):
    def cannot_build(self, config: ManagerConfig, reason: str) -> bool:
        return config.enable_caching and any(
            g.kind == "mamba" and g.mamba_cache_mode != "align" for g in config.groups
        )


class CannotBuildTqRemoved(Rule):
    """0.33.0 has no ``TQFullAttentionSpec``: a layout with a TurboQuant group cannot be built."""

    def cannot_build(self, config: ManagerConfig, reason: str) -> bool:
        return any(g.kind == "tq_full" for g in config.groups) and "TQFullAttentionSpec" in reason


class CannotBuildCircularAdded(Rule):
    """0.25.1 has no ``CircularBufferSpec``: a layout with a ring-buffer group cannot be
    built there (vLLM 0.25.1 lacks the class; kvcache's 0.25.1 profile refuses it)."""

    refused_by = "old"

    def cannot_build(self, config: ManagerConfig, reason: str) -> bool:
        return any(g.kind == "circular" for g in config.groups) and "CircularBufferSpec" in reason


class CannotBuildLookaheadAdded(Rule):
    """0.25.1's manager has no lookahead arguments: a configuration with
    ``num_hash_lookahead_tokens`` or ``num_prefill_lookahead`` cannot be built there
    (vLLM 0.25.1 raises TypeError on the unknown keyword; kvcache's 0.25.1 profile
    refuses the value, naming the argument)."""

    refused_by = "old"

    def cannot_build(self, config: ManagerConfig, reason: str) -> bool:
        return any(
            getattr(config, name) and name in reason
            for name in ("num_hash_lookahead_tokens", "num_prefill_lookahead")
        )


class CannotBuildCheckpointsAdded(Rule):
    """0.25.1's ``MambaSpec`` has no prefill checkpoint fields: a layout with a Mamba
    group setting them cannot be built there (vLLM 0.25.1 raises TypeError on the
    unknown field; kvcache's 0.25.1 profile refuses the value, naming the field)."""

    refused_by = "old"

    def cannot_build(self, config: ManagerConfig, reason: str) -> bool:
        return any(g.has_checkpoint_fields for g in config.groups) and any(
            name in reason
            for name in ("num_prefill_checkpoint_blocks", "prefill_checkpoint_alignment")
        )


class CannotBuildDcpHybridCachingAdded(Rule):
    """0.25.1 caches no layout of several groups under decode context parallelism
    (vLLM 0.25.1 asserts "DCP not support hybrid attn"; kvcache's 0.25.1 profile
    raises ``ContextParallelError``); 0.33.0 builds it with per-group geometry."""

    refused_by = "old"

    def cannot_build(self, config: ManagerConfig, reason: str) -> bool:
        return (
            config.dcp_world_size > 1
            and config.enable_caching is not False
            and len(config.groups) > 1
            and any(
                words in reason
                for words in ("DCP not support hybrid", "do not support context parallelism")
            )
        )


class SubBlockEntries(Rule):
    """Where a group's blocks span several hash blocks, drops what only the new side
    has: extra cache entries (keys the old side lacks), the primary hash of a block
    the old side has not hashed yet (a prompt tail registered inside a block) and
    the ``BlockStored`` event of such a partial entry (fewer tokens than its group's
    block). Later hits that use a partial entry still differ."""

    def applies(self, ctx: Context) -> bool:
        hash_block = ctx.config.hash_block_size
        return any(g.block_size > hash_block for g in ctx.config.groups)

    def outcome(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> tuple[Outcome, Outcome]:
        n = _ok(new)
        if op != "take_events" or not isinstance(n, list) or not self.applies(ctx):
            return old, new
        groups = ctx.config.groups

        def partial(event: Any) -> bool:
            stored = _stored_event(event, groups)
            return (
                stored is not None
                and stored.block_size is not None
                and stored.block_size < stored.group.block_size
            )

        kept = [event for event in n if not partial(event)]
        return (old, new) if len(kept) == len(n) else (old, _with_ok(new, kept))

    def state(
        self, ctx: Context, old: dict[str, Any], new: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """An empty map (``{}``) counts as one without entries. A full-attention block
        the old side counts as cached but holds unhashed (an evicted block) is no
        block "not hashed yet": a new-side entry on it is kept for the other rules."""
        if not self.applies(ctx):
            return old, new
        out = dict(new)
        stale = {json.dumps(b) for b in _cached_unhashed_full_blocks(ctx, old)}
        o, n = _entries(old.get("cached")), _entries(new.get("cached"))
        if o is not None and n is not None and n:
            old_keys = {json.dumps(k, sort_keys=True) for k, _ in o}
            kept = [
                kv
                for kv in n
                if json.dumps(kv[0], sort_keys=True) in old_keys
                or any(json.dumps(b) in stale for b in kv[1] or [])
            ]
            out["cached"] = _as_map(kept, old.get("cached"))
        oh, nh = _entries(old.get("block_hash")), _entries(new.get("block_hash"))
        if oh is not None and nh is not None and nh:
            hashed = {json.dumps(b) for b, _ in oh} | stale
            kept = [kv for kv in nh if json.dumps(kv[0]) in hashed]
            out["block_hash"] = _as_map(kept, old.get("block_hash"))
        return (old, new) if out == new else (old, out)

    def recognise(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> bool:
        """Events where the new side has extra ones, all for groups whose blocks span
        several hash blocks (partial entries stored or removed)."""
        o, n = _ok(old), _ok(new)
        if op != "take_events" or not self.applies(ctx):
            return False
        if not isinstance(o, list) or not isinstance(n, list) or len(n) <= len(o):
            return False

        def key(event: Any) -> tuple[Any, Any]:
            if not isinstance(event, dict):
                return (None, None)
            return (event.get("type"), event.get("fields", {}).get("group_idx"))

        extra = Counter(key(e) for e in n)
        extra.subtract(Counter(key(e) for e in o))
        if any(count < 0 for count in extra.values()):
            return False
        hash_block = ctx.config.hash_block_size
        groups = ctx.config.groups
        return all(
            isinstance(group, int)
            and 0 <= group < len(groups)
            and groups[group].block_size > hash_block
            for (_, group), count in extra.items()
            if count > 0
        )

    def recognise_state(
        self,
        ctx: Context,
        op: str,
        diff_keys: Sequence[str],
        old: Mapping[str, Any],
        new: Mapping[str, Any],
    ) -> bool:
        """A free whose queue order alone differs: a block with a partial entry is
        hashed, so it goes to the queue's tail (kept) where 0.25.1 puts the unhashed
        block first (evicted first)."""
        freeing_ops = ("free", "free_blocks", "remove_skipped_blocks", "allocate_slots")
        if op not in freeing_ops or list(diff_keys) != ["free_queue"]:
            return False
        o, n = old.get("free_queue"), new.get("free_queue")
        return (
            self.applies(ctx)
            and isinstance(o, list)
            and isinstance(n, list)
            and sorted(o) == sorted(n)
        )


def _entries(value: Any) -> list[Any] | None:
    """The pairs of a canonical map (``{"dict": [[k, v], ...]}``; ``{}`` is empty),
    ``None`` for anything else."""
    if value == {}:
        return []
    pairs = value.get("dict") if isinstance(value, dict) else None
    return pairs if isinstance(pairs, list) else None


def _as_map(pairs: list[Any], like: Any) -> dict[str, Any]:
    """``pairs`` as a canonical map, empty written as ``like`` writes it."""
    return {"dict": pairs} if pairs or like != {} else {}


def _cached_unhashed_full_blocks(ctx: Context, state: Mapping[str, Any]) -> set[Any]:
    """Blocks a request holds in a full-attention group below its cached-block count
    that carry no hash in ``state`` (full attention hashes every block it caches, so
    such a block lost its hash: ``evict_blocks``)."""
    tables, counts = state.get("req_to_blocks"), state.get("num_cached_block")
    hashed = {json.dumps(b) for b, _ in _entries(state.get("block_hash")) or []}
    if not isinstance(tables, list) or not isinstance(counts, list):
        return set()
    out: set[Any] = set()
    for gid, (per_request, cached) in enumerate(zip(tables, counts, strict=False)):
        if gid >= len(ctx.config.groups) or ctx.config.groups[gid].kind != "full":
            continue
        if not isinstance(per_request, dict) or not isinstance(cached, dict):
            continue
        for rid, blocks in per_request.items():
            for block in blocks[: int(cached.get(rid, 0))]:
                if block != 0 and json.dumps(block) not in hashed:
                    out.add(block)
    return out


def _hit_tokens(outcome: Outcome) -> int | None:
    value = _ok(outcome)
    if isinstance(value, dict) and "num_computed_tokens" in value:
        return int(value["num_computed_tokens"])
    return None


#: Group kinds whose hit blocks must cover the hit (Mamba's hold one state).
_COVERING_KINDS = ("full", "sliding_window")


class ShorterHitMambaEagle(Rule):
    """With Mamba and EAGLE: the new side's hit is shorter, or the old side's hit is
    longer than its own full-attention or sliding-window blocks cover (the bug's
    signature: Mamba, which never drops the EAGLE block, grew the candidate back past
    what an attention group kept after its drop) while the new side's blocks of those
    groups cover its hit."""

    def recognise(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> bool:
        o, n = _hit_tokens(old), _hit_tokens(new)
        if op != "get_computed_blocks" or not (ctx.has_mamba and ctx.has_eagle):
            return False
        if o is None or n is None:
            return False
        if n < o:
            return True
        groups = ctx.config.groups

        def covers(outcome: Outcome, hit: int) -> bool:
            blocks = _hit_blocks(outcome)
            return blocks is not None and all(
                len(b) * g.block_size >= hit
                for b, g in zip(blocks, groups, strict=False)
                if g.kind in _COVERING_KINDS
            )

        return not covers(old, o) and covers(new, n)


class LookupAssertsBesideWindow(Rule):
    """A lookup the new side refuses with ``AssertionError`` where the old side answers,
    in a layout that turns fine-grained hits on (an 'align' Mamba group whose block
    is larger than the hash block) beside a sliding-window group whose block is not
    the hash block: its manager asserts that a hit is block-aligned."""

    def recognise(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> bool:
        config = ctx.config
        hash_block = config.hash_block_size
        fine_grained = any(
            g.kind == "mamba" and g.mamba_cache_mode == "align" and g.block_size > hash_block
            for g in config.groups
        )
        window = any(
            g.kind == "sliding_window" and g.block_size != hash_block for g in config.groups
        )
        return (
            op.startswith("get_computed_blocks")
            and new.get("raises") == "AssertionError"
            and "raises" not in old
            and fine_grained
            and window
        )


class MmOutputBlockHash(Rule):
    def recognise(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> bool:
        request = ctx.requests.get(str(args.get("request_id")), {})
        return op == "append_output_token_ids" and bool(request.get("mm_features"))


def _hit_blocks(outcome: Outcome) -> list[list[Any]] | None:
    value = _ok(outcome)
    block_ids = value.get("block_ids") if isinstance(value, dict) else None
    groups = block_ids.get("tuple") if isinstance(block_ids, dict) else None
    return groups if isinstance(groups, list) else None


class ThreeFullGroupsHit(Rule):
    """A lookup where the old side leaves some full group more hit blocks than its
    hit needs (only the first group is trimmed) and the new side trims them all."""

    def recognise(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> bool:
        groups = ctx.config.groups
        if op != "get_computed_blocks" or sum(g.kind == "full" for g in groups) < 3:
            return False
        o, n = _hit_blocks(old), _hit_blocks(new)
        o_hit, n_hit = _hit_tokens(old), _hit_tokens(new)
        if o is None or n is None or o_hit is None or n_hit is None:
            return False

        def untrimmed(blocks: list[list[Any]], hit: int) -> bool:
            return any(
                g.kind == "full" and len(b) > -(-hit // g.block_size)
                for b, g in zip(blocks, groups, strict=False)
            )

        return untrimmed(o, o_hit) and not untrimmed(n, n_hit)


class EagleLookaheadWholePrompt(Rule):
    """With EAGLE in a multi-group layout, 0.25.1 caps the one-block look-ahead an
    EAGLE group matches before dropping it at the lookup's limit (prompt - 1);
    0.33.0 caps it at the hashed prompt, so a fully cached prompt hits longer: one
    block, or more where the fixed point then settles higher (a Mamba state there).
    Recognised where the new hit is longer and its full-attention blocks cover it."""

    def recognise(
        self, ctx: Context, op: str, args: Mapping[str, Any], old: Outcome, new: Outcome
    ) -> bool:
        o, n = _hit_tokens(old), _hit_tokens(new)
        if op != "get_computed_blocks" or o is None or n is None or n <= o:
            return False
        if not ctx.config.use_eagle or len(ctx.config.groups) < 2:
            return False
        blocks = _hit_blocks(new)
        return blocks is not None and all(  # the longer hit is covered by every full group
            len(b) * g.block_size >= n
            for b, g in zip(blocks, ctx.config.groups, strict=False)
            if g.kind == "full"
        )
