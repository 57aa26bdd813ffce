"""Every property ``proofs/run.py`` checks, in one place.

* ``CONTRACTS``: functions whose PEP 316 docstring contract (``pre:``/``post:``)
  ``crosshair check`` verifies: the spec's pure arithmetic (``spec/pure.py``), the
  kvcache functions the spec has no twin of, and the kernels' slot arithmetic
  (``proofs/slots.py``).
* ``PAIRS``: twin functions ``crosshair diffbehavior`` compares on a domain: each pure
  function the spec and kvcache both run (``spec.pure`` and ``kvcache.kv_cache_math``,
  called by the managers), and the slot formula of the reference against the kernel's.
  ``domain`` is the shared precondition (diffbehavior ignores ``pre:``); outside it
  both wrappers in ``proofs/pairs.py`` return None.
* ``EXHAUSTIVE``: the bounded exhaustive comparison of the two managers
  (``proofs/exhaustive.py``).

Every bound is a count (``proofs/bounded.py``): CrossHair paths per condition of a
contract or per pair, the inputs of the enumeration that decides what CrossHair does
not exhaust, and the exhaustive search's depth per layout. The same commit gives the
same verdicts on any machine, loaded or idle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Contract:
    """``crosshair check`` of one function's docstring contract."""

    target: str
    """Dotted path of the function."""
    max_iterations: int = 100
    """CrossHair paths per ``post:`` condition."""
    max_cases: int = 250_000
    """Inputs of the enumeration when CrossHair does not exhaust the paths."""


@dataclass(frozen=True)
class Pair:
    """``crosshair diffbehavior`` of two functions with one signature."""

    name: str
    """Also the stem of the wrappers ``proofs.pairs.<name>__oracle`` / ``__subject``."""
    oracle: str
    """Dotted path of the reference (spec, or the reference formula)."""
    subject: str
    """Dotted path of the implementation (kvcache, or the kernel formula)."""
    domain: Callable[..., bool]
    """The arguments both are specified for."""
    max_iterations: int = 100
    """CrossHair paths for the whole comparison (half per argument order)."""
    max_cases: int = 250_000
    """Inputs of the enumeration when CrossHair does not exhaust the paths."""
    types: Mapping[str, Any] | None = None
    """Concrete annotations for generic parameters (``Sequence[H]`` -> ``list[int]``)."""


@dataclass(frozen=True)
class Exhaustive:
    """The bounded exhaustive comparison of kvcache with spec."""

    min_depth: int = 7
    """The least depth of any layout (``proofs/exhaustive.py`` ``LAYOUTS``)."""


def _nonneg(*values: int) -> bool:
    return all(v >= 0 for v in values)


def _hashes(block_hashes: Sequence[Any], max_num_blocks: int) -> bool:
    return 0 <= max_num_blocks <= len(block_hashes)


def _split(block_table: list[int], pos: int, manager_bs: int, kernel_bs: int) -> bool:
    return (kernel_bs >= 1 and manager_bs >= kernel_bs and manager_bs % kernel_bs == 0
            and 0 <= pos < len(block_table) * manager_bs)


S, K = "spec.pure", "kvcache.kv_cache_math"
INT_BLOCKS = {"blocks": list[int], "null": int}
INT_HASHES = {"block_hashes": list[int], "cached": set[int]}

CONTRACTS: tuple[Contract, ...] = (
    # block counts
    Contract(f"{S}.cdiv"),
    Contract(f"{S}.num_required_blocks"),
    Contract(f"{S}.num_new_blocks"),
    Contract(f"{S}.num_skipped_hits"),
    Contract(f"{S}.mamba_align_num_new_blocks"),
    Contract(f"{S}.mamba_prompt_tail_boundary"),
    Contract(f"{S}.mamba_checkpoint_exportable"),
    Contract(f"{K}.sliding_window_admission_blocks"),
    Contract(f"{K}.chunked_local_admission_blocks"),
    Contract(f"{K}.sliding_window_final_segment_tail"),
    # skipped tokens per group kind
    Contract(f"{S}.num_skipped_tokens_full_attention"),
    Contract(f"{S}.num_skipped_tokens_sliding_window"),
    Contract(f"{S}.num_skipped_tokens_chunked_local"),
    Contract(f"{S}.num_skipped_tokens_mamba"),
    Contract(f"{S}.skipped_blocks_to_free"),
    Contract(f"{S}.rswa_gap_blocks"),
    Contract(f"{S}.gap_blocks_to_free"),
    # sliding-window caching
    Contract(f"{S}.num_contiguous_blocks_for_hit"),
    Contract(f"{S}.sliding_window_reachable_mask"),
    Contract(f"{S}.replay_boundaries"),
    # hit searches over a container of cached hashes
    Contract(f"{S}.align_num_hit_blocks"),
    Contract(f"{S}.full_attention_hit_num_blocks"),
    Contract(f"{S}.sliding_window_hit_range"),
    Contract(f"{S}.chunked_local_hit_range"),
    Contract(f"{S}.mamba_hit_num_blocks"),
    Contract(f"{S}.num_tokens_to_cache"),
    # hash re-slicing (BlockHashListWithBlockSize)
    Contract(f"{K}.coarse_hash_index"),
    Contract(f"{K}.num_coarse_hashes"),
    # admission gate
    Contract(f"{S}.admits"),
    # slot arithmetic of the kernels
    Contract("proofs.slots.slot"),
    Contract("proofs.slots.live_token_slot"),
    Contract("proofs.slots.share_slot"),
    Contract("proofs.slots.map_to_kernel_blocks"),
    Contract("proofs.slots.reference_slot"),
    Contract("proofs.slots.kernel_slot"),
    Contract("proofs.slots.padded_slot_mapping"),
)

PAIRS: tuple[Pair, ...] = (
    Pair("cdiv", f"{S}.cdiv", f"{K}.cdiv", lambda a, b: b > 0),
    Pair("num_required_blocks", f"{S}.num_required_blocks", f"{K}.num_required_blocks",
         lambda n, bs, cap: n >= 0 and bs > 0 and (cap is None or cap >= 0)),
    Pair("num_new_blocks", f"{S}.num_new_blocks", f"{K}.num_new_blocks",
         lambda req, held, hits, skipped, running: _nonneg(req, held, hits, skipped)),
    Pair("num_skipped_hits", f"{S}.num_skipped_hits", f"{K}.num_skipped_hits", _nonneg),
    Pair("mamba_align_num_new_blocks", f"{S}.mamba_align_num_new_blocks",
         f"{K}.mamba_align_num_new_blocks",
         lambda n, bs, spec, hits, held, before, copy, checkpoint, capped, takes:
         bs > 0 and _nonneg(n, spec, hits, held) and 0 <= checkpoint <= 1),
    Pair("mamba_prompt_tail_boundary", f"{S}.mamba_prompt_tail_boundary",
         f"{K}.mamba_prompt_tail_boundary",
         lambda n, hbs, eagle, lookahead: n >= 0 and hbs > 0 and lookahead >= 0),
    Pair("num_skipped_tokens_sliding_window", f"{S}.num_skipped_tokens_sliding_window",
         f"{K}.num_skipped_tokens_sliding_window", lambda n, window: n >= 0 and window >= 1),
    Pair("num_skipped_tokens_chunked_local", f"{S}.num_skipped_tokens_chunked_local",
         f"{K}.num_skipped_tokens_chunked_local", lambda n, chunk: n >= 0 and chunk >= 1),
    Pair("num_skipped_tokens_mamba", f"{S}.num_skipped_tokens_mamba",
         f"{K}.num_skipped_tokens_mamba", _nonneg),
    Pair("skipped_blocks_to_free", f"{S}.skipped_blocks_to_free",
         f"{K}.skipped_blocks_to_free", lambda blocks, null, n: n >= 0, types=INT_BLOCKS),
    Pair("rswa_gap_blocks", f"{S}.rswa_gap_blocks", f"{K}.rswa_gap_blocks",
         lambda prompt, computed, window, bs: _nonneg(prompt, computed) and window >= 1
         and bs >= 1),
    # (No gap_blocks_to_free pair: CrossHair's diffbehavior of the four-argument
    # twins runs into the safety limit even at 30 paths; tests/unit/test_rswa_sink.py
    # compares them input by input instead.)
    Pair("num_contiguous_blocks_for_hit", f"{S}.num_contiguous_blocks_for_hit",
         f"{K}.num_contiguous_blocks_for_hit", lambda window, bs, eagle: window >= 1 and bs >= 1),
    Pair("sliding_window_reachable_mask", f"{S}.sliding_window_reachable_mask",
         f"{K}.sliding_window_reachable_mask",
         lambda start, end, need, per_segment, eagle: _nonneg(start, need) and per_segment >= 1),
    Pair("replay_boundaries", f"{S}.replay_boundaries", f"{K}.replay_boundaries",
         lambda n, block, eagle: n >= 1 and block >= 1),
    Pair("sliding_window_retention_mask", f"{S}.sliding_window_retention_mask",
         f"{K}.sliding_window_retention_mask",
         lambda start, end, need, bs, alignment, interval, boundaries, eagle: (
             _nonneg(start, need, interval, *boundaries) and bs >= 1 and alignment >= 1),
         types={"boundaries": list[int]}),
    Pair("mamba_retention_mask", f"{S}.mamba_retention_mask", f"{K}.mamba_retention_mask",
         lambda start, end, bs, alignment, interval, boundaries: (
             _nonneg(start, interval, *boundaries) and bs >= 1 and alignment >= 1),
         types={"boundaries": list[int]}),
    Pair("align_num_hit_blocks", f"{S}.align_num_hit_blocks", f"{K}.align_num_hit_blocks",
         lambda n, bs, alignment: n >= 0 and bs >= 1 and alignment >= 1),
    Pair("full_attention_hit_num_blocks", f"{S}.full_attention_hit_num_blocks",
         f"{K}.full_attention_hit_num_blocks",
         lambda hashes, cached, n, eagle, bs, alignment: n >= 0 and bs >= 1 and alignment >= 1,
         types=INT_HASHES),
    Pair("sliding_window_hit_range", f"{S}.sliding_window_hit_range",
         f"{K}.sliding_window_hit_range",
         lambda hashes, cached, n, need, eagle, bs, alignment: (
             _hashes(hashes, n) and need >= 0 and bs >= 1 and alignment >= 1), types=INT_HASHES),
    Pair("chunked_local_hit_range", f"{S}.chunked_local_hit_range",
         f"{K}.chunked_local_hit_range",
         lambda hashes, cached, length, chunk, bs: (
             length >= 0 and chunk >= 1 and bs >= 1 and length // bs <= len(hashes)),
         types=INT_HASHES),
    Pair("mamba_hit_num_blocks", f"{S}.mamba_hit_num_blocks", f"{K}.mamba_hit_num_blocks",
         lambda hashes, cached, n, bs, alignment: (
             _hashes(hashes, n) and bs >= 1 and alignment >= 1), types=INT_HASHES),
    Pair("num_tokens_to_cache", f"{S}.num_tokens_to_cache", f"{K}.num_tokens_to_cache",
         lambda n, scheduler_bs, bs, eagle, reprefill: n >= 0 and scheduler_bs >= 1
         and bs >= 1 and reprefill >= 0),
    Pair("admits", f"{S}.admits", f"{K}.admits",
         lambda n, free, reserved, watermark: _nonneg(free, reserved, watermark)),
    Pair("slot_formula", "proofs.slots.reference_slot", "proofs.slots.kernel_slot", _split),
)

EXHAUSTIVE = Exhaustive()
