"""The intrusive free queue against a plain list: same order and count after any
sequence of operations, links consistent, and no operation walks the queue."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

NUM_BLOCKS = 12

op = st.one_of(
    st.tuples(st.just("popleft_n"), st.integers(0, 4)),
    st.tuples(st.just("remove"), st.integers(0, NUM_BLOCKS - 1)),
    st.tuples(st.just("append_n"), st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=4)),
    st.tuples(st.just("prepend_n"), st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=4)),
    st.tuples(st.just("popleft"), st.just(0)),
)


def linked_ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    """Walk the links both ways and check they agree."""
    forward = [b.block_id for b in queue.get_all_free_blocks()]
    backward = []
    block = queue.fake_free_list_tail.prev_free_block
    while block is not None and block is not queue.fake_free_list_head:
        backward.append(block.block_id)
        block = block.prev_free_block
    assert forward == backward[::-1]
    return forward


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=30))
def test_queue_matches_a_list(ops: list[tuple[str, object]]) -> None:
    blocks = [KVCacheBlock(i) for i in range(NUM_BLOCKS)]
    queue = FreeKVCacheBlockQueue(blocks)
    model = list(range(NUM_BLOCKS))
    for name, arg in ops:
        if name == "popleft_n":
            assert isinstance(arg, int)
            if arg > len(model):
                continue
            got = [b.block_id for b in queue.popleft_n(arg)]
            assert got == model[:arg]
            del model[:arg]
        elif name == "popleft":
            if not model:
                continue
            assert queue.popleft().block_id == model.pop(0)
        elif name == "remove":
            assert isinstance(arg, int)
            if arg not in model:
                continue
            queue.remove(blocks[arg])
            model.remove(arg)
        else:
            assert isinstance(arg, list)
            ids = [i for i in dict.fromkeys(arg) if i not in model]  # only blocks not queued
            chosen = [blocks[i] for i in ids]
            if name == "append_n":
                queue.append_n(chosen)
                model.extend(ids)
            else:
                queue.prepend_n(chosen)
                model[:0] = ids
        assert linked_ids(queue) == model
        assert queue.num_free_blocks == len(queue) == len(model)
        for block in blocks:
            assert (block in queue) == (block.block_id in model)


def test_queue_rejects_what_it_cannot_do() -> None:
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.popleft_n(3)
    try:
        queue.popleft()
    except ValueError as e:
        assert "No free blocks" in str(e)
    else:
        raise AssertionError("popleft on an empty queue must raise")
    try:
        queue.remove(blocks[0])
    except RuntimeError as e:
        assert "not in the free queue" in str(e)
    else:
        raise AssertionError("remove of a block not queued must raise")
    assert queue.num_free_blocks == 0 and queue.get_all_free_blocks() == []


touched: set[int] = set()


class TrackedBlock(KVCacheBlock):
    """A block that records every read or write of its queue links."""

    def __getattribute__(self, name: str) -> object:
        if name in ("prev_free_block", "next_free_block"):
            touched.add(object.__getattribute__(self, "block_id"))
        return object.__getattribute__(self, name)

    def __setattr__(self, name: str, value: object) -> None:
        if name in ("prev_free_block", "next_free_block"):
            touched.add(object.__getattribute__(self, "block_id"))
        object.__setattr__(self, name, value)


def test_operations_touch_only_the_blocks_they_move_and_their_neighbours() -> None:
    """Flat cost in pool size: every operation on a 2,000-block queue reads or
    writes the links of the blocks it moves, their neighbours and the sentinels
    (id -1) only; a walk or a rebuild would touch the far blocks."""
    blocks = [TrackedBlock(i) for i in range(2000)]
    queue = FreeKVCacheBlockQueue(list(blocks))
    queue.fake_free_list_head.block_id = queue.fake_free_list_tail.block_id = -1
    ops = [
        (lambda: queue.popleft_n(3), {0, 1, 2, 3}),
        (lambda: queue.remove(blocks[1000]), {999, 1000, 1001}),
        (lambda: queue.append_n([blocks[1], blocks[1000]]), {1999, 1, 1000}),
        (lambda: queue.prepend_n([blocks[0], blocks[2]]), {0, 2, 3}),
        (lambda: queue.popleft(), {0, 2}),
    ]
    for run, expected in ops:
        touched.clear()
        run()
        assert touched - {-1} <= expected, (touched, expected)
    assert [b.block_id for b in queue.get_all_free_blocks()][:2] == [2, 3]
    assert [b.block_id for b in queue.get_all_free_blocks()][-2:] == [1, 1000]
