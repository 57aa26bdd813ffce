"""The 0.33.0 ledger rules found by the census, and the changelog from two trace sets.

Each rule is checked on the difference it explains and on a near miss it must
not explain (another layout, another direction, another block), so that a
rule cannot quietly swallow a new difference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvcache.kit.config import GroupConfig, ManagerConfig
from kvcache.kit.driver import compare_outcomes
from kvcache.kit.ledger import Judge, fine_grained_hits

DATA = Path(__file__).resolve().parents[1] / "data"


def _judge(groups: tuple[GroupConfig, ...], **config: Any) -> Judge:
    cfg = ManagerConfig(num_blocks=16, groups=groups, max_model_len=32, **config)
    return Judge(cfg, "0.33", old_is_expected=True)


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return compare_outcomes(a, b)[0]


def _hit(blocks: list[list[int]], tokens: int) -> dict[str, Any]:
    return {"ok": {"block_ids": {"tuple": blocks}, "num_computed_tokens": tokens}}


def _state(mamba_blocks: list[int], free: list[int]) -> dict[str, Any]:
    return {
        "free_queue": free,
        "ref_cnt": {"dict": [[b, 1] for b in [1, 2, *mamba_blocks] if b]},
        "req_to_blocks": [{"r": [1, 2]}, {"r": mamba_blocks}],
    }


MAMBA_SPEC = (
    GroupConfig("full", 2),
    GroupConfig("mamba", 2, mamba_cache_mode="align", num_speculative_blocks=1),
)


def test_mamba_state_freed_a_step_earlier_is_known_only_as_extra_nulls() -> None:
    judge = _judge(MAMBA_SPEC)
    old, new = _state([0, 3, 5], [6, 7]), _state([0, 0, 5], [6, 7, 3])
    verdict, _ = judge.state("allocate_slots", old, new)
    assert verdict.known == ("mamba-freed-on-processed-tokens",)
    # Another block where the old side has one is not an early free.
    verdict, _ = judge.state("allocate_slots", old, _state([0, 4, 5], [6, 7, 3]))
    assert "mamba-freed-on-processed-tokens" not in verdict.known
    # Without speculative blocks 0.25.1 has no hedge: not this entry.
    plain = (GroupConfig("full", 2), GroupConfig("mamba", 2, mamba_cache_mode="align"))
    verdict, _ = _judge(plain).state("allocate_slots", old, new)
    assert "mamba-freed-on-processed-tokens" not in verdict.known


def test_the_eagle_flag_acts_only_with_use_eagle_in_033() -> None:
    flagged = (GroupConfig("full", 2, is_eagle_group=True), GroupConfig("full", 4, num_kv_heads=2))
    args = {"request_id": "r"}
    old, new = _hit([[1], [2]], 0), _hit([[1, 3], [2]], 4)
    verdict = _judge(flagged).outcome("get_computed_blocks", args, old, new, _equal)
    assert verdict.known == ("eagle-flag-needs-use-eagle",)
    # With use_eagle on both releases drop: a longer hit is something else.
    verdict = _judge(flagged, use_eagle=True).outcome(
        "get_computed_blocks", args, old, new, _equal
    )
    assert "eagle-flag-needs-use-eagle" not in verdict.known


def test_eagle_lookahead_over_the_whole_prompt_needs_a_covered_longer_hit() -> None:
    groups = (GroupConfig("full", 1), GroupConfig("full", 1, num_kv_heads=2))
    judge = _judge(groups, use_eagle=True)
    args = {"request_id": "r"}
    one_more = judge.outcome(
        "get_computed_blocks", args, _hit([[1, 2], [5, 6]], 2), _hit([[1, 2, 3], [5, 6, 7]], 3),
        _equal,
    )
    assert one_more.known == ("eagle-lookahead-whole-prompt",)
    # A longer hit that the full-attention blocks do not cover is not this entry.
    uncovered = judge.outcome(
        "get_computed_blocks", args, _hit([[1], [5]], 1), _hit([[1, 2], [5, 6]], 3), _equal
    )
    assert "eagle-lookahead-whole-prompt" not in uncovered.known


def test_three_full_groups_entry_needs_an_untrimmed_old_hit() -> None:
    groups = (
        GroupConfig("full", 1),
        GroupConfig("full", 2, num_kv_heads=2),
        GroupConfig("full", 4, num_kv_heads=3),
    )
    judge = _judge(groups)
    args = {"request_id": "r"}
    untrimmed, trimmed = _hit([[], [9, 10], []], 0), _hit([[], [], []], 0)
    verdict = judge.outcome("get_computed_blocks", args, untrimmed, trimmed, _equal)
    assert verdict.known == ("bug-three-full-groups-trim",)
    # Two trimmed hits of different lengths are not that bug.
    verdict = judge.outcome(
        "get_computed_blocks", args, _hit([[1, 2], [3], [4]], 2), _hit([[1], [3], [4]], 1), _equal
    )
    assert "bug-three-full-groups-trim" not in verdict.known


def test_fine_grained_hits_need_an_align_mamba_block_larger_than_the_hash_block() -> None:
    def config(*groups: GroupConfig) -> ManagerConfig:
        return ManagerConfig(num_blocks=16, groups=groups, max_model_len=32)

    align4 = GroupConfig("mamba", 4, mamba_cache_mode="align", num_kv_heads=2)
    assert fine_grained_hits(config(GroupConfig("full", 2), align4))
    assert not fine_grained_hits(config(GroupConfig("full", 4), align4))  # hash block 4
    swa = GroupConfig("sliding_window", 2, sliding_window=4, num_kv_heads=3)
    assert fine_grained_hits(config(GroupConfig("full", 2), swa, align4))  # swa is hash-sized
    swa4 = GroupConfig("sliding_window", 4, sliding_window=4, num_kv_heads=3)
    assert not fine_grained_hits(config(GroupConfig("full", 2), swa4, align4))


def test_partial_entry_events_are_dropped_and_a_free_order_from_them_known() -> None:
    groups = (GroupConfig("full", 4), GroupConfig("full", 2, num_kv_heads=2))  # hash block 2
    judge = _judge(groups)

    def stored(group: int, size: int) -> dict[str, Any]:
        return {"type": "BlockStored", "fields": {"group_idx": group, "block_size": size}}

    old = {"ok": [stored(0, 4)]}
    new = {"ok": [stored(0, 4), stored(0, 2)]}  # a partial entry inside a 4-token block
    verdict = judge.outcome("take_events", {}, old, new, _equal)
    assert verdict.ok and verdict.known == ("sub-block-prefix-entries",)
    # A full-size extra event is not a partial entry.
    extra = {"ok": [stored(0, 4), stored(1, 2)]}
    verdict = judge.outcome("take_events", {}, old, extra, _equal)
    assert not verdict.ok and "sub-block-prefix-entries" not in verdict.known
    verdict, _ = judge.state("free", {"free_queue": [3, 1, 2]}, {"free_queue": [1, 2, 3]})
    assert verdict.known == ("sub-block-prefix-entries",)
    verdict, _ = judge.state("free", {"free_queue": [3, 1, 2]}, {"free_queue": [1, 2, 4]})
    assert "sub-block-prefix-entries" not in verdict.known


# ---------------------------------------------------------------- two recorded trace sets


def _copy_as(src: Path, dst: Path, version: str, edit: dict[str, Any] | None = None) -> None:
    """``src`` rewritten as recorded on vLLM ``version``; ``edit`` maps an op to a new
    result for its first record."""
    lines = []
    edit = dict(edit or {})
    for line in src.read_text().splitlines():
        record = json.loads(line)
        if record.get("record") == "header":
            record["recorded_with"] = {"impl": "vllm", "version": version}
        elif record.get("op") in edit:
            record["ok"] = edit.pop(record["op"])
        lines.append(json.dumps(record))
    dst.write_text("\n".join(lines) + "\n")


def test_two_trace_sets_are_compared_through_the_ledger(tmp_path: Path) -> None:
    from kvcache.kit.cli import main
    from kvcache.kit.releases import compare_trace_sets

    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    src = DATA / "prefix_hits_and_eviction.jsonl"
    for name in ("same.jsonl", "cascade.jsonl", "hit.jsonl", "only_old.jsonl"):
        (old / name).write_text(src.read_text())
    _copy_as(src, new / "same.jsonl", "0.33.0")
    _copy_as(src, new / "cascade.jsonl", "0.33.0", {"get_num_common_prefix_blocks": [0]})
    shorter = {"block_ids": {"tuple": [[1]]}, "num_computed_tokens": 4}
    _copy_as(src, new / "hit.jsonl", "0.33.0", {"get_computed_blocks": shorter})
    check = compare_trace_sets(old, new)
    reports = {Path(r.path).name: r for r in check.traces}
    assert reports["same.jsonl"].verdict == "identical"
    assert reports["cascade.jsonl"].verdict == "known"
    assert "cascade-always-zero" in reports["cascade.jsonl"].entries
    assert reports["hit.jsonl"].verdict == "divergence"
    assert reports["hit.jsonl"].index == 1  # the first lookup
    assert reports["only_old.jsonl"].verdict == "unpaired"
    assert check.unknown == [f"{old / 'hit.jsonl'}: stops at record #1 get_computed_blocks/result"]
    # The command writes the changelog and fails on the unknown difference.
    out = tmp_path / "changelog.md"
    argv = ["changelog", "--from-traces", str(old), "--to-traces", str(new), "--out", str(out)]
    assert main(argv) == 1
    text = out.read_text()
    assert "## Recorded trace pairs" in text and "0.25.1 → 0.33.0" in text
    assert "`cascade-always-zero`" in text and "no API table" in text
    (new / "hit.jsonl").unlink()
    assert main(argv) == 0  # hit.jsonl is now unpaired: no unknown difference
    assert main([*argv, "--to", "0.34.0"]) == 2  # the traces record 0.33.0


def test_trace_sets_that_cannot_be_compared_are_refused_by_name(tmp_path: Path) -> None:
    from kvcache.kit.releases import compare_trace_sets

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"old_dir=.*holds no"):
        compare_trace_sets(empty, DATA)
    with pytest.raises(ValueError, match=r"new_dir=.*not a folder"):
        compare_trace_sets(DATA, tmp_path / "missing")
    same = tmp_path / "same"
    same.mkdir()
    (same / "a.jsonl").write_text((DATA / "prefix_hits_and_eviction.jsonl").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.jsonl").write_text((DATA / "prefix_hits_and_eviction.jsonl").read_text())
    with pytest.raises(ValueError, match=r"both recordings are of release line 0\.25"):
        compare_trace_sets(same, other)


def test_a_partial_mamba_tail_copy_needs_a_state_block_larger_than_the_hash_block() -> None:
    copy_old = {"free_queue": [7, 8, 9], "ref_cnt": {"dict": [[5, 1]]}}
    copy_new = {"free_queue": [8, 9], "ref_cnt": {"dict": [[5, 2], [7, 1]]}}
    def layout(mamba_block: int) -> tuple[GroupConfig, ...]:
        mamba = GroupConfig("mamba", mamba_block, mamba_cache_mode="align", num_kv_heads=2)
        return (GroupConfig("full", 2), mamba)

    big = layout(4)  # the hash block is 2
    verdict, _ = _judge(big).state("allocate_slots", copy_old, copy_new)
    assert verdict.known == ("mamba-partial-tail-copy",)
    # Fewer blocks held is not a copy.
    verdict, _ = _judge(big).state("allocate_slots", copy_new, copy_old)
    assert "mamba-partial-tail-copy" not in verdict.known
    same = layout(2)
    verdict, _ = _judge(same).state("allocate_slots", copy_old, copy_new)
    assert "mamba-partial-tail-copy" not in verdict.known


def test_an_allocation_that_only_the_early_free_lets_through_is_that_entry() -> None:
    args = {"request_id": "r", "num_new_tokens": 2}
    failed, granted = {"ok": None}, {"ok": {"tuple": [[3], [1]]}}
    verdict = _judge(MAMBA_SPEC).outcome("allocate_slots", args, failed, granted, _equal)
    assert verdict.known == ("mamba-freed-on-processed-tokens",)
    # The other way round (0.33.0 refusing what 0.25.1 grants) is not.
    verdict = _judge(MAMBA_SPEC).outcome("allocate_slots", args, granted, failed, _equal)
    assert "mamba-freed-on-processed-tokens" not in verdict.known


def test_a_hit_full_attention_does_not_cover_is_the_mamba_eagle_bug() -> None:
    groups = (GroupConfig("full", 1), GroupConfig("mamba", 1, mamba_cache_mode="align"))
    judge = _judge(groups, use_eagle=True)
    args = {"request_id": "r"}
    uncovered, covered = _hit([[], [9]], 1), _hit([[1], [9]], 1)
    verdict = judge.outcome("get_computed_blocks", args, uncovered, covered, _equal)
    assert verdict.known == ("bug-mamba-eagle-long-hit",)
    # The other way round is not the fixed bug.
    verdict = judge.outcome("get_computed_blocks", args, covered, uncovered, _equal)
    assert "bug-mamba-eagle-long-hit" not in verdict.known


def test_a_state_block_freed_before_it_is_cached_stays_unhashed() -> None:
    def with_hash(state: dict[str, Any], blocks: list[int]) -> dict[str, Any]:
        hashed = {
            "block_hash": {"dict": [[b, {"bytes": f"{b:02x}"}] for b in blocks]},
            "cached": {"dict": [[{"bytes": f"{b:02x}"}, [b]] for b in blocks]},
        }
        return {**state, **hashed}

    judge = _judge(MAMBA_SPEC)
    old = with_hash(_state([0, 3, 5], [6, 7]), [3])
    verdict, _ = judge.state("allocate_slots", old, with_hash(_state([0, 0, 5], [6, 7, 3]), []))
    assert verdict.known == ("mamba-freed-on-processed-tokens",)
    # A hash lost on a block the new side still holds is something else.
    verdict, _ = judge.state("allocate_slots", with_hash(old, [3, 5]), with_hash(old, [3]))
    assert "mamba-freed-on-processed-tokens" not in verdict.known


def _hashed(state: dict[str, Any], entries: list[tuple[int, str]]) -> dict[str, Any]:
    """``state`` with ``entries`` (block id, pool key hex) as its hashes and cache."""
    return {
        **state,
        "block_hash": {"dict": [[b, {"bytes": key}] for b, key in entries]},
        "cached": {"dict": [[{"bytes": key}, [b]] for b, key in entries]},
    }


def test_a_mamba_entry_put_back_after_evict_blocks_is_the_prompt_boundary_rekey() -> None:
    groups = (GroupConfig("full", 2), GroupConfig("mamba", 2, mamba_cache_mode="align"))
    held = {"req_to_blocks": [{"r": [1, 2, 3]}, {"r": [0, 0, 4, 5]}]}
    h = "ab" * 8
    old = _hashed(held, [(3, h + "00000000")])
    new = _hashed(held, [(3, h + "00000000"), (4, h + "00000001")])
    judge = _judge(groups)
    judge.observe("evict_blocks", {"block_ids": [4]}, {"ok": None}, {"ok": None})
    verdict, _ = judge.state("allocate_slots", old, new)
    assert verdict.known == ("mamba-prompt-boundary-rekey",)
    # Under the full-attention group's id it is not a Mamba re-key.
    elsewhere = _hashed(held, [(3, h + "0" * 8), (4, h + "0" * 8)])
    verdict, _ = judge.state("allocate_slots", old, elsewhere)
    assert "mamba-prompt-boundary-rekey" not in verdict.known
    # The old side having the extra entry is the other direction.
    verdict, _ = judge.state("allocate_slots", new, old)
    assert "mamba-prompt-boundary-rekey" not in verdict.known
    # Without an evict_blocks of that block there is nothing to put back.
    verdict, _ = _judge(groups).state("allocate_slots", old, new)
    assert "mamba-prompt-boundary-rekey" not in verdict.known


def test_a_rekey_seen_only_in_events_is_one_extra_mamba_block_stored() -> None:
    groups = (GroupConfig("full", 2), GroupConfig("mamba", 1, mamba_cache_mode="align"))
    stored = {"type": "BlockStored", "fields": {"group_idx": 0, "block_hashes": [7]}}
    rekey = {"type": "BlockStored", "fields": {"group_idx": 1, "block_hashes": [7]}}
    judge = _judge(groups)
    judge.observe("evict_blocks", {"block_ids": [5]}, {"ok": None}, {"ok": None})
    old, new = {"ok": [stored]}, {"ok": [stored, rekey]}
    verdict = judge.outcome("take_events", {}, old, new, _equal)
    assert verdict.known == ("mamba-prompt-boundary-rekey",)
    # An extra full-attention event is not the Mamba re-key.
    verdict = judge.outcome("take_events", {}, old, {"ok": [stored, stored]}, _equal)
    assert "mamba-prompt-boundary-rekey" not in verdict.known


def test_retention_with_eagle_differs_only_in_which_window_blocks_are_hashed() -> None:
    swa = (GroupConfig("sliding_window", 4, sliding_window=4),)
    held = {"req_to_blocks": [{"r": [1, 2, 3]}]}
    old = _hashed(held, [(2, "aa" * 8 + "0" * 8)])
    new = _hashed(held, [(1, "bb" * 8 + "0" * 8), (2, "aa" * 8 + "0" * 8)])
    verdict, _ = _judge(swa, use_eagle=True, prefix_cache_retention_interval=0).state(
        "allocate_slots", old, new
    )
    assert verdict.known == ("bug-retention-eagle-replay-boundary",)
    # Without EAGLE, or without a retention interval, the boundaries agree.
    for config in ({"prefix_cache_retention_interval": 0}, {"use_eagle": True}):
        verdict, _ = _judge(swa, **config).state("allocate_slots", old, new)
        assert "bug-retention-eagle-replay-boundary" not in verdict.known
    # A block hashed differently on the two sides is not a retention choice.
    other = _hashed(held, [(2, "cc" * 8 + "0" * 8)])
    verdict, _ = _judge(swa, use_eagle=True, prefix_cache_retention_interval=0).state(
        "allocate_slots", old, other
    )
    assert "bug-retention-eagle-replay-boundary" not in verdict.known


def test_the_stored_retention_trace_marks_the_fixed_bug() -> None:
    records = [json.loads(line) for line in (DATA / "retention_eagle_resend.jsonl").open()]
    marked = [r for r in records if r.get("known")]
    assert [r["known"] for r in marked] == [["bug-retention-eagle-replay-boundary"]]
    assert marked[0]["op"] == "allocate_slots"
    resend = [r for r in records if r.get("op") == "get_computed_blocks"][-1]
    assert resend["ok"]["num_computed_tokens"] == 0  # 0.25.1's collapsed hit


def test_a_retention_choice_hidden_from_the_state_surfaces_in_window_groups_only() -> None:
    groups = (GroupConfig("full", 4), GroupConfig("sliding_window", 2, sliding_window=3))
    judge = _judge(groups, use_eagle=True, prefix_cache_retention_interval=0)
    args = {"request_id": "r", "num_new_tokens": 2}
    verdict = judge.outcome(
        "allocate_slots", args, {"ok": {"tuple": [[], [4]]}}, {"ok": {"tuple": [[], [9]]}}, _equal
    )
    assert verdict.known == ("bug-retention-eagle-replay-boundary",)
    # Another full-attention block alone is not a window group's free order.
    verdict = judge.outcome(
        "allocate_slots", args, {"ok": {"tuple": [[4], []]}}, {"ok": {"tuple": [[9], []]}}, _equal
    )
    assert "bug-retention-eagle-replay-boundary" not in verdict.known
    window = {"type": "BlockStored", "fields": {"group_idx": 1, "block_hashes": [3]}}
    full = {"type": "BlockStored", "fields": {"group_idx": 0, "block_hashes": [3]}}
    verdict = judge.outcome("take_events", {}, {"ok": [full]}, {"ok": [full, window]}, _equal)
    assert verdict.known == ("bug-retention-eagle-replay-boundary",)
    verdict = judge.outcome("take_events", {}, {"ok": [full]}, {"ok": [full, full]}, _equal)
    assert "bug-retention-eagle-replay-boundary" not in verdict.known


def test_the_stored_rekey_trace_leaves_the_evicted_state_block_unhashed_on_0_25_1() -> None:
    records = [json.loads(line) for line in (DATA / "mamba_prompt_boundary_rekey.jsonl").open()]
    calls = [r for r in records if r.get("record") == "call"]
    evict = next(i for i, r in enumerate(calls) if r["op"] == "evict_blocks")
    after = calls[evict + 1]
    assert after["op"] == "allocate_slots"
    hashed = {b for b, _ in after["state"]["block_hash"]["dict"]}
    mamba_held = set(after["state"]["req_to_blocks"][1]["a"])
    assert set(calls[evict]["args"]["block_ids"]) & mamba_held
    assert not hashed & set(calls[evict]["args"]["block_ids"])  # 0.33.0 re-keys block 4


def test_an_early_free_beside_a_missing_eagle_block_is_both_entries() -> None:
    """One allocation, two causes: 0.33.0 frees the first Mamba state block (block 3,
    which keeps its hash) and, the EAGLE flag acting only with use_eagle on, caches one
    Mamba block fewer (block 4 stays unhashed)."""
    groups = (
        GroupConfig("sliding_window", 2, sliding_window=3),
        GroupConfig("mamba", 1, mamba_cache_mode="align", num_speculative_blocks=1,
                    is_eagle_group=True),
    )  # fmt: skip
    h3, h4 = ("aa" * 8 + "00000001", 3), ("bb" * 8 + "00000001", 4)

    def state(mamba: list[int], free: list[int], hashed: list[tuple[str, int]]) -> dict[str, Any]:
        held = {
            "free_queue": free,
            "ref_cnt": {"dict": [[b, 1] for b in [1, *mamba] if b]},
            "req_to_blocks": [{"r": [1]}, {"r": mamba}],
            "num_cached_block": [{"r": 0}, {"r": len(hashed)}],
        }
        return _hashed(held, [(b, key) for key, b in hashed])

    old = state([3, 4, 5], [6, 7], [h3, h4])
    new = {**state([0, 4, 5], [6, 7, 3], [h3]), "num_cached_block": [{"r": 0}, {"r": 1}]}
    verdict, _ = _judge(groups).state("allocate_slots", old, new)
    assert verdict.known == ("eagle-flag-needs-use-eagle", "mamba-freed-on-processed-tokens")
    # With use_eagle on the flag acts in both releases: the missing hash is unexplained.
    verdict, _ = _judge(groups, use_eagle=True).state("allocate_slots", old, new)
    assert not verdict.known
    # A held block that is not nulled but swapped is no early free.
    swapped = {**new, "req_to_blocks": [{"r": [1]}, {"r": [8, 4, 5]}]}
    verdict, _ = _judge(groups).state("allocate_slots", old, swapped)
    assert not verdict.known
    # Alone (no freeing part), a freed block's lost hash still needs the freeing rule's check.
    verdict, _ = _judge(MAMBA_SPEC).state(
        "allocate_slots", _hashed(_state([0, 3, 5], [6, 7]), [(3, "03"), (5, "05")]),
        _hashed(_state([0, 0, 5], [6, 7, 3]), [(3, "03")]),
    )  # fmt: skip
    assert "mamba-freed-on-processed-tokens" not in verdict.known


def test_the_stored_early_free_trace_marks_the_fixed_bug_at_the_third_allocation() -> None:
    records = [json.loads(line) for line in (DATA / "mamba_eagle_flag_early_free.jsonl").open()]
    marked = [r for r in records if r.get("known")]
    assert [r["known"] for r in marked] == [["mamba-freed-on-processed-tokens"]]
    last = marked[0]
    assert last is records[-2] and last["op"] == "allocate_slots"  # before the end record
    # 0.25.1 keeps the first state block and caches the EAGLE look-ahead block too.
    assert last["state"]["req_to_blocks"][1]["a"][0] != 0
    assert last["state"]["num_cached_block"][1]["a"] == 3


def test_a_sliding_window_hit_mamba_outgrew_is_the_mamba_eagle_bug() -> None:
    swa_mamba = (
        GroupConfig("sliding_window", 1, sliding_window=11),
        GroupConfig("mamba", 1, mamba_cache_mode="align", num_kv_heads=2),
    )
    judge = _judge(swa_mamba, use_eagle=True)
    args = {"request_id": "r"}
    # 0.25.1: the window group kept 4 blocks after its EAGLE drop, Mamba grew the hit to 5.
    short_window = _hit([[1, 2, 3, 4], [0, 0, 0, 0, 7]], 5)
    covered = _hit([[1, 2, 3, 4, 6], [0, 0, 0, 0, 7]], 5)
    verdict = judge.outcome("get_computed_blocks", args, short_window, covered, _equal)
    assert verdict.known == ("bug-mamba-eagle-long-hit",)
    # The other way round is not the fixed bug.
    verdict = judge.outcome("get_computed_blocks", args, covered, short_window, _equal)
    assert "bug-mamba-eagle-long-hit" not in verdict.known
    # A Mamba list shorter than the hit is not what the bug leaves short (its state is one block).
    short_state = _hit([[1, 2, 3, 4, 6], [0, 0, 0, 7]], 5)
    verdict = judge.outcome("get_computed_blocks", args, short_state, covered, _equal)
    assert "bug-mamba-eagle-long-hit" not in verdict.known
    # Covered on both sides, other blocks: not this entry.
    other = _hit([[1, 2, 3, 4, 5], [0, 0, 0, 0, 7]], 5)
    verdict = judge.outcome("get_computed_blocks", args, other, covered, _equal)
    assert "bug-mamba-eagle-long-hit" not in verdict.known
    # Without EAGLE the window group drops nothing: not this entry.
    verdict = _judge(swa_mamba).outcome("get_computed_blocks", args, short_window, covered, _equal)
    assert "bug-mamba-eagle-long-hit" not in verdict.known


def _tail_judge(full_block: int = 8, evict: bool = True) -> Judge:
    """Full attention (``full_block``) beside a window of 4-token blocks (hash block 4),
    a 7-token prompt whose tail boundary (4 tokens) lies inside the first full block,
    that block (4) held by the request and named by ``evict_blocks`` when ``evict``."""
    groups = (
        GroupConfig("full", full_block),
        GroupConfig("sliding_window", 4, sliding_window=5, num_kv_heads=2),
    )
    judge = _judge(groups)
    request = {"request_id": "r3", "prompt_token_ids": [2, 2, 1, 2, 2, 2, 2], "max_tokens": 6}
    hashes = {"ok": [{"bytes": "aa" * 4}]}
    judge.observe("add_request", request, hashes, hashes)
    judge.observe(
        "append_output_token_ids", {"request_id": "r3", "token_ids": 1},
        {"ok": [{"bytes": "bb" * 4}]}, {"ok": [{"bytes": "bb" * 4}]},
    )  # fmt: skip
    if evict:
        judge.observe("evict_blocks", {"block_ids": [4, 5]}, {"ok": None}, {"ok": None})
    return judge


def _keyed(key: str | None, cached_count: int = 1) -> dict[str, Any]:
    state: dict[str, Any] = {
        "block_hash": {},
        "cached": {},
        "num_cached_block": [{"r3": cached_count}, {"r3": 2}],
        "req_to_blocks": [{"r3": [4, 2]}, {"r3": [0, 5, 6]}],
    }
    if key is not None:
        state["block_hash"] = {"dict": [[4, {"bytes": key}]]}
        state["cached"] = {"dict": [[{"bytes": key}, [4]]]}
    return state


def test_an_evicted_block_keyed_again_by_the_prompt_tail_is_the_resurrection_bug() -> None:
    entry = "bug-prompt-tail-entry-resurrected"
    tail_key = "aa" * 4 + "00000000"  # the 4-token boundary's hash, group 0
    verdict, _ = _tail_judge().state("allocate_slots", _keyed(None), _keyed(tail_key))
    assert verdict.known == (entry,)
    # Another hash (the full block's own), another group's suffix: not the prompt tail.
    for key in ("bb" * 4 + "00000000", "aa" * 4 + "00000001"):
        verdict, _ = _tail_judge().state("allocate_slots", _keyed(None), _keyed(key))
        assert entry not in verdict.known
    # 0.33.0 dropping a key 0.25.1 keeps is the other direction.
    verdict, _ = _tail_judge().state("allocate_slots", _keyed(tail_key), _keyed(None))
    assert entry not in verdict.known
    # Without an evict_blocks, or a block 0.25.1 has not cached yet: something else.
    verdict, _ = _tail_judge(evict=False).state("allocate_slots", _keyed(None), _keyed(tail_key))
    assert entry not in verdict.known
    verdict, _ = _tail_judge().state("allocate_slots", _keyed(None, 0), _keyed(tail_key, 0))
    assert entry not in verdict.known
    # A full block of one hash block has no tail inside it.
    verdict, _ = _tail_judge(full_block=4).state("allocate_slots", _keyed(None), _keyed(tail_key))
    assert entry not in verdict.known


def test_sub_block_entries_drop_a_tail_not_cached_yet_but_not_one_on_an_evicted_block() -> None:
    tail_key = "aa" * 4 + "00000000"
    # A prompt tail in a block 0.25.1 has not cached yet: normalised, even with no old entries.
    verdict, diff = _tail_judge().state("allocate_slots", _keyed(None, 0), _keyed(tail_key, 0))
    assert verdict.ok and "sub-block-prefix-entries" in verdict.known and diff == []
    # Beside entries both sides have, the key put back on the evicted block is not swallowed.
    other = [[9, {"bytes": "cc" * 4 + "00000001"}]]

    def with_other(state: dict[str, Any]) -> dict[str, Any]:
        hashes = _entries_of(state, "block_hash") + other
        cached = [*_entries_of(state, "cached"), [other[0][1], [9]]]
        return {**state, "block_hash": {"dict": hashes}, "cached": {"dict": cached}}

    verdict, _ = _tail_judge().state(
        "allocate_slots", with_other(_keyed(None)), with_other(_keyed(tail_key))
    )
    assert verdict.known == ("bug-prompt-tail-entry-resurrected",)


def _entries_of(state: dict[str, Any], key: str) -> list[Any]:
    return list(state[key].get("dict", []))


def test_the_stored_swa_mamba_trace_marks_the_short_window_hit() -> None:
    records = [json.loads(line) for line in (DATA / "swa_mamba_eagle_long_hit.jsonl").open()]
    marked = [r for r in records if r.get("known")]
    assert [r["known"] for r in marked] == [["bug-mamba-eagle-long-hit"]]
    hit = marked[0]["ok"]
    assert hit["num_computed_tokens"] == 5 and len(hit["block_ids"]["tuple"][0]) == 4


def test_the_stored_resurrection_trace_leaves_the_evicted_block_unhashed_on_0_25_1() -> None:
    records = [json.loads(line) for line in (DATA / "prompt_tail_entry_resurrected.jsonl").open()]
    assert not any(r.get("known") for r in records)  # 0.25.1 is right here: no known bug
    evict = next(i for i, r in enumerate(records) if r.get("op") == "evict_blocks")
    after = records[evict + 1]
    assert after["op"] == "allocate_slots"
    (block,) = records[evict]["args"]["block_ids"]
    assert after["state"]["req_to_blocks"][0]["a"][0] == block
    assert after["state"]["num_cached_block"][0]["a"] == 1
    assert block not in [b for b, _ in after["state"]["block_hash"].get("dict", [])]


def test_a_block_stored_event_is_read_once_for_every_rule() -> None:
    from kvcache.kit.ledger import _stored_event

    groups = (GroupConfig("full", 4), GroupConfig("mamba", 2, mamba_cache_mode="align"))
    fields = {"group_idx": 1, "block_size": 2, "block_hashes": [7]}
    stored = _stored_event({"type": "BlockStored", "fields": fields}, groups)
    assert stored is not None and stored.group is groups[1]
    assert (stored.group_idx, stored.block_size, stored.block_hashes) == (1, 2, [7])
    loose = _stored_event(
        {"type": "BlockStored", "fields": {"group_idx": 0, "block_size": "2"}}, groups
    )
    assert loose is not None and loose.block_size is None and loose.block_hashes is None
    for event in (
        {"type": "BlockRemoved", "fields": fields},
        {"type": "BlockStored", "fields": {**fields, "group_idx": 2}},
        {"type": "BlockStored", "fields": {**fields, "group_idx": -1}},
        {"type": "BlockStored", "fields": [1]},
        "BlockStored",
    ):
        assert _stored_event(event, groups) is None, event


def test_a_construction_failure_is_explained_only_for_the_side_that_refuses() -> None:
    ring = (GroupConfig("full", 4), GroupConfig("circular", 4, num_kv_heads=2))
    reason = "kv_cache_spec of type CircularBufferSpec (group 1) is not supported"
    # The 0.25.1 side refuses a ring group 0.33.0 adds; 0.33.0 itself refusing one is news.
    assert _judge(ring).cannot_build(reason, refused_by="old") == "circular-buffer-kind"
    assert _judge(ring).cannot_build(reason) is None
    tq = (GroupConfig("tq_full", 4),)
    tq_reason = "module 'vllm.v1.kv_cache_interface' has no attribute 'TQFullAttentionSpec'"
    assert _judge(tq).cannot_build(tq_reason) == "tq-spec-removed"
    assert _judge(tq).cannot_build(tq_reason, refused_by="old") is None
    with pytest.raises(ValueError, match="refused_by='both'"):
        _judge(tq).cannot_build(tq_reason, refused_by="both")


def test_checkpoint_fields_explain_only_an_old_side_refusing_them() -> None:
    mamba = GroupConfig(
        "mamba", 4, mamba_cache_mode="align", num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=2,
    )  # fmt: skip
    groups = (GroupConfig("full", 4), mamba)
    reason = "__init__() got an unexpected keyword argument 'num_prefill_checkpoint_blocks'"
    entry = "mamba-prefill-checkpoints"
    assert _judge(groups).cannot_build(reason, refused_by="old") == entry
    assert _judge(groups).cannot_build(reason) is None  # 0.33.0 refusing them is news
    plain = (GroupConfig("full", 4), GroupConfig("mamba", 4, mamba_cache_mode="align"))
    assert _judge(plain).cannot_build(reason, refused_by="old") is None
    # The fields belong to Mamba groups; the record leaves them out when unset.
    with pytest.raises(ValueError, match="full group has no prefill checkpoint"):
        GroupConfig("full", 4, num_prefill_checkpoint_blocks=1)
    with pytest.raises(ValueError, match="prefill_checkpoint_alignment=0"):
        GroupConfig("mamba", 4, prefill_checkpoint_alignment=0)
    config = ManagerConfig(num_blocks=16, groups=groups, max_model_len=32)
    record = config.to_record()
    assert "num_prefill_checkpoint_blocks" not in record["groups"][0]
    assert record["groups"][1]["prefill_checkpoint_alignment"] == 2
    assert ManagerConfig.from_record(record) == config


def test_lookahead_arguments_explain_only_an_old_side_refusing_them() -> None:
    groups = (GroupConfig("full", 4),)
    reason = "__init__() got an unexpected keyword argument 'num_hash_lookahead_tokens'"
    entry = "lookahead-arguments-added"
    assert _judge(groups, num_hash_lookahead_tokens=2).cannot_build(reason, "old") == entry
    # 0.33.0 refusing it, a configuration without lookahead, or another reason: news.
    assert _judge(groups, num_hash_lookahead_tokens=2).cannot_build(reason) is None
    assert _judge(groups).cannot_build(reason, refused_by="old") is None
    assert _judge(groups, num_prefill_lookahead=2).cannot_build(reason, "old") is None
    assert _judge(groups, num_hash_lookahead_tokens=1).cannot_build("no blocks", "old") is None
