"""Issue 14's kinds have teeth: bugs planted in kvcache's MLA, sliding-window MLA,
context-parallel and metrics paths are caught.

As ``tests/test_injected_bugs_hybrid.py``, for ``NewKindsMachine``
(``tests/stateful/test_new_kinds_machine.py``: the hybrid machine drawing MLA
variants and context parallelism): each test monkeypatches one piece of kvcache
with a small buggy version, replays the machine's directed programs, runs it on a fixed budget
(``tests/injected_harness.py``: the same examples every run) and expects a
failure; the control runs unpatched and must pass. The metrics bug is caught by
the comparison with vLLM's collector (``tests/unit/test_kv_cache_metrics_vs_vllm.py``).
Nothing in kvcache/ or spec/ is edited.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
from injected_harness import budget, machine_failure, raised_in, timed_catch, unit_failure
from stateful.test_new_kinds_machine import PROGRAMS, NewKindsMachine

import kvcache.kv_cache_interface as interface
import kvcache.single_type_kv_cache_manager as single_type
from kvcache import BlockPool, FullAttentionManager, init_none_hash, sha256

BUDGET = budget(max_examples=150)
DIRECTED = [PROGRAMS[name] for name in sorted(PROGRAMS)]


def new_kinds_machine_failure() -> BaseException | None:
    init_none_hash(sha256)  # other tests may have seeded the chain with another function
    return machine_failure(NewKindsMachine, BUDGET, DIRECTED)


@pytest.fixture(scope="module")
def control_failure() -> BaseException | None:
    """The unpatched machine's outcome (run once per module)."""
    return new_kinds_machine_failure()


# ---------------------------------------------------------------- the bugs

def patch_hit_ignoring_context_parallel(mp: pytest.MonkeyPatch) -> None:
    """Full attention's hit search in the spec's block units, as if every rank
    held whole blocks: hits come out too long under context parallelism."""
    original = FullAttentionManager.find_longest_cache_hit  # bound to the class

    def buggy(cls: Any, *args: Any, **kwargs: Any) -> Any:
        # The coordinators pass the arguments positionally: bind them by name.
        bound = inspect.signature(original).bind(*args, **kwargs)
        bound.arguments["dcp_world_size"] = bound.arguments["pcp_world_size"] = 1
        return original(*bound.args, **bound.kwargs)

    mp.setattr(FullAttentionManager, "find_longest_cache_hit", classmethod(buggy))


def touch_without_metrics(self: BlockPool, blocks: Any) -> None:
    """Prefix hits are not reported to the metrics collector."""
    queue = self.free_block_queue
    for block in blocks:
        if block.ref_cnt == 0 and not block.is_null:
            queue.remove(block)
        block.ref_cnt += 1


def _metrics_test() -> None:
    from unit.test_kv_cache_metrics_vs_vllm import test_residency_figures_equal_vllms

    with pytest.MonkeyPatch.context() as mp:
        test_residency_figures_equal_vllms(mp, 0, True)


MACHINE_BUGS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "MLA groups do not report fresh blocks for zeroing": lambda mp: mp.setattr(
        single_type, "_TRACKING_SPECS", frozenset({"FullAttentionSpec", "TQFullAttentionSpec"})
    ),
    "sliding-window MLA events say sliding_window": lambda mp: mp.setattr(
        interface,
        "_KIND_ORDER",
        tuple(k for k in interface._KIND_ORDER if k[0] != "SlidingWindowMLASpec"),
    ),
    "full-attention hits ignore context parallelism": patch_hit_ignoring_context_parallel,
}


def test_unpatched_new_kinds_machine_passes_the_budget(
    control_failure: BaseException | None,
) -> None:
    assert control_failure is None


@pytest.mark.parametrize("bug", sorted(MACHINE_BUGS))
def test_new_kinds_machine_catches(
    bug: str, monkeypatch: pytest.MonkeyPatch, control_failure: BaseException | None
) -> None:
    if control_failure is not None:
        pytest.fail(f"the unpatched machine fails already: {control_failure!r}")
    MACHINE_BUGS[bug](monkeypatch)
    error = timed_catch(bug, new_kinds_machine_failure)
    assert error is not None, f"the machine missed: {bug}"
    assert "/spec/" not in raised_in(error), f"{bug}: spec raised {error!r}"


@pytest.mark.usefixtures("vllm_reference")
def test_metrics_comparison_catches_unreported_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    assert unit_failure(_metrics_test) is None  # control
    monkeypatch.setattr(BlockPool, "touch", touch_without_metrics)
    error = timed_catch("hits not reported to the metrics collector",
                        lambda: unit_failure(_metrics_test))
    assert isinstance(error, AssertionError), f"missed: {error!r}"
