"""The spec's pure arithmetic: block counts, skipped tokens, hit searches, admission.

The managers call these functions; each one's docstring states its contract as PEP 316
``pre:``/``post:`` lines, which ``proofs/`` checks with CrossHair, and ``proofs/manifest.py``
pairs each with its kvcache twin (``kvcache.kv_cache_math``) for ``crosshair diffbehavior``.

A hit search reads the request's hashes and ``cached``, anything whose ``in`` says
whether a hash is cached in every searched group (a set, a dict, a pool view).
Helpers named ``_…`` exist for the contracts only.
"""

from __future__ import annotations

import itertools
from collections.abc import Container, Hashable, Sequence
from typing import TypeVar

H = TypeVar("H", bound=Hashable)
T = TypeVar("T")


# ---------------------------------------------------------------- contract helpers


def _all_cached(block_hashes: Sequence[H], cached: Container[H], start: int, end: int) -> bool:
    """Whether blocks ``[start, end)`` are all cached."""
    return all(block_hashes[i] in cached for i in range(start, end))


def _aligned(num_blocks: int, block_size: int, alignment_tokens: int) -> bool:
    """Whether ``num_blocks`` blocks end on an ``alignment_tokens`` boundary."""
    return num_blocks * block_size % alignment_tokens == 0


def _align_down(num_tokens: int, alignment_tokens: int) -> int:
    """The last ``alignment_tokens`` boundary at or before ``num_tokens``."""
    return num_tokens - num_tokens % alignment_tokens


# ---------------------------------------------------------------- block counts


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks of ``b`` tokens that hold ``a`` tokens.

    pre: b > 0
    post: (__return__ - 1) * b < a <= __return__ * b
    """
    return -(a // -b)


def num_required_blocks(num_tokens: int, block_size: int, admission_cap: int | None) -> int:
    """Blocks for ``num_tokens`` tokens, at most ``admission_cap`` (None: no cap).

    pre: num_tokens >= 0 and block_size > 0
    pre: admission_cap is None or admission_cap >= 0
    post: __return__ * block_size >= num_tokens or __return__ == admission_cap
    post: (__return__ - 1) * block_size < num_tokens or __return__ == 0
    post: admission_cap is None or __return__ <= admission_cap
    """
    num_required = cdiv(num_tokens, block_size)
    if admission_cap is not None:
        num_required = min(num_required, admission_cap)
    return num_required


def num_new_blocks(num_required: int, num_held: int, num_hits: int, num_skipped: int,
                   is_running: bool) -> int:
    """Fresh blocks that bring a table to ``num_required`` blocks: after what it holds
    (a running request), or after its skipped positions or its held blocks plus hits.

    pre: num_required >= 0 and num_held >= 0 and num_hits >= 0 and num_skipped >= 0
    post: __return__ >= 0
    post: _fills(num_required, _table_len(num_held, num_hits, num_skipped, is_running), __return__)
    """
    if is_running:
        return max(num_required - num_held, 0)
    return max(num_required - max(num_skipped, num_hits + num_held), 0)


def _table_len(num_held: int, num_hits: int, num_skipped: int, is_running: bool) -> int:
    """A table's length before fresh blocks: skipped positions are nulls."""
    return num_held if is_running else max(num_skipped, num_held + num_hits)


def _fills(num_required: int, table_len: int, num_new: int) -> bool:
    """Whether ``num_new`` fresh blocks bring the table to ``num_required``, none spare."""
    return table_len + num_new >= num_required and (num_new == 0
                                                    or table_len + num_new == num_required)


def num_skipped_hits(num_skipped: int, num_held: int) -> int:
    """How many leading hits land on skipped positions (they are never touched): hit j
    goes to position ``num_held + j``.

    pre: num_skipped >= 0 and num_held >= 0
    post: __return__ >= 0 and num_held + __return__ >= num_skipped
    post: __return__ == 0 or num_held + __return__ == num_skipped
    """
    return max(0, num_skipped - num_held)


def mamba_prompt_tail_boundary(num_prompt_tokens: int, hash_block_size: int, eagle: bool,
                               num_hash_lookahead_tokens: int = 0) -> int:
    """The last hash boundary of the prompt where a later lookup of it can reuse a Mamba
    state (0.33.0): the prompt less one token (for the logits), or less the lookahead
    tokens its hash covers when there are more, rounded down; with EAGLE the prompt
    rounded down less one hash block; at least 0.

    pre: num_prompt_tokens >= 0 and hash_block_size > 0 and num_hash_lookahead_tokens >= 0
    post: __return__ >= 0 and __return__ % hash_block_size == 0
    post: __return__ < num_prompt_tokens or __return__ == 0
    """
    if eagle:
        boundary = num_prompt_tokens // hash_block_size * hash_block_size - hash_block_size
    else:
        limit = num_prompt_tokens - max(1, num_hash_lookahead_tokens)
        boundary = max(limit, 0) // hash_block_size * hash_block_size
    return max(boundary, 0)


def mamba_checkpoint_exportable(start: int, end: int, position: int, hash_block_size: int,
                                block_size: int, alignment: int | None) -> bool:
    """Whether a prefill chunk computing tokens ``[start, end)`` can leave the Mamba
    state after ``position`` tokens in a block of its own (a prefill checkpoint,
    0.33.0): the layer says how far apart such states may be (``alignment``; None:
    never); the chunk starts on a hash boundary; the checkpoint's column (the block
    one before the chunk's last) lies past the column of the state the chunk starts
    from; the position lies inside the chunk, at least one hash block after its start
    and a whole number of alignments after it.

    pre: start >= 0 and end >= start and position >= 0
    pre: hash_block_size > 0 and block_size > 0 and (alignment is None or alignment > 0)
    post: not __return__ or (start < position < end and alignment is not None)
    """
    if alignment is None:
        return False
    start_column = (start - 1) // block_size  # -1 for a chunk starting at token 0
    checkpoint_column = cdiv(end, block_size) - 2
    return (start % hash_block_size == 0
            and checkpoint_column > start_column
            and start + hash_block_size <= position
            and start < position < end
            and (position - start) % alignment == 0)


def mamba_align_num_new_blocks(num_tokens_main_model: int, block_size: int, num_spec: int,
                               num_hits: int, num_held: int, allocated_before: bool,
                               copy: bool = False, checkpoint: int = 0,
                               capped: bool = False, checkpoint_takes_spec: bool = False
                               ) -> int:
    """Align-mode Mamba's new blocks, as vLLM: the shortfall is what the table lacks,
    plus one when a state ending inside its block is copied (``copy``). When short:
    one state block, one for the copy, ``checkpoint`` for a prefill checkpoint, and
    ``num_spec`` speculative blocks on the first allocation; that cap itself, or the
    shortfall capped by it (``capped``, 0.31.0); a request allocated before taking a
    checkpoint keeps its shortfall uncapped (0.30.0). Else the (<= 0) shortfall.

    pre: num_tokens_main_model >= 0 and block_size > 0
    pre: num_spec >= 0 and num_hits >= 0 and num_held >= 0 and 0 <= checkpoint <= 1
    post: __return__ <= 2 + checkpoint + num_spec or (checkpoint and allocated_before)
    post: copy or __return__ > 0 or num_hits + num_held >= cdiv(num_tokens_main_model, block_size)
    post: not copy or __return__ > 0
    """
    short = cdiv(num_tokens_main_model, block_size) + num_spec - num_hits - num_held
    if copy:
        short = max(short, 0) + 1
    if short <= 0:
        return short
    fresh_spec = not allocated_before or (checkpoint > 0 and checkpoint_takes_spec)
    cap = 1 + copy + checkpoint + (num_spec if fresh_spec else 0)
    if capped:
        return min(short, cap)
    return short if checkpoint and allocated_before else cap


# ---------------------------------------------------------------- skipped tokens


def num_skipped_tokens_full_attention(num_computed_tokens: int) -> int:
    """Full attention skips nothing.

    pre: num_computed_tokens >= 0
    post: __return__ == 0
    """
    return 0


def num_skipped_tokens_sliding_window(num_computed_tokens: int, sliding_window: int) -> int:
    """Tokens before the window of the next token: it reads ``sliding_window - 1`` back.

    pre: num_computed_tokens >= 0 and sliding_window >= 1
    post: 0 <= __return__ <= num_computed_tokens
    post: num_computed_tokens - __return__ == min(num_computed_tokens, sliding_window - 1)
    post: __return__ <= num_skipped_tokens_sliding_window(num_computed_tokens + 1, sliding_window)
    """
    return max(0, num_computed_tokens - sliding_window + 1)


def num_skipped_tokens_chunked_local(num_computed_tokens: int, chunk_size: int) -> int:
    """Tokens of the chunks before the next token's chunk.

    pre: num_computed_tokens >= 0 and chunk_size >= 1
    post: __return__ % chunk_size == 0
    post: 0 <= num_computed_tokens - __return__ < chunk_size
    post: __return__ <= num_skipped_tokens_chunked_local(num_computed_tokens + 1, chunk_size)
    """
    return num_computed_tokens // chunk_size * chunk_size


def num_skipped_tokens_mamba(num_computed_tokens: int) -> int:
    """Every token but the last: only the latest state is read.

    pre: num_computed_tokens >= 0
    post: num_computed_tokens - __return__ == 1
    """
    return num_computed_tokens - 1


def skipped_blocks_to_free(blocks: Sequence[T], null: T, num_skipped: int) -> tuple[int, int]:
    """``(start, stop)``: the skipped blocks still live, freed right to left. The scan
    stops at the first null, which an earlier removal left.

    pre: num_skipped >= 0
    post: 0 <= __return__[0] <= __return__[1] == min(num_skipped, len(blocks))
    post: all(blocks[i] != null for i in range(__return__[0], __return__[1]))
    post: __return__[0] == __return__[1] or __return__[0] == 0 or blocks[__return__[0] - 1] == null
    """
    stop = min(num_skipped, len(blocks))
    start = stop
    while start > 0 and blocks[start - 1] != null:
        start -= 1
    return start, stop


def rswa_gap_blocks(num_prompt_tokens: int, total_computed_tokens: int, rswa_window: int,
                    block_size: int) -> tuple[int, int]:
    """``(first, last)``: R-SWA's gap, the blocks wholly after the prompt and before the
    decode window (the ``rswa_window`` tokens before the next token, never reaching into
    the prompt); empty when ``first >= last``.

    pre: num_prompt_tokens >= 0 and total_computed_tokens >= 0
    pre: rswa_window >= 1 and block_size >= 1
    post: __return__[0] * block_size >= num_prompt_tokens
    post: __return__[1] * block_size <= max(num_prompt_tokens, total_computed_tokens - rswa_window)
    """
    window_start = max(num_prompt_tokens, total_computed_tokens - rswa_window)
    return cdiv(num_prompt_tokens, block_size), window_start // block_size


def gap_blocks_to_free(blocks: Sequence[T], null: T, first: int, last: int) -> tuple[int, int]:
    """``(start, stop)``: the live blocks of ``[first, last)`` to free, right to left
    from the range's end (cut to the table) back to ``first`` or the first null, which
    an earlier removal left.

    pre: first >= 0
    post: first <= __return__[0] <= __return__[1] or __return__[0] == __return__[1]
    post: all(blocks[i] != null for i in range(__return__[0], __return__[1]))
    post: __return__[0] == __return__[1] or __return__[1] == min(last, len(blocks))
    """
    stop = min(last, len(blocks))
    start = stop
    while start > first and blocks[start - 1] != null:
        start -= 1
    return start, stop


# ---------------------------------------------------------------- sliding-window hits


def num_contiguous_blocks_for_hit(sliding_window: int, block_size: int, use_eagle: bool) -> int:
    """Contiguous cached blocks a sliding-window hit needs: those holding the
    ``sliding_window - 1`` tokens before the next token; EAGLE matches one more.

    pre: sliding_window >= 1 and block_size >= 1
    post: (__return__ - use_eagle) * block_size >= sliding_window - 1
    post: (__return__ - use_eagle - 1) * block_size < sliding_window - 1
    """
    return cdiv(sliding_window - 1, block_size) + use_eagle


def sliding_window_reachable_mask(start_block: int, end_block: int, num_needed: int,
                                  per_segment: int, use_eagle: bool) -> list[bool] | None:
    """Which of blocks ``[start_block, end_block)`` a hit can read: hits end on segment
    boundaries (one block further with EAGLE) and read the ``num_needed`` blocks before
    the end. None when that is every block.

    pre: 0 <= start_block and num_needed >= 0 and per_segment >= 1
    post: (__return__ is None) == (num_needed >= per_segment)
    post: __return__ is None or len(__return__) == max(0, end_block - start_block)
    post: __return__ is None or _reads(__return__, start_block, num_needed, per_segment, use_eagle)
    """
    if num_needed >= per_segment:
        return None
    shift = int(use_eagle)
    return [i >= shift and (i - shift) % per_segment >= per_segment - num_needed
            for i in range(start_block, end_block)]


def _reads(mask: list[bool], start_block: int, num_needed: int, per_segment: int,
           use_eagle: bool) -> bool:
    """Whether ``mask[k]`` says exactly if a hit ending at a segment boundary ``e`` reads
    block ``start_block + k``; that hit reads ``[e - num_needed + use_eagle, e + use_eagle)``."""
    return all(m == any(e - num_needed + use_eagle <= block < e + use_eagle
                        for e in range(per_segment, block + num_needed + per_segment + 1,
                                       per_segment))
               for block, m in enumerate(mask, start_block))


def replay_boundaries(num_prompt_tokens: int, block: int, use_eagle: bool) -> tuple[int, ...]:
    """Where replays of the prompt resume (vLLM 0.33.0): one token short of the prompt;
    with EAGLE, one scheduler ``block`` below a resend's hit (the prompt less one token,
    rounded down) and below a longer sibling's (the prompt rounded down), at least 0.

    pre: num_prompt_tokens >= 1 and block >= 1
    post: list(__return__) == sorted(set(__return__))
    post: all(0 <= b < num_prompt_tokens for b in __return__)
    """
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    resend = (num_prompt_tokens - 1) // block * block
    extension = num_prompt_tokens // block * block
    return tuple(sorted({max(resend - block, 0), max(extension - block, 0)}))


def sliding_window_retention_mask(start_block: int, end_block: int, num_needed: int,
                                  block_size: int, alignment_tokens: int, retention_interval: int,
                                  boundaries: Sequence[int], use_eagle: bool
                                  ) -> list[bool] | None:
    """Sparse retention of a sliding window: ``sliding_window_reachable_mask`` with
    segments of ``retention_interval`` tokens (no segments for 0), plus the window's
    blocks before each of ``boundaries`` rounded down to ``alignment_tokens`` (shifted
    one block with EAGLE). None when that is every block."""
    mask: list[bool] | None = [False] * max(0, end_block - start_block)
    if retention_interval != 0:
        mask = sliding_window_reachable_mask(start_block, end_block, num_needed,
                                             retention_interval // block_size, use_eagle)
    if mask is None:
        return mask
    for boundary in boundaries:
        end = boundary // alignment_tokens * alignment_tokens // block_size + int(use_eagle)
        for block in range(start_block, end_block):
            mask[block - start_block] |= end - num_needed <= block < end
    return mask


def mamba_retention_mask(start_block: int, end_block: int, block_size: int,
                         alignment_tokens: int, retention_interval: int,
                         boundaries: Sequence[int]) -> list[bool] | None:
    """Sparse retention of Mamba states (block ``i`` ends at token ``(i+1)*block_size``):
    the states ending on a multiple of ``retention_interval`` (none for 0) and, for each
    of ``boundaries`` rounded down to ``alignment_tokens``, the last whole block's state
    before it. None when the interval is at most one block."""
    if retention_interval != 0 and retention_interval // block_size <= 1:
        return None
    kept = [b // alignment_tokens * alignment_tokens // block_size - 1 for b in boundaries]
    return [(retention_interval != 0 and (block + 1) * block_size % retention_interval == 0)
            or block in kept for block in range(start_block, end_block)]


# ---------------------------------------------------------------- hit searches


def align_num_hit_blocks(num_blocks: int, block_size: int, alignment_tokens: int) -> int:
    """The longest prefix of ``num_blocks`` hit blocks that ends on an alignment boundary.

    pre: num_blocks >= 0 and block_size >= 1 and alignment_tokens >= 1
    post: 0 <= __return__ <= num_blocks
    post: _aligned(__return__, block_size, alignment_tokens)
    post: all(m * block_size % alignment_tokens for m in range(__return__ + 1, num_blocks + 1))
    """
    while block_size != alignment_tokens and num_blocks * block_size % alignment_tokens:
        num_blocks -= 1
    return num_blocks


def full_attention_hit_num_blocks(block_hashes: Sequence[H], cached: Container[H],
                                  max_num_blocks: int, drop_eagle_block: bool, block_size: int,
                                  alignment_tokens: int) -> int:
    """Full attention: the leading cached blocks (the hash chain makes the first miss
    final), less the EAGLE block, aligned.

    pre: max_num_blocks >= 0 and block_size >= 1 and alignment_tokens >= 1
    post: 0 <= __return__ <= min(max_num_blocks, len(block_hashes))
    post: _all_cached(block_hashes, cached, 0, __return__)
    post: _aligned(__return__, block_size, alignment_tokens)
    post: not any(_aligned(m, block_size, alignment_tokens) and _all_cached(block_hashes, cached, 0, m + drop_eagle_block) for m in range(__return__ + 1, min(max_num_blocks, len(block_hashes)) - drop_eagle_block + 1))
    """  # noqa: E501
    num_blocks = 0
    for block_hash in itertools.islice(block_hashes, max_num_blocks):
        if block_hash not in cached:
            break
        num_blocks += 1
    if drop_eagle_block and num_blocks:
        num_blocks -= 1
    return align_num_hit_blocks(num_blocks, block_size, alignment_tokens)


def sliding_window_hit_range(block_hashes: Sequence[H], cached: Container[H],
                             max_num_blocks: int, num_needed: int, drop_eagle_block: bool,
                             block_size: int, alignment_tokens: int) -> tuple[int, int]:
    """Sliding window: ``(first, num_blocks)``, the hit is ``num_blocks`` blocks whose
    ``[first, num_blocks)`` are cached and the rest null. Scans right to left for the
    last run of ``num_needed`` cached blocks that ends where an aligned hit can; a
    shorter run from block 0 also counts. EAGLE drops the last block.

    pre: 0 <= max_num_blocks <= len(block_hashes) and num_needed >= 0
    pre: block_size >= 1 and alignment_tokens >= 1
    post: 0 <= __return__[0] <= __return__[1] <= max_num_blocks
    post: _all_cached(block_hashes, cached, __return__[0], __return__[1])
    post: _aligned(__return__[1], block_size, alignment_tokens)
    post: __return__[0] == 0 or __return__[1] - __return__[0] + drop_eagle_block >= num_needed
    """
    run = 0
    for i in reversed(range(max_num_blocks)):
        if block_hashes[i] not in cached:
            run = 0
            continue
        end = i if drop_eagle_block else i + 1  # the hit's length in blocks after the drop
        if run == 0 and block_size != alignment_tokens and end * block_size % alignment_tokens:
            continue
        run += 1
        if run >= num_needed:
            first, num_blocks = i, i + run
            break
    else:
        first, num_blocks = 0, align_num_hit_blocks(run, block_size, alignment_tokens)
    if drop_eagle_block and num_blocks:
        num_blocks = align_num_hit_blocks(num_blocks - 1, block_size, alignment_tokens)
    return min(first, num_blocks), num_blocks


def chunked_local_hit_range(block_hashes: Sequence[H], cached: Container[H], max_length: int,
                            chunk_size: int, block_size: int) -> tuple[int, int]:
    """Chunked local attention: ``(first, num_blocks)``: blocks before the chunk of
    token ``max_length`` are null, the chunk's own blocks hit left to right.

    pre: max_length >= 0 and chunk_size >= 1 and block_size >= 1
    pre: max_length // block_size <= len(block_hashes)
    post: 0 <= __return__[0] <= __return__[1] <= max_length // block_size
    post: __return__[0] * block_size <= max_length // chunk_size * chunk_size
    post: _all_cached(block_hashes, cached, __return__[0], __return__[1])
    post: __return__[1] == max_length // block_size or block_hashes[__return__[1]] not in cached
    """
    first = max(max_length, 0) // chunk_size * chunk_size // block_size
    num_blocks = first
    for i in range(first, max_length // block_size):
        if block_hashes[i] not in cached:
            break
        num_blocks += 1
    return first, num_blocks


def mamba_hit_num_blocks(block_hashes: Sequence[H], cached: Container[H], max_num_blocks: int,
                         block_size: int, alignment_tokens: int) -> int:
    """Mamba: the hit ends at the last cached state on an aligned boundary (0: none).

    pre: 0 <= max_num_blocks <= len(block_hashes)
    pre: block_size >= 1 and alignment_tokens >= 1
    post: 0 <= __return__ <= max_num_blocks
    post: __return__ == 0 or block_hashes[__return__ - 1] in cached
    post: _aligned(__return__, block_size, alignment_tokens)
    post: not any(block_hashes[m - 1] in cached and _aligned(m, block_size, alignment_tokens) for m in range(__return__ + 1, max_num_blocks + 1))
    """  # noqa: E501
    for i in reversed(range(max_num_blocks)):
        if block_hashes[i] in cached and (block_size == alignment_tokens
                                          or (i + 1) * block_size % alignment_tokens == 0):
            return i + 1
    return 0


def num_tokens_to_cache(num_computed_tokens: int, scheduler_block_size: int, block_size: int,
                        use_eagle: bool, num_reprefillable_tokens: int = 0) -> int:
    """Hybrid caching: up to the last scheduler-block boundary (hits end only there);
    an EAGLE group one block further, since its hits look one block past a boundary,
    counted from the tokens whose KV is final: all but the last
    ``num_reprefillable_tokens`` (0.33.0's prefill lookahead re-computes those).

    pre: num_computed_tokens >= 0 and scheduler_block_size >= 1 and block_size >= 1
    pre: num_reprefillable_tokens >= 0
    post: __return__ <= num_computed_tokens
    post: num_reprefillable_tokens > 0 or 0 <= __return__ - _align_down(num_computed_tokens, scheduler_block_size) <= block_size
    post: use_eagle or __return__ % scheduler_block_size == 0
    post: not use_eagle or __return__ == 0 or __return__ <= num_computed_tokens - num_reprefillable_tokens
    """  # noqa: E501
    if not use_eagle or num_computed_tokens < scheduler_block_size:
        return _align_down(num_computed_tokens, scheduler_block_size)
    final = max(0, num_computed_tokens - num_reprefillable_tokens)
    return min(final, _align_down(final, scheduler_block_size) + block_size)


# ---------------------------------------------------------------- admission


def admits(num_blocks: int, num_free_blocks: int, num_reserved_blocks: int,
           num_watermark_blocks: int) -> bool:
    """``allocate_slots``' gate: the free queue can give ``num_blocks`` and still keep
    the blocks reserved for other in-flight requests and the watermark.

    pre: num_free_blocks >= 0 and num_reserved_blocks >= 0 and num_watermark_blocks >= 0
    post: __return__ == (num_free_blocks - num_blocks >= num_reserved_blocks + num_watermark_blocks)
    post: not __return__ or num_blocks <= num_free_blocks
    """
    return num_blocks + num_watermark_blocks <= num_free_blocks - num_reserved_blocks
