"""The effectiveness scenario suite: a few requests per scenario through a small
scheduler (``run_scenario``), on each family's suite config (``suite_config``), with
EAGLE, lookahead and retention variants, for the subject's release (``subject_release``,
``switch_on``); ``run_suite`` runs it on an implementation and judges each scenario's
lookups (``kvcache.kit.effectiveness_judge``) into ``SuiteRow``s.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvcache.kit.config import ManagerConfig
from kvcache.kit.effectiveness_judge import judge_records
from kvcache.kit.oracle import spec_module

if TYPE_CHECKING:
    from spec import effectiveness as rules
else:  # the repository's spec, or the installed kvcache_spec
    rules = spec_module("effectiveness")

__all__ = [
    "HASH_LOOKAHEAD",
    "LOOKAHEADS",
    "LOOKAHEAD_SLOTS",
    "PREFILL_LOOKAHEAD",
    "SCALE",
    "SCENARIOS",
    "SUITE_FAMILIES",
    "SuiteRow",
    "master_switch_for",
    "run_scenario",
    "run_suite",
    "subject_release",
    "suite_config",
    "switch_on",
    "variants",
]


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

    def __init__(self, run: Any, config: ManagerConfig, slots: int = 0) -> None:
        self.run = run
        self.config = config
        self.next_token = 0
        # A drafter's slots on every allocation (num_lookahead_tokens), when any.
        self.slots: dict[str, int] = {"num_lookahead_tokens": slots} if slots else {}

    def add(self, rid: str, prompt: list[int]) -> None:
        self.run.ok("add_request", request_id=rid, prompt_token_ids=prompt, max_tokens=64)

    def checkpoint(self, num_tokens: int) -> int:
        """Where the engine's scheduler ends a prefill chunk so that an align-mode Mamba
        group caches its state there (0: no such group): the prompt's last scheduler
        block boundary (below its end), a block lower under EAGLE (whose lookup drops
        the hit's last block), as vLLM's scheduler splits an align-mode prefill."""
        if not any(g.kind == "mamba" and g.mamba_cache_mode == "align" for g in self.config.groups):
            return 0
        block = self.config.scheduler_block_size
        eagle = self.config.use_eagle
        position = num_tokens // block * block - (block if eagle else 0)
        if not eagle and position == num_tokens:  # a state at the end: none to recompute
            position -= block
        return max(position, 0)

    def admit(self, rid: str, num_tokens: int) -> bool:
        """Look ``rid`` up and schedule its remaining prompt: in one step, or in two
        ending at the align-mode Mamba checkpoint (``checkpoint``) when the hit is
        below it; False if refused."""
        hit = self.run.ok("get_computed_blocks", request_id=rid)["num_computed_tokens"]
        stop = self.checkpoint(num_tokens)
        done = hit
        for end in [stop, num_tokens] if hit < stop else [num_tokens]:
            first = {"num_new_computed_tokens": hit, "new_computed_blocks": "last"}
            blocks = self.run.ok(
                "allocate_slots",
                request_id=rid,
                num_new_tokens=end - done,
                **(first if done == hit else {}),
                **self.slots,
            )
            if blocks is None:
                return False
            self.run.ok("update_request", request_id=rid, status="RUNNING", num_computed_tokens=end)
            done = end
        return True

    def decode(self, rid: str, num_tokens: int, steps: int) -> list[int]:
        """``steps`` decode steps after the prefill; returns the tokens sampled."""
        sampled = []
        for _ in range(steps):
            self.next_token = (self.next_token + 7) % 97
            sampled.append(self.next_token)
            self.run.ok("append_output_token_ids", request_id=rid, token_ids=[self.next_token])
            num_tokens += 1
            if (
                self.run.ok("allocate_slots", request_id=rid, num_new_tokens=1, **self.slots)
                is None
            ):
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


def run_scenario(name: str, run: Any, config: ManagerConfig, slots: int = 0) -> list[str]:
    """Run scenario ``name`` (``slots``: draft slots, ``num_lookahead_tokens``, on every
    allocation); returns the request ids whose lookups are judged."""
    unit = config.scheduler_block_size
    r = _Runner(run, config, slots)
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

#: The suite's lookahead variants: what each sets, and the release that has it.
LOOKAHEADS = {
    "none": "no lookahead",
    "slots": "num_lookahead_tokens=2 on every allocate_slots (a drafter's slots; any release)",
    "hash": "the slots, plus num_hash_lookahead_tokens=1 and num_prefill_lookahead=2 "
    "(vLLM 0.33.0's lookahead hashing and prefill lookahead)",
}
#: Draft slots (``num_lookahead_tokens``) of the "slots" and "hash" variants.
LOOKAHEAD_SLOTS = 2
#: ``num_hash_lookahead_tokens`` / ``num_prefill_lookahead`` of the "hash" variant.
HASH_LOOKAHEAD = 1
PREFILL_LOOKAHEAD = 2


def suite_config(family: str, use_eagle: bool, lookahead: str = "none") -> ManagerConfig:
    """The suite's config of ``family``: its layout drawn once (a fixed seed), caching
    on, no retention interval, a pool roomy enough that nothing is evicted, EAGLE and
    lookahead hashing as asked (``lookahead``: a key of ``LOOKAHEADS``)."""
    from kvcache.kit.driver import FAMILIES, random_config

    if lookahead not in LOOKAHEADS:
        raise ValueError(f"lookahead={lookahead!r}; expected one of {', '.join(LOOKAHEADS)}")
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
    hashing = lookahead == "hash"
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
        num_hash_lookahead_tokens=HASH_LOOKAHEAD if hashing else 0,
        num_prefill_lookahead=PREFILL_LOOKAHEAD if hashing else 0,
    )


# ---------------------------------------------------------------- the subject's release


def subject_release(impl: str) -> str | None:
    """The vLLM release implementation ``impl`` behaves like: ``"0.25.1"`` for kvcache
    and spec, the profile's release for kvcache-0.33 / spec-0.33, the installed version
    for ``vllm``; None where the kit cannot tell (a third party's ``module:factory``).

    Raises:
        ValueError: ``impl`` is no implementation the kit resolves.
    """
    from kvcache.kit.fuzz import REFERENCE_LINE_IMPLS
    from kvcache.kit.ledger import release_line_of
    from kvcache.kit.sides import resolve_adapter
    from kvcache.profile import DEFAULT_RELEASE, RELEASES

    if impl in REFERENCE_LINE_IMPLS:
        return DEFAULT_RELEASE
    adapter = resolve_adapter(impl)
    if adapter.name == "vllm":
        version = adapter.version
        return str(version) if version else None
    line = getattr(adapter, "release_line", None)  # kvcache-0.33, spec-0.33
    if isinstance(line, str) and line:
        return next((r for r in RELEASES if release_line_of(r) == line), f"{line}.0")
    return None


def switch_on(name: str, release: str) -> bool:
    """Whether ``kvcache.profile`` switch ``name`` is on in vLLM ``release``: by the
    releases of the ledger entry it covers (so a release between kvcache's profiles,
    0.29.0 say, is judged by when the difference came), else by the switch's ``since``.

    Raises:
        ValueError: ``name`` is no switch, or ``release`` is no version.
    """
    from kvcache.kit.ledger import in_range, load_ledger, version_key
    from kvcache.profile import SWITCHES

    switch = next((s for s in SWITCHES if s.name == name), None)
    if switch is None:
        raise ValueError(f"name={name!r}: not a switch of kvcache.profile.SWITCHES")
    entry = next((e for e in load_ledger() if e.id == switch.ledger_id), None)
    if entry is not None:
        return in_range(release, entry.releases)
    return version_key(release) >= version_key(switch.since)


def master_switch_for(impl: str) -> bool | None:
    """Whether ``impl``'s release makes ``use_eagle`` the master switch of EAGLE groups
    (``eagle_master_switch``: vLLM 0.30.0 and later); None where its release is unknown."""
    release = subject_release(impl)
    return None if release is None else switch_on("eagle_master_switch", release)


def _lookahead_refusal(family: str, lookahead: str, release: str | None) -> str:
    """Why the suite does not build ``family`` with ``lookahead`` for a subject of
    ``release`` ("" : it does)."""
    from kvcache.kit.driver import FAMILIES

    if lookahead != "hash":
        return ""
    if release is not None and not switch_on("lookahead_arguments", release):
        return f"vLLM {release} has no lookahead hashing (ledger: lookahead-arguments-added)"
    if "full" not in FAMILIES[family].kinds:
        # As the kit's *-lookahead families: vLLM 0.33.0's sliding-window and Mamba hit
        # search reads hashes up to the lookup length, past the fewer hashes lookahead
        # leaves (IndexError), unless a full-attention group's hit bounds theirs.
        return "lookahead hashing needs a full-attention group (vLLM 0.33.0 reads past the hashes)"
    return ""


# ---------------------------------------------------------------- the suite


@dataclasses.dataclass(frozen=True)
class SuiteRow:
    """One (family, EAGLE, lookahead, retention, scenario) of the suite: its judged
    lookups, or why it could not run (``cannot_build``)."""

    family: str
    eagle: bool
    retention: int | None
    scenario: str
    verdicts: tuple[rules.Verdict, ...]
    hash_block: int
    cannot_build: str = ""
    lookahead: str = "none"

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

    @property
    def key(self) -> str:
        """The row's name, as ``--expect-flag`` patterns match it:
        ``family:scenario:eagle|no-eagle:lookahead=X:retention=Y``."""
        retention = "unset" if self.retention is None else str(self.retention)
        return (
            f"{self.family}:{self.scenario}:{'eagle' if self.eagle else 'no-eagle'}"
            f":lookahead={self.lookahead}:retention={retention}"
        )

    def to_json(self) -> dict[str, Any]:
        """The row as plain data (``--json``; docs/effectiveness.md is made from it)."""
        return {
            "family": self.family,
            "eagle": self.eagle,
            "lookahead": self.lookahead,
            "retention": self.retention,
            "scenario": self.scenario,
            "hash_block": self.hash_block,
            "cannot_build": self.cannot_build,
            "lookups": [
                {
                    "achievable": v.achievable,
                    "expected": v.expected,
                    "realized": v.realized,
                    "losses": dict(v.losses),
                    "computed": v.computed,
                }
                for v in self.verdicts
            ],
            "flags": self.flags,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SuiteRow:
        """A row back from ``to_json``'s data.

        Raises:
            ValueError: ``data`` lacks a field or has one of the wrong type (naming it).
        """
        try:
            verdicts = tuple(
                rules.Verdict(
                    int(v["achievable"]),
                    int(v["expected"]),
                    int(v["realized"]),
                    {str(k): int(n) for k, n in v["losses"].items()},
                    int(v.get("computed", v["achievable"])),
                )
                for v in data["lookups"]
            )
            retention = data["retention"]
            return cls(
                str(data["family"]),
                bool(data["eagle"]),
                None if retention is None else int(retention),
                str(data["scenario"]),
                verdicts,
                int(data["hash_block"]),
                str(data.get("cannot_build", "")),
                str(data.get("lookahead", "none")),
            )
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"row={dict(data)!r}: not a suite row ({exc!r})") from None


def _retentions(family: str) -> tuple[int | None, ...]:
    """Retention intervals the suite tries, in scheduler blocks: unset, and 0 and 2
    where a group is sliding-window or Mamba (0.25.1 refuses one elsewhere)."""
    from kvcache.kit.driver import FAMILIES

    sparse = any(k.startswith(("swa", "mamba")) for k in FAMILIES[family].kinds)
    return (None, 0, 2) if sparse else (None,)


def variants(family: str) -> list[tuple[str, int | None]]:
    """The (lookahead, retention in scheduler blocks) pairs the suite runs ``family``
    with: every retention without lookahead, then each lookahead with none set."""
    return [("none", r) for r in _retentions(family)] + [
        (name, None) for name in LOOKAHEADS if name != "none"
    ]


def _run_row(
    impl: str,
    config: ManagerConfig,
    scenario: str,
    slots: int,
    master_switch: bool,
    fine_grained: bool = True,
) -> tuple[tuple[rules.Verdict, ...], str]:
    """One scenario on a fresh manager: its judged lookups, or why it could not run."""
    from kvcache.kit.driver import DriverError, Lockstep
    from kvcache.kit.sides import CannotBuild

    try:
        run = Lockstep(config, None, reference=impl, record_state=True)
    except CannotBuild as exc:
        return (), str(exc)
    try:
        judged = run_scenario(scenario, run, config, slots)
    except DriverError as exc:  # a call the implementation refuses for this layout
        found = re.search(r" raised (\w+) on (\w+)\(.*?\): (.*)", str(exc), re.S)
        if found is None:
            return (), f"refused: {str(exc)[:160]}"
        kind, op, message = found.groups()
        return (), f"{op} raised {kind}: {' '.join(message.split())[:120]}"
    last: dict[str, rules.Verdict] = {}
    for rid, verdict in judge_records(config, run.records, master_switch, fine_grained):
        last[rid] = verdict
    return tuple(last[rid] for rid in judged if rid in last), ""


def run_suite(
    impl: str,
    families: Sequence[str] = SUITE_FAMILIES,
    scenarios: Sequence[str] = tuple(SCENARIOS),
    master_switch: bool | None = None,
    lookaheads: Sequence[str] = tuple(LOOKAHEADS),
) -> list[SuiteRow]:
    """The suite on ``impl`` (any name the kit resolves): every family with EAGLE off
    and on, the retention interval unset / 0 / 2 scheduler blocks where a group is
    sparse, each lookahead variant (``LOOKAHEADS``) the subject's release has, every
    scenario. ``master_switch`` None: from the subject's release (``master_switch_for``;
    off where it is unknown). The release's ``mamba_fine_grained_hits`` decides whether
    hits may end inside a block (off where the release is unknown). Every side plays
    the engine's scheduler: where a release's lookup returns the shared-prefix
    boundary (0.28.0 on), it is kept on the request, as that release's scheduler does.

    Raises:
        ValueError: an unknown family, scenario, lookahead or implementation (naming it).
    """
    from kvcache.kit.driver import FAMILIES

    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"families={unknown!r}: not families the kit knows")
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"scenarios={unknown!r}: expected some of {', '.join(SCENARIOS)}")
    unknown = [x for x in lookaheads if x not in LOOKAHEADS]
    if unknown:
        raise ValueError(f"lookaheads={unknown!r}: expected some of {', '.join(LOOKAHEADS)}")
    from kvcache.kit.vllm_side import VllmAdapter

    release = subject_release(impl)
    if master_switch is None:
        master_switch = bool(release and switch_on("eagle_master_switch", release))
    fine_grained = bool(release and switch_on("mamba_fine_grained_hits", release))
    stored = VllmAdapter.stores_shared_prefix_boundary
    VllmAdapter.stores_shared_prefix_boundary = True
    try:
        return _suite_rows(impl, families, scenarios, lookaheads, release, master_switch,
                           fine_grained)  # fmt: skip
    finally:
        VllmAdapter.stores_shared_prefix_boundary = stored


def _suite_rows(
    impl: str,
    families: Sequence[str],
    scenarios: Sequence[str],
    lookaheads: Sequence[str],
    release: str | None,
    master_switch: bool,
    fine_grained: bool,
) -> list[SuiteRow]:
    """``run_suite``'s rows, once its arguments are checked."""
    rows = []
    for family in families:
        for eagle in (False, True):
            for lookahead, retention_blocks in variants(family):
                if lookahead not in lookaheads:
                    continue
                base = suite_config(family, eagle, lookahead)
                retention = (
                    None
                    if retention_blocks is None
                    else retention_blocks * base.scheduler_block_size
                )
                config = dataclasses.replace(base, prefix_cache_retention_interval=retention)
                refusal = _lookahead_refusal(family, lookahead, release)
                slots = LOOKAHEAD_SLOTS if lookahead != "none" else 0
                for scenario in scenarios:
                    if refusal:
                        verdicts: tuple[rules.Verdict, ...] = ()
                        why = f"cannot build: {refusal}"
                    else:
                        verdicts, why = _run_row(
                            impl, config, scenario, slots, master_switch, fine_grained
                        )
                    rows.append(
                        SuiteRow(
                            family,
                            eagle,
                            retention,
                            scenario,
                            verdicts,
                            0 if why else config.hash_block_size,
                            why,
                            lookahead,
                        )
                    )
    return rows
