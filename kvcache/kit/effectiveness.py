"""Cache effectiveness over recorded lookups: what each lookup could have reused
(``spec.effectiveness``: content-level, from the pool's state) against what it did.

``judge_records`` reads a lockstep run's records (each call with the reference's
canonical state after it, as ``run_sequence(..., record_state=True)`` keeps them)
and judges every ``get_computed_blocks``: any implementation, any release the kit
drives, since it reads only canonical records.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvcache.kit.config import ManagerConfig, fine_grained_hits
from kvcache.kit.oracle import spec_module
from kvcache.kit.trace import pool_key_hex

if TYPE_CHECKING:
    from spec import effectiveness as rules
else:  # the repository's spec, or the installed kvcache_spec
    rules = spec_module("effectiveness")

__all__ = [
    "SCENARIOS",
    "SuiteRow",
    "eagle_groups",
    "format_suite",
    "judge_records",
    "layout",
    "run_scenario",
    "run_suite",
]


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
        if ok is None:  # a call that raised, or returned nothing to learn from
            continue
        if op == "add_request":
            hashes[rid] = [_hex(v) for v in ok]
            tokens[rid] = len(args.get("prompt_token_ids") or args.get("prompt_embeds") or ())
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


# ---------------------------------------------------------------- scenarios

#: The scenario suite, each a few requests through a small scheduler: the lookup
#: judged is the last one of each scenario's later requests.
SCENARIOS = {
    "repeat": "an identical prompt again after the first one completed",
    "multi_turn": "each turn appends an answer and a new question to the last turn",
    "shared_prefix": "one system prompt, three different suffixes, one after another",
    "in_flight": "a second request sharing a prefix while the first still runs",
    "preempted": "a request preempted after its prefill, looked up again",
}

#: Families the suite runs (layouts every release from 0.25.1 can build).
SUITE_FAMILIES = (
    "full", "swa", "chunked", "mamba", "full+swa", "full+chunked", "full+mamba-align",
    "full+swa+mamba", "eagle-hybrid", "mla", "full+rswa",
)  # fmt: skip


class _Runner:
    """Drives whole requests through a lockstep run (reference only)."""

    def __init__(self, run: Any, config: ManagerConfig) -> None:
        self.run = run
        self.config = config
        self.next_token = 0

    def add(self, rid: str, prompt: list[int]) -> None:
        self.run.ok("add_request", request_id=rid, prompt_token_ids=prompt, max_tokens=64)

    def admit(self, rid: str, num_tokens: int) -> bool:
        """Look ``rid`` up and schedule its whole remaining prompt; False if refused."""
        hit = self.run.ok("get_computed_blocks", request_id=rid)["num_computed_tokens"]
        blocks = self.run.ok(
            "allocate_slots",
            request_id=rid,
            num_new_tokens=num_tokens - hit,
            num_new_computed_tokens=hit,
            new_computed_blocks="last",
        )
        if blocks is None:
            return False
        self.run.ok(
            "update_request", request_id=rid, status="RUNNING", num_computed_tokens=num_tokens
        )
        return True

    def decode(self, rid: str, num_tokens: int, steps: int) -> list[int]:
        """``steps`` decode steps after the prefill; returns the tokens sampled."""
        sampled = []
        for _ in range(steps):
            self.next_token = (self.next_token + 7) % 97
            sampled.append(self.next_token)
            self.run.ok("append_output_token_ids", request_id=rid, token_ids=[self.next_token])
            num_tokens += 1
            if self.run.ok("allocate_slots", request_id=rid, num_new_tokens=1) is None:
                break
            self.run.ok(
                "update_request", request_id=rid, status="RUNNING", num_computed_tokens=num_tokens
            )
        return sampled

    def finish(self, rid: str) -> None:
        self.run.ok("update_request", request_id=rid, status="FINISHED_LENGTH_CAPPED")
        self.run.ok("free", request_id=rid)

    def whole(self, rid: str, prompt: list[int], steps: int = 3) -> list[int]:
        """A request from arrival to completion; returns prompt plus output."""
        self.add(rid, prompt)
        if not self.admit(rid, len(prompt)):
            return prompt
        out = self.decode(rid, len(prompt), steps)
        self.finish(rid)
        return prompt + out


def _tokens(seed: str, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(count)]


def run_scenario(name: str, run: Any, config: ManagerConfig) -> list[str]:
    """Run scenario ``name``; returns the request ids whose lookups are judged."""
    unit = config.scheduler_block_size
    r = _Runner(run, config)
    prompt = _tokens(name, 6 * unit + 3)
    if name == "repeat":
        r.whole("a", prompt)
        r.whole("b", prompt)
        return ["b"]
    if name == "multi_turn":
        history = r.whole("t0", prompt)
        for turn in (1, 2):
            history = r.whole(f"t{turn}", history + _tokens(f"q{turn}", unit + 1))
        return ["t1", "t2"]
    if name == "shared_prefix":
        system = prompt[: 4 * unit]
        for i in range(3):
            r.whole(f"s{i}", system + _tokens(f"suffix{i}", 2 * unit + i))
        return ["s1", "s2"]
    if name == "in_flight":
        system = prompt[: 4 * unit]
        r.add("a", system + _tokens("a", unit + 1))
        r.admit("a", 5 * unit + 1)
        r.add("b", system + _tokens("b", unit + 2))
        r.admit("b", 5 * unit + 2)
        r.finish("a")
        r.finish("b")
        return ["b"]
    if name == "preempted":
        r.add("a", prompt)
        r.admit("a", len(prompt))
        out = r.decode("a", len(prompt), 2)
        r.run.ok("free", request_id="a")
        r.run.ok(
            "update_request",
            request_id="a",
            status="PREEMPTED",
            num_computed_tokens=0,
            num_preemptions=1,
        )
        r.admit("a", len(prompt) + len(out))
        return ["a"]
    raise ValueError(f"scenario={name!r}; expected one of {', '.join(SCENARIOS)}")


#: How much the suite scales the drawn layout's blocks, windows and chunks.
SCALE = 4


def suite_config(family: str, use_eagle: bool) -> ManagerConfig:
    """The suite's config of ``family``: its layout drawn once (a fixed seed), caching
    on, no retention interval, a pool roomy enough that nothing is evicted, EAGLE as
    asked."""
    from kvcache.kit.driver import FAMILIES, random_config

    config = random_config(random.Random(f"effectiveness {family}"), FAMILIES[family])
    groups = tuple(  # blocks of at least 4 tokens, so a hit is several tokens
        dataclasses.replace(
            g,
            block_size=g.block_size * SCALE,
            sliding_window=g.sliding_window and g.sliding_window * SCALE,
            attention_chunk_size=g.attention_chunk_size and g.attention_chunk_size * SCALE,
            is_eagle_group=False,
            num_speculative_blocks=0,
        )
        for g in config.groups
    )
    return dataclasses.replace(
        config,
        groups=groups,
        num_blocks=400,
        max_model_len=512,
        enable_caching=True,
        watermark=0.0,
        use_eagle=use_eagle,
        max_num_batched_tokens=None,
        prefix_cache_retention_interval=None,
    )


@dataclasses.dataclass(frozen=True)
class SuiteRow:
    """One (family, EAGLE, retention, scenario) of the suite: its judged lookups."""

    family: str
    eagle: bool
    retention: int | None
    scenario: str
    verdicts: tuple[rules.Verdict, ...]
    hash_block: int
    cannot_build: str = ""

    @property
    def flags(self) -> list[str]:
        """What makes the suite fail: an unexplained loss, a false hit, a 0-hit
        lookup where the pool could serve a hash block or more."""
        found = []
        for v in self.verdicts:
            if v.false_hit:
                found.append(f"false hit {v.realized} > {v.achievable}")
            elif v.unexplained:
                found.append(f"unexplained loss {v.unexplained}")
            if v.realized == 0 and v.achievable >= self.hash_block:
                found.append(f"0-hit with {v.achievable} achievable")
        return found


def _retentions(family: str) -> tuple[int | None, ...]:
    """Retention intervals the suite tries, in scheduler blocks: unset, and 0 and 2
    where a group is sliding-window or Mamba (0.25.1 refuses one elsewhere)."""
    from kvcache.kit.driver import FAMILIES

    sparse = any(k.startswith(("swa", "mamba")) for k in FAMILIES[family].kinds)
    return (None, 0, 2) if sparse else (None,)


def run_suite(
    impl: str,
    families: Sequence[str] = SUITE_FAMILIES,
    scenarios: Sequence[str] = tuple(SCENARIOS),
    master_switch: bool = False,
) -> list[SuiteRow]:
    """The suite on ``impl`` (any name the kit resolves): every family with EAGLE off
    and on, the retention interval unset / 0 / 2 scheduler blocks where a group is
    sparse, every scenario."""
    from kvcache.kit.driver import FAMILIES, Lockstep
    from kvcache.kit.sides import CannotBuild

    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"families={unknown!r}: not families the kit knows")
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"scenarios={unknown!r}: expected some of {', '.join(SCENARIOS)}")
    rows = []
    for family in families:
        for eagle in (False, True):
            for retention_blocks in _retentions(family):
                base = suite_config(family, eagle)
                retention = (
                    None
                    if retention_blocks is None
                    else retention_blocks * base.scheduler_block_size
                )
                config = dataclasses.replace(base, prefix_cache_retention_interval=retention)
                for scenario in scenarios:
                    try:
                        run = Lockstep(config, None, reference=impl, record_state=True)
                    except CannotBuild as exc:
                        rows.append(SuiteRow(family, eagle, retention, scenario, (), 0, str(exc)))
                        continue
                    judged = run_scenario(scenario, run, config)
                    last: dict[str, rules.Verdict] = {}
                    for rid, verdict in judge_records(config, run.records, master_switch):
                        last[rid] = verdict
                    verdicts = tuple(last[rid] for rid in judged if rid in last)
                    rows.append(
                        SuiteRow(
                            family, eagle, retention, scenario, verdicts, config.hash_block_size
                        )
                    )
    return rows


def format_suite(rows: Sequence[SuiteRow]) -> str:
    """The suite as a markdown table: realized / achievable tokens and loss by rule."""
    lines = [
        "| family | EAGLE | retention | scenario | realized / achievable | loss by rule | flags |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        retention = "unset" if row.retention is None else str(row.retention)
        if row.cannot_build:
            cells = ["cannot build", "", ""]
        else:
            cells = [
                ", ".join(f"{v.realized} / {v.achievable}" for v in row.verdicts),
                "; ".join(
                    ", ".join(f"{k} {n}" for k, n in v.losses.items()) or "-" for v in row.verdicts
                ),
                "; ".join(row.flags) or "-",
            ]
        lines.append(
            f"| {row.family} | {'on' if row.eagle else 'off'} | {retention} | {row.scenario} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)
