"""Side-by-side timing of the hit path and of request hashing (issue 28).

``python scripts/hit_bench.py [--blocks N] [--requests K] [--repetitions R]
[--impls kvcache,kvcache-pure,vllm] [--only hit|hash]``

- ``hit``: a prefix of ``N`` (default 1,024) cached full blocks (block size 16,
  full attention, sha256, a 4,096-block pool) looked up by ``K`` requests in turn,
  each ``get_computed_blocks`` then ``allocate_slots`` of its 8-token tail (the hit
  adopted) then ``free``: the median time of one such lookup, and the median
  time of hashing one of those requests' blocks (their ``block_hasher`` over the
  whole prompt), per implementation.
- ``hash``: one request hasher per hash function (sha256, sha256_cbor, xxhash,
  xxhash_cbor) and per set of extra keys (none, LoRA, cache salt, multimodal
  items, all three) over a 16,392-token prompt, the fastest of ``--copies``
  requests; the hashes must be identical across implementations.

Every implementation runs in one process, in alternating order per repetition;
the ratios ``other / kvcache`` are per repetition (median, min-max). The
results of the managers (block ids, hit lengths) and the hashes must agree
across implementations, or the script fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcache.kit.config import ManagerConfig
from kvcache.kit.sides import Adapter, resolve_adapter
from kvcache.kit.workloads import GroupLayout, Workload

BLOCK = 16
TAIL = 8
HASH_FNS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
EXTRA_KEYS: dict[str, dict[str, Any]] = {
    "none": {},
    "lora": {"lora": ["adapter-a", 1]},
    "salt": {"cache_salt": "salt-1"},
    "mm": {"mm_features": [["img-0", 40, 300], ["img-1", 2000, 600], ["img-2", 9000, 90]]},
    "all": {
        "lora": ["adapter-a", 1],
        "cache_salt": "salt-1",
        "mm_features": [["img-0", 40, 300], ["img-1", 2000, 600]],
    },
}


def _config(num_blocks: int, prompt_blocks: int) -> ManagerConfig:
    workload = Workload(
        name="hit-heavy",
        num_blocks=num_blocks,
        groups=(GroupLayout("full", BLOCK),),
        max_model_len=(prompt_blocks + 8) * BLOCK,
        token_budget=(prompt_blocks + 8) * BLOCK,
        max_num_seqs=16,
        requests=(),
    )
    return ManagerConfig.from_workload(workload)


def _prompt(prompt_blocks: int, tail_seed: int) -> list[int]:
    prefix = [(i * 7919) % 32000 for i in range(prompt_blocks * BLOCK)]
    return prefix + [(tail_seed * 31 + j) % 32000 for j in range(TAIL)]


def _args(request_id: str, prompt: list[int], extra: dict[str, Any]) -> dict[str, Any]:
    return {"request_id": request_id, "prompt_token_ids": prompt, "max_tokens": 16, **extra}


def hit_run(adapter: Adapter, prompt_blocks: int, num_requests: int) -> tuple[float, float, str]:
    """Median seconds of one lookup cycle and of hashing one request, and a digest of
    the lookups' results."""
    config = _config(4096, prompt_blocks)
    adapter.init_hashes(config, "0")
    manager = adapter.build_manager(config)
    prompts = [_prompt(prompt_blocks, i) for i in range(num_requests + 1)]
    requests = [adapter.build_request(config, _args(f"r{i}", p, {})) for i, p in enumerate(prompts)]
    hasher = requests[0]._block_hasher  # vLLM's Request and kvcache's keep it there
    for request in requests:
        request.block_hashes.clear()
    sha = hashlib.sha256()
    perf = time.perf_counter
    hash_times = timed_hashing(requests, hasher)
    manager_times: list[float] = []
    gc.collect()
    gc.freeze()
    try:
        for request in requests:
            t = perf()
            hits, num_hit = manager.get_computed_blocks(request)
            out = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits)
            ids = out.get_block_ids()
            manager.free(request)
            manager_times.append(perf() - t)
            sha.update(f"{num_hit}:{ids}".encode())
    finally:
        gc.unfreeze()
    # The first request cached the prefix: its time is not a hit's. Medians: on a
    # shared machine a descheduled call would outweigh many.
    return statistics.median(manager_times[1:]), statistics.median(hash_times), sha.hexdigest()


def timed_hashing(requests: list[Any], hasher: Any) -> list[float]:
    """Seconds each request's ``hasher`` takes to hash it (the collector frozen meanwhile,
    so a collection does not land in one request's time); fills ``block_hashes``."""
    perf = time.perf_counter
    times: list[float] = []
    gc.collect()
    gc.freeze()
    try:
        for request in requests:
            t = perf()
            request.block_hashes.extend(hasher(request))
            times.append(perf() - t)
    finally:
        gc.unfreeze()
    return times


def hash_run(
    adapter: Adapter, hash_fn: str, extra: dict[str, Any], copies: int
) -> tuple[float, str]:
    """Seconds to hash one request of 1,024 blocks (the fastest of ``copies``), and a
    digest of the hashes."""
    config = dataclasses.replace(_config(4096, 1024), hash_fn=hash_fn)
    adapter.init_hashes(config, "0")
    requests = [
        adapter.build_request(config, _args(f"h{i}", _prompt(1024, 0), extra))
        for i in range(copies)
    ]
    hasher = requests[0]._block_hasher
    expected = list(requests[0].block_hashes)
    for request in requests:
        request.block_hashes.clear()
    times = timed_hashing(requests, hasher)
    seconds = min(times)  # the fastest copy: the least disturbed by the machine's load
    if requests[0].block_hashes != expected:
        raise AssertionError(f"{adapter.name}: the hasher disagrees with the request's hashes")
    sha = hashlib.sha256()
    for h in expected:
        sha.update(h if isinstance(h, bytes) else repr(h).encode())
    return seconds, sha.hexdigest()


def _ratios(times: dict[str, list[float]], base: str) -> str:
    parts = []
    for impl, values in times.items():
        if impl == base:
            continue
        rs = [x / y for x, y in zip(values, times[base], strict=True)]
        parts.append(f"{impl}/{base} {statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})")
    return ", ".join(parts)


def _alternate(
    impls: list[str], repetitions: int, fn: Callable[[str, int], tuple[list[float], str]]
) -> tuple[list[dict[str, list[float]]], dict[str, str]]:
    series: list[dict[str, list[float]]] = []
    digests: dict[str, str] = {}
    for rep in range(repetitions):
        for impl in impls if rep % 2 == 0 else impls[::-1]:
            values, digest = fn(impl, rep)
            while len(series) < len(values):
                series.append({i: [] for i in impls})
            for k, v in enumerate(values):
                series[k][impl].append(v)
            digests[impl] = digest
    if len(set(digests.values())) != 1:
        raise AssertionError(f"implementations disagree: {digests}")
    return series, digests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--copies", type=int, default=5)
    parser.add_argument("--impls", default="kvcache,kvcache-pure,vllm")
    parser.add_argument("--only", choices=("hit", "hash"), default=None)
    parser.add_argument("--hash-fns", default=",".join(HASH_FNS))
    parser.add_argument("--extra-keys", default=",".join(EXTRA_KEYS))
    args = parser.parse_args(argv)
    import kvcache

    impls = args.impls.split(",")
    adapters = {name: resolve_adapter(name) for name in impls}
    print(f"kvcache compiled={kvcache.COMPILED} ({kvcache.__file__})")
    if args.only in (None, "hit"):

        def hit(impl: str, rep: int) -> tuple[list[float], str]:
            manager, hashing, digest = hit_run(adapters[impl], args.blocks, args.requests)
            return [manager, hashing, manager + hashing], digest

        series, _ = _alternate(impls, args.repetitions, hit)
        per_hit = {
            i: statistics.median(v) / args.blocks * 1e6
            for i, v in series[0].items()
        }
        print(
            f"== hit-heavy: {args.blocks} cached blocks, {args.requests} lookups, "
            "outputs identical; us per hit block (manager): "
            + ", ".join(f"{i} {v:.3f}" for i, v in per_hit.items())
        )
        for label, times in zip(("manager", "hashing", "sum"), series, strict=True):
            print(f"  {label:<8} {_ratios(times, 'kvcache')}")
    if args.only in (None, "hash"):
        for hash_fn in args.hash_fns.split(","):
            for key in args.extra_keys.split(","):

                def hashing(impl: str, rep: int, fn: str = hash_fn, k: str = key) -> Any:
                    seconds, digest = hash_run(adapters[impl], fn, EXTRA_KEYS[k], args.copies)
                    return [seconds], digest

                series, _ = _alternate(impls, args.repetitions, hashing)
                print(
                    f"== hashing {hash_fn:<12} extra={key:<5} hashes identical; "
                    f"{_ratios(series[0], 'kvcache')}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
