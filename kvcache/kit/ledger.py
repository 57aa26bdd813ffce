"""The known-differences ledger: what differs between vLLM release lines, and how to tell.

``ledger.toml`` (next to this module) holds one entry per difference: its id,
the releases that differ from vLLM 0.25.1, what differs, a verdict
(``intended``, ``bug-fixed-in``, ``bug-introduced-in``, ``unknown``), an
upstream reference and a **rule**, one of ``RULES`` below:

* a *normaliser* rewrites both sides' outcomes (or states) to a common form;
  when the difference disappears, it is known and the comparison goes on
  (hash renaming, new fields, zeros for a deprecated call);
* an *expected-result rule* recognises a behaviour difference at one call (a
  shorter hit, a hash collision that a fixed bug made); the sequence stops
  there, reported as known, not as a divergence;
* ``adapter``: handled by the release line's adapter (``vllm_side.RELEASE_LINES``);
  listed for the changelog.

A ``Judge`` applies the entries that concern one pair of sides: the *old*
side behaves like 0.25.1 (kvcache, spec, vLLM 0.25.x, a trace recorded on
one of them), the *new* one is a later release.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcache.kit.config import GroupConfig, ManagerConfig, fine_grained_hits
from kvcache.kit.trace import pool_key_hex, results_equal, state_diff

LEDGER_PATH = Path(__file__).with_name("ledger.toml")
VERDICTS = ("intended", "bug-fixed-in", "bug-introduced-in", "unknown")
REFERENCE_LINE = "0.25"
#: Set to "1" (``python -m kvcache bisect`` does, per release): every entry judges,
#: whatever its ``releases`` range, to see where each one's behaviour shows.
ALL_RELEASES_ENV = "KVCACHE_LEDGER_ALL_RELEASES"


def version_key(version: str) -> tuple[int, int, int]:
    """``(0, 33, 0)`` for ``"0.33.0"``; a line (``"0.33"``) is its first release.

    Raises:
        ValueError: ``version`` is not of the form ``0.33`` or ``0.33.0``.
    """
    parts = version.strip().split(".")
    if not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"version={version!r}: use major.minor[.patch], like 0.29.0")
    major, minor, patch = (int(p) for p in (*parts, "0")[:3])
    return major, minor, patch


def parse_range(text: str) -> tuple[tuple[str, tuple[int, int, int]], ...]:
    """A ledger entry's ``releases``: comma-separated clauses ``>=X``, ``<X`` or ``==X``
    (``">=0.26.0,<0.29.0"``), all of which a release must meet.

    Raises:
        ValueError: an empty range or a clause of another form (naming it).
    """
    clauses = []
    for clause in text.split(","):
        clause = clause.strip()
        op = next((o for o in (">=", "==", "<") if clause.startswith(o)), None)
        if op is None:
            raise ValueError(f"releases={text!r}: clause {clause!r} is not >=X, <X or ==X")
        clauses.append((op, version_key(clause[len(op):])))
    return tuple(clauses)


def in_range(version: str, text: str) -> bool:
    """Whether release ``version`` (or a line's first release) is in range ``text``."""
    key = version_key(version)
    checks = {">=": key.__ge__, "<": key.__lt__, "==": key.__eq__}
    return all(checks[op](bound) for op, bound in parse_range(text))


def release_line_of(version: str | None) -> str:
    """``"0.33"`` for ``"0.33.0"``: the major.minor a version belongs to."""
    if not version:
        return REFERENCE_LINE
    return ".".join(version.split(".")[:2])


@dataclass(frozen=True)
class Entry:
    """One known difference (a ``[[difference]]`` of ledger.toml)."""

    id: str
    #: The releases that behave differently from 0.25.1: a range (``parse_range``).
    releases: str
    what: str
    verdict: str
    rule: str
    upstream: str = ""
    fixed_in: str = ""
    #: For rule "observed": the difference kinds (``op/part``, a trailing ``*``
    #: matches any rest) and the layout condition (``WHEN``) it is seen under.
    kinds: tuple[str, ...] = ()
    when: str = ""

    def covers(self, version: str) -> bool:
        """Whether the entry concerns release ``version`` (a line: its first release)."""
        return in_range(version, self.releases)

    @property
    def is_bug(self) -> bool:
        return self.verdict in ("bug-fixed-in", "bug-introduced-in")

    def label(self) -> str:
        """``id`` plus the verdict, for reports: ``bug-x (fixed in 0.33.0)``."""
        if self.verdict == "bug-fixed-in":
            return f"{self.id} (fixed in {self.fixed_in})"
        if self.verdict == "bug-introduced-in":
            return f"{self.id} (bug introduced in {self.fixed_in})"
        return f"{self.id} ({self.verdict})"


def load_ledger(path: Path | None = None) -> list[Entry]:
    """The ledger's entries, checked.

    Raises:
        ValueError: an entry with a missing field, an unknown verdict or rule, or
            a duplicate id (naming the entry).
    """
    path = path or LEDGER_PATH
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    entries: list[Entry] = []
    seen: set[str] = set()
    for i, raw in enumerate(data.get("difference", [])):
        name = raw.get("id", f"#{i}")
        missing = [k for k in ("id", "releases", "what", "verdict", "rule") if k not in raw]
        if missing:
            raise ValueError(f"{path}: entry {name!r} lacks {', '.join(missing)}")
        if raw["verdict"] not in VERDICTS:
            raise ValueError(
                f"{path}: entry {name!r} verdict={raw['verdict']!r}; use one of {VERDICTS}"
            )
        if raw["rule"] not in RULES:
            raise ValueError(f"{path}: entry {name!r} rule={raw['rule']!r} is not in RULES")
        if raw["verdict"] in ("bug-fixed-in", "bug-introduced-in") and not raw.get("fixed_in"):
            raise ValueError(f"{path}: entry {name!r} ({raw['verdict']}) needs fixed_in")
        if raw["rule"] == "observed" and (not raw.get("kinds") or raw.get("when", "") not in WHEN):
            raise ValueError(
                f"{path}: entry {name!r} (rule observed) needs kinds and a when of {sorted(WHEN)}"
            )
        if name in seen:
            raise ValueError(f"{path}: duplicate entry id {name!r}")
        if not isinstance(raw["releases"], str):
            raise ValueError(
                f"{path}: entry {name!r} releases={raw['releases']!r}; use a range, "
                'like ">=0.26.0" or ">=0.26.0,<0.29.0"'
            )
        try:
            parse_range(raw["releases"])
        except ValueError as exc:
            raise ValueError(f"{path}: entry {name!r}: {exc}") from None
        seen.add(name)
        entries.append(
            Entry(
                id=raw["id"],
                releases=raw["releases"],
                what=raw["what"],
                verdict=raw["verdict"],
                rule=raw["rule"],
                upstream=raw.get("upstream", ""),
                fixed_in=raw.get("fixed_in", ""),
                kinds=tuple(raw.get("kinds", ())),
                when=raw.get("when", ""),
            )
        )
    return entries


# ---------------------------------------------------------------- rules

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


def _groups(config: ManagerConfig) -> int:
    return len(config.groups)


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


#: Layout conditions an "observed" entry can name.
WHEN: dict[str, Callable[[ManagerConfig], bool]] = {
    "": lambda config: True,
    "hybrid": lambda config: _groups(config) > 1,
    "mamba": lambda config: any(g.kind == "mamba" for g in config.groups),
    "mixed-block-sizes": lambda config: len({g.block_size for g in config.groups}) > 1,
    "mamba-align-dense": lambda config: config.prefix_cache_retention_interval is None
    and any(g.kind == "mamba" and g.mamba_cache_mode == "align" for g in config.groups),
    "retention": lambda config: config.prefix_cache_retention_interval is not None,
    "no-caching": lambda config: not config.enable_caching,
    "eagle-hybrid": lambda config: config.use_eagle and _groups(config) > 1,
}


def kind_matches(patterns: Sequence[str], kind: str) -> bool:
    """Whether ``kind`` (``op/part``) is one of ``patterns`` (``*`` at the end: a prefix)."""
    return any(kind.startswith(p[:-1]) if p.endswith("*") else kind == p for p in patterns)


class Observed(Rule):
    """A difference seen but not yet understood (verdict ``unknown``): recognised by
    its kind under a layout condition, so that CI flags only new kinds."""


RULES: dict[str, Callable[[], Rule]] = {
    "observed": Observed,
    "mamba_prompt_boundary_rekey": MambaPromptBoundaryRekey,
    "prompt_tail_entry_resurrected": PromptTailEntryResurrected,
    "retention_eagle_boundaries": RetentionEagleLater,
    "adapter": Rule,
    "prefix_stats_counts": PrefixStatsCounts,
    "stats_new_fields": StatsNewFields,
    "event_new_fields": EventNewFields,
    "hash_renaming": HashRenaming,
    "new_block_ids": NewBlockIds,
    "pop_null_head": PopNullHead,
    "common_prefix_zero": CommonPrefixZero,
    "cannot_build_mamba_all": CannotBuildMambaAll,
    "cannot_build_tq_removed": CannotBuildTqRemoved,
    "cannot_build_circular_added": CannotBuildCircularAdded,
    "cannot_build_lookahead_added": CannotBuildLookaheadAdded,
    "cannot_build_checkpoints_added": CannotBuildCheckpointsAdded,
    "cannot_build_dcp_hybrid_caching_added": CannotBuildDcpHybridCachingAdded,
    "sub_block_entries": SubBlockEntries,
    "shorter_hit_mamba_eagle": ShorterHitMambaEagle,
    "mm_output_block_hash": MmOutputBlockHash,
    "three_full_groups_hit": ThreeFullGroupsHit,
    "mamba_freed_on_processed_tokens": MambaFreedOnProcessedTokens,
    "eagle_flag_needs_use_eagle": EagleFlagNeedsUseEagle,
    "mamba_fine_grained_hits": MambaFineGrainedHits,
    "mamba_partial_tail_copy": MambaPartialTailCopy,
    "eagle_lookahead_whole_prompt": EagleLookaheadWholePrompt,
    "pcp_not_scaled": PcpNotScaled,
    "mamba_not_dcp_sharded": MambaNotDcpSharded,
}


# ---------------------------------------------------------------- judging


@dataclass
class Judgement:
    """The ledger's view of one difference.

    ``ok``: the sides agree once normalised (``known``: the entries that made
    them agree). Otherwise ``known`` names the expected-result entry that
    recognised the difference (the sequence stops there), or is empty: an
    unknown difference.
    """

    ok: bool
    known: tuple[str, ...] = ()

    @property
    def stops(self) -> bool:
        return not self.ok


class Judge:
    """Applies the ledger's entries for one (old line, new line) pair of sides."""

    def __init__(
        self,
        config: ManagerConfig,
        new_line: str,
        old_is_expected: bool,
        entries: Sequence[Entry] | None = None,
    ) -> None:
        entries = load_ledger() if entries is None else entries
        every = os.environ.get(ALL_RELEASES_ENV) == "1"  # kvcache.kit.bisect
        self.entries = [e for e in entries if every or e.covers(new_line)]
        self.rules = [(e, RULES[e.rule]()) for e in self.entries]
        self.ctx = Context(config)
        self.old_is_expected = old_is_expected
        self.new_line = new_line

    def _orient(self, expected: Any, actual: Any) -> tuple[Any, Any]:
        return (expected, actual) if self.old_is_expected else (actual, expected)

    def observe(self, op: str, args: Mapping[str, Any], expected: Outcome, actual: Outcome) -> None:
        """Learn from every call (requests, hash pairs), equal or not."""
        if op == "add_request":
            self.ctx.requests[str(args.get("request_id"))] = dict(args)
        if op == "evict_blocks":
            self.ctx.evicted.update(int(b) for b in args.get("block_ids") or ())
        old, new = self._orient(expected, actual)
        if op in ("add_request", "append_output_token_ids") and isinstance(_ok(old), list):
            known = self.ctx.hashes.setdefault(str(args.get("request_id")), [])
            if op == "add_request":
                known.clear()
            known.extend(h["bytes"] for h in _ok(old) if isinstance(h, dict) and "bytes" in h)
        for _, rule in self.rules:
            if isinstance(rule, HashRenaming):
                rule.learn(self.ctx, op, args, old, new)

    def outcome(
        self,
        op: str,
        args: Mapping[str, Any],
        expected: Outcome,
        actual: Outcome,
        equal: Callable[[Outcome, Outcome], bool],
    ) -> Judgement:
        """Judge outcomes that ``equal`` (the kit's comparison) found different."""
        old, new = self._orient(expected, actual)
        used: list[str] = []
        for _ in range(2):  # a second pass: one normaliser can enable another
            for entry, rule in self.rules:
                o, n = rule.outcome(self.ctx, op, args, old, new)
                if (o, n) != (old, new):
                    if entry.id not in used:
                        used.append(entry.id)
                    old, new = o, n
                    if equal(*self._orient(old, new)):
                        return Judgement(True, tuple(used))
        for entry, rule in self.rules:
            if rule.recognise(self.ctx, op, args, old, new):
                return Judgement(False, (entry.id,))
        part = "raises" if "raises" in old or "raises" in new else "result"
        return Judgement(False, self.observed(f"{op}/{part}"))

    def observed(self, kind: str) -> tuple[str, ...]:
        """The "observed" entry for a difference of ``kind`` here, if there is one."""
        for entry in self.entries:
            if (
                entry.rule == "observed"
                and WHEN[entry.when](self.ctx.config)
                and kind_matches(entry.kinds, kind)
            ):
                return (entry.id,)
        return ()

    def state(
        self, op: str, expected: dict[str, Any], actual: dict[str, Any]
    ) -> tuple[Judgement, list[str]]:
        """Judge canonical states that differ; returns the judgement and the remaining diff."""
        old, new = self._orient(expected, actual)
        used: list[str] = []
        for entry, rule in self.rules:
            o, n = rule.state(self.ctx, old, new)
            if (o, n) != (old, new):
                old, new = o, n
                used.append(entry.id)
        diff = state_diff(*self._orient(old, new))
        if not diff:
            return Judgement(True, tuple(used)), []
        keys = [
            key
            for key in sorted(set(old) | set(new))
            if not results_equal(old.get(key), new.get(key))
        ]
        for entry, rule in self.rules:
            if rule.recognise_state(self.ctx, op, keys, old, new):
                return Judgement(False, (entry.id,)), diff
        # Two causes in one call: one entry explains what was cached, another what
        # was freed (e.g. a Mamba state freed early beside an EAGLE caching change).
        caching = [k for k in keys if k in CACHING_STATE]
        freeing = [k for k in keys if k in FREEING_STATE]
        if caching and freeing and len(caching) + len(freeing) == len(keys):
            cached_by = [
                e.id for e, r in self.rules if r.recognise_state(self.ctx, op, caching, old, new)
            ]
            freed_by = [
                e.id for e, r in self.rules if r.recognise_state(self.ctx, op, freeing, old, new)
            ]
            if cached_by and freed_by:
                return Judgement(False, (cached_by[0], freed_by[0])), diff
        return Judgement(False, self.observed(f"{op}/state:" + ",".join(keys))), diff

    def cannot_build(self, reason: str, refused_by: str = "new") -> str | None:
        """The entry that explains a construction failure, if one does: of the new
        side (``refused_by="new"``, the later release) or of the old one (``"old"``,
        the side that behaves like 0.25.1)."""
        if refused_by not in ("new", "old"):
            raise ValueError(f"refused_by={refused_by!r}; expected 'new' or 'old'")
        for entry, rule in self.rules:
            if rule.refused_by == refused_by and rule.cannot_build(self.ctx.config, reason):
                return entry.id
        return None


def entry_by_id(entry_id: str, entries: Sequence[Entry] | None = None) -> Entry:
    """The ledger entry called ``entry_id``.

    Raises:
        KeyError: no such entry.
    """
    for entry in load_ledger() if entries is None else entries:
        if entry.id == entry_id:
            return entry
    raise KeyError(f"no ledger entry {entry_id!r}")
