"""Pure index arithmetic of the managers: block counts, skipped tokens, hit searches.

Leaf module (no kvcache imports): plain ints, sequences and containers in, ints out.
The managers call these functions, and ``proofs/`` compares each one with its twin in
the spec (``spec.pure``) with ``crosshair diffbehavior``; the functions kvcache alone
has carry their PEP 316 contract (``pre:``/``post:``), checked with ``crosshair check``.

A hit search reads ``cached``: anything whose ``in`` tells whether a hash is cached in
every searched group (one group's hash map, or a view over several). ``block_hashes``
is only indexed and measured, so a ``BlockHashListWithBlockSize`` view serves too.
"""

from __future__ import annotations

import itertools
from collections.abc import Container, Hashable, Sequence
from typing import TypeVar

H = TypeVar("H", bound=Hashable)
T = TypeVar("T")


def cdiv(a: int, b: int) -> int:
    """Ceiling division of ints: the blocks needed for ``a`` tokens of ``b`` per block."""
    return -(a // -b)


# ---------------------------------------------------------------- block counts


def num_required_blocks(num_tokens: int, block_size: int, admission_cap: int | None) -> int:
    """Blocks holding ``num_tokens`` tokens, capped at ``admission_cap`` unless None."""
    num_blocks = cdiv(num_tokens, block_size)
    if admission_cap is not None and admission_cap < num_blocks:
        return admission_cap
    return num_blocks


def num_new_blocks(
    num_required: int, num_held: int, num_hits: int, num_skipped: int, is_running: bool
) -> int:
    """Fresh blocks a table needs to reach ``num_required`` blocks.

    A running request (no new hits) may hold more than needed (rejected draft
    tokens); a new one starts after its skipped positions or after its held
    blocks plus its hits, whichever is further.
    """
    if is_running:
        num_new = num_required - num_held
    else:
        num_new = num_required - max(num_skipped, num_hits + num_held)
    return num_new if num_new > 0 else 0


def num_skipped_hits(num_skipped: int, num_held: int) -> int:
    """Leading hits that land on skipped positions (never touched, never counted)."""
    first_kept = num_skipped - num_held
    return first_kept if first_kept > 0 else 0


def mamba_align_num_new_blocks(
    num_tokens_main_model: int,
    block_size: int,
    num_spec: int,
    num_hits: int,
    num_held: int,
    allocated_before: bool,
    copy: bool = False,
    checkpoint: int = 0,
    capped: bool = False,
    checkpoint_takes_spec: bool = False,
) -> int:
    """Align-mode Mamba's new blocks. The shortfall is what the table lacks, plus one
    when a state ending inside its block is to be copied (``copy``). When short, the
    count is one state block, one for the copy, ``checkpoint`` for a prefill
    checkpoint and the speculative blocks on the first allocation: that cap itself
    (vLLM 0.25.1-0.30.0; 0.30.0 keeps the shortfall of a request allocated before
    that takes a checkpoint), or the shortfall capped by it (``capped``:
    ``mamba_caps_new_state_blocks``). Else the shortfall itself (<= 0). A checkpoint
    step takes fresh speculative blocks when ``checkpoint_takes_spec`` (0.30.0-0.31.0).
    """
    num_new = cdiv(num_tokens_main_model, block_size) + num_spec - num_hits - num_held
    if copy:
        num_new = max(num_new, 0) + 1
    if num_new <= 0:
        return num_new
    fresh_spec = not allocated_before or (checkpoint > 0 and checkpoint_takes_spec)
    cap = 1 + int(copy) + checkpoint + (num_spec if fresh_spec else 0)
    if capped:
        return min(num_new, cap)
    return num_new if checkpoint and allocated_before else cap


def mamba_prompt_tail_boundary(
    num_prompt_tokens: int, hash_block_size: int, eagle: bool, num_hash_lookahead_tokens: int = 0
) -> int:
    """The prompt's last hash boundary a later lookup of it can reuse a Mamba state
    at (vLLM 0.33.0): one token is left for the logits, or the lookahead tokens the
    boundary's hash covers when there are more (``num_hash_lookahead_tokens``); with
    EAGLE the whole prompt counts and one more hash block is dropped. Never negative.

    pre: num_prompt_tokens >= 0 and hash_block_size > 0 and num_hash_lookahead_tokens >= 0
    post: __return__ >= 0 and __return__ % hash_block_size == 0
    post: __return__ < num_prompt_tokens or __return__ == 0
    """
    limit = num_prompt_tokens if eagle else num_prompt_tokens - max(1, num_hash_lookahead_tokens)
    boundary = max(limit, 0) // hash_block_size * hash_block_size
    if eagle:
        boundary -= hash_block_size
    return max(boundary, 0)


def mamba_prefill_checkpoint_valid(
    query_start: int,
    query_end: int,
    checkpoint_position: int,
    hash_block_size: int,
    mamba_block_size: int,
    checkpoint_alignment: int | None,
) -> bool:
    """Whether a backend can export a Mamba state at ``checkpoint_position`` inside
    the chunk ``[query_start, query_end)`` (vLLM 0.33.0's prefill checkpoints): the
    backend has an alignment, the chunk starts on a hash boundary, the state goes
    to a column (``cdiv(query_end, block) - 2``) past the one holding the chunk's
    initial state, the position is at least one hash block into the chunk and
    before its end, and it is a whole number of alignment steps from the start.

    pre: hash_block_size > 0 and mamba_block_size > 0 and query_start >= 0
    pre: checkpoint_alignment is None or checkpoint_alignment > 0
    post: not __return__ or query_start < checkpoint_position < query_end
    """
    if checkpoint_alignment is None:
        return False
    initial_state_col = (query_start - 1) // mamba_block_size
    checkpoint_col = cdiv(query_end, mamba_block_size) - 2
    return (
        query_start % hash_block_size == 0
        and checkpoint_col > initial_state_col
        and query_start + hash_block_size <= checkpoint_position
        and query_start < checkpoint_position < query_end
        and (checkpoint_position - query_start) % checkpoint_alignment == 0
    )


def sliding_window_admission_blocks(
    sliding_window: int, block_size: int, max_num_batched_tokens: int, max_model_len: int
) -> int:
    """Most blocks a sliding-window request holds at once: the window behind its
    computed tokens plus one step's tokens, plus one for a window starting mid-block.

    pre: sliding_window >= 1 and block_size >= 1
    pre: max_num_batched_tokens >= 1 and max_model_len >= 1
    post: (__return__ - 1) * block_size >= min(sliding_window - 1 + max_num_batched_tokens, max_model_len)
    post: (__return__ - 2) * block_size < min(sliding_window - 1 + max_num_batched_tokens, max_model_len)
    """  # noqa: E501
    num_tokens = min(sliding_window - 1 + max_num_batched_tokens, max_model_len)
    return cdiv(num_tokens, block_size) + 1


def chunked_local_admission_blocks(
    attention_chunk_size: int, block_size: int, max_num_batched_tokens: int, max_model_len: int
) -> int:
    """Most blocks a chunked-local request holds at once: a chunk plus one step's tokens.

    pre: attention_chunk_size >= 1 and block_size >= 1
    pre: max_num_batched_tokens >= 1 and max_model_len >= 1
    post: __return__ * block_size >= min(attention_chunk_size + max_num_batched_tokens, max_model_len)
    post: (__return__ - 1) * block_size < min(attention_chunk_size + max_num_batched_tokens, max_model_len)
    """  # noqa: E501
    num_tokens = min(attention_chunk_size + max_num_batched_tokens, max_model_len)
    return cdiv(num_tokens, block_size)


# ---------------------------------------------------------------- skipped tokens


def num_skipped_tokens_sliding_window(num_computed_tokens: int, sliding_window: int) -> int:
    """Tokens left of the next token's window: ``computed - window + 1``."""
    return max(0, num_computed_tokens - sliding_window + 1)


def num_skipped_tokens_chunked_local(num_computed_tokens: int, chunk_size: int) -> int:
    """Tokens of the chunks before the one the next token falls in."""
    return num_computed_tokens // chunk_size * chunk_size


def num_skipped_tokens_mamba(num_computed_tokens: int) -> int:
    """All but the last computed token: only the latest state is needed."""
    return num_computed_tokens - 1


def skipped_blocks_to_free(blocks: Sequence[T], null: T, num_skipped: int) -> tuple[int, int]:
    """``(start, stop)``: the skipped positions still holding a live block.

    Removal runs right to left up to the first null block (left by an earlier
    removal), so a null at the last skipped position means nothing to free, the
    common case, answered without a scan.
    """
    stop = min(num_skipped, len(blocks))
    if stop <= 0 or blocks[stop - 1] == null:
        return stop, stop
    start = stop - 1
    while start > 0 and blocks[start - 1] != null:
        start -= 1
    return start, stop


def rswa_gap_blocks(
    num_prompt_tokens: int, total_computed_tokens: int, rswa_window: int, block_size: int
) -> tuple[int, int]:
    """``(first, last)``: R-SWA's gap blocks, wholly after the prompt's last block and
    before the decode window (which never reaches into the prompt)."""
    window_start = max(num_prompt_tokens, total_computed_tokens - rswa_window)
    return cdiv(num_prompt_tokens, block_size), window_start // block_size


def gap_blocks_to_free(blocks: Sequence[T], null: T, first: int, last: int) -> tuple[int, int]:
    """``(start, stop)``: the live blocks of ``[first, last)`` (cut to the table) still
    to free: removal runs right to left from the range's end and stops at ``first`` or
    at a null block an earlier removal left (a null at the end: nothing to free)."""
    stop = min(last, len(blocks))
    if stop <= first or blocks[stop - 1] == null:
        return stop, stop
    start = stop - 1
    while start > first and blocks[start - 1] != null:
        start -= 1
    return start, stop


# ---------------------------------------------------------------- sliding-window caching


def num_contiguous_blocks_for_hit(sliding_window: int, block_size: int, use_eagle: bool) -> int:
    """Blocks that must be cached back to back for a hit: those holding the
    ``sliding_window - 1`` tokens before the next one (+1 for the EAGLE drop)."""
    return cdiv(sliding_window - 1, block_size) + (1 if use_eagle else 0)


def sliding_window_reachable_mask(
    start_block: int, end_block: int, num_needed: int, per_segment: int, use_eagle: bool
) -> list[bool] | None:
    """Which of blocks ``[start_block, end_block)`` can serve a hit: the ``num_needed``
    blocks before each segment boundary (shifted one block with EAGLE); None: all."""
    if num_needed >= per_segment:
        return None
    shift = 1 if use_eagle else 0
    first_reachable = per_segment - num_needed
    return [
        i >= shift and (i - shift) % per_segment >= first_reachable
        for i in range(start_block, end_block)
    ]


def replay_boundaries(
    num_prompt_tokens: int, scheduler_block_size: int, use_eagle: bool
) -> tuple[int, ...]:
    """Token positions where a later request replaying the prompt can resume, which
    sparse retention keeps (vLLM 0.33.0's rule): ``num_prompt_tokens - 1`` without
    EAGLE; with EAGLE a hit loses its last block, so the positions one scheduler block
    below a resend's cap (the prompt less one token, rounded down) and below a longer
    sibling's (the prompt rounded down), clamped at 0; one position unless the prompt
    is block-aligned (the spec's twin carries the contract)."""
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    resend = (num_prompt_tokens - 1) // scheduler_block_size * scheduler_block_size
    extension = num_prompt_tokens // scheduler_block_size * scheduler_block_size
    low = max(resend - scheduler_block_size, 0)
    high = max(extension - scheduler_block_size, 0)
    return (low,) if low == high else (low, high)


def sliding_window_final_segment_tail(
    start_block: int, end_block: int, num_needed: int, per_segment: int, final_end_block: int
) -> range:
    """The blocks of ``[start_block, end_block)`` in the ``num_needed``-block tail of a
    request's last, partial segment (ending at block ``final_end_block``), which a hit
    on the whole request reads; empty when that segment is whole.

    pre: 0 <= start_block and num_needed >= 0 and per_segment >= 1 and final_end_block >= 0
    post: all(start_block <= i < min(end_block, final_end_block) for i in __return__)
    post: len(__return__) <= num_needed
    """
    final_size = final_end_block % per_segment
    if not final_size:
        return range(0)
    tail_start = max(final_end_block - final_size, final_end_block - num_needed)
    return range(max(start_block, tail_start), min(end_block, final_end_block))


def sliding_window_retention_mask(
    start_block: int,
    end_block: int,
    num_needed: int,
    block_size: int,
    alignment_tokens: int,
    retention_interval: int,
    boundaries: Sequence[int],
    use_eagle: bool,
) -> list[bool] | None:
    """Sparse retention (``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``) for a sliding window:
    the ``num_needed`` blocks before each ``retention_interval`` boundary (no such tails
    when it is 0), plus those before each of ``boundaries`` (token positions a replay
    of the prompt resumes at, rounded down to ``alignment_tokens``). Shifted one block
    with EAGLE. None: every block."""
    if retention_interval != 0:
        mask = sliding_window_reachable_mask(
            start_block, end_block, num_needed, retention_interval // block_size, use_eagle
        )
        if mask is None:
            return None
    else:
        mask = [False] * max(0, end_block - start_block)
    shift = 1 if use_eagle else 0
    for boundary in boundaries:
        replay_end = boundary // alignment_tokens * alignment_tokens // block_size + shift
        for i in range(max(start_block, replay_end - num_needed), min(end_block, replay_end)):
            mask[i - start_block] = True
    return mask


def mamba_retention_mask(
    start_block: int,
    end_block: int,
    block_size: int,
    alignment_tokens: int,
    retention_interval: int,
    boundaries: Sequence[int],
) -> list[bool] | None:
    """Sparse retention for Mamba states: block ``i`` holds the state after token
    ``(i + 1) * block_size``; keep the states ending on a ``retention_interval``
    boundary (none when it is 0) and, for each of ``boundaries`` (the positions a
    replay of the prompt resumes at) rounded down to ``alignment_tokens``, the state
    of the last whole block before it.
    None: every block (an interval of at most one block)."""
    if retention_interval != 0 and retention_interval // block_size <= 1:
        return None
    # The state a hit at an aligned boundary resumes from: the last whole block before it.
    kept = {b // alignment_tokens * alignment_tokens // block_size - 1 for b in boundaries}
    mask = []
    for i in range(start_block, end_block):
        num_state_tokens = (i + 1) * block_size  # the tokens block i's state follows
        mask.append(
            (retention_interval != 0 and num_state_tokens % retention_interval == 0)
            or i in kept
        )
    return mask


# ---------------------------------------------------------------- hit searches


def align_num_hit_blocks(num_blocks: int, block_size: int, alignment_tokens: int) -> int:
    """Drop trailing hit blocks until the hit length is a multiple of ``alignment_tokens``."""
    while num_blocks * block_size % alignment_tokens:
        num_blocks -= 1
    return num_blocks


def full_attention_hit_num_blocks(
    block_hashes: Sequence[H],
    cached: Container[H],
    max_num_blocks: int,
    drop_eagle_block: bool,
    block_size: int,
    alignment_tokens: int,
) -> int:
    """Leading cached blocks (the chain makes the first miss final), then
    ``trim_full_attention_hit``."""
    leading = itertools.islice(block_hashes, max_num_blocks)
    num_blocks = len(list(itertools.takewhile(cached.__contains__, leading)))
    return trim_full_attention_hit(num_blocks, drop_eagle_block, block_size, alignment_tokens)


def trim_full_attention_hit(
    num_blocks: int, drop_eagle_block: bool, block_size: int, alignment_tokens: int
) -> int:
    """A full-attention hit of ``num_blocks`` leading cached blocks, less the EAGLE
    block, cut back to an alignment boundary."""
    if drop_eagle_block and num_blocks:
        num_blocks -= 1
    if block_size != alignment_tokens:
        num_blocks = align_num_hit_blocks(num_blocks, block_size, alignment_tokens)
    return num_blocks


def sliding_window_hit_range(
    block_hashes: Sequence[H],
    cached: Container[H],
    max_num_blocks: int,
    num_needed: int,
    drop_eagle_block: bool,
    block_size: int,
    alignment_tokens: int,
) -> tuple[int, int]:
    """``(first, num_blocks)``: the rightmost run of ``num_needed`` cached blocks whose
    end is aligned; blocks before ``first`` are null. Without such a run, the cached
    run at the very start (maybe empty) is the hit. EAGLE drops the last block."""
    run = 0
    first = num_blocks = 0
    match_found = False
    for i in range(max_num_blocks - 1, -1, -1):
        if block_hashes[i] not in cached:
            run = 0
            continue
        if run == 0 and block_size != alignment_tokens:
            # A run must end where the hit (after the EAGLE drop) is aligned.
            end = i if drop_eagle_block else i + 1
            if end * block_size % alignment_tokens:
                continue
        run += 1
        if run >= num_needed:
            first, num_blocks = i, i + run
            match_found = True
            break
    if not match_found:
        num_blocks = align_num_hit_blocks(run, block_size, alignment_tokens)
    if drop_eagle_block and num_blocks:
        num_blocks = align_num_hit_blocks(num_blocks - 1, block_size, alignment_tokens)
    return (first if first < num_blocks else num_blocks), num_blocks


def chunked_local_hit_range(
    block_hashes: Sequence[H],
    cached: Container[H],
    max_length: int,
    chunk_size: int,
    block_size: int,
) -> tuple[int, int]:
    """``(first, num_blocks)``: null blocks up to the chunk holding ``max_length``,
    then cached blocks from there left to right until the first miss."""
    first = (max_length // chunk_size * chunk_size if max_length > 0 else 0) // block_size
    num_blocks = first
    for i in range(first, max_length // block_size):
        if block_hashes[i] not in cached:
            break
        num_blocks += 1
    return first, num_blocks


def mamba_hit_num_blocks(
    block_hashes: Sequence[H],
    cached: Container[H],
    max_num_blocks: int,
    block_size: int,
    alignment_tokens: int,
) -> int:
    """Blocks up to the rightmost cached state whose end is aligned (0: no hit)."""
    for i in range(max_num_blocks - 1, -1, -1):
        if block_size != alignment_tokens and (i + 1) * block_size % alignment_tokens:
            continue  # a state that does not end on a boundary can never be a hit
        if block_hashes[i] in cached:
            return i + 1
    return 0


def num_tokens_to_cache(
    num_computed_tokens: int,
    scheduler_block_size: int,
    block_size: int,
    use_eagle: bool,
    num_reprefillable_tokens: int = 0,
) -> int:
    """Tokens a hybrid group caches: up to the last scheduler-block boundary, plus the
    block just past it for an EAGLE group. That block stops short of the last
    ``num_reprefillable_tokens`` computed tokens (vLLM 0.33.0's prefill lookahead:
    a multi-module drafter computes them again, so their KV is not final).

    pre: num_computed_tokens >= 0 and scheduler_block_size > 0 and block_size > 0
    pre: num_reprefillable_tokens >= 0
    post: 0 <= __return__ <= num_computed_tokens
    """
    aligned = num_computed_tokens // scheduler_block_size * scheduler_block_size
    if use_eagle and aligned > 0:
        finalized = max(0, num_computed_tokens - num_reprefillable_tokens)
        return min(finalized, finalized // scheduler_block_size * scheduler_block_size + block_size)
    return aligned


# ---------------------------------------------------------------- admission


def admits(
    num_blocks: int, num_free_blocks: int, num_reserved_blocks: int, num_watermark_blocks: int
) -> bool:
    """``allocate_slots``' gate: ``num_blocks`` fit in the free queue beside the
    blocks reserved for in-flight requests and the watermark."""
    return num_blocks + num_watermark_blocks <= num_free_blocks - num_reserved_blocks


# ---------------------------------------------------------------- hash re-slicing


def coarse_hash_index(block_index: int, scale_factor: int) -> int:
    """Index of the fine hash that names coarse block ``block_index`` when a coarse
    block is ``scale_factor`` fine blocks: the fine block that ends with it (its hash
    chains over the whole prefix).

    pre: block_index >= 0 and scale_factor >= 1
    post: __return__ >= block_index
    post: (__return__ + 1) % scale_factor == 0
    post: (__return__ + 1) // scale_factor == block_index + 1
    """
    return (block_index + 1) * scale_factor - 1


def num_coarse_hashes(num_fine_hashes: int, scale_factor: int) -> int:
    """Coarse blocks fully covered by ``num_fine_hashes`` fine blocks.

    pre: num_fine_hashes >= 0 and scale_factor >= 1
    post: __return__ * scale_factor <= num_fine_hashes < (__return__ + 1) * scale_factor
    post: __return__ == 0 or coarse_hash_index(__return__ - 1, scale_factor) < num_fine_hashes
    """
    return num_fine_hashes // scale_factor
