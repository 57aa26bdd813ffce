"""Instructions per manager call of the compiled build, counted with callgrind
(instruction counts do not change with the machine's load, as timings do).

``python scripts/callgrind_calls.py [SHAPE ...]`` runs this script under
``valgrind --tool=callgrind`` (``setarch -R``: no address randomisation; a fixed
environment, ``PYTHONHASHSEED=0``) twice per shape and layout, making ``N`` and
then ``2N`` calls of the shape, with collection on only inside the compiled
entry point of the method (``--toggle-collect`` on its mypyc wrapper,
``CPyPy_...``: the argument parsing of a Python-level call is counted, the
harness is not), and prints ``(Ir(2N) - Ir(N)) / N``, so one-off costs (the
first allocation, warm caches) cancel out: the minimum over ``LAYOUTS``, then
each layout's figure. The pure build has no such symbol: run it on a compiled
build (``setup.py build_ext --inplace``). The script imports the kvcache of the
checkout it lies in.

Shapes (full attention, block size 16, 4,096-block pool, prefix caching on):

- ``decode``: ``allocate_slots(request, 1, ...)`` with every keyword argument,
  as the bench passes them (``kvcache.kit.sides``), one decode step each (a new
  block, and one cached, every 16th step);
- ``hit``: ``get_computed_blocks`` of a 37-block cached prefix;
- ``admit``: ``allocate_slots`` adopting that 37-block hit plus one new token;
- ``free``: ``free`` of that admitted request;
- ``hybrid-decode``, ``hybrid-hit``: ``decode`` and ``hit`` with a sliding
  window of 64 tokens (block size 16) beside full attention;
- ``hit-1k``, ``admit-1k``, ``free-1k``: ``hit``, ``admit`` and ``free`` of a
  1,024-block cached prefix (issue 28's hit-heavy lookups), ``LONG_CALLS`` calls.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcache import BlockHash, KVCacheBlocks, KVCacheManager, KVCacheSpec, Request

# The checkout's own kvcache (a script's sys.path starts at scripts/, which would
# leave the import to whatever build the environment has installed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CALLS = 256
"""``N``: a multiple of 16, so the decode window holds whole blocks (16 new ones)."""
LAYOUTS = (0, 100, 1000)
"""Bytes of padding in the measured process's environment, one pair of runs each.
Counts are exact for one layout, but a layout can put two hot attribute names in
one slot of CPython's type-attribute cache: e.g. decode took 5,640 instructions a
call with 7 of 8 paddings tried and 5,951 (a cache miss a call) with the 8th. The
minimum over the layouts is the figure reported."""
LONG_CALLS = 32
"""``N`` of the ``-1k`` shapes (a call there costs ~30 short ones)."""
SHAPES = (
    "decode",
    "hit",
    "admit",
    "free",
    "hybrid-decode",
    "hybrid-hit",
    "hit-1k",
    "admit-1k",
    "free-1k",
)


def _prompt(num_blocks: int) -> list[int]:
    """``num_blocks`` full blocks and one token: the hit shapes find them cached
    (37 blocks; 1,024 for the ``-1k`` shapes)."""
    return [i % 50_000 for i in range(num_blocks * 16 + 1)]


PROMPT = _prompt(37)
_HASHES: dict[int, list[BlockHash]] = {}
"""The block hashes of ``_prompt(n)``, made once: a request copies them."""


def _manager(hybrid: bool, max_model_len: int = 8192) -> KVCacheManager:
    """Full attention, with ``hybrid`` a sliding window of 64 tokens beside it."""
    import kvcache

    kvcache.init_none_hash(kvcache.sha256)  # seeded by PYTHONHASHSEED (``_collected``)
    specs: list[KVCacheSpec] = [
        kvcache.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float16")
    ]
    if hybrid:
        specs.append(
            kvcache.SlidingWindowSpec(
                block_size=16, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=64
            )
        )
    groups = [kvcache.KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
    config = kvcache.KVCacheConfig(4096, [], groups)
    return kvcache.KVCacheManager(
        config,
        max_model_len=max_model_len,
        scheduler_block_size=16,
        hash_block_size=16,
        enable_caching=True,
    )


def _request(rid: str, num_blocks: int = 37) -> Request:
    """A request for ``_prompt(num_blocks)``, its block hashes computed (outside any
    count); for the 1,024-block prompt computed once and copied (as new objects,
    like a request's own hashes: a dict finds an identical key without comparing)."""
    import kvcache

    hasher = kvcache.get_request_block_hasher(16, kvcache.sha256)
    if num_blocks == 37:
        return kvcache.Request(rid, list(PROMPT), block_hasher=hasher)
    prompt = _prompt(num_blocks)
    if num_blocks not in _HASHES:
        _HASHES[num_blocks] = kvcache.Request(rid, prompt, block_hasher=hasher).block_hashes
    request = kvcache.Request(rid, prompt)
    copies = (kvcache.BlockHash(bytes(memoryview(h))) for h in _HASHES[num_blocks])
    request.block_hashes.extend(copies)
    return request


def _alloc(
    manager: KVCacheManager,
    request: Request,
    num_new: int,
    num_hit: int = 0,
    hits: KVCacheBlocks | None = None,
) -> KVCacheBlocks | None:
    """allocate_slots with the bench's call shape (every keyword argument)."""
    return manager.allocate_slots(
        request,
        num_new,
        num_new_computed_tokens=num_hit,
        new_computed_blocks=hits,
        num_lookahead_tokens=0,
        num_external_computed_tokens=0,
        delay_cache_blocks=False,
        num_encoder_tokens=0,
        full_sequence_must_fit=False,
        reserved_blocks=0,
        has_scheduled_reqs=True,
    )


def _shape(name: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """(prepare, call) for one measured call of ``name``; prepare runs outside
    the collection window."""
    blocks = 1024 if name.endswith("-1k") else 37
    manager = _manager(name.startswith("hybrid-"), 8192 if blocks == 37 else 32768)
    name = name.removeprefix("hybrid-")
    name = name.removesuffix("-1k")
    if name == "decode":
        running = _request("d")
        assert _alloc(manager, running, running.num_tokens) is not None
        steps = [0]

        def prepare() -> None:
            running.num_computed_tokens = running.num_tokens
            steps[0] += 1
            running.append_output_token_ids(steps[0] % 50_000)

        def call() -> None:
            assert _alloc(manager, running, 1) is not None

        return prepare, call
    # A cached prefix (the prompt's full blocks), its request freed.
    first = _request("first", blocks)
    assert _alloc(manager, first, first.num_tokens) is not None
    first.num_computed_tokens = first.num_tokens
    manager.free(first)
    made = [0]

    def fresh() -> Request:
        made[0] += 1
        return _request(f"r{made[0]}", blocks)

    if name == "hit":
        waiting = fresh()

        def call_hit() -> None:
            _, num_hit = manager.get_computed_blocks(waiting)
            assert num_hit == blocks * 16

        return (lambda: None), call_hit

    # admit: the request ``admit_prepare`` looked up, with its hit; then admitted.
    looked_up: list[tuple[Request, KVCacheBlocks, int]] = []
    admitted: list[Request] = []

    def admit_prepare() -> None:
        if admitted:
            manager.free(admitted.pop())
        request = fresh()
        looked_up.append((request, *manager.get_computed_blocks(request)))

    def admit_call() -> None:
        request, hits, num_hit = looked_up.pop()
        assert _alloc(manager, request, request.num_tokens - num_hit, num_hit, hits) is not None
        admitted.append(request)

    if name == "admit":
        return admit_prepare, admit_call

    def free_prepare() -> None:
        admit_prepare()
        admit_call()

    def free_call() -> None:
        manager.free(admitted.pop())

    return free_prepare, free_call


SYMBOLS = {
    "decode": "allocate_slots",
    "hit": "get_computed_blocks",
    "admit": "allocate_slots",
    "free": "free",
    "hybrid-decode": "allocate_slots",
    "hybrid-hit": "get_computed_blocks",
    "hit-1k": "get_computed_blocks",
    "admit-1k": "allocate_slots",
    "free-1k": "free",
}
"""The KVCacheManager method each shape counts."""


def measure(name: str, num_calls: int) -> None:
    """Make ``num_calls`` calls of shape ``name`` (collection is the caller's)."""
    prepare, call = _shape(name)
    gc.disable()  # a collection inside a counted call would add noise, not its cost
    for _ in range(num_calls):
        prepare()
        call()


def _collected(name: str, num_calls: int, python: str, layout: int = 0) -> int:
    """Instructions callgrind collects inside the shape's method over ``num_calls``,
    in a fixed environment padded by ``layout`` bytes (``LAYOUTS``)."""
    symbol = f"CPyPy_kv_cache_manager___KVCacheManager___{SYMBOLS[name]}"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = [
            *(["setarch", "-R"] if shutil.which("setarch") else []),  # fixed addresses
            "valgrind", "--tool=callgrind", "--collect-atstart=no",
            f"--toggle-collect={symbol}", f"--callgrind-out-file={out}",
            python, __file__, "--calls", str(num_calls), name,
        ]
        # A fixed hash seed: str hashes (request ids in dicts) probe alike each run,
        # and NONE_HASH, hence every block hash (the cache's dict keys), is fixed.
        # Nothing else of the caller's environment: its size and contents (PWD,
        # OLDPWD, ...) move heap objects, and with them the counts (``LAYOUTS``).
        env = {
            "PATH": os.environ.get("PATH", os.defpath),
            "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
            "KVCACHE_CALLGRIND_PAD": "x" * layout,
        }
        subprocess.run(cmd, check=True, capture_output=True, env=env)
        with open(out) as f:
            for line in f:
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
    raise RuntimeError(f"no totals in callgrind's output for {name!r}")


def per_layout(name: str, python: str = sys.executable) -> list[float]:
    """Instructions per call of shape ``name`` in each of ``LAYOUTS``: the difference
    of an ``N`` and a ``2 * N`` run, divided by ``N`` (``CALLS``, or ``LONG_CALLS``
    for the ``-1k`` shapes)."""
    n = LONG_CALLS if name.endswith("-1k") else CALLS
    return [
        (_collected(name, 2 * n, python, pad) - _collected(name, n, python, pad)) / n
        for pad in LAYOUTS
    ]


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--calls":
        measure(sys.argv[3], int(sys.argv[2]))
    else:
        import kvcache

        if not kvcache.COMPILED:
            sys.exit("kvcache is not compiled here: build it first (setup.py build_ext --inplace)")
        unknown = sorted(set(sys.argv[1:]) - set(SHAPES))
        if unknown:
            sys.exit(f"unknown shapes {unknown}: choose from {', '.join(SHAPES)}")
        for shape in sys.argv[1:] or SHAPES:
            counts = per_layout(shape)
            each = " / ".join(f"{c:,.0f}" for c in counts)
            print(f"{shape}: {min(counts):,.0f} instructions per call ({each})", flush=True)
