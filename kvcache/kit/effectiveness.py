"""Cache effectiveness over recorded lookups: what each lookup could have reused
(``spec.effectiveness``: content-level, from the pool's state) against what it did.

``judge_records`` reads a lockstep run's records (each call with the reference's
canonical state after it, as ``run_sequence(..., record_state=True)`` keeps them)
and judges every ``get_computed_blocks``: any implementation, any release the kit
drives, since it reads only canonical records.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from kvcache.kit.config import ManagerConfig, fine_grained_hits
from kvcache.kit.oracle import spec_module

if TYPE_CHECKING:
    from spec import effectiveness as rules
else:  # the repository's spec, or the installed kvcache_spec
    rules = spec_module("effectiveness")

__all__ = ["eagle_groups", "judge_records", "layout"]


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


def judge_records(
    config: ManagerConfig, records: Iterable[Mapping[str, Any]], master_switch: bool = False
) -> list[tuple[str, rules.Verdict]]:
    """Every ``get_computed_blocks`` of ``records`` judged: (request id, verdict)."""
    groups = layout(config, master_switch)
    h = config.hash_block_size
    fine = fine_grained_hits(config)
    alignment = h if fine else config.scheduler_block_size
    steps = tuple(h if fine else g.block_size for g in groups)
    hashes: dict[str, list[str]] = {}
    tokens: dict[str, int] = {}
    skips: dict[str, bool] = {}
    verdicts: list[tuple[str, rules.Verdict]] = []
    for record in records:
        op, args = record["op"], record["args"]
        ok: Any = record.get("ok")
        rid = args.get("request_id")
        if ok is None and op != "get_computed_blocks":
            continue
        if op == "add_request":
            hashes[rid] = [_hex(v) for v in ok]
            tokens[rid] = len(args.get("prompt_token_ids") or args.get("prompt_embeds") or ())
            skips[rid] = bool(args.get("skip_reading_prefix_cache", False))
        elif op == "append_output_token_ids":
            ids = args["token_ids"]
            tokens[rid] += 1 if isinstance(ids, int) else len(ids)
            hashes[rid].extend(_hex(v) for v in ok)
        elif op == "get_computed_blocks" and ok is not None and "state" in record:
            keys = {_hex(k) for k, _ in record["state"]["cached"].get("dict", [])}
            cached = tuple(
                frozenset(
                    (i + 1) * h
                    for i, digest in enumerate(hashes[rid])
                    if digest + format(g, "08x") in keys
                )
                for g in range(len(groups))
            )
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
            )
            verdicts.append((rid, rules.explain(lookup, ok["num_computed_tokens"])))
    return verdicts
