"""``kvcache.kit.profile_check``: kvcache's ``KVCacheManager(profile=R)`` against the
installed vLLM R with no ledger between them. Here R is 0.25.1 (the test venv's);
``make verify`` runs it on vLLM 0.29.0 as well (the ``check-0.29.0`` stage), and
``make profile-check-releases`` on every release venv present."""

from __future__ import annotations

import pickle

import pytest

import kvcache
from kvcache import kv_events
from kvcache.kit import profile_check
from kvcache.profile import Profile

pytestmark = pytest.mark.conformance


def test_kvcaches_0_25_1_profile_equals_vllm_0_25_1_call_for_call() -> None:
    ran, bad, first = profile_check.run("0.25.1", 2)
    assert ran == 2 * len(profile_check.FAMILIES)
    assert bad == 0, first


def test_the_specs_0_25_1_profile_equals_vllm_0_25_1_call_for_call() -> None:
    """The oracle itself (spec@0.25.1), not only through kvcache: the same families,
    stats counted where the release counts them (at the lookup)."""
    ran, bad, first = profile_check.run("0.25.1", 2, subject="spec")
    assert ran == 2 * len(profile_check.FAMILIES)
    assert bad == 0, first


@pytest.mark.parametrize("subject", profile_check.SUBJECTS)
@pytest.mark.parametrize("switch", ["event_locality", "stats_hits_by_source",
                                    "stats_at_admission"])
def test_a_flipped_report_switch_is_caught(subject: str, switch: str) -> None:
    """A profile emitting a later release's event fields (or stats class, or counting
    stats at admission) is not 0.25.1, for kvcache's profile and the spec's."""
    _, bad, first = profile_check.run("0.25.1", 2, switch, profile_check.REPORT_FAMILIES,
                                      subject=subject)
    assert bad > 0
    assert ("take_events" if switch.startswith("event") else "make_prefix_cache_stats") in first


def test_an_unknown_subject_is_refused() -> None:
    with pytest.raises(ValueError, match="subject='vllm'"):
        profile_check.run("0.25.1", 1, subject="vllm")


def test_a_mismatch_under_a_gap_of_the_profile_is_named_not_counted() -> None:
    """0.27.x returns a freed request's blocks in their own order without caching, which
    its profile does not model (the gap free-order-without-caching): a free-queue
    mismatch there is that gap's; with caching on, on another release, or of another
    kind, it is a mismatch."""
    import dataclasses
    import random

    from kvcache.kit.driver import FAMILIES, random_config
    from kvcache.kit.lockstep import Mismatch

    config = random_config(random.Random(0), FAMILIES["full"])
    uncached = dataclasses.replace(config, enable_caching=False)
    cached = dataclasses.replace(config, enable_caching=True)
    order = Mismatch(7, "free", {"request_id": "r0"}, "state differs", part="state:free_queue")
    other = Mismatch(7, "take_events", {}, "differs")
    assert profile_check.gap_of("0.27.1", uncached, order) == "free-order-without-caching"
    assert profile_check.gap_of("0.27.0", uncached, order) == "free-order-without-caching"
    assert profile_check.gap_of("0.28.0", uncached, order) is None
    assert profile_check.gap_of("0.27.1", cached, order) is None
    assert profile_check.gap_of("0.27.1", uncached, other) is None


def test_the_check_refuses_what_it_cannot_check() -> None:
    with pytest.raises(SystemExit):
        profile_check.main(["--sequences", "0"])


@pytest.mark.parametrize("release", ["0.25.1", "0.26.0", "0.29.0", "0.30.0", "0.33.0"])
def test_each_release_reports_its_own_event_fields(release: str) -> None:
    """The pool's events carry the fields of the release's classes, in vLLM's order
    (read from vllm/distributed/kv_events.py of each release), and pickle and hash as
    values; a session id reaches BlockStored from 0.30.0 on."""
    expected = {"0.25.1": (), "0.26.0": ("locality",), "0.29.0": ("locality", "ownership"),
                "0.30.0": ("locality", "ownership", "session_id"),
                "0.33.0": ("locality", "ownership", "session_id", "lookahead_token_ids")}
    spec = kvcache.FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=8, dtype="float16")
    config = kvcache.KVCacheConfig(4, [], [kvcache.KVCacheGroupSpec(["l0"], spec)])
    manager = kvcache.KVCacheManager(config, max_model_len=16, scheduler_block_size=2,
                                     hash_block_size=2, enable_kv_cache_events=True,
                                     profile=release)  # fmt: skip
    hasher = kvcache.get_request_block_hasher(2, kvcache.sha256)
    for i in range(3):  # the third evicts the first's blocks
        request = kvcache.Request(f"r{i}", [i * 10 + t for t in range(5)], block_hasher=hasher)
        request.session_id = "s"  # vLLM's Request field (kvcache's has none to declare)
        assert manager.allocate_slots(request, 5) is not None
        manager.free(request)
    events = manager.take_events()
    stored = [e for e in events if type(e).__name__ == "BlockStored"]
    removed = [e for e in events if type(e).__name__ == "BlockRemoved"]
    assert stored and removed
    base = {f.name for f in kv_events.dataclasses.fields(kv_events.BlockStored)}
    added = tuple(f.name for f in kv_events.dataclasses.fields(stored[0]) if f.name not in base)
    assert added == expected[release]
    assert getattr(stored[0], "session_id", None) == ("s" if "session_id" in added else None)
    assert all(type(e) is kv_events.event_class("BlockRemoved", tuple(
        f for f in expected[release] if f in ("locality", "ownership"))) for e in removed)
    assert pickle.loads(pickle.dumps(events)) == events
    assert len({*events, *pickle.loads(pickle.dumps(events))}) == len(set(events))
    assert kv_events.release_fields(Profile(release), "BlockStored") == expected[release]


def test_event_class_refuses_a_field_no_release_added() -> None:
    with pytest.raises(ValueError, match="fields=\\('session_id',\\)"):
        kv_events.event_class("BlockRemoved", ("session_id",))
    with pytest.raises(ValueError, match="name='BlockGone'"):
        kv_events.event_class("BlockGone", ())
