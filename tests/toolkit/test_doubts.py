"""docs/divergences.md's "vLLM 0.33.0: matched although doubtful" examples
(``kvcache.kit.doubts``): every claim about kvcache holds here, and the reader of
the section catches a wrong claim or an entry without its example. Both sides,
vLLM 0.33.0 included, run in ``make conformance-0.33``.

And the driver's rare case behind the section's entry 3: a decode with a hash block
or more of drafts in a Mamba checkpoint layout, where vLLM 0.33.0 asserts and
kvcache and the spec refuse at the same call."""

from __future__ import annotations

import pytest

from kvcache.kit import doubts


def test_every_kvcache_claim_of_the_section_holds() -> None:
    preamble, found = doubts.examples()
    assert "api(\"kvcache\")" in preamble
    assert len(found) >= 6
    assert all(set(e.claims) == {"vllm", "kvcache"} for e in found)
    assert doubts.check(["kvcache"]) == []


def test_a_wrong_claim_is_caught() -> None:
    text = doubts.DOC.read_text()
    claim = "kvcache: (16, 'ValueError')"
    assert text.count(claim) == 1
    wrong = doubts.check(["kvcache"], text.replace(claim, "kvcache: (16, 'AssertionError')"))
    assert len(wrong) == 1 and "decode context parallelism" in wrong[0], wrong
    assert "observed (16, 'ValueError')" in wrong[0]


def test_an_entry_without_its_claim_or_example_is_refused() -> None:
    text = doubts.DOC.read_text()
    claim = "  # vLLM 0.33.0: (16, 'AssertionError'); kvcache: (16, 'ValueError')"
    no_claim = text.replace(claim, "")
    with pytest.raises(ValueError, match="has no line"):
        doubts.examples(no_claim)
    section = doubts.section_text(text)
    count = len(doubts.examples(text)[1])
    extra = text.replace(section, section + f"{count + 1}. **An entry without an example.**\n")
    with pytest.raises(ValueError, match=f"{count + 1} entries but {count} examples"):
        doubts.examples(extra)
    with pytest.raises(ValueError, match="has no section"):
        doubts.examples(text.replace(doubts.SECTION, "## Renamed"))


def test_bad_sides_are_refused() -> None:
    with pytest.raises(ValueError, match="side='gpu'"):
        doubts.api("gpu")
    preamble, found = doubts.examples()
    with pytest.raises(ValueError, match="side='gpu'"):
        doubts.run_example(preamble, found[0], "gpu")


def test_checkpoint_drafts_past_the_hashes_are_drawn_and_agree() -> None:
    """kvcache's 0.33 profile against the spec's on the Mamba checkpoint family: some
    decodes keep a hash block of drafts, the reference refuses the checkpoint inside
    them, the subject fails at the same call (PartialBlockError met by the spec's
    ValueError), and the sequences go on without a mismatch."""
    from kvcache.kit.conformance import family_index, family_seed
    from kvcache.kit.driver import FAMILIES, Stats, run_sequence

    stats = Stats()
    bad = []
    for i in range(40):
        seed = family_seed(0, family_index("mamba-checkpoint"), i)
        family = FAMILIES["mamba-checkpoint"]
        result = run_sequence(seed, family, "kvcache-0.33", "spec-0.33", stats)
        if result.mismatch is not None or result.cannot_build is not None:
            bad.append(seed)
    assert not bad, bad
    assert stats.events["checkpoint_in_drafts"] > 0, dict(stats.events)


def test_kvcaches_partial_block_error_compares_as_a_value_error() -> None:
    """kvcache's PartialBlockError (a ValueError and an AssertionError) meets the
    spec's ValueError as equal and vLLM's assert as the usual allowance."""
    from kvcache.kit.driver import compare_outcomes

    partial = {"raises": "PartialBlockError", "message": "num_tokens=12 ..."}
    assert compare_outcomes({"raises": "ValueError"}, partial) == (True, "")
    assert compare_outcomes({"raises": "AssertionError"}, partial) == (True, "assert->ValueError")
    assert not compare_outcomes({"raises": "KeyError"}, partial)[0]
    assert not compare_outcomes({"ok": None}, partial)[0]
