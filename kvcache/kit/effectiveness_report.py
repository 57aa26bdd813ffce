"""The effectiveness suite's rows reported: held to the flags each release line is
known to raise (``KNOWN_FLAGS``, ``--expect-flag`` patterns, ``check_flags``), and drawn
as a markdown table (``format_suite``) or a plot (``plot_suite``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcache.kit.effectiveness_suite import LOOKAHEADS, SCENARIOS, SuiteRow
from kvcache.kit.oracle import spec_module

if TYPE_CHECKING:
    from spec import effectiveness as rules
else:  # the repository's spec, or the installed kvcache_spec
    rules = spec_module("effectiveness")

__all__ = [
    "KNOWN_FLAGS",
    "check_flags",
    "format_suite",
    "known_flags",
    "lookup_cell",
    "matches",
    "parse_expectation",
    "plot_suite",
]


# ---------------------------------------------------------------- expected flags


#: Why a flagged row is known: the reasons ``KNOWN_FLAGS`` cites.
_REPLAY = (
    "EAGLE with retention 0: the sliding-window tail kept ends a block above the replay "
    "boundary, the block the EAGLE lookup matches and drops, so the hit collapses to 0 "
    "(ledger bug-retention-eagle-replay-boundary, fixed in 0.30.0 by vLLM #53945)"
)
_SIBLING = (
    "EAGLE with retention 0: the tails kept are a resend's and a longer sibling's "
    "post-drop positions; a request sharing only the system prompt needs the window "
    "after the shared prefix's drop, which was not kept, so its hit collapses to 0"
)
_53504 = (
    "the shape of vLLM #53504: under EAGLE the first request's Mamba state is kept at "
    "its checkpoint (its prompt's last block boundary less a block), the end of the "
    "shared prefix here; the EAGLE drop needs the attention block after it, which holds "
    "the other request's suffix, and no state lies lower, so the whole hit is lost"
)

_MAMBA_TAIL = (
    "EAGLE with a sparse retention on a Mamba layout: the state kept at the prompt's "
    "replay boundary is the one before EAGLE's drop; a repeat's lookup, a block lower, "
    "needs the state there, which was computed and never kept (the write side; vLLM "
    "#53504 / #54360, ledger bug-retention-eagle-replay-boundary, fixed in 0.30.0)"
)

#: Rows of those shapes: the resend / sibling rows of sliding-window layouts under
#: EAGLE with retention 0, and a request in flight beside a sibling on Mamba layouts.
_REPLAY_ROWS = tuple(
    f"{family}:{scenario}:eagle:retention=0"
    for family in ("swa", "full+swa")
    for scenario in ("repeat", "multi_turn", "preempted")
)
_SIBLING_ROWS = tuple(
    f"{family}:{scenario}:eagle:retention=0"
    for family in ("swa", "full+swa")
    for scenario in ("shared_prefix", "in_flight")
)
_MAMBA_TAIL_ROWS = tuple(
    f"{family}:{scenario}:eagle:lookahead=none:retention={blocks * unit}"
    for family, unit in (("full+mamba-align", 4), ("full+swa+mamba", 8), ("eagle-hybrid", 16))
    for scenario in ("repeat", "multi_turn", "preempted")
    for blocks in (0, 2)  # the suite's sparse retentions, in scheduler blocks
)
_IN_FLIGHT_ROWS = tuple(
    f"{family}:in_flight:eagle" for family in ("full+mamba-align", "full+swa+mamba", "eagle-hybrid")
)

#: Flags each release line is known to raise on the suite, with why: (line, an
#: ``--expect-flag`` pattern, reason). ``--expect-known`` expects those of the
#: subject's line; a flagged row none of them names still fails the run, and so does
#: a line with no entries here (classify its flags first). 0.25.1's full + Mamba
#: 'align' in flight is not among them: its Mamba group never drops a block under
#: EAGLE (ledger bug-mamba-eagle-long-hit, fixed by 0.26.0), so that hit survives.
KNOWN_FLAGS: tuple[tuple[str, str, str], ...] = (
    *(("0.25", p, _REPLAY) for p in _REPLAY_ROWS),
    *(("0.25", p, _53504) for p in _IN_FLIGHT_ROWS[1:]),
    *(("0.25", p, _MAMBA_TAIL) for p in _MAMBA_TAIL_ROWS),
    *((line, p, _REPLAY) for line in ("0.28", "0.29") for p in _REPLAY_ROWS),
    *((line, p, _53504) for line in ("0.28", "0.29") for p in _IN_FLIGHT_ROWS),
    *((line, p, _MAMBA_TAIL) for line in ("0.28", "0.29") for p in _MAMBA_TAIL_ROWS),
    *(("0.33", p, _SIBLING) for p in _SIBLING_ROWS),
    *(("0.33", p, _53504) for p in _IN_FLIGHT_ROWS),
)


def known_flags(release: str | None) -> list[tuple[tuple[str, ...], str]]:
    """The ``KNOWN_FLAGS`` of ``release``'s line, parsed, with their reasons (none for
    an unknown release)."""
    from kvcache.kit.ledger import release_line_of

    if release is None:
        return []
    line = release_line_of(release)
    return [(parse_expectation(p), why) for li, p, why in KNOWN_FLAGS if li == line]


def parse_expectation(text: str) -> tuple[str, ...]:
    """An ``--expect-flag`` pattern, ``FAMILY:SCENARIO[:QUALIFIER...]`` (qualifiers:
    ``eagle``, ``no-eagle``, ``lookahead=X``, ``retention=Y``), as the parts a row's
    ``key`` must contain; a qualifier left out matches any value.

    Raises:
        ValueError: an unknown family, scenario, lookahead or qualifier (naming it).
    """
    from kvcache.kit.driver import FAMILIES

    parts = text.split(":")
    if len(parts) < 2 or parts[0] not in FAMILIES or parts[1] not in SCENARIOS:
        raise ValueError(
            f"expect-flag={text!r}: use FAMILY:SCENARIO[:eagle|no-eagle][:lookahead=X]"
            "[:retention=Y] with a family the kit knows and a scenario of " + ", ".join(SCENARIOS)
        )
    for qualifier in parts[2:]:
        name, _, value = qualifier.partition("=")
        ok = (
            qualifier in ("eagle", "no-eagle")
            or (name == "lookahead" and value in LOOKAHEADS)
            or (name == "retention" and (value == "unset" or value.isdigit()))
        )
        if not ok:
            raise ValueError(
                f"expect-flag={text!r}: qualifier {qualifier!r} is not eagle, no-eagle, "
                f"lookahead={'|'.join(LOOKAHEADS)} or retention=unset|N"
            )
    return tuple(parts)


def matches(row: SuiteRow, pattern: Sequence[str]) -> bool:
    """Whether ``row`` is one ``pattern`` (``parse_expectation``) names."""
    key = row.key.split(":")
    return key[:2] == list(pattern[:2]) and all(q in key[2:] for q in pattern[2:])


def check_flags(
    rows: Sequence[SuiteRow],
    expected: Sequence[tuple[str, ...]],
    known: Sequence[tuple[str, ...]] = (),
) -> tuple[list[SuiteRow], list[str]]:
    """The flagged rows no expectation names, and the expectations no flagged row met
    (both make ``effectiveness`` fail: a new flag, or a known one gone without notice).
    ``known`` (``known_flags``) count as unmet only where they name a row that ran."""
    flagged = [row for row in rows if row.flags]
    every = [*expected, *known]
    unexpected = [row for row in flagged if not any(matches(row, p) for p in every)]
    ran = [p for p in known if any(matches(row, p) for row in rows if not row.cannot_build)]
    unmet = [":".join(p) for p in [*expected, *ran] if not any(matches(row, p) for row in flagged)]
    return unexpected, unmet


# ---------------------------------------------------------------- output


def lookup_cell(verdict: rules.Verdict) -> str:
    """One judged lookup as the tables show it: realized / achievable tokens, and what
    the requests had computed when the pool never held it all (the write side)."""
    cell = f"{verdict.realized} / {verdict.achievable}"
    if verdict.computed > verdict.achievable:
        cell += f" (computed {verdict.computed})"
    return cell


def format_suite(rows: Sequence[SuiteRow]) -> str:
    """The suite as a markdown table: realized / achievable tokens and loss by rule."""
    lines = [
        "| family | EAGLE | lookahead | retention | scenario | realized / achievable "
        "| loss by rule | flags |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        retention = "unset" if row.retention is None else str(row.retention)
        if row.cannot_build:
            reason = row.cannot_build.replace("|", "/").replace("\n", " ")
            cells = [reason if reason.startswith("cannot") else f"cannot run: {reason}", "", ""]
        else:
            cells = [
                ", ".join(map(lookup_cell, row.verdicts)),
                "; ".join(
                    ", ".join(f"{k} {n}" for k, n in v.losses.items()) or "-" for v in row.verdicts
                ),
                "; ".join(row.flags) or "-",
            ]
        lines.append(
            f"| {row.family} | {'on' if row.eagle else 'off'} | {row.lookahead} | {retention} "
            f"| {row.scenario} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def plot_suite(rows: Sequence[SuiteRow], path: str, title: str = "") -> None:
    """Draw ``rows`` to ``path`` (PNG): per (family, scenario), summed over the
    variants, the realized tokens and the loss each rule explains stacked up to the
    achievable, unexplained loss on top; a flagged (family, scenario) marked in red.
    Imports matplotlib here (a dev dependency)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [rule.name for rule in rules.LOSS_RULES]
    cells: dict[tuple[str, str], dict[str, int]] = {}
    flagged: set[tuple[str, str]] = set()
    for row in rows:
        if row.cannot_build:
            continue
        cell = cells.setdefault((row.family, row.scenario), {})
        for v in row.verdicts:
            cell["realized"] = cell.get("realized", 0) + min(v.realized, v.achievable)
            cell["unexplained"] = cell.get("unexplained", 0) + v.unexplained
            cell["false hit"] = cell.get("false hit", 0) + max(0, v.realized - v.achievable)
            for name, n in v.losses.items():
                cell[name] = cell.get(name, 0) + n
        if row.flags:
            flagged.add((row.family, row.scenario))
    labels = list(cells)
    stacks = ["realized", *names, "unexplained", "false hit"]
    fig, ax = plt.subplots(figsize=(max(8.0, 0.28 * len(labels) + 2), 5.5))
    bottom = [0] * len(labels)
    colors = plt.get_cmap("tab10")
    for i, name in enumerate(stacks):
        heights = [cells[k].get(name, 0) for k in labels]
        if not any(heights):
            continue
        ax.bar(range(len(labels)), heights, bottom=bottom, label=name, color=colors(i % 10))
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for x, label in enumerate(labels):
        if label in flagged:
            ax.annotate("flagged", (x, bottom[x]), ha="center", va="bottom", rotation=90,
                        color="red", fontsize=7)  # fmt: skip
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels([f"{f} / {s}" for f, s in labels], rotation=90, fontsize=6)
    for tick, label in zip(ax.get_xticklabels(), labels, strict=True):
        if label in flagged:
            tick.set_color("red")
    ax.set_ylabel("tokens (judged lookups, summed over EAGLE / lookahead / retention)")
    ax.set_title(title or "prefix-cache effectiveness: realized vs achievable, loss by rule")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
