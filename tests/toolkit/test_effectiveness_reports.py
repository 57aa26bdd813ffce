"""The upstream prefix-cache reports of docs/effectiveness-reports.md, held to their
classification.

Each trace under tests/data/effectiveness/ was recorded on a real vLLM release
(``scripts/effectiveness_report_traces.py``). A trace of 0.25.1 or 0.33.0 is replayed
through kvcache's matching line (``kvcache``, ``kvcache-0.33``): it must replay
identically, and the lookups judged (``judge_records``) are kvcache's own. A trace of
a release kvcache has no line for (0.28.0, 0.29.0) is judged as recorded: those
traces keep the pool's state at lookups only, so the judge sees their read side
alone (``judge_records``: the write side needs the state after every call). The
tests then assert what the report's classification rests on: which lookups miss, by
how much, and whether the judge sees the loss and which rule explains it, or flags
it: a state computed at the replay boundary and never kept is a loss no rule
explains (the retention must keep that boundary).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvcache.kit.driver import Lockstep, replay_trace
from kvcache.kit.effectiveness import judge_records, switch_on
from kvcache.kit.trace import Trace, read_trace
from spec.effectiveness import Verdict

DATA = Path(__file__).resolve().parents[1] / "data" / "effectiveness"

#: kvcache's line of each release it models.
LINES = {"0.25.1": "kvcache", "0.33.0": "kvcache-0.33"}


def trace_path(case: str, release: str) -> Path:
    return DATA / f"{case}.vllm-{release}.jsonl"


def release_of(trace: Trace) -> str:
    return str((trace.header.get("recorded_with") or {}).get("version"))


def master_switch(release: str) -> bool:
    """vLLM 0.30.0 and later apply EAGLE only with ``use_eagle``."""
    major, minor = (int(x) for x in release.split(".")[:2])
    return (major, minor) >= (0, 30)


def records_on_line(trace: Trace, line: str) -> list[dict[str, Any]]:
    """The trace's calls run on kvcache's ``line``, with its states recorded."""
    run = Lockstep(trace.config, None, reference=line, hash_seed=trace.hash_seed)
    for record in trace.records:
        run.call(record["op"], **record["args"])
    return run.records


def verdicts(case: str, release: str) -> dict[str, Verdict]:
    """Each request's lookup in ``case`` on ``release``, judged (kvcache's line where
    kvcache models the release, else the recorded lookups)."""
    path = trace_path(case, release)
    if not path.is_file():
        pytest.skip(f"{path.name}: not recorded")
    trace = read_trace(path)
    assert release_of(trace) == release
    line = LINES.get(release)
    if line is None:
        records: list[dict[str, Any]] = trace.records
    else:
        replay = replay_trace(trace, line)
        assert replay.mismatch is None, f"{path.name} on {line}: {replay.mismatch}"
        records = records_on_line(trace, line)
    fine = switch_on("mamba_fine_grained_hits", release)
    judged = dict(judge_records(trace.config, records, master_switch(release), fine))
    for rid, verdict in judged.items():  # every report: no hit past the pool
        assert not verdict.false_hit, (case, release, rid, verdict)
    return judged


def explained(judged: dict[str, Verdict]) -> dict[str, Verdict]:
    """``judged``, asserting that every loss in it is one a named rule explains."""
    for rid, verdict in judged.items():
        assert verdict.unexplained == 0, (rid, verdict)
    return judged


def flagged_write_loss(verdict: Verdict, tokens: int) -> bool:
    """A lookup that reused nothing while ``tokens`` were computed at a boundary the
    retention must keep and the pool never held: flagged (unexplained)."""
    return verdict.realized == 0 == verdict.achievable and verdict.unexplained == tokens

def hidden_miss(verdict: Verdict) -> bool:
    """A lookup that reused nothing and that the judge sees no loss in: the pool held
    nothing to serve (the loss, if any, happened when the state was not kept)."""
    return verdict.realized == 0 and verdict.achievable == 0 and not verdict.losses


# ------------------------------------------------------- vLLM #53504 (and #54360)


@pytest.mark.parametrize("release", ["0.25.1", "0.28.0", "0.29.0"])
def test_53504_first_mtp_repeat_misses_with_sparse_retention_before_0_30(release: str) -> None:
    """EAGLE on 3 align-mode Mamba groups + 1 full, retention 0: the retention keeps
    the unshifted replay boundary, the state at the EAGLE checkpoint is dropped, and
    the first repeat misses; the judge sees no loss (the pool never held the state).
    From 0.28.0 the miss's shared-prefix boundary is kept as a junction, so the second
    repeat hits (the report's symptom); 0.25.1 keeps no junction and misses again.
    The workaround (retention = block size) hits the first repeat."""
    sparse = verdicts("mtp_mamba_retention0_repeat", release)
    dense = explained(verdicts("mtp_mamba_dense_repeat", release))
    assert sparse["first"].realized == 0
    if release == "0.25.1":  # states after every call (kvcache's line): the write side
        # The state at 20 (the EAGLE-shifted replay boundary) was computed, never kept.
        assert flagged_write_loss(sparse["repeat1"], 20)
        assert flagged_write_loss(sparse["repeat2"], 20)
    else:
        assert hidden_miss(sparse["repeat1"])
        assert sparse["repeat2"].realized == dense["repeat2"].realized > 0
    workaround = explained(verdicts("mtp_mamba_retention_block_repeat", release))
    assert workaround["repeat1"].realized == dense["repeat1"].realized > 0


def test_53504_is_fixed_in_0_33_0() -> None:
    sparse = explained(verdicts("mtp_mamba_retention0_repeat", "0.33.0"))
    dense = explained(verdicts("mtp_mamba_dense_repeat", "0.33.0"))
    assert sparse["repeat1"].realized == dense["repeat1"].realized > 0
    assert sparse["repeat1"].losses == {}


# ------------------------------------------------------------------ vLLM #38182


@pytest.mark.parametrize("release", ["0.25.1", "0.28.0", "0.29.0", "0.33.0"])
def test_38182_mtp_costs_one_mamba_block_at_write_time(release: str) -> None:
    """With MTP the repeat hits one block (4 tokens here, 1,072 in the report) less
    than without; the lookup loses nothing the pool held: the scheduler's EAGLE
    checkpoint is a block lower, so the state one block higher never exists."""
    mtp = verdicts("mtp_mamba_dense_repeat", release)["repeat1"]
    plain = verdicts("mamba_dense_repeat", release)["repeat1"]
    assert plain.realized - mtp.realized == 4
    assert mtp.realized == mtp.achievable and not mtp.losses


# ------------------------------------------------------------------ vLLM #45238


@pytest.mark.parametrize("release", ["0.25.1", "0.28.0", "0.29.0", "0.33.0"])
def test_45238_first_sibling_misses_then_the_junction_is_kept(release: str) -> None:
    """The align checkpoint (24) of a 27-token prompt lands in its own suffix: the
    first sibling sharing the 16-token system prompt reuses nothing (and the judge
    sees nothing lost); its prefill stops at the junction, so the next one hits 16."""
    judged = verdicts("mamba_shared_prefix_unique_tail", release)
    assert hidden_miss(judged["sibling1"])
    assert judged["sibling2"].realized == judged["sibling2"].achievable == 16


# ------------------------------- 1Cat-vLLM #205 (vLLM #42258 / #44082), vLLM #40624


@pytest.mark.parametrize("release", ["0.25.1", "0.28.0", "0.29.0", "0.33.0"])
def test_swa_eagle_mask_over_window_hits(release: str) -> None:
    """SWA + full with EAGLE, the scheduler block (16) over the window (5): the repeat
    hits a whole scheduler block; what it loses is the EAGLE drop (and, on 0.33.0, a
    hash-block alignment), never the whole hit."""
    verdict = explained(verdicts("swa_eagle_alignment_over_window", release))["repeat1"]
    assert verdict.realized >= 16
    # On 0.33.0 the block past the prompt's last token is computed, never cached: the
    # write side's starting point is a block higher, and the last-token rule takes it.
    assert set(verdict.losses) <= {"eagle_drop", "block_alignment", "last_token"}
    assert verdict.losses["eagle_drop"] == 16


@pytest.mark.parametrize("release", ["0.25.1", "0.28.0", "0.29.0", "0.33.0"])
def test_205_the_42258_mask_gap_zeroes_the_hit_and_the_judge_blames_eagle(release: str) -> None:
    """#42258's write-side mask emulated (the window blocks just past each aligned
    boundary evicted): the repeat reuses nothing, and the judge, which sees only the
    pool, explains the whole loss by the EAGLE rule: it cannot tell a write-side gap
    from the drop (the missing rule of docs/effectiveness-reports.md)."""
    intact = verdicts("swa_eagle_alignment_over_window", release)["repeat1"]
    gap = explained(verdicts("swa_eagle_mask_gap_emulated", release))["repeat1"]
    assert intact.realized >= 16 and gap.realized == 0
    # An eviction is no write-side loss (the blocks were held): EAGLE takes the blame.
    assert gap.losses["eagle_drop"] == gap.achievable > 0
    assert set(gap.losses) <= {"eagle_drop", "last_token"}


# ------------------------------------------------------- vLLM #51250 / #40624


@pytest.mark.parametrize("release", ["0.25.1", "0.28.0", "0.29.0", "0.33.0"])
def test_drafter_group_beside_mamba_hits(release: str) -> None:
    """A drafter's sliding-window group beside full attention and align-mode Mamba,
    marked as the EAGLE group or not (every group EAGLE then): with dense retention the
    first repeat hits what the pool holds; with retention 0 it misses before 0.30.0
    (as in #53504) and hits on 0.33.0."""
    for case in ("drafter_swa_mamba_repeat", "drafter_fallback_swa_mamba_repeat"):
        judged = explained(verdicts(case, release))
        assert 0 < judged["repeat1"].realized == judged["repeat1"].achievable, case
    sparse = verdicts("drafter_fallback_swa_mamba_retention0_repeat", release)
    if release == "0.33.0":
        assert sparse["repeat1"].realized > 0 and not sparse["repeat1"].unexplained
    elif release == "0.25.1":
        assert flagged_write_loss(sparse["repeat1"], 20)
    else:
        assert hidden_miss(sparse["repeat1"])


# ------------------------------------------------------------------ vLLM #54360


@pytest.mark.parametrize("release", ["0.25.1", "0.28.0", "0.29.0"])
def test_54360_mtp_repeats_miss_with_sparse_retention_before_0_30(release: str) -> None:
    """Plain MTP (every group EAGLE), Mamba block 16 over hash block 4, retention 0:
    neither prompt length hits on a repeat, where the same without MTP does."""
    mtp = verdicts("mtp_fallback_fine_grained_lengths_tail", release)
    plain = explained(verdicts("fine_grained_lengths_tail_no_mtp", release))
    for rid in ("len26-repeat", "len40-repeat"):
        assert mtp[rid].realized == 0 < plain[rid].realized, (release, rid)
    # The 26-token prompt: nothing lost that a rule does not name (on 0.25.1 hits
    # align to the 16-token scheduler block, and EAGLE's drop leaves no state a repeat
    # could use). The 40-token one on 0.25.1, where the write side is seen: the state
    # at 16 (32 less EAGLE's drop, on the block) was computed and never kept: flagged.
    # On 0.28.0 / 0.29.0 (read side only) only the prompt-tail state is lost.
    rids = ("len26-repeat",) if release == "0.25.1" else ("len26-repeat", "len40-repeat")
    for rid in rids:
        assert not mtp[rid].expected and set(mtp[rid].losses) <= {"last_token"}
    if release == "0.25.1":
        assert flagged_write_loss(mtp["len40-repeat"], 16)


def test_54360_is_absent_on_0_33_0() -> None:
    mtp = verdicts("mtp_fallback_fine_grained_lengths_tail", "0.33.0")
    assert all(mtp[r].realized > 0 for r in ("len26-repeat", "len40-repeat"))


def test_54360_dense_retention_zero_depends_on_prompt_length() -> None:
    """Dense retention (0.25.1 to 0.28.x's default): a prompt under two Mamba blocks
    gets its checkpoint moved to 0 by the EAGLE prune and misses; a longer one hits
    (#52244's "zero for some prompt lengths, partial for others")."""
    for release in ("0.25.1", "0.33.0"):
        dense = verdicts("mtp_fallback_fine_grained_lengths_dense", release)
        assert hidden_miss(dense["len26-repeat"]) and dense["len40-repeat"].realized > 0
