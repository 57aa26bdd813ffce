"""The kernels' index arithmetic in plain Python ints, where CrossHair can reach it.

``kernels/`` imports torch and triton, so its formulas are restated here, one function
each, with their contracts (PEP 316 ``pre:``/``post:``):

* ``slot``: vLLM's slot of token ``pos``,
  ``block_table[pos // block_size] * block_size + pos % block_size``;
* ``map_to_kernel_blocks``: ``BlockTable.map_to_kernel_blocks``, each manager block
  split into ``blocks_per_manager_block`` consecutive kernel blocks;
* ``reference_slot``: ``kernels/reference.py``'s ``slot_mapping_ref`` (split, then slot);
* ``kernel_slot``: ``kernels/slot_mapping.py``'s ``slot_mapping_kernel`` (no split table);
* ``live_token_slot`` and ``share_slot``: the safety facts the manager relies on.

``proofs/manifest.py`` pairs ``reference_slot`` with ``kernel_slot`` for
``crosshair diffbehavior``; ``proofs/exhaustive.py`` applies ``live_token_slot`` and
``share_slot`` to the managers' real block tables.
"""

from __future__ import annotations

PAD_SLOT_ID = -1
"""The slot of a padding token (``kv_write`` skips it)."""


def slot(block_table: list[int], pos: int, block_size: int) -> int:
    """The cache slot of token ``pos`` of a request with this block table.

    pre: block_size >= 1
    pre: 0 <= pos < len(block_table) * block_size
    post: __return__ // block_size == block_table[pos // block_size]
    post: __return__ % block_size == pos % block_size
    """
    return block_table[pos // block_size] * block_size + pos % block_size


def live_token_slot(block_table: list[int], pos: int, block_size: int, num_blocks: int) -> int:
    """The slot of a live token: one whose block is a pool block other than the null
    block 0. It lies inside the pool and outside the null block.

    pre: block_size >= 1 and num_blocks >= 2
    pre: 0 <= pos < len(block_table) * block_size
    pre: 0 < block_table[pos // block_size] < num_blocks
    post: block_size <= __return__ < num_blocks * block_size
    """
    return slot(block_table, pos, block_size)


def share_slot(table_a: list[int], pos_a: int, table_b: list[int], pos_b: int,
               block_size: int) -> bool:
    """Whether two tokens (of one request or two) write the same slot: exactly when
    they sit at the same offset of the same block.

    pre: block_size >= 1
    pre: 0 <= pos_a < len(table_a) * block_size and 0 <= pos_b < len(table_b) * block_size
    post: __return__ == _same_block_and_offset(table_a, pos_a, table_b, pos_b, block_size)
    """
    return slot(table_a, pos_a, block_size) == slot(table_b, pos_b, block_size)


def _same_block_and_offset(table_a: list[int], pos_a: int, table_b: list[int], pos_b: int,
                           block_size: int) -> bool:
    """Whether the tokens share a block and an offset in it (contract helper)."""
    return (table_a[pos_a // block_size] == table_b[pos_b // block_size]
            and pos_a % block_size == pos_b % block_size)


def map_to_kernel_blocks(block_ids: list[int], blocks_per_manager_block: int) -> list[int]:
    """Each manager block id ``b`` becomes kernel blocks ``b * n .. b * n + n - 1``
    (``n = blocks_per_manager_block``), in order.

    pre: blocks_per_manager_block >= 1
    post: len(__return__) == len(block_ids) * blocks_per_manager_block
    post: _splits(block_ids, blocks_per_manager_block, __return__)
    """
    return [block_id * blocks_per_manager_block + i
            for block_id in block_ids for i in range(blocks_per_manager_block)]


def _splits(block_ids: list[int], n: int, kernel_ids: list[int]) -> bool:
    """Whether kernel block ``k`` is part ``k % n`` of manager block ``k // n`` (helper)."""
    return all(kernel_id // n == block_ids[k // n] and kernel_id % n == k % n
               for k, kernel_id in enumerate(kernel_ids))


def reference_slot(block_table: list[int], pos: int, manager_block_size: int,
                   kernel_block_size: int) -> int:
    """vLLM's CPU formula (``slot_mapping_ref``): split the table into kernel blocks,
    then take the slot at the kernel block size. Splitting moves no token.

    pre: kernel_block_size >= 1 and manager_block_size % kernel_block_size == 0
    pre: 0 <= pos < len(block_table) * manager_block_size
    post: __return__ == slot(block_table, pos, manager_block_size)
    """
    kernel_table = map_to_kernel_blocks(block_table, manager_block_size // kernel_block_size)
    return slot(kernel_table, pos, kernel_block_size)


def kernel_slot(block_table: list[int], pos: int, manager_block_size: int,
                kernel_block_size: int) -> int:
    """The Triton kernel's formula (``slot_mapping_kernel``): the kernel block from the
    manager block id and the offset in it, without a split table.

    pre: kernel_block_size >= 1 and manager_block_size % kernel_block_size == 0
    pre: 0 <= pos < len(block_table) * manager_block_size
    post: __return__ == slot(block_table, pos, manager_block_size)
    """
    blocks_per_manager_block = manager_block_size // kernel_block_size
    manager_block_id = block_table[pos // manager_block_size]
    kernel_block_id = (manager_block_id * blocks_per_manager_block
                       + pos % manager_block_size // kernel_block_size)
    return kernel_block_id * kernel_block_size + pos % kernel_block_size


def padded_slot_mapping(positions: list[int], query_start_loc: list[int],
                        block_table: list[list[int]], block_size: int) -> list[int]:
    """Slots of a batch: request ``r`` owns tokens ``query_start_loc[r]`` to
    ``query_start_loc[r + 1]``; the tokens after the last request are padding.

    pre: block_size >= 1 and len(query_start_loc) == len(block_table) + 1
    pre: query_start_loc[0] == 0 and query_start_loc[-1] <= len(positions)
    pre: all(a <= b for a, b in zip(query_start_loc, query_start_loc[1:]))
    pre: _positions_in_tables(positions, query_start_loc, block_table, block_size)
    post: len(__return__) == len(positions)
    post: all(s == PAD_SLOT_ID for s in __return__[query_start_loc[-1]:])
    post: all(s >= 0 for s in __return__[:query_start_loc[-1]]) or _has_negative(block_table)
    """
    slots = [PAD_SLOT_ID] * len(positions)
    for req_idx, table in enumerate(block_table):
        for token_idx in range(query_start_loc[req_idx], query_start_loc[req_idx + 1]):
            slots[token_idx] = slot(table, positions[token_idx], block_size)
    return slots


def _positions_in_tables(positions: list[int], query_start_loc: list[int],
                         block_table: list[list[int]], block_size: int) -> bool:
    """Whether every scheduled token's position is covered by its request's table."""
    return all(0 <= positions[t] < len(table) * block_size
               for r, table in enumerate(block_table)
               for t in range(query_start_loc[r], query_start_loc[r + 1]))


def _has_negative(block_table: list[list[int]]) -> bool:
    """Whether some table holds a negative id (then slots may be negative)."""
    return any(b < 0 for table in block_table for b in table)
