"""Declared features: what a subject supports, so that the driver draws only that.

A subject declares the features it supports (``FEATURES``, an iterable of the
names below, or ``features()`` returning one, on its factory, its ``Adapter`` or,
for an ``exec:`` subject, in its ``hello`` answer; ``--features`` overrides).
Without a declaration a subject supports everything: today's behaviour.

The random scheduler then

* runs only the layout families whose group kinds (and knobs: several groups,
  context parallelism, a retention interval) the features name (``families_for``);
* builds each config without what is not declared (``restrict_config``: EAGLE,
  watermark, events, stats, lookahead hashing, caching off);
* rewrites or drops the calls that need an undeclared feature, on both sides, so
  that the reference and the subject see the same, still valid, scheduler
  sequence (``restrict_call``): request fields (LoRA, salt, multimodal, prompt
  embeddings, skipping the cache) are left out, external tokens become tokens the
  step computes, a deferred free becomes a free, admin calls are not made.

``FEATURES`` maps every name to what it covers (docs/protocol.md has the table).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from kvcache.kit.config import GroupConfig, ManagerConfig

#: The conformance levels, weakest first (``kvcache.kit.levels`` says what each promises).
LEVELS = ("admission", "hits", "sharing", "exact")

#: Layout kinds, as family tokens (``driver.Family.kinds``; ``mamba-*`` is ``mamba``).
KIND_FEATURES = (
    "full", "swa", "chunked", "mamba", "cross", "mla", "swa-mla", "rswa", "tq",
    "hidden-state", "circular",
)

#: Every feature and what it covers.
FEATURES: dict[str, str] = {
    **{kind: f"layout families with {kind} groups" for kind in KIND_FEATURES},
    "hybrid": "layout families of more than one group",
    "context-parallel": "decode / prefill context parallelism (dcp, pcp > 1)",
    "retention": "a prefix-cache retention interval",
    "caching-off": "configs with enable_caching false",
    "eagle": "use_eagle and EAGLE groups",
    "lookahead": "lookahead slots (num_lookahead_tokens) and lookahead hashing",
    "watermark": "a watermark",
    "lora": "requests with a LoRA adapter (lora)",
    "salt": "requests with a cache_salt",
    "multimodal": "requests with multimodal placeholders (mm_features)",
    "prompt-embeds": "requests given by prompt embeddings",
    "skip-reading": "requests with skip_reading_prefix_cache",
    "external": "external computed tokens, async KV loads (P/D): "
    "num_external_computed_tokens, delay_cache_blocks, cache_blocks",
    "reserved": "allocate_slots with reserved_blocks",
    "full-sequence": "allocate_slots with full_sequence_must_fit",
    "events": "KV events (enable_kv_cache_events, take_events)",
    "stats": "prefix-cache stats (log_stats, make_prefix_cache_stats, new_step_starts)",
    "eviction": "evict_blocks",
    "reset": "reset_prefix_cache",
    "deferred-free": "pop_blocks_for_free then free_blocks (else a free)",
    "new-block-ids": "take_new_block_ids",
    "common-prefix": "get_num_common_prefix_blocks",
    "queries": "get_block_ids, get_blocks, get_block_ids_for_computed_tokens",
    "usage": "the usage property",
    "skipped-blocks": "remove_skipped_blocks",
    "rejections": "calls the reference rejects (the subject must raise too)",
}
ALL_FEATURES = frozenset(FEATURES)

#: Calls made only when their feature is declared (else not made at all).
OP_FEATURES = {
    "take_events": "events",
    "make_prefix_cache_stats": "stats",
    "new_step_starts": "stats",
    "evict_blocks": "eviction",
    "reset_prefix_cache": "reset",
    "take_new_block_ids": "new-block-ids",
    "get_num_common_prefix_blocks": "common-prefix",
    "get_block_ids": "queries",
    "get_blocks": "queries",
    "get_block_ids_for_computed_tokens": "queries",
    "usage": "usage",
    "remove_skipped_blocks": "skipped-blocks",
    "cache_blocks": "external",
}
#: Request fields left out unless their feature is declared.
REQUEST_FEATURES = {
    "lora": "lora",
    "cache_salt": "salt",
    "mm_features": "multimodal",
    "prompt_embeds": "prompt-embeds",
    "skip_reading_prefix_cache": "skip-reading",
}


def parse_features(text: str, what: str = "--features") -> frozenset[str]:
    """Comma-separated feature names (``all``: every one) as a set.

    Raises:
        ValueError: an unknown name, named with ``what`` and the known ones.
    """
    names = [name.strip() for name in text.split(",") if name.strip()]
    if "all" in names:
        return ALL_FEATURES
    return check_features(names, what)


def check_features(names: Iterable[Any], what: str) -> frozenset[str]:
    """``names`` as a feature set, every one known.

    Raises:
        ValueError: a name that is not a feature (or not a string).
    """
    names = list(names)
    unknown = [n for n in names if not isinstance(n, str) or n not in FEATURES]
    if unknown:
        raise ValueError(
            f"{what}: unknown feature(s) {', '.join(map(repr, unknown))}; "
            f"choose from {', '.join(FEATURES)} (or all)"
        )
    return frozenset(names)


def declared_features(target: Any, what: str) -> frozenset[str]:
    """What ``target`` (a factory, an adapter or its factory) declares: its ``FEATURES``
    or ``features()``; every feature when it declares nothing.

    Raises:
        ValueError: a declaration naming an unknown feature.
    """
    for candidate in (target, getattr(target, "factory", None)):
        if candidate is None:
            continue
        declared = getattr(candidate, "FEATURES", None)
        if declared is None and callable(getattr(candidate, "features", None)):
            declared = candidate.features()
        if declared is not None:
            if isinstance(declared, str):
                return parse_features(declared, what)
            return check_features(declared, what)
    return ALL_FEATURES


def family_features(family: Any) -> frozenset[str]:
    """The features a layout family (``driver.Family``) needs to be run at all."""
    kinds = {"mamba" if k.startswith("mamba") else k for k in family.kinds}
    needed = set(kinds)
    if len(family.kinds) > 1:
        needed.add("hybrid")
    if family.context_parallel:
        needed.add("context-parallel")
    if family.retention:
        needed.add("retention")
    if family.enable_caching is False:
        needed.add("caching-off")
    if family.lookahead:
        needed.add("lookahead")
    return frozenset(needed)


def families_for(features: frozenset[str], families: Mapping[str, Any]) -> list[str]:
    """The names of ``families`` a subject with ``features`` can be run on."""
    return [name for name, family in families.items() if family_features(family) <= features]


def restrict_config(config: ManagerConfig, features: frozenset[str]) -> ManagerConfig:
    """``config`` without what ``features`` leave out (the same config when all are in)."""
    changes: dict[str, Any] = {}
    if "eagle" not in features:
        changes["use_eagle"] = False
        if any(g.is_eagle_group for g in config.groups):
            changes["groups"] = tuple(
                GroupConfig(**{**g.__dict__, "is_eagle_group": False}) for g in config.groups
            )
    if "watermark" not in features:
        changes["watermark"] = 0.0
    if "events" not in features:
        changes["enable_kv_cache_events"] = False
    if "stats" not in features:
        changes["log_stats"] = False
    if "lookahead" not in features:
        changes["num_hash_lookahead_tokens"] = 0
        changes["num_prefill_lookahead"] = 0
    if "caching-off" not in features:
        changes["enable_caching"] = True
    changes = {k: v for k, v in changes.items() if getattr(config, k) != v}
    return replace(config, **changes) if changes else config


Restricted = tuple[str, dict[str, Any]] | None


def _prompt_from_embeds(rows: Any) -> list[int]:
    """The token ids the driver's embedding rows stand for (``[token, style]`` rows)."""
    return [int(row[0]) for row in rows or []]


def restrict_call(op: str, args: Mapping[str, Any], features: frozenset[str]) -> Restricted:
    """The call to make instead of ``op(args)`` for a subject with ``features``
    (``None``: make none; the driver uses no result of such a call).

    Rewrites keep the sequence one the scheduler could make and the reference
    accepts: a prompt given by embeddings alone becomes its token ids; external
    tokens become tokens of the same step (the same blocks are allocated);
    ``pop_blocks_for_free`` becomes ``free`` (and ``free_blocks`` is not made).
    """
    if features >= ALL_FEATURES:
        return op, dict(args)
    needed = OP_FEATURES.get(op)
    if needed is not None and needed not in features:
        return None
    new = dict(args)
    if op == "add_request":
        for key, feature in REQUEST_FEATURES.items():
            if key in new and feature not in features:
                if key == "prompt_embeds" and new.get("prompt_token_ids") is None:
                    new["prompt_token_ids"] = _prompt_from_embeds(new["prompt_embeds"])
                del new[key]
    elif op == "allocate_slots":
        if "lookahead" not in features:
            new.pop("num_lookahead_tokens", None)
        if "reserved" not in features:
            new.pop("reserved_blocks", None)
        if "full-sequence" not in features:
            new.pop("full_sequence_must_fit", None)
        if "external" not in features:
            external = int(new.pop("num_external_computed_tokens", 0) or 0)
            if external:
                new["num_new_tokens"] = int(new["num_new_tokens"]) + external
            new.pop("delay_cache_blocks", None)
            new.pop("skip_zeroing_group_ids", None)
    elif "deferred-free" not in features:
        if op == "pop_blocks_for_free":
            return "free", {"request_id": new["request_id"]}
        if op == "free_blocks":
            return None
    return op, new


def used_features(op: str, args: Mapping[str, Any]) -> list[str]:
    """The features a call exercises (for a run's report)."""
    used = [OP_FEATURES[op]] if op in OP_FEATURES else []
    if op == "add_request":
        used += [f for key, f in REQUEST_FEATURES.items() if args.get(key) not in (None, False)]
    elif op == "allocate_slots":
        if args.get("num_lookahead_tokens"):
            used.append("lookahead")
        if args.get("reserved_blocks"):
            used.append("reserved")
        if args.get("full_sequence_must_fit"):
            used.append("full-sequence")
        if args.get("num_external_computed_tokens") or args.get("delay_cache_blocks"):
            used.append("external")
    elif op in ("pop_blocks_for_free", "free_blocks"):
        used.append("deferred-free")
    return used


def config_features(config: ManagerConfig) -> list[str]:
    """The features a config exercises (its kinds and knobs)."""
    used = {"mamba" if g.label.startswith("mamba") else g.label for g in config.groups}
    if len(config.groups) > 1:
        used.add("hybrid")
    if config.dcp_world_size * config.pcp_world_size > 1:
        used.add("context-parallel")
    if config.prefix_cache_retention_interval is not None:
        used.add("retention")
    flags: dict[str, Callable[[ManagerConfig], bool]] = {
        "caching-off": lambda c: not c.enable_caching,
        "eagle": lambda c: c.has_eagle,
        "watermark": lambda c: c.watermark > 0,
        "lookahead": lambda c: c.num_hash_lookahead_tokens > 0 or c.num_prefill_lookahead > 0,
    }
    used.update(name for name, test in flags.items() if test(config))
    return sorted(used & ALL_FEATURES)


def trace_features(config: ManagerConfig, records: Iterable[Mapping[str, Any]]) -> set[str]:
    """Every feature a recorded trace exercises (``replay`` leaves a trace that needs
    an undeclared one unjudged)."""
    used = set(config_features(config))
    for record in records:
        used.update(used_features(record["op"], record["args"]))
        if "raises" in record:
            used.add("rejections")
    return used
