"""vLLM 0.33.0's request fields in the kit's random sequences: ``session_id`` (which
0.33.0's BlockStored events carry, switch ``event_session_id``) and
``kv_cache_report_mode`` "full" (a lookup's hit blocks reported as stored again,
switch ``full_report_mode``). The driver draws them only when every side is of
the 0.33 line; ``make conformance-0.33`` compares them with vLLM 0.33.0 itself.
Here kvcache's 0.33 profile against the spec's, and a planted bug per switch."""

from __future__ import annotations

import pytest

from kvcache import vllm_0_33 as v33
from kvcache.kit.conformance import family_seed
from kvcache.kit.driver import FAMILIES, REQUEST_FIELDS_0_33, Stats, run_sequence
from kvcache.kit.sides import HarnessError, make_side, request_fields_0_33
from kvcache.profile import Profile


def run(family: str, subject: str, reference: str, sequences: int) -> tuple[Stats, int]:
    """``sequences`` random sequences of ``family``: their stats and mismatches."""
    stats = Stats()
    index = list(FAMILIES).index(family)
    bad = 0
    for i in range(sequences):
        result = run_sequence(family_seed(5, index, i), FAMILIES[family], subject, reference,
                              stats)  # fmt: skip
        bad += result.mismatch is not None or result.cannot_build is not None
    return stats, bad


def test_the_0_33_sides_draw_the_fields_and_agree() -> None:
    stats, bad = run("full+swa", "kvcache-0.33", "spec-0.33", 8)
    assert bad == 0
    assert stats.events["event:session_id"] > 0 and stats.events["full_report_hit"] > 0


def test_a_0_25_1_side_gets_no_0_33_fields() -> None:
    stats, bad = run("full+swa", "kvcache", "spec", 8)
    assert bad == 0
    assert stats.events["event:session_id"] == 0 and stats.events["full_report_hit"] == 0


@pytest.mark.parametrize("switch", ["event_session_id", "full_report_mode"])
def test_kvcache_with_the_switch_off_is_caught(
    switch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    mutant = Profile("0.33.0").with_switches(**{switch: False})
    monkeypatch.setattr(v33, "PROFILE", mutant)
    assert run("full+swa", "kvcache-0.33", "spec-0.33", 8)[1] > 0, f"{switch} off not caught"


def test_the_fields_are_set_on_the_request_and_checked() -> None:
    from kvcache.kit.config import ManagerConfig

    assert set(REQUEST_FIELDS_0_33) == {"session_id", "kv_cache_report_mode"}
    side = make_side("kvcache-0.33", ManagerConfig.full_attention(8, 2, 16))
    args = {"request_id": "r", "prompt_token_ids": [1, 2, 3], "session_id": "s",
            "kv_cache_report_mode": "full"}  # fmt: skip
    request = side.adapter.build_request(side.config, args)
    assert (request.session_id, request.kv_cache_report_mode) == ("s", "full")
    with pytest.raises(HarnessError, match="kv_cache_report_mode='partial'"):
        request_fields_0_33({"kv_cache_report_mode": "partial"})
    with pytest.raises(HarnessError, match="session_id=3"):
        request_fields_0_33({"session_id": 3})


def test_no_full_report_mode_where_vllm_0_33_cannot_report() -> None:
    """vLLM 0.33.0's "full" report mode asserts under dcp > 1 and raises IndexError on
    a fine-grained hit inside a block: the driver does not draw it there."""
    import random

    from kvcache.kit.config import GroupConfig, ManagerConfig
    from kvcache.kit.driver import draw_request_fields_0_33, full_report_works

    full = ManagerConfig.full_attention(8, 2, 16)
    assert full_report_works(full)
    assert not full_report_works(ManagerConfig.full_attention(8, 2, 16, dcp_world_size=2))
    align = GroupConfig("mamba", 4, mamba_cache_mode="align", num_kv_heads=2)
    assert not full_report_works(ManagerConfig(8, (GroupConfig("full", 2), align), 16))
    draws = [draw_request_fields_0_33(random.Random(i), False) for i in range(200)]
    assert all(d.get("kv_cache_report_mode") != "full" for d in draws)
    assert any("session_id" in d for d in draws)
    with_full = [draw_request_fields_0_33(random.Random(i)) for i in range(200)]
    assert [d.get("session_id") for d in draws] == [d.get("session_id") for d in with_full]
