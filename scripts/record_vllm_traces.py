#!/usr/bin/env python3
"""Record call traces from the real vLLM 0.25.1 into tests/data/.

Each trace holds vLLM's result (or the exception it raised) for every call and
the abstract state after it (format: docs/trace-format.md).
``tests/conformance/test_trace_replay.py`` replays them against kvcache, and
against vLLM to prove they are still faithful. Three kinds of traces:

* scripted scenarios, written out below call by call so that a reader can
  follow them (prefix hits and eviction order, preemption and resumption);
* short random scheduler sequences (``kvcache.kit.driver.RandomScheduler``)
  for fixed seeds, one-group and hybrid layouts (``hybrid_*``);
* small workload simulations, on full attention (``workload_chat_full.jsonl.gz``)
  and on hybrid models (``hybrid_workload_*.jsonl.gz``),
  as ``python -m kvcache record`` makes them.

Usage: ``.venv/bin/python scripts/record_vllm_traces.py [--out tests/data]``
(``make traces``; needs the reference: ``make conformance`` installs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from kvcache.kit.config import GroupConfig, ManagerConfig
from kvcache.kit.driver import (
    FAMILIES,
    Call,
    Lockstep,
    RandomScheduler,
    random_config,
    record_reference,
)
from kvcache.kit.record import record_workload
from kvcache.kit.trace import write_trace
from kvcache.kit.workloads import make_workload

ROOT = Path(__file__).resolve().parents[1]


def running(rid: str, num_computed_tokens: int) -> Call:
    return (
        "update_request",
        {"request_id": rid, "status": "RUNNING", "num_computed_tokens": num_computed_tokens},
    )


def admit(rid: str, num_new_tokens: int, num_hit_tokens: int, **extra: Any) -> list[Call]:
    """The scheduler's admission of a waiting request: lookup, allocate, mark running."""
    return [
        ("get_computed_blocks", {"request_id": rid}),
        (
            "allocate_slots",
            {
                "request_id": rid,
                "num_new_tokens": num_new_tokens,
                "num_new_computed_tokens": num_hit_tokens,
                "new_computed_blocks": "last",
                **extra,
            },
        ),
        running(rid, num_hit_tokens + num_new_tokens),
    ]


def scenario_prefix_hits_and_eviction() -> tuple[ManagerConfig, list[Call]]:
    """Two requests share a 2-block prefix; freeing and a big request evict tail first."""
    config = ManagerConfig.full_attention(num_blocks=8, block_size=4, max_model_len=64)
    shared = [7, 7, 1, 2, 3, 4, 5, 6]
    calls: list[Call] = [
        ("add_request", {"request_id": "a", "prompt_token_ids": [*shared, 9, 9], "max_tokens": 4}),
        *admit("a", 10, 0),
        ("append_output_token_ids", {"request_id": "a", "token_ids": 1}),
        ("update_request", {"request_id": "a", "num_computed_tokens": 10}),
        ("take_events", {}),
        ("add_request", {"request_id": "b", "prompt_token_ids": [*shared, 8], "max_tokens": 4}),
        *admit("b", 1, 8),
        ("get_num_common_prefix_blocks", {"request_id": "a"}),
        ("make_prefix_cache_stats", {}),
        ("allocate_slots", {"request_id": "a", "num_new_tokens": 1}),
        ("update_request", {"request_id": "a", "status": "FINISHED_STOPPED"}),
        ("free", {"request_id": "a"}),
        ("update_request", {"request_id": "b", "status": "FINISHED_STOPPED"}),
        ("free", {"request_id": "b"}),
        ("reset_prefix_cache", {}),
        (
            "add_request",
            {"request_id": "c", "prompt_token_ids": list(range(20, 44)), "max_tokens": 2},
        ),
        *admit("c", 24, 0),
        ("take_events", {}),
        ("reset_prefix_cache", {}),
        ("update_request", {"request_id": "c", "status": "FINISHED_ABORTED"}),
        ("free", {"request_id": "c"}),
        ("reset_prefix_cache", {}),
        ("take_events", {}),
        ("take_new_block_ids", {}),
        ("usage", {}),
    ]
    return config, calls


def scenario_preempt_and_resume() -> tuple[ManagerConfig, list[Call]]:
    """Watermark refuses an admission; a decode that does not fit preempts a request whose
    blocks return only at the deferred free; the preempted request resumes from its cache."""
    config = ManagerConfig.full_attention(
        num_blocks=8, block_size=2, max_model_len=32, watermark=0.25
    )
    calls: list[Call] = [
        (
            "add_request",
            {
                "request_id": "x",
                "prompt_token_ids": [1, 2, 3, 4, 5, 6],
                "max_tokens": 8,
                "lora": ["lora-a", 1],
            },
        ),
        *admit("x", 6, 0, has_scheduled_reqs=False),
        ("append_output_token_ids", {"request_id": "x", "token_ids": [0]}),
        ("update_request", {"request_id": "x", "num_computed_tokens": 6}),
        (
            "add_request",
            {
                "request_id": "y",
                "prompt_token_ids": [1, 2, 3, 4, 9],
                "max_tokens": 8,
                "cache_salt": "salt-x",
            },
        ),
        ("get_computed_blocks", {"request_id": "y"}),
        # 3 blocks + 2 watermark blocks > 4 free: refused while x is scheduled.
        (
            "allocate_slots",
            {
                "request_id": "y",
                "num_new_tokens": 5,
                "new_computed_blocks": "last",
                "has_scheduled_reqs": True,
            },
        ),
        (
            "allocate_slots",
            {
                "request_id": "y",
                "num_new_tokens": 5,
                "new_computed_blocks": "last",
                "has_scheduled_reqs": False,
            },
        ),
        running("y", 5),
        ("append_output_token_ids", {"request_id": "y", "token_ids": 1}),
        # x's decode with 2 lookahead slots needs 2 blocks; 1 is free.
        ("allocate_slots", {"request_id": "x", "num_new_tokens": 1, "num_lookahead_tokens": 2}),
        ("pop_blocks_for_free", {"request_id": "y", "handle": 0}),
        (
            "update_request",
            {
                "request_id": "y",
                "status": "PREEMPTED",
                "num_computed_tokens": 0,
                "num_preemptions": 1,
            },
        ),
        ("allocate_slots", {"request_id": "x", "num_new_tokens": 1, "num_lookahead_tokens": 2}),
        ("free_blocks", {"handle": 0}),
        ("allocate_slots", {"request_id": "x", "num_new_tokens": 1, "num_lookahead_tokens": 2}),
        ("update_request", {"request_id": "x", "num_computed_tokens": 7}),
        ("append_output_token_ids", {"request_id": "x", "token_ids": [1]}),
        ("update_request", {"request_id": "x", "status": "FINISHED_LENGTH_CAPPED"}),
        ("free", {"request_id": "x"}),
        *admit("y", 2, 4, has_scheduled_reqs=False),
        ("make_prefix_cache_stats", {}),
        ("get_num_common_prefix_blocks", {"request_id": "y"}),
        ("allocate_slots", {"request_id": "y", "num_new_tokens": 0}),
        ("evict_blocks", {"block_ids": [99]}),
        ("evict_blocks", {"block_ids": [1, 2]}),
        ("take_events", {}),
        ("free", {"request_id": "y"}),
        ("take_events", {}),
        ("take_new_block_ids", {}),
    ]
    return config, calls


def scenario_mm_output_block_hash() -> tuple[ManagerConfig, list[Call]]:
    """Two requests, same tokens, different first images; outputs complete the block
    holding both images: vLLM 0.25.1 keys it on the last image only, so both requests'
    block hashes are equal (ledger: bug-mm-output-block-hash, fixed in 0.33.0)."""
    config = ManagerConfig.full_attention(num_blocks=12, block_size=4, max_model_len=32)
    calls: list[Call] = []
    for rid, first_image in (("a", "img-a"), ("b", "img-c")):
        calls += [
            (
                "add_request",
                {
                    "request_id": rid,
                    "prompt_token_ids": [1, 2, 3, 4, 5, 6],
                    "max_tokens": 4,
                    "mm_features": [[first_image, 4, 1], ["img-b", 5, 1]],
                },
            ),
            *admit(rid, 6, 0),
            ("append_output_token_ids", {"request_id": rid, "token_ids": [7]}),
            ("allocate_slots", {"request_id": rid, "num_new_tokens": 1}),
            running(rid, 7),
            ("append_output_token_ids", {"request_id": rid, "token_ids": [8]}),
        ]
    return config, calls


def scenario_three_full_groups_trim() -> tuple[ManagerConfig, list[Call]]:
    """Three full-attention groups of block sizes 1, 2, 4 (the last two EAGLE-flagged,
    use_eagle off): a resent prompt's hit is 0 tokens, but vLLM 0.25.1 trims only the
    first group's hits and returns two blocks of the second (ledger:
    bug-three-full-groups-trim, fixed in 0.33.0)."""
    groups = (
        GroupConfig("full", 1),
        GroupConfig("full", 2, is_eagle_group=True, num_kv_heads=2),
        GroupConfig("full", 4, is_eagle_group=True, num_kv_heads=3),
    )
    config = ManagerConfig(num_blocks=26, groups=groups, max_model_len=64)
    prompt = [1, 1, 2, 2, 2, 0, 0, 1]
    calls: list[Call] = [
        ("add_request", {"request_id": "a", "prompt_token_ids": prompt, "max_tokens": 4}),
        running("a", 3),
        ("allocate_slots", {"request_id": "a", "num_new_tokens": 5}),
        ("free", {"request_id": "a"}),
        ("add_request", {"request_id": "b", "prompt_token_ids": prompt, "max_tokens": 4}),
        ("get_computed_blocks", {"request_id": "b"}),
        ("allocate_slots", {"request_id": "b", "num_new_tokens": 8, "num_new_computed_tokens": 0,
                            "new_computed_blocks": "last"}),
        ("take_events", {}),
    ]
    return config, calls


def scenario_mamba_partial_tail_copy() -> tuple[ManagerConfig, list[Call]]:
    """Full attention (bs 2), sliding window (bs 4) and align-mode Mamba (bs 8, larger
    than the hash block): a 24-token prompt computed to 22, then 2 more tokens. vLLM
    0.33.0 caches the prompt tail's Mamba state as a partial entry and continues in a
    copy of that block, holding one block more (ledger: mamba-partial-tail-copy)."""
    groups = (
        GroupConfig("full", 2),
        GroupConfig("sliding_window", 4, sliding_window=7, num_kv_heads=2),
        GroupConfig("mamba", 8, mamba_cache_mode="align", num_kv_heads=3),
    )
    config = ManagerConfig(num_blocks=34, groups=groups, max_model_len=64, use_eagle=True)
    prompt = [0, 2, 1, 0, 1, 2, 1, 2, 0, 2, 2, 1, 0, 2, 1, 1, 0, 0, 0, 1, 2, 2, 1, 1]
    calls: list[Call] = [
        ("add_request", {"request_id": "a", "prompt_token_ids": prompt, "max_tokens": 5}),
        running("a", 16),
        ("allocate_slots", {"request_id": "a", "num_new_tokens": 6}),
        ("allocate_slots", {"request_id": "a", "num_new_tokens": 2}),
    ]
    return config, calls


def scenario_retention_eagle_resend() -> tuple[ManagerConfig, list[Call]]:
    """One sliding window (bs 4, window 4) with EAGLE and retention interval 0: a
    10-token prompt computed and freed, then resent. vLLM 0.25.1 keeps the window's
    tail one block above the replay boundary, so the resend's hit is 0 tokens; 0.33.0
    keeps the tail below it (ledger: bug-retention-eagle-replay-boundary, fixed in
    0.33.0)."""
    groups = (GroupConfig("sliding_window", 4, sliding_window=4),)
    config = ManagerConfig(
        num_blocks=12,
        groups=groups,
        max_model_len=32,
        use_eagle=True,
        prefix_cache_retention_interval=0,
    )
    prompt = [1, 2, 0, 0, 2, 1, 1, 2, 0, 2]
    calls: list[Call] = [
        ("add_request", {"request_id": "a", "prompt_token_ids": prompt, "max_tokens": 4}),
        *admit("a", 10, 0),
        ("free", {"request_id": "a"}),
        ("add_request", {"request_id": "b", "prompt_token_ids": prompt, "max_tokens": 4}),
        ("get_computed_blocks", {"request_id": "b"}),
        ("take_events", {}),
    ]
    return config, calls


def scenario_mamba_prompt_boundary_rekey() -> tuple[ManagerConfig, list[Call]]:
    """Full attention and align-mode Mamba (bs 2, one speculative block): a 7-token
    prompt computed to 6, evict_blocks drops the Mamba state block's entry (the request
    still holds it), then one more token. vLLM 0.33.0 keys that block at the prompt's
    last hash boundary again; 0.25.1 leaves it unhashed (ledger:
    mamba-prompt-boundary-rekey)."""
    groups = (
        GroupConfig("full", 2),
        GroupConfig("mamba", 2, mamba_cache_mode="align", num_speculative_blocks=1,
                    num_kv_heads=2),
    )  # fmt: skip
    config = ManagerConfig(num_blocks=18, groups=groups, max_model_len=64)
    prompt = [1, 2, 1, 1, 1, 1, 0]
    calls: list[Call] = [
        ("add_request", {"request_id": "a", "prompt_token_ids": prompt, "max_tokens": 1}),
        *admit("a", 6, 0),
        ("evict_blocks", {"block_ids": [4, 5]}),
        ("allocate_slots", {"request_id": "a", "num_new_tokens": 1}),
        ("take_events", {}),
    ]
    return config, calls


def scenario_mamba_eagle_flag_early_free() -> tuple[ManagerConfig, list[Call]]:
    """Sliding window (bs 2) and align-mode Mamba (bs 1, one speculative block,
    flagged is_eagle_group, use_eagle off): a 1-token prompt decoded two steps. At the
    third allocation vLLM 0.33.0 frees the first Mamba state block (processed tokens,
    ledger: mamba-freed-on-processed-tokens, fixed in 0.33.0) and caches one Mamba
    block fewer (no EAGLE look-ahead block, ledger: eagle-flag-needs-use-eagle)."""
    groups = (
        GroupConfig("sliding_window", 2, sliding_window=3),
        GroupConfig("mamba", 1, mamba_cache_mode="align", num_speculative_blocks=1,
                    is_eagle_group=True, num_kv_heads=2),
    )  # fmt: skip
    config = ManagerConfig(
        num_blocks=30,
        groups=groups,
        max_model_len=10,
        watermark=0.25,
        max_num_batched_tokens=32,
        hash_fn="sha256_cbor",
    )
    calls: list[Call] = [
        ("add_request", {"request_id": "a", "prompt_token_ids": [0], "max_tokens": 10}),
        *admit("a", 1, 0, delay_cache_blocks=True),
        ("append_output_token_ids", {"request_id": "a", "token_ids": 1}),
        ("allocate_slots", {"request_id": "a", "num_new_tokens": 1}),
        running("a", 2),
        ("append_output_token_ids", {"request_id": "a", "token_ids": [1]}),
        ("allocate_slots", {"request_id": "a", "num_new_tokens": 1}),
    ]
    return config, calls


def scenario_prompt_tail_entry_resurrected() -> tuple[ManagerConfig, list[Call]]:
    """Full attention (bs 8) beside a sliding window (bs 4, hash block 4): a 7-token
    prompt (its last hash boundary, 4 tokens, inside the first full block) and one
    output token fill that block; evict_blocks drops its entries while the request
    holds it, then one more token. vLLM 0.33.0 keys the evicted block again under the
    prompt-tail hash; 0.25.1 leaves it unhashed (ledger:
    bug-prompt-tail-entry-resurrected, a bug introduced in 0.33.0)."""
    groups = (
        GroupConfig("full", 8),
        GroupConfig("sliding_window", 4, sliding_window=5, num_kv_heads=2),
    )
    config = ManagerConfig(num_blocks=8, groups=groups, max_model_len=64)
    calls: list[Call] = [
        ("add_request", {"request_id": "a", "prompt_token_ids": [2, 2, 1, 2, 2, 2, 2],
                         "max_tokens": 6}),
        *admit("a", 7, 0),
        ("append_output_token_ids", {"request_id": "a", "token_ids": [1]}),
        ("allocate_slots", {"request_id": "a", "num_new_tokens": 1}),
        running("a", 8),
        ("evict_blocks", {"block_ids": [1]}),
        ("allocate_slots", {"request_id": "a", "num_new_tokens": 1}),
        ("take_events", {}),
    ]  # fmt: skip
    return config, calls


def scenario_swa_mamba_eagle_long_hit() -> tuple[ManagerConfig, list[Call]]:
    """Sliding window (bs 1, window 11) and align-mode Mamba (bs 1), use_eagle on: a
    6-token prompt computed 5 then 6 tokens, then the same prompt again. vLLM 0.25.1's
    lookup drops the window group's EAGLE block (4 blocks) but lets Mamba, which never
    drops, grow the hit back to 5 tokens: a 5-token hit with 4 window blocks (ledger:
    bug-mamba-eagle-long-hit, fixed in 0.33.0, which returns 5 window blocks)."""
    groups = (
        GroupConfig("sliding_window", 1, sliding_window=11),
        GroupConfig("mamba", 1, mamba_cache_mode="align", num_kv_heads=2),
    )
    config = ManagerConfig(num_blocks=16, groups=groups, max_model_len=16, use_eagle=True)
    prompt = [0, 1, 1, 1, 1, 2]
    calls: list[Call] = [
        ("add_request", {"request_id": "a", "prompt_token_ids": prompt, "max_tokens": 4}),
        *admit("a", 5, 0),
        ("allocate_slots", {"request_id": "a", "num_new_tokens": 1}),
        ("add_request", {"request_id": "b", "prompt_token_ids": prompt, "max_tokens": 4}),
        ("get_computed_blocks", {"request_id": "b"}),
    ]
    return config, calls


def scenario_tq_full_prefix_hit() -> tuple[ManagerConfig, list[Call]]:
    """One TurboQuant full-attention group (TQFullAttentionSpec, bs 4, managed as full
    attention): a 9-token prompt computed, freed, and looked up again (a two-block
    hit). vLLM 0.33.0 has no TQFullAttentionSpec, so the manager cannot be built there
    (ledger: tq-spec-removed)."""
    config = ManagerConfig(num_blocks=10, groups=(GroupConfig("tq_full", 4),), max_model_len=32)
    prompt = [1, 2, 0, 0, 2, 1, 1, 2, 0]
    calls: list[Call] = [
        ("add_request", {"request_id": "a", "prompt_token_ids": prompt, "max_tokens": 2}),
        *admit("a", 9, 0),
        ("free", {"request_id": "a"}),
        ("add_request", {"request_id": "b", "prompt_token_ids": prompt, "max_tokens": 2}),
        ("get_computed_blocks", {"request_id": "b"}),
    ]
    return config, calls


SCENARIOS = {
    "prefix_hits_and_eviction": scenario_prefix_hits_and_eviction,
    "preempt_and_resume": scenario_preempt_and_resume,
    "mm_output_block_hash": scenario_mm_output_block_hash,
    "three_full_groups_trim": scenario_three_full_groups_trim,
    "mamba_partial_tail_copy": scenario_mamba_partial_tail_copy,
    "retention_eagle_resend": scenario_retention_eagle_resend,
    "mamba_prompt_boundary_rekey": scenario_mamba_prompt_boundary_rekey,
    "mamba_eagle_flag_early_free": scenario_mamba_eagle_flag_early_free,
    "prompt_tail_entry_resurrected": scenario_prompt_tail_entry_resurrected,
    "swa_mamba_eagle_long_hit": scenario_swa_mamba_eagle_long_hit,
    "tq_full_prefix_hit": scenario_tq_full_prefix_hit,
}

# Known vLLM 0.25.1 bugs the scenarios record: record index -> ledger ids, written
# into the record's "known" mark, so that a release that fixed the bug replays the
# trace as "fixed (ledger id)".
KNOWN_BUGS: dict[str, dict[int, list[str]]] = {
    "mm_output_block_hash": {15: ["bug-mm-output-block-hash"]},
    "three_full_groups_trim": {5: ["bug-three-full-groups-trim"]},
    "retention_eagle_resend": {2: ["bug-retention-eagle-replay-boundary"]},
    "mamba_eagle_flag_early_free": {8: ["mamba-freed-on-processed-tokens"]},
    "swa_mamba_eagle_long_hit": {6: ["bug-mamba-eagle-long-hit"]},
}


def mark_known(name: str, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` with the KNOWN_BUGS marks of scenario ``name``."""
    marks = KNOWN_BUGS.get(name, {})
    return [dict(r, known=marks[i]) if i in marks else r for i, r in enumerate(records)]


# (file name, seed, layout family, caching, watermark); None: drawn by the seed.
RANDOM_TRACES: list[tuple[str, int, str, bool | None, float | None]] = [
    ("random_caching", 7, "full", True, 0.0),
    ("random_caching_watermark", 11, "full", True, 0.25),
    ("random_no_caching", 5, "full", False, 0.1),
    ("random_two_groups", 4, "full+full", True, 0.0),
    ("hybrid_full_swa", 3, "full+swa", True, 0.0),
    ("hybrid_full_chunked", 3, "full+chunked", True, 0.0),
    ("hybrid_full_mamba_align", 21, "full+mamba-align", True, 0.0),
    ("hybrid_full_mamba_all", 1, "full+mamba-all", True, 0.1),
    ("hybrid_full_cross", 8, "full+cross", False, 0.0),
    ("hybrid_eagle_mixed_sizes", 10, "eagle-hybrid", True, 0.0),
]

# (file name, workload, requests): the scheduler simulation, recorded (a state every
# 50th call: the pools have 1,024 blocks).
WORKLOAD_TRACES = [
    ("workload_chat_full", "chat", 4),
    ("hybrid_workload_chat_swa", "chat-swa", 4),
    ("hybrid_workload_chat_mamba", "chat-mamba", 4),
]


def record_random(
    seed: int, family_name: str, caching: bool | None, watermark: float | None, steps: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    family = dataclasses.replace(FAMILIES[family_name], enable_caching=caching, watermark=watermark)
    rng = random.Random(seed)
    run = Lockstep(random_config(rng, family), None, "vllm")
    scheduler = RandomScheduler(rng, run)
    for _ in range(steps):
        scheduler.step()
    scheduler.drain()
    note = f"RandomScheduler, family {family_name}, seed {seed}, {steps} steps then drain"
    return run.header(source=note, seed=seed), run.records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data")
    parser.add_argument("--steps", type=int, default=40, help="steps per random trace")
    args = parser.parse_args()
    written: list[tuple[Path, int, str]] = []

    for name, make in SCENARIOS.items():
        config, calls = make()
        header, records = record_reference(config, calls, "vllm", source=make.__doc__)
        path = write_trace(args.out / f"{name}.jsonl", header, mark_known(name, records))
        written.append((path, len(records), config.layout))

    for name, seed, family, caching, watermark in RANDOM_TRACES:
        header, records = record_random(seed, family, caching, watermark, args.steps)
        path = write_trace(args.out / f"{name}.jsonl", header, records)
        written.append((path, len(records), ManagerConfig.from_record(header["config"]).layout))

    for name, workload, num_requests in WORKLOAD_TRACES:
        recording = record_workload(make_workload(workload, num_requests), "vllm", 50)
        if recording.error is not None:
            raise recording.error
        path = write_trace(args.out / f"{name}.jsonl.gz", recording.header, recording.records)
        written.append((path, len(recording.records), workload))

    for path, num_records, what in written:
        print(f"{path.relative_to(ROOT)}: {num_records} records ({what})")


if __name__ == "__main__":
    main()
