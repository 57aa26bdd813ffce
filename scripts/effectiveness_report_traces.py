"""Record the directed traces of docs/effectiveness-reports.md (upstream prefix-cache
reports, each a short lockstep sequence on one layout).

Each case drives whole requests the way vLLM's scheduler does for an align-mode
Mamba group: a prefill chunk ends at the prompt's Mamba checkpoint (the last block
boundary, one block lower under EAGLE: ``Scheduler._mamba_block_aligned_split``) and
at a shared-prefix junction (the Marconi admission), then the rest of the prompt,
two decode steps, and the request finishes. The traces are written to
``tests/data/effectiveness/<case>.<impl>-<version>.jsonl``, with the manager's state
at each lookup (what the effectiveness judge reads).

Usage (the reference is the installed vLLM, or a kvcache line for a dry run)::

    .venv/bin/python scripts/effectiveness_report_traces.py --impl vllm
    .venv-0.33/bin/python scripts/effectiveness_report_traces.py --impl vllm
    python scripts/effectiveness_report_traces.py --impl kvcache-0.33 --out /tmp/x
    python scripts/effectiveness_report_traces.py --judge tests/data/effectiveness/*.jsonl
    .venv-0.33/bin/python scripts/effectiveness_report_traces.py --impl vllm \
        --replay tests/data/effectiveness/*.vllm-0.33.0.jsonl
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcache.kit.config import GroupConfig, ManagerConfig
from kvcache.kit.driver import Lockstep, replay_trace
from kvcache.kit.effectiveness import judge_records
from kvcache.kit.sides import CannotBuild, make_side
from kvcache.kit.trace import read_trace, write_trace

ROOT = Path(__file__).resolve().parents[1]

DATA = ROOT / "tests" / "data" / "effectiveness"


def tokens(seed: str, count: int) -> list[int]:
    """``count`` token ids drawn from a fixed seed (distinct seeds: distinct text)."""
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(count)]


class Driver:
    """Whole requests through a lockstep run, scheduled as vLLM's scheduler would."""

    def __init__(self, run: Lockstep) -> None:
        self.run = run
        self.sampled = 0

    def junction(self, rid: str, hit: int) -> int:
        """Where the scheduler stops a prefill at a shared prefix the lookup found
        uncached in a Mamba group (Marconi admission), floored to the Mamba block:
        0.28.0 on keep the lookup's shared-prefix boundary on the request, 0.25.1 reads
        the coordinator's uncached common prefix. 0 when none."""
        side = self.run.reference
        block = min((g.block_size for g in self.run.config.groups if g.kind == "mamba"), default=0)
        if not block:
            return 0
        boundary = int(getattr(side.requests[rid], "shared_prefix_boundary", 0) or 0)
        if not boundary:
            layer = getattr(side.manager, "coordinator", side.manager)  # spec: no coordinator
            extra = getattr(layer, "num_uncached_common_prefix_tokens", 0)
            boundary = hit + int(extra) if int(extra) >= block else 0
        return boundary // block * block if boundary > hit else 0

    def request(
        self,
        rid: str,
        prompt: list[int],
        stops: Sequence[int] = (),
        after_prefill: Callable[[Any], None] | None = None,
    ) -> int:
        """Look ``rid`` up, prefill it in chunks ending at ``stops`` (those past the
        hit) and at the prompt's end, decode two tokens, finish; returns the hit.
        ``after_prefill`` gets the request's block tables once its prompt is computed."""
        run = self.run
        run.ok("add_request", request_id=rid, prompt_token_ids=prompt, max_tokens=8)
        hit = run.ok("get_computed_blocks", request_id=rid)["num_computed_tokens"]
        junction = self.junction(rid, hit)
        if junction:
            stops = sorted({*stops, junction})
        done, first = hit, True
        for end in [s for s in stops if s > hit] + [len(prompt)]:
            if end <= done:
                continue
            if first:
                blocks = run.ok(
                    "allocate_slots",
                    request_id=rid,
                    num_new_tokens=end - done,
                    num_new_computed_tokens=hit,
                    new_computed_blocks="last",
                )
                first = False
            else:
                blocks = run.ok("allocate_slots", request_id=rid, num_new_tokens=end - done)
            assert blocks is not None, (rid, end)
            run.ok("update_request", request_id=rid, status="RUNNING", num_computed_tokens=end)
            run.ok("new_step_starts")
            done = end
        if after_prefill is not None:
            after_prefill(run.ok("get_block_ids", request_id=rid))
        for _ in range(2):
            self.sampled += 1
            run.ok("append_output_token_ids", request_id=rid, token_ids=[1000 + self.sampled])
            assert run.ok("allocate_slots", request_id=rid, num_new_tokens=1) is not None
            done += 1
            run.ok("update_request", request_id=rid, status="RUNNING", num_computed_tokens=done)
            run.ok("new_step_starts")
        run.ok("update_request", request_id=rid, status="FINISHED_LENGTH_CAPPED")
        run.ok("free", request_id=rid)
        return int(hit)


def checkpoint(num_tokens: int, block: int, eagle: bool) -> int:
    """Where an align-mode prefill stops so that the Mamba state there is cached: the
    last block boundary of the prompt, one block lower under EAGLE (0.25.1's
    ``last_cache_position``; 0.33.0's ``get_mamba_prefill_checkpoint_position`` gives
    the same on these prompts)."""
    position = num_tokens // block * block - (block if eagle else 0)
    if not eagle and position == num_tokens:
        position -= block
    return max(position, 0)


def hybrid(*groups: GroupConfig, eagle: bool, retention: int | None) -> ManagerConfig:
    return ManagerConfig(
        num_blocks=120,
        groups=groups,
        max_model_len=256,
        use_eagle=eagle,
        prefix_cache_retention_interval=retention,
    )


FULL4 = GroupConfig("full", 4, num_kv_heads=1)


def mamba(block: int, heads: int = 2) -> GroupConfig:
    return GroupConfig("mamba", block, mamba_cache_mode="align", num_kv_heads=heads)


def repeats(config: ManagerConfig, run: Lockstep) -> None:
    """One 27-token prompt three times (the first, the first repeat, the second)."""
    prompt = tokens("report prompt", 27)
    stop = checkpoint(len(prompt), 4, config.use_eagle)
    drive = Driver(run)
    for rid in ("first", "repeat1", "repeat2"):
        drive.request(rid, prompt, [stop])


def shared_prefix(config: ManagerConfig, run: Lockstep) -> None:
    """One 16-token system prompt, three 11-token user suffixes: the align checkpoint
    (24) lands in each request's own suffix. A request whose lookup missed a shared
    prefix the attention group holds stops its prefill at that junction (the
    scheduler's Marconi admission: 0.25.1's num_uncached_common_prefix_tokens,
    0.33.0's shared_prefix_boundary), so the next sibling can hit it."""
    system = tokens("system", 16)
    drive = Driver(run)
    for i in range(3):
        prompt = system + tokens(f"user {i}", 11)
        drive.request(f"sibling{i}", prompt, [checkpoint(len(prompt), 4, config.use_eagle)])


def swa_repeat(config: ManagerConfig, run: Lockstep) -> None:
    """One 40-token prompt twice, whole (no Mamba group: no chunking)."""
    prompt = tokens("swa prompt", 40)
    drive = Driver(run)
    drive.request("first", prompt)
    drive.request("repeat1", prompt)


def swa_mask_gap(config: ManagerConfig, run: Lockstep) -> None:
    """``swa_repeat`` with vLLM #42258's write-side mask emulated: after the first
    request, the sliding-window blocks just past each aligned boundary (tokens 16..20
    and 32..36, the blocks #42258 left uncached and #44082 caches again) are evicted
    (``evict_blocks``, the scheduler's path after a failed KV load), then the repeat
    looks up."""
    prompt = tokens("swa prompt", 40)
    drive = Driver(run)
    size = config.groups[1].block_size
    gone: list[int] = []

    def past_boundaries(tables: Any) -> None:
        window = tables["tuple"][1] if isinstance(tables, dict) else tables[1]
        gone.extend(window[end // size - 1] for end in (20, 36))

    drive.request("first", prompt, after_prefill=past_boundaries)
    assert all(gone), gone
    run.ok("evict_blocks", block_ids=gone)
    drive.request("repeat1", prompt)


def prompt_lengths(config: ManagerConfig, run: Lockstep, tail: bool = False) -> None:
    """Prompts of 26 and 40 tokens (one and a half, two and a half scheduler blocks
    of 16), each sent twice, prefilled in one chunk up to the Mamba block boundary
    the scheduler stops at (the prompt's last whole block of 16, less one under
    EAGLE), with ``tail`` also at the prompt's hash-block checkpoint (0.33.0's
    scheduler with sub-block Mamba hits), and then the rest."""
    drive = Driver(run)
    for n in (26, 40):
        prompt = tokens(f"length {n}", n)
        stops = [checkpoint(n, 16, config.use_eagle)]
        if tail:
            stops.append(checkpoint(n - (0 if config.use_eagle else 1), 4, config.use_eagle))
        drive.request(f"len{n}", prompt, stops)
        drive.request(f"len{n}-repeat", prompt, stops)


def prompt_lengths_tail(config: ManagerConfig, run: Lockstep) -> None:
    """``prompt_lengths`` with the hash-block checkpoint stop too."""
    prompt_lengths(config, run, tail=True)


@dataclass(frozen=True)
class Case:
    name: str
    report: str
    config: ManagerConfig
    drive: Callable[[ManagerConfig, Lockstep], None]


THREE_MAMBA = (FULL4, mamba(4, 2), mamba(4, 3), mamba(4, 4))

CASES = (
    Case(
        "mtp_mamba_retention0_repeat",
        "vLLM #53504: MTP, 3 align-mode Mamba groups + 1 full, sparse retention (0)",
        hybrid(*THREE_MAMBA, eagle=True, retention=0),
        repeats,
    ),
    Case(
        "mtp_mamba_retention_block_repeat",
        "vLLM #53504 workaround: retention interval = block size",
        hybrid(*THREE_MAMBA, eagle=True, retention=4),
        repeats,
    ),
    Case(
        "mtp_mamba_dense_repeat",
        "vLLM #38182: MTP on full + align-mode Mamba, dense retention (unset)",
        hybrid(FULL4, mamba(4), eagle=True, retention=None),
        repeats,
    ),
    Case(
        "mamba_dense_repeat",
        "vLLM #38182 control: the same without MTP",
        hybrid(FULL4, mamba(4), eagle=False, retention=None),
        repeats,
    ),
    Case(
        "mamba_shared_prefix_unique_tail",
        "vLLM #45238: align checkpoint in request-unique tokens",
        hybrid(FULL4, mamba(4), eagle=False, retention=None),
        shared_prefix,
    ),
    Case(
        "swa_eagle_alignment_over_window",
        "1Cat-vLLM #205 (vLLM #42258 / #44082), vLLM #40624: SWA + full, EAGLE, "
        "scheduler block (16) over the window (5)",
        hybrid(
            GroupConfig("full", 16, num_kv_heads=1),
            GroupConfig("sliding_window", 4, sliding_window=5, num_kv_heads=2),
            eagle=True,
            retention=None,
        ),
        swa_repeat,
    ),
    Case(
        "swa_eagle_mask_gap_emulated",
        "1Cat-vLLM #205: vLLM #42258's mask (no block past an aligned boundary) emulated "
        "by evicting those blocks",
        hybrid(
            GroupConfig("full", 16, num_kv_heads=1),
            GroupConfig("sliding_window", 4, sliding_window=5, num_kv_heads=2),
            eagle=True,
            retention=None,
        ),
        swa_mask_gap,
    ),
    Case(
        "drafter_swa_mamba_repeat",
        "vLLM #51250 / #40624: a drafter's sliding-window group (the EAGLE group) beside "
        "full attention and an align-mode Mamba group",
        hybrid(
            FULL4,
            GroupConfig("sliding_window", 4, sliding_window=8, num_kv_heads=2, is_eagle_group=True),
            mamba(4, 3),
            eagle=True,
            retention=None,
        ),
        repeats,
    ),
    Case(
        "drafter_fallback_swa_mamba_repeat",
        "vLLM #51250 / #40624: the same drafter layout with no group marked (every "
        "group EAGLE, the draft window's included)",
        hybrid(
            FULL4,
            GroupConfig("sliding_window", 4, sliding_window=8, num_kv_heads=2),
            mamba(4, 3),
            eagle=True,
            retention=None,
        ),
        repeats,
    ),
    Case(
        "drafter_fallback_swa_mamba_retention0_repeat",
        "vLLM #51250 / #40624 under 0.29.0's default retention (0)",
        hybrid(
            FULL4,
            GroupConfig("sliding_window", 4, sliding_window=8, num_kv_heads=2),
            mamba(4, 3),
            eagle=True,
            retention=0,
        ),
        repeats,
    ),
    Case(
        "mtp_fallback_fine_grained_lengths",
        "vLLM #54360 (#52244, #57616): plain MTP (no group marked: every group EAGLE), "
        "Mamba block 16 over hash block 4, sparse retention (0)",
        hybrid(FULL4, mamba(16), eagle=True, retention=0),
        prompt_lengths,
    ),
    Case(
        "fine_grained_lengths_no_mtp",
        "vLLM #54360 control: the same without MTP",
        hybrid(FULL4, mamba(16), eagle=False, retention=0),
        prompt_lengths,
    ),
    Case(
        "mtp_fallback_fine_grained_lengths_tail",
        "vLLM #54360 (#57616), 0.33.0's scheduler: the prefill also stops at the "
        "prompt's hash-block checkpoint",
        hybrid(FULL4, mamba(16), eagle=True, retention=0),
        prompt_lengths_tail,
    ),
    Case(
        "fine_grained_lengths_tail_no_mtp",
        "vLLM #54360 control: the same without MTP",
        hybrid(FULL4, mamba(16), eagle=False, retention=0),
        prompt_lengths_tail,
    ),
    Case(
        "mtp_fallback_fine_grained_lengths_dense",
        "vLLM #54360 before 0.29.0's default: the same as the first with dense retention",
        hybrid(FULL4, mamba(16), eagle=True, retention=None),
        prompt_lengths,
    ),
)


def record(case: Case, impl: str, out: Path) -> Path | str:
    """Run ``case`` on ``impl``; returns the trace written, or why it was not."""
    try:
        run = Lockstep(case.config, None, reference=impl, record_state=True)
    except CannotBuild as exc:
        return f"cannot build: {exc}"
    if hasattr(run.reference.adapter, "stores_shared_prefix_boundary"):
        # As the scheduler of 0.28.0 on does with the lookup's third value.
        run.reference.adapter.stores_shared_prefix_boundary = True
    case.drive(case.config, run)
    version = run.reference.adapter.version or "line"
    name = impl if impl != "vllm" else f"vllm-{version}"
    header = run.header(source=f"scripts/effectiveness_report_traces.py {case.name}")
    header["note"] = case.report
    # The judge reads the pool's state at each lookup; the other states are left out.
    records = [
        r if r["op"] == "get_computed_blocks" else {k: v for k, v in r.items() if k != "state"}
        for r in run.records
    ]
    return write_trace(out / f"{case.name}.{name}.jsonl", header, records)


def judge(paths: Sequence[Path]) -> None:
    """Print each stored trace's lookups as the effectiveness judge sees them."""
    for path in paths:
        trace = read_trace(path)
        version = str((trace.header.get("recorded_with") or {}).get("version"))
        major, minor = (int(x) for x in version.split(".")[:2])
        print(f"{path.name} ({trace.recorded_with})")
        for rid, v in judge_records(trace.config, trace.records, (major, minor) >= (0, 30)):
            losses = ", ".join(f"{k} {n}" for k, n in v.losses.items()) or "-"
            flags = " UNEXPLAINED" if v.unexplained else " FALSE HIT" if v.false_hit else ""
            print(f"  {rid}: {v.realized} / {v.achievable} realized / achievable; {losses}{flags}")


def replay(paths: Sequence[Path], impl: str) -> int:
    """Replay stored traces on ``impl`` as they were recorded: on an installed vLLM
    whose lookup returns the shared-prefix boundary, the boundary is kept on the
    request (as its scheduler does). Returns 1 if any diverges."""
    status = 0
    for path in paths:
        trace = read_trace(path)
        side = make_side(impl, trace.config, trace.hash_seed)
        if hasattr(side.adapter, "stores_shared_prefix_boundary"):
            side.adapter.stores_shared_prefix_boundary = True
        mismatch = replay_trace(trace, impl, side).mismatch
        print(f"{path.name} on {impl}: {'identical' if mismatch is None else mismatch}")
        status |= mismatch is not None
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default="vllm")
    parser.add_argument("--out", type=Path, default=DATA)
    parser.add_argument("--cases", default="", help="comma-separated case names (default all)")
    parser.add_argument(
        "--judge", type=Path, nargs="+", help="print the judge's verdicts on stored traces"
    )
    parser.add_argument(
        "--replay", type=Path, nargs="+", help="replay stored traces on --impl, as recorded"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    if args.judge:
        judge(args.judge)
        return 0
    if args.replay:
        return replay(args.replay, args.impl)
    wanted = set(filter(None, args.cases.split(",")))
    for case in CASES:
        if wanted and case.name not in wanted:
            continue
        print(case.name, record(case, args.impl, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
