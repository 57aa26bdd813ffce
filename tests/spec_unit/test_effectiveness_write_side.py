"""The write side of ``spec.effectiveness``: what earlier requests computed, what the
retention rule keeps of it, and the losses it explains (or flags)."""

from __future__ import annotations

from spec import effectiveness as eff

FULL = eff.Group("full", 4)
MAMBA = eff.Group("mamba", 4)
SWA = eff.Group("sliding_window", 4, span=5)


def lookup(cached: tuple[set[int], ...], uncached: tuple[set[int], ...],
           **kw: object) -> eff.Lookup:
    fields: dict[str, object] = dict(
        groups=(FULL, MAMBA), num_tokens=25, hashed_tokens=24, hash_block=4, alignment=4
    )
    fields.update(kw)
    return eff.Lookup(  # type: ignore[arg-type]
        cached=tuple(map(frozenset, cached)), uncached=tuple(map(frozenset, uncached)), **fields
    )


def test_the_write_rule_of_each_kind() -> None:
    assert list(eff.written(FULL, 13, 12)) == [4, 8, 12]
    assert list(eff.written(SWA, 13, 12)) == [12]  # the window's tokens 9..12
    assert list(eff.written(eff.Group("sliding_window", 4, span=1), 12, 8)) == []
    assert list(eff.written(eff.Group("chunked_local", 4, span=8), 14, 12)) == [12]
    assert list(eff.written(MAMBA, 20, 20)) == [20]  # the state at the replay boundary
    assert list(eff.written(MAMBA, 16, 20)) == []  # any other state: the retention's
    assert list(eff.written(eff.Group("cross_attention", 4), 16, 16)) == []


def test_a_state_computed_at_the_replay_boundary_and_never_kept_is_unexplained() -> None:
    full = {4, 8, 12, 16, 20, 24}
    for retention in (None, 0, 8):
        verdict = eff.explain(
            lookup((full, set()), (set(), {20}), retention=retention, replay=frozenset({20})), 0
        )
        assert (verdict.achievable, verdict.computed) == (0, 20)
        assert verdict.unexplained == 20 and not verdict.false_hit


def test_a_state_the_sparse_retention_drops_is_explained_by_it() -> None:
    full = {4, 8, 12, 16, 20, 24}
    # Retention 8: 16 is kept (the pool holds it); 20 is neither a multiple nor the
    # replay boundary (24): computed, dropped by the rule.
    verdict = eff.explain(
        lookup((full, {16}), (set(), {20}), retention=8, replay=frozenset({24})), 16
    )
    assert (verdict.achievable, verdict.computed, verdict.expected) == (16, 20, 16)
    assert verdict.losses == {"retention": 4} and verdict.unexplained == 0
    # Dense retention keeps everything computed: the same loss is a finding.
    verdict = eff.explain(lookup((full, {16}), (set(), {20})), 16)
    assert verdict.unexplained == 4 and "retention" not in verdict.losses


def test_a_window_keeps_the_blocks_the_window_of_a_kept_boundary_reads() -> None:
    group = eff.Group("sliding_window", 4, span=5)
    look = lookup((set(),), (set(),), groups=(group,), retention=0, replay=frozenset({20}))
    assert eff.kept(look, group, 20) and eff.kept(look, group, 16) is False
    assert eff.kept(look, FULL, 4)  # other kinds keep every block


def test_without_write_side_facts_the_judge_is_the_read_side_one() -> None:
    plain = eff.Lookup((FULL,), (frozenset({4, 8}),), 13, 12, 4, 4)
    verdict = eff.explain(plain, 8)
    assert (verdict.achievable, verdict.computed, verdict.unexplained) == (8, 8, 0)
