#!/usr/bin/env python3
"""Record call traces from the real vLLM 0.25.1 into tests/data/*.jsonl.

Each trace is a config line plus one line per call with vLLM's result (or the
exception it raised) and the abstract state after the call (format:
tests/conformance/trace.py). ``tests/conformance/test_trace_replay.py``
replays them against kvcache, and against vLLM to prove they are still
faithful. Two kinds of traces:

* scripted scenarios, written out below call by call so that a reader can
  follow them (prefix hits and eviction order, preemption and resumption);
* short random scheduler sequences (``conformance.driver.RandomScheduler``)
  for a few fixed seeds.

Usage: ``.venv/bin/python scripts/record_vllm_traces.py [--out tests/data]``
(needs the reference: ``make conformance`` installs it).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from conformance.driver import Call, Lockstep, RandomScheduler, random_config  # noqa: E402
from conformance.sides import ManagerConfig  # noqa: E402
from conformance.trace import write_trace  # noqa: E402


def running(rid: str, num_computed_tokens: int) -> Call:
    return ("update_request", {"request_id": rid, "status": "RUNNING",
                               "num_computed_tokens": num_computed_tokens})


def admit(rid: str, num_new_tokens: int, num_hit_tokens: int, **extra: Any) -> list[Call]:
    """The scheduler's admission of a waiting request: lookup, allocate, mark running."""
    return [
        ("get_computed_blocks", {"request_id": rid}),
        ("allocate_slots", {"request_id": rid, "num_new_tokens": num_new_tokens,
                            "num_new_computed_tokens": num_hit_tokens,
                            "new_computed_blocks": "last", **extra}),
        running(rid, num_hit_tokens + num_new_tokens),
    ]


def scenario_prefix_hits_and_eviction() -> tuple[ManagerConfig, list[Call]]:
    """Two requests share a 2-block prefix; freeing and a big request evict tail first."""
    config = ManagerConfig(num_blocks=8, block_sizes=(4,), max_model_len=64)
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
        ("add_request", {"request_id": "c", "prompt_token_ids": list(range(20, 44)),
                         "max_tokens": 2}),
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
    config = ManagerConfig(num_blocks=8, block_sizes=(2,), max_model_len=32, watermark=0.25)
    calls: list[Call] = [
        ("add_request", {"request_id": "x", "prompt_token_ids": [1, 2, 3, 4, 5, 6],
                         "max_tokens": 8, "lora": ["lora-a", 1]}),
        *admit("x", 6, 0, has_scheduled_reqs=False),
        ("append_output_token_ids", {"request_id": "x", "token_ids": [0]}),
        ("update_request", {"request_id": "x", "num_computed_tokens": 6}),
        ("add_request", {"request_id": "y", "prompt_token_ids": [1, 2, 3, 4, 9],
                         "max_tokens": 8, "cache_salt": "salt-x"}),
        ("get_computed_blocks", {"request_id": "y"}),
        # 3 blocks + 2 watermark blocks > 4 free: refused while x is scheduled.
        ("allocate_slots", {"request_id": "y", "num_new_tokens": 5,
                            "new_computed_blocks": "last", "has_scheduled_reqs": True}),
        ("allocate_slots", {"request_id": "y", "num_new_tokens": 5,
                            "new_computed_blocks": "last", "has_scheduled_reqs": False}),
        running("y", 5),
        ("append_output_token_ids", {"request_id": "y", "token_ids": 1}),
        # x's decode with 2 lookahead slots needs 2 blocks; 1 is free.
        ("allocate_slots", {"request_id": "x", "num_new_tokens": 1, "num_lookahead_tokens": 2}),
        ("pop_blocks_for_free", {"request_id": "y", "handle": 0}),
        ("update_request", {"request_id": "y", "status": "PREEMPTED", "num_computed_tokens": 0,
                            "num_preemptions": 1}),
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


SCENARIOS = {
    "prefix_hits_and_eviction": scenario_prefix_hits_and_eviction,
    "preempt_and_resume": scenario_preempt_and_resume,
}

# (name, seed, enable_caching, watermark, group kinds)
RANDOM_TRACES = [
    ("random_caching", 7, True, 0.0, ("full",)),
    ("random_caching_watermark", 11, True, 0.25, ("full",)),
    ("random_no_caching", 5, False, 0.1, ("full",)),
    ("random_two_groups", 3, True, 0.0, ("full", "full")),
    ("random_full_and_sliding_window", 4, True, 0.0, ("full", "sliding_window")),
]


def record_calls(config: ManagerConfig, calls: list[Call]) -> Lockstep:
    run = Lockstep(config, None)
    for op, args in calls:
        run.call(op, **args)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data")
    parser.add_argument("--steps", type=int, default=25, help="steps per random trace")
    args = parser.parse_args()

    for name, make in SCENARIOS.items():
        config, calls = make()
        run = record_calls(config, calls)
        path = args.out / f"{name}.jsonl"
        write_trace(path, run.config_record(note=make.__doc__), run.records)
        print(f"{path.relative_to(ROOT)}: {len(run.records)} calls")

    for name, seed, enable_caching, watermark, group_kinds in RANDOM_TRACES:
        rng = random.Random(seed)
        config = random_config(rng, enable_caching, watermark, group_kinds=group_kinds)
        run = Lockstep(config, None)
        scheduler = RandomScheduler(rng, run)
        for _ in range(args.steps):
            scheduler.step()
        scheduler.drain()
        path = args.out / f"{name}.jsonl"
        note = f"RandomScheduler, seed {seed}, {args.steps} steps then drain"
        write_trace(path, run.config_record(seed=seed, note=note), run.records)
        print(f"{path.relative_to(ROOT)}: {len(run.records)} calls")


if __name__ == "__main__":
    main()
