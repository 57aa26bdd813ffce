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

The rules live in modules by job, and this module re-exports every one of them,
so ``from kvcache.kit.ledger import ...`` keeps working: ``ledger_rules``
(``Rule``, ``Context``; the rules on results' shape, construction failures and
hits) and ``ledger_state_rules`` (what is cached and freed; ``CACHING_STATE``,
``FREEING_STATE``).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcache.kit.config import ManagerConfig, fine_grained_hits
from kvcache.kit.ledger_rules import (
    CannotBuildCheckpointsAdded,
    CannotBuildCircularAdded,
    CannotBuildDcpHybridCachingAdded,
    CannotBuildLookaheadAdded,
    CannotBuildMambaAll,
    CannotBuildTqRemoved,
    CommonPrefixZero,
    Context,
    EagleLookaheadWholePrompt,
    EventNewFields,
    HashRenaming,
    LookupAssertsBesideWindow,
    MmOutputBlockHash,
    NewBlockIds,
    Outcome,
    PopNullHead,
    PrefixStatsCounts,
    Rule,
    ShorterHitMambaEagle,
    StatsNewFields,
    StoredEvent,
    SubBlockEntries,
    ThreeFullGroupsHit,
    _ok,
    _stored_event,
)
from kvcache.kit.ledger_state_rules import (
    CACHING_STATE,
    FREEING_STATE,
    CachingStateRule,
    EagleFlagNeedsUseEagle,
    MambaFineGrainedHits,
    MambaFreedOnProcessedTokens,
    MambaNotDcpSharded,
    MambaPartialTailCopy,
    MambaPromptBoundaryRekey,
    PcpNotScaled,
    PromptTailEntryResurrected,
    RetentionEagleBoundaries,
    RetentionEagleLater,
)
from kvcache.kit.trace import results_equal, state_diff

__all__ = [
    "ALL_RELEASES_ENV",
    "CACHING_STATE",
    "FREEING_STATE",
    "LEDGER_PATH",
    "REFERENCE_LINE",
    "RULES",
    "VERDICTS",
    "WHEN",
    "CachingStateRule",
    "CannotBuildCheckpointsAdded",
    "CannotBuildCircularAdded",
    "CannotBuildDcpHybridCachingAdded",
    "CannotBuildLookaheadAdded",
    "CannotBuildMambaAll",
    "CannotBuildTqRemoved",
    "CommonPrefixZero",
    "Context",
    "EagleFlagNeedsUseEagle",
    "EagleLookaheadWholePrompt",
    "Entry",
    "EventNewFields",
    "HashRenaming",
    "Judge",
    "Judgement",
    "LookupAssertsBesideWindow",
    "MambaFineGrainedHits",
    "MambaFreedOnProcessedTokens",
    "MambaNotDcpSharded",
    "MambaPartialTailCopy",
    "MambaPromptBoundaryRekey",
    "MmOutputBlockHash",
    "NewBlockIds",
    "Observed",
    "Outcome",
    "PcpNotScaled",
    "PopNullHead",
    "PrefixStatsCounts",
    "PromptTailEntryResurrected",
    "RetentionEagleBoundaries",
    "RetentionEagleLater",
    "Rule",
    "ShorterHitMambaEagle",
    "StatsNewFields",
    "StoredEvent",
    "SubBlockEntries",
    "ThreeFullGroupsHit",
    "_stored_event",
    "entry_by_id",
    "fine_grained_hits",
    "in_range",
    "kind_matches",
    "load_ledger",
    "parse_range",
    "release_line_of",
    "version_key",
]

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

    def observes(self, config: ManagerConfig, kind: str) -> bool:
        """Whether this entry names a difference of ``kind`` (``op/part``) in
        ``config``: its kinds match and its layout condition (``WHEN``) holds."""
        return WHEN[self.when](config) and kind_matches(self.kinds, kind)

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


def _groups(config: ManagerConfig) -> int:
    return len(config.groups)


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
    "mamba-align-hybrid": lambda config: _groups(config) > 1
    and any(g.kind == "mamba" and g.mamba_cache_mode == "align" for g in config.groups),
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
    "lookup_asserts_beside_window": LookupAssertsBesideWindow,
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
            if entry.rule == "observed" and entry.observes(self.ctx.config, kind):
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
