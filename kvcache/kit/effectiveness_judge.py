"""Judging recorded lookups: what each lookup could have reused (``spec.effectiveness``:
content-level, from the pool's state) against what it did.

``judge_records`` reads a lockstep run's records (each call with the reference's
canonical state after it, as ``run_sequence(..., record_state=True)`` keeps them)
and judges every ``get_computed_blocks``: any implementation, any release the kit
drives, since it reads only canonical records. ``layout`` (and ``eagle_groups``): a
config's groups as the resume rules see them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from kvcache.kit.config import ManagerConfig, fine_grained_hits
from kvcache.kit.oracle import spec_module
from kvcache.kit.trace import pool_key_hex

if TYPE_CHECKING:
    from spec import effectiveness as rules
else:  # the repository's spec, or the installed kvcache_spec
    rules = spec_module("effectiveness")

__all__ = ["WRITE_OPS", "eagle_groups", "judge_records", "layout"]


def eagle_groups(config: ManagerConfig, master_switch: bool) -> tuple[bool, ...]:
    """Which groups drop a hit's last block: the marked ones, or every group when
    ``use_eagle`` marks none; with ``master_switch`` (the ``eagle_master_switch`` of
    vLLM 0.30.0 and later) only when ``use_eagle`` is on."""
    marked = tuple(g.is_eagle_group for g in config.groups)
    if master_switch and not config.use_eagle:
        return tuple(False for _ in marked)
    if config.use_eagle and not any(marked):
        return tuple(True for _ in marked)
    return marked


def layout(config: ManagerConfig, master_switch: bool) -> tuple[rules.Group, ...]:
    """The config's groups as the resume rules see them."""
    single = len(config.groups) == 1
    eagle = eagle_groups(config, master_switch)
    return tuple(
        rules.Group(
            g.kind,
            config.scheduler_block_size if single else g.block_size,
            g.sliding_window or g.attention_chunk_size or 0,
            e,
        )
        for g, e in zip(config.groups, eagle, strict=True)
    )


def _hex(value: Any) -> str:
    return str(value["bytes"])


#: Calls after which the pool's cached keys may have changed.
WRITE_OPS = frozenset(
    {"allocate_slots", "free", "evict_blocks", "reset_prefix_cache", "cache_blocks"}
)


def judge_records(
    config: ManagerConfig,
    records: Iterable[Mapping[str, Any]],
    master_switch: bool = False,
    fine_grained_switch: bool = True,
) -> list[tuple[str, rules.Verdict]]:
    """Every ``get_computed_blocks`` of ``records`` judged: (request id, verdict).
    ``master_switch``: the release's ``eagle_master_switch``; ``fine_grained_switch``:
    its ``mamba_fine_grained_hits`` (off in 0.25.1: no sub-block hits, whatever the
    layout).

    The write side comes from the records too: each ``update_request`` says how far a
    request has computed, so each group's blocks (or, for a state kind, the state at
    that point) are *materialized* there; a materialized key no recorded state ever
    held was never cached (``Lookup.uncached``), and each request's replay boundary
    (where a repeat of its prompt resumes) is what a sparse retention must keep. The
    write side needs the state after every call that caches or evicts (a lockstep
    run's own records have it; a stored trace may keep states at lookups only, and
    is then judged on the read side alone)."""
    records = list(records)
    complete = all("state" in r for r in records if r["op"] in WRITE_OPS and "ok" in r)
    groups = layout(config, master_switch)
    h = config.hash_block_size
    fine = fine_grained_switch and fine_grained_hits(config)
    alignment = h if fine else config.scheduler_block_size
    steps = tuple(h if fine else g.block_size for g in groups)
    # EAGLE's drop (attention groups only), below which a repeat resumes, on the alignment.
    drafts = max(
        (
            step
            for g, step in zip(groups, steps, strict=True)
            if g.eagle and rules.KINDS[g.kind] not in (None, "nothing")
        ),
        default=0,
    )
    # Mamba in mode 'none' caches no state: nothing it computes is the pool's to keep.
    writes = tuple(g.kind != "mamba" or g.mamba_cache_mode != "none" for g in config.groups)
    hashes: dict[str, list[str]] = {}
    tokens: dict[str, int] = {}
    prompts: dict[str, int] = {}
    skips: dict[str, bool] = {}
    materialized: list[set[str]] = [set() for _ in groups]
    replay_hashes: set[str] = set()
    ever_held: set[str] = set()
    verdicts: list[tuple[str, rules.Verdict]] = []
    for record in records:
        op, args = record["op"], record["args"]
        ok: Any = record.get("ok")
        rid = args.get("request_id")
        if "state" in record:
            ever_held.update(_hex(k) for k, _ in record["state"]["cached"].get("dict", []))
        if op == "update_request" and "raises" not in record and rid in hashes:
            computed = min(args.get("num_computed_tokens") or 0, len(hashes[rid]) * h)
            replay = ((prompts[rid] - 1) // alignment * alignment - drafts) // alignment
            replay *= alignment
            for g, group in enumerate(groups):
                if writes[g]:
                    materialized[g].update(
                        pool_key_hex(hashes[rid][p // h - 1], g)
                        for p in rules.written(group, computed, replay)
                    )
            if 0 < replay <= computed:
                replay_hashes.add(hashes[rid][replay // h - 1])
        if ok is None:  # a call that raised, or returned nothing to learn from
            continue
        if op == "add_request":
            hashes[rid] = [_hex(v) for v in ok]
            tokens[rid] = len(args.get("prompt_token_ids") or args.get("prompt_embeds") or ())
            prompts[rid] = tokens[rid]
            skips[rid] = bool(args.get("skip_reading_prefix_cache", False))
        elif op == "append_output_token_ids":
            ids = args["token_ids"]
            tokens[rid] += 1 if isinstance(ids, int) else len(ids)
            hashes[rid].extend(_hex(v) for v in ok)
        elif op == "get_computed_blocks" and "state" in record:
            keys = {_hex(k) for k, _ in record["state"]["cached"].get("dict", [])}
            cached = tuple(
                frozenset(
                    (i + 1) * h
                    for i, digest in enumerate(hashes[rid])
                    if pool_key_hex(digest, g) in keys
                )
                for g in range(len(groups))
            )
            uncached = tuple(
                frozenset(
                    (i + 1) * h
                    for i, digest in enumerate(hashes[rid])
                    if (key := pool_key_hex(digest, g)) in materialized[g] and key not in ever_held
                )
                for g in range(len(groups))
            )
            if not complete:
                uncached = ()
            lookup = rules.Lookup(
                groups,
                cached,
                tokens[rid],
                len(hashes[rid]) * h,
                h,
                alignment,
                config.enable_caching,
                skips[rid],
                steps,
                uncached,
                config.prefix_cache_retention_interval,
                frozenset(
                    (i + 1) * h for i, digest in enumerate(hashes[rid]) if digest in replay_hashes
                ),
            )
            verdicts.append((rid, rules.explain(lookup, ok["num_computed_tokens"])))
    return verdicts
