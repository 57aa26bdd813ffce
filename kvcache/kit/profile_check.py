"""``python -m kvcache.kit.profile_check``: kvcache's profile of the installed vLLM
release against that release, call for call, on the layouts whose reports it settles.

``make conformance-0.33`` holds the 0.33.0 drop-in to vLLM 0.33.0, and the release
census (``kvcache release-check``) holds 0.25.1 plus the ledger to any release. Neither
runs ``KVCacheManager(profile=R)`` against vLLM R itself, so a switch whose first
release was guessed went unseen (``event_session_id`` was on from 0.33.0 in the table;
vLLM's pools fill it from 0.30.0). This runs the kit's random sequences
(``kvcache.kit.driver``) on the installed vLLM and on ``kvcache@R``
(``ReleaseProfileAdapter``) with no ledger between them: results, events, stats and
the abstract state must be equal after every call.

``FAMILIES`` are the 42 layout families that match on every release measured here
(all ten, 10-20 sequences each, sessions 20-22; 0.27.x differs by the ledger's
free-order-without-caching, and 0.32.0 by eagle-hybrid-allocation-refused, gaps of
their profiles); the others (Mamba 'align' with context parallelism, a ring buffer
beside Mamba) still differ on some middle release (docs/profiles.md), so they are not
run here. ``--subject spec`` checks the spec's
profile of the release instead of kvcache's (``spec@R``: the oracle held to vLLM R
itself, not only through kvcache). ``REPORT_FAMILIES``
settle what a manager reports: each release's event classes and fields
(``session_id`` drawn on the requests), its stats class and where stats are
counted, the "full" report mode.

``--teeth N`` also flips each switch of ``TEETH`` in kvcache's profile alone and runs
the families that settle it, N sequences each, requiring a mismatch: the check can
tell each one's value (the report switches, and seven whose first release it placed:
``prompt_tail_before_last_token``, ``eagle_master_switch``,
``mamba_partial_prompt_tail``, two of the prefill-checkpoint rules, and the two dcp
scaling rules, ``dcp_full_attention_only`` and ``dcp_sharded_field``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

FAMILIES = (
    "full", "swa", "chunked", "mamba", "mla", "rswa", "full+full", "full+swa", "full+chunked",
    "full+cross", "full+mla", "full+rswa", "full+swa-mla", "full+hidden-state",
    "full+mamba-all", "full+mamba-none", "full+circular", "full+swa+circular",
    "full+full+full", "full+swa+swa", "full+swa+cross", "rswa+swa",
    "swa-retention", "full+swa-retention", "full-dcp",
    "full+mamba-align", "swa+mamba", "full+swa+mamba", "eagle-hybrid",
    "mamba-checkpoint", "full+mamba-checkpoint", "full+mamba-checkpoint-retention",
    "swa+mamba-retention", "hybrid-dcp", "full+mamba-align-retention", "tq",
    "full-lookahead", "full+swa-lookahead", "full+full-lookahead", "full+chunked-lookahead",
    "full+mamba-align-lookahead", "full+mamba-checkpoint-lookahead",
)  # fmt: skip
"""The driver families run: those on which kvcache's profile and the spec's match vLLM
on every release measured here (all ten; sessions 20-22)."""

REPORT_FAMILIES = ("full", "swa", "chunked", "mamba", "mla", "full+swa", "full+cross",
                   "full+mamba-all")  # fmt: skip
"""The families the teeth run: they settle what a manager reports (events, stats)."""

TEETH: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("event_locality", "event_ownership", "event_session_id",
                     "event_lookahead_tokens", "stats_hits_by_source", "stats_at_admission",
                     "full_report_mode"), REPORT_FAMILIES),
    "prompt_tail_before_last_token": ("full+full", "full+full+full", "full+mla"),
    "eagle_master_switch": ("rswa+swa", "full+hidden-state", "full+rswa"),
    "mamba_partial_prompt_tail": ("full+mamba-align", "swa+mamba", "full+swa+mamba"),
    **dict.fromkeys(("dcp_full_attention_only", "dcp_sharded_field"), ("hybrid-dcp",)),
    **dict.fromkeys(("mamba_checkpoint_eagle_whole_prompt",
                     "mamba_checkpoint_relocates_speculative"),
                    ("mamba-checkpoint", "full+mamba-checkpoint",
                     "full+mamba-checkpoint-retention")),
}  # fmt: skip
"""The switches ``--teeth`` flips, each with the families that settle it."""


SUBJECTS = ("kvcache", "spec")
"""What the check holds to the installed vLLM: kvcache's ``KVCacheManager(profile=R)``
(``kvcache@R``) or the spec's (``spec@R``, the oracle itself, not only through kvcache)."""


def gap_of(release: str, config: Any, mismatch: Any) -> str | None:
    """The ledger entry of a gap of ``release``'s profile (``Profile.not_reproduced``:
    what the release does that its profile does not model) that explains
    ``mismatch`` in ``config`` (``Entry.observes``). None when no gap does."""
    from kvcache.kit.ledger import load_ledger
    from kvcache.profile import Profile

    gaps = {gap.ledger_id for gap in Profile(release).not_reproduced()}
    if not gaps:
        return None
    for entry in load_ledger():
        if entry.id in gaps and entry.observes(config, mismatch.kind):
            return entry.id
    return None


def run(release: str, sequences: int, flipped: str | None = None,
        families: Sequence[str] = FAMILIES,
        known: dict[str, int] | None = None, subject: str = "kvcache") -> tuple[int, int, str]:
    """``sequences`` seeded sequences of each of ``families``, ``subject``'s profile of
    ``release`` (kvcache's, or the spec's: ``"spec"``; ``flipped`` turned over, if
    given) against the installed vLLM: the sequences run, the mismatching ones, and
    the first mismatch (or ""). A layout both sides refuse agrees (the release lacks
    its class or field, and its profile refuses it too, naming it). A mismatch a gap
    of the profile explains (``gap_of``) is not counted: it is tallied in ``known``
    by ledger entry."""
    from kvcache.kit import sides
    from kvcache.kit.adapter_base import CannotBuild, ReleaseProfileAdapter, SpecReleaseAdapter
    from kvcache.kit.conformance import TARGETS, family_seed, under_release
    from kvcache.kit.driver import FAMILIES as ALL_FAMILIES
    from kvcache.kit.driver import Stats
    from kvcache.kit.shrinking import run_sequence
    from kvcache.kit.vllm_side import VllmAdapter
    from kvcache.profile import Profile

    if subject not in SUBJECTS:
        raise ValueError(f"subject={subject!r}: expected one of {SUBJECTS}")
    name = f"{subject}@{release}"
    if flipped is not None:
        name += f"~{flipped}"

        def flipped_adapter() -> ReleaseProfileAdapter:
            own = Profile(release)
            adapter_cls = SpecReleaseAdapter if subject == "spec" else ReleaseProfileAdapter
            adapter = adapter_cls(
                release, own.with_switches(**{flipped: not getattr(own, flipped)})
            )
            adapter.name = name
            return adapter

        sides.ADAPTERS[name] = flipped_adapter
    stats = Stats()
    bad, first = 0, ""
    differing: dict[str, int] = {}
    # Both sides play the release's scheduler: it keeps a lookup's shared-prefix
    # boundary on the request (0.26.0 on; the subject's adapter always does).
    stored = VllmAdapter.stores_shared_prefix_boundary
    VllmAdapter.stores_shared_prefix_boundary = True
    try:
        for family in families:
            index = list(ALL_FAMILIES).index(family)
            driven = ALL_FAMILIES[family]
            if release in TARGETS:  # as its conformance runs it (0.33.0: Mamba 'all' uncached)
                driven = under_release(driven, release)
            for i in range(sequences):
                result = run_sequence(family_seed(0, index, i), driven, name, "vllm", stats)
                failure = result.mismatch or result.cannot_build
                gap = result.mismatch and gap_of(release, result.config, result.mismatch)
                if gap:
                    if known is not None:
                        known[gap] = known.get(gap, 0) + 1
                    continue
                if result.cannot_build and "vllm rejects" in result.cannot_build:
                    try:
                        sides.make_side(name, result.config, "0")
                    except CannotBuild:
                        failure = None  # a layout neither side builds
                if failure is not None:
                    bad += 1
                    first = first or f"{family} #{i}: {str(failure)[:600]}"
                    differing[family] = differing.get(family, 0) + 1
    finally:
        sides.ADAPTERS.pop(name, None)
        VllmAdapter.stores_shared_prefix_boundary = stored
    if differing:
        first = ", ".join(f"{f} ({n})" for f, n in differing.items()) + " differ; first: " + first
    return stats.sequences, bad, first


def main(argv: Sequence[str] | None = None) -> int:
    """Check the installed vLLM's profile; 0 when it matches (and, with ``--teeth``,
    every flipped switch is caught), 1 otherwise, 2 on a bad argument."""
    parser = argparse.ArgumentParser(prog="python -m kvcache.kit.profile_check",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("--sequences", type=int, default=10, help="sequences per family")
    parser.add_argument("--teeth", type=int, default=0, metavar="N",
                        help="also flip each TEETH switch, N sequences per family each")
    parser.add_argument("--subject", choices=SUBJECTS, default="kvcache",
                        help="whose profile of the release is checked (default: kvcache's)")
    args = parser.parse_args(argv)
    if args.sequences < 1 or args.teeth < 0:
        parser.error(f"--sequences must be positive and --teeth not negative, got "
                     f"{args.sequences} and {args.teeth}")
    import vllm

    from kvcache.profile import RELEASES, Profile

    release = str(vllm.__version__)
    if release not in RELEASES:
        print(f"profile_check: vLLM {release} installed; kvcache has profiles of "
              f"{', '.join(RELEASES)}", file=sys.stderr)  # fmt: skip
        return 2
    known: dict[str, int] = {}
    ran, bad, first = run(release, args.sequences, known=known, subject=args.subject)
    gaps = "".join(f", {n} under the profile's gap {entry}" for entry, n in known.items())
    print(f"{args.subject}@{release} vs vLLM {release}: {ran} sequences over {len(FAMILIES)} "
          f"families, {bad} mismatching{gaps}" + (f"; first: {first}" if first else ""))
    failed = bad > 0
    for switch, families in TEETH.items() if args.teeth else ():
        if switch == "full_report_mode" and release == RELEASES[0]:
            print(f"  {switch}: not flipped (the driver draws no report mode for 0.25.1)")
            continue
        profile = Profile(release)
        if switch == "prompt_tail_before_last_token" and not profile.partial_prompt_tail_entries:
            print(f"  {switch}: not flipped (vLLM {release} keys no prompt tail)")
            continue
        if switch == "mamba_partial_prompt_tail" and (
            profile.mamba_prompt_tail_state or not profile.partial_hit_copy_on_write
        ):
            print(f"  {switch}: not flipped (another rule keys vLLM {release}'s Mamba tail, "
                  "or none copies it)")
            continue
        if switch.startswith("mamba_checkpoint") and not profile.mamba_prefill_checkpoints:
            print(f"  {switch}: not flipped (vLLM {release} takes no prefill checkpoints)")
            continue
        if (switch == "dcp_full_attention_only" and profile.dcp_sharded_field) or (
                switch == "dcp_sharded_field" and not profile.dcp_full_attention_only):
            print(f"  {switch}: not flipped (inert in vLLM {release}'s profile: "
                  "dcp_sharded_field decides after dcp_full_attention_only)")
            continue
        ran, bad, first = run(release, args.teeth, switch, families, subject=args.subject)
        print(f"  {switch} flipped: {bad} of {ran} sequences mismatch"
              + ("" if bad else "  <- NOT CAUGHT"))
        failed |= bad == 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
