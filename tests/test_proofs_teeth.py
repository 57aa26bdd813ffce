"""The proofs have teeth: a planted bug in a copy of a checked function is caught.

Each test copies the real source file into a temporary module, plants one bug with
a textual edit (asserted to apply), and runs the same check as ``proofs/run.py``
(``python -m proofs.bounded``: CrossHair capped by paths, with the same z3 work
limit); CrossHair itself must report the counterexample (its message, not the
enumeration's). The diffbehavior test runs CrossHair's command line on a planted
pair. The last tests plant bugs in kvcache itself (in memory) and run the
exhaustive search, or the enumeration alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import spec.profile as spec_profile

ROOT = Path(__file__).resolve().parent.parent


def plant(tmp_path: Path, source: str, module: str, original: str, bug: str) -> None:
    """Write ``source`` (a repo file) with ``original`` replaced by ``bug`` as ``module``."""
    text = (ROOT / source).read_text()
    assert text.count(original) == 1, f"{original!r} is not in {source} exactly once"
    (tmp_path / f"{module}.py").write_text(text.replace(original, bug))


def crosshair(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m crosshair ARGS`` seeing the planted modules and the repo."""
    env = {**os.environ, "PYTHONHASHSEED": "0",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "crosshair", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def check_contract(tmp_path: Path, target: str) -> str:
    """``proofs.bounded`` on the planted target, as ``proofs/run.py`` runs it; assert
    CrossHair finds a counterexample (``file:line: message``)."""
    from proofs.run import environment

    env = {**environment(), "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    result = subprocess.run(
        [sys.executable, "-m", "proofs.bounded", json.dumps([["contract", target, 100, 1000]])],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    verdict = json.loads(result.stdout.strip().splitlines()[-1])
    assert verdict["status"] == "counterexample", verdict
    assert ".py:" in verdict["evidence"], verdict  # CrossHair's message, not the enumeration's
    return str(verdict["evidence"])


def test_cdiv_off_by_one_breaks_its_contract(tmp_path: Path) -> None:
    plant(tmp_path, "spec/pure.py", "planted_pure", "    return -(a // -b)\n",
          "    return a // b + 1\n")
    assert "false when calling cdiv" in check_contract(tmp_path, "planted_pure.cdiv")


def test_sliding_window_rule_with_window_not_window_minus_one(tmp_path: Path) -> None:
    plant(tmp_path, "spec/pure.py", "planted_pure",
          "return cdiv(sliding_window - 1, block_size) + use_eagle",
          "return cdiv(sliding_window, block_size) + use_eagle")
    out = check_contract(tmp_path, "planted_pure.num_contiguous_blocks_for_hit")
    assert "num_contiguous_blocks_for_hit" in out


def test_slot_formula_with_floor_division_for_the_offset(tmp_path: Path) -> None:
    plant(tmp_path, "proofs/slots.py", "planted_slots",
          "return block_table[pos // block_size] * block_size + pos % block_size",
          "return block_table[pos // block_size] * block_size + pos // block_size")
    assert "false when calling slot" in check_contract(tmp_path, "planted_slots.slot")


def test_skipped_tokens_of_a_window_off_by_one(tmp_path: Path) -> None:
    plant(tmp_path, "spec/pure.py", "planted_pure",
          "return max(0, num_computed_tokens - sliding_window + 1)",
          "return max(0, num_computed_tokens - sliding_window)")
    check_contract(tmp_path, "planted_pure.num_skipped_tokens_sliding_window")


def test_diffbehavior_finds_a_kvcache_gate_that_differs_from_spec(tmp_path: Path) -> None:
    """The admission gate with ``<`` for ``<=`` in (a copy of) kvcache's module."""
    plant(tmp_path, "kvcache/kv_cache_math.py", "planted_math",
          "return num_blocks + num_watermark_blocks <= num_free_blocks - num_reserved_blocks",
          "return num_blocks + num_watermark_blocks < num_free_blocks - num_reserved_blocks")
    (tmp_path / "planted_pair.py").write_text(
        "import planted_math\n"
        "import spec.pure\n"
        "from proofs.manifest import PAIRS\n"
        "from proofs.pairs import restricted\n"
        "(pair,) = [p for p in PAIRS if p.name == 'admits']\n"
        "oracle = restricted(spec.pure.admits, pair.domain)\n"
        "subject = restricted(planted_math.admits, pair.domain)\n")
    result = crosshair(tmp_path, "diffbehavior", "--per_condition_timeout=6",
                       "--max_uninteresting_iterations=50", "planted_pair.oracle",
                       "planted_pair.subject")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Given:" in result.stdout


def test_exhaustive_search_finds_a_manager_freeing_heads_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """kvcache's ``free`` releasing a request's blocks head first (spec: tail first)."""
    from kvcache.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from proofs import exhaustive

    def free_head_first(self: SingleTypeKVCacheManager, request_id: str) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if blocks:
            self.block_pool.release_blocks(list(blocks))
        self.pop_blocks_for_free(request_id)

    monkeypatch.setattr(SingleTypeKVCacheManager, "free", free_head_first)
    explorer = exhaustive.Explorer(exhaustive.LAYOUTS[0])
    with pytest.raises(exhaustive.Mismatch, match="free_queue"):
        explorer.explore(max_depth=6)


def test_exhaustive_search_covers_mamba_align() -> None:
    """A Mamba-align manager that never frees its previous state, found by the
    full + Mamba align layout."""
    from kvcache import MambaManager
    from proofs import exhaustive

    (layout,) = [lay for lay in exhaustive.LAYOUTS if "Mamba" in lay.name]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(MambaManager, "remove_skipped_blocks", lambda self, *args, **kwargs: None)
        with pytest.raises(exhaustive.Mismatch):
            exhaustive.Explorer(layout).explore(max_depth=5)


RELEASE_SHALLOWER = 3
"""How much shallower than ``make proofs`` the 0.33.0 search below runs (about 15 s)."""


def test_exhaustive_search_under_0_33_finds_no_difference() -> None:
    """The exhaustive search of the ``proofs`` stage (vLLM 0.25.1's profile) under
    0.33.0's instead, with the later releases' layouts too: kvcache's
    ``KVCacheManager(profile="0.33.0")`` equals the spec's 0.33.0 profile on every call
    sequence, each layout 3 steps less deep than its depth (``make
    exhaustive-releases`` runs every release at full depth)."""
    from proofs import exhaustive

    layouts = tuple(replace(layout, depth=layout.depth - RELEASE_SHALLOWER, release="0.33.0")
                    for layout in exhaustive.LAYOUTS + exhaustive.LATER_LAYOUTS)
    reports = exhaustive.run(layouts)
    assert [r.mismatch for r in reports if r.mismatch] == []
    assert all(r.depth == layout.depth or r.exhausted
               for r, layout in zip(reports, layouts, strict=True))


# (switch of 0.33.0 turned back in the spec alone, the layout that sees it, what differs)
SEEN = [
    ("new_block_ids_zeroing_only", "full attention, block 1, 3 blocks", "new_block_ids"),
    ("cascade_always_zero", "full attention, block 1, 3 blocks", r"ok \[1\], kvcache -> ok \[0\]"),
    ("event_session_id", "full attention, block 1, 3 blocks", "session_id"),
    ("mamba_no_eagle_margin", "full + Mamba align, EAGLE, block 1, 4 blocks",
     r"admit\(a, one\): spec -> ok \(\("),  # a hit differs
    ("zero_every_attention_group",
     "sliding window 2 + Mamba align, preempt by pop, block 1, 4 blocks", "new_block_ids"),
    ("pop_drops_null_head", "sliding window 2 + Mamba align, preempt by pop, block 1, 4 blocks",
     r"preempt\(a\): spec -> ok"),
]


@pytest.mark.parametrize("switch, name, differs", SEEN, ids=[s[0] for s in SEEN])
def test_exhaustive_search_under_0_33_has_teeth(switch: str, name: str, differs: str) -> None:
    """The spec's 0.33.0 profile with one switch at 0.25.1's value (``turned_back``)
    differs from kvcache's within a few states: the new block ids (fresh blocks
    reported for zeroing where 0.33.0's layout needs none), cascade attention's common
    prefix (0.32.0 removed it), the events' session id, Mamba's EAGLE peek (seen only
    by an EAGLE layout), a sliding window's fresh blocks beside Mamba, and the null
    blocks ``pop_blocks_for_free`` hands back."""
    from proofs import exhaustive

    (layout,) = [lay for lay in exhaustive.LAYOUTS + exhaustive.LATER_LAYOUTS
                 if lay.name == name]
    flipped = replace(layout, release="0.33.0", turned_back=switch)
    with pytest.raises(exhaustive.Mismatch, match=differs):
        exhaustive.Explorer(flipped).explore(max_depth=4)


def test_teeth_names_what_the_search_sees_and_what_it_cannot() -> None:
    """``--teeth`` on the smallest layout, 2 steps deep: the switches it turns back
    that a one-group full-attention layout can show are seen; a kind it lacks
    (HiSparse) or an argument it never passes (lookahead) is reported not seen."""
    from proofs import exhaustive

    found = dict(exhaustive.teeth((replace(exhaustive.LAYOUTS[0], depth=2,
                                           release="0.33.0"),)))
    assert set(found) == set(spec_profile.ON["0.33.0"])
    assert found["new_block_ids_zeroing_only"] and found["cascade_always_zero"]
    assert found["hisparse_groups"] is None and found["lookahead_arguments"] is None


def test_enumeration_decides_what_crosshair_leaves_open(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``proofs.bounded``'s enumeration (what decides a property CrossHair does not
    exhaust within its path cap) finds a planted bug on its own; unplanted, the same
    check is exhausted."""
    from proofs import bounded

    plant(tmp_path, "spec/pure.py", "planted_pure",
          "while block_size != alignment_tokens and num_blocks * block_size % alignment_tokens:",
          "while num_blocks > 3 and num_blocks * block_size % alignment_tokens:")
    monkeypatch.syspath_prepend(str(tmp_path))
    status, _, evidence = bounded.enumerate_contract("planted_pure.align_num_hit_blocks",
                                                     20_000)
    assert status == bounded.COUNTEREXAMPLE, evidence
    status, detail, _ = bounded.enumerate_contract("spec.pure.align_num_hit_blocks", 20_000)
    assert status == bounded.EXHAUSTED and "inputs" in detail


def test_bounded_verdicts_are_counts_not_seconds() -> None:
    """One check run twice in one process gives the same verdict, detail included."""
    from proofs import bounded

    first = bounded.enumerate_pair("admits", 5_000)
    assert first == bounded.enumerate_pair("admits", 5_000)
    assert first[0] == bounded.EXHAUSTED
