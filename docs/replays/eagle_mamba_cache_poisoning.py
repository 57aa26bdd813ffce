"""Replay: full attention + Mamba with use_eagle=True and no group flagged.

vLLM 0.25.1 then treats every group as an EAGLE group; Mamba's hit search
ignores the EAGLE drop while the coordinator widens its search by one block, so
the agreed hit (12 tokens) is longer than the full-attention hit blocks (8
tokens). allocate_slots puts a fresh block where the dropped one was and caches
it under that block's hash although its KV is never computed.

Run: .venv/bin/python docs/replays/eagle_mamba_cache_poisoning.py
(needs the reference: make conformance). Prints the same lines for vllm,
kvcache and spec.
"""

import os

os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch
import vllm.v1.core.kv_cache_utils as vku
import vllm.v1.kv_cache_interface as vki
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256 as vllm_sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
from vllm.v1.request import Request as VllmRequest

import kvcache as K
import spec as S

vku.init_none_hash(vllm_sha256)
K.init_none_hash(K.sha256)


def run(name, lib, manager_cls, make_request, hasher, dtype):
    groups = [
        lib.KVCacheGroupSpec(["full"], lib.FullAttentionSpec(block_size=4, num_kv_heads=1,
                                                             head_size=8, dtype=dtype)),
        lib.KVCacheGroupSpec(["mamba"], lib.MambaSpec(block_size=4, shapes=((2,),), dtypes=(dtype,),
                                                      mamba_cache_mode="all")),
    ]
    m = manager_cls(lib.KVCacheConfig(30, [], groups), 64, 4, 4, use_eagle=True)
    a = make_request("a", list(range(13)), hasher)
    m.allocate_slots(a, 13)
    m.free(a)
    m.new_step_starts()
    b = make_request("b", [*range(12), 99], hasher)
    hits, n = m.get_computed_blocks(b)
    print(f"{name:8} hit tokens={n} hit blocks={hits.get_block_ids()}")
    m.allocate_slots(b, 1, n, hits)
    print(f"{name:8} tables after allocate_slots: {m.get_block_ids('b')}")


run("vllm", vki, VllmManager,
    lambda rid, t, h: VllmRequest(rid, t, SamplingParams(max_tokens=4), None, block_hasher=h),
    vku.get_request_block_hasher(4, vllm_sha256), torch.float16)
for name, manager_cls in (("kvcache", K.KVCacheManager), ("spec", S.KVCacheManager)):
    run(name, K, manager_cls, lambda rid, t, h: K.Request(rid, t, block_hasher=h),
        K.get_request_block_hasher(4, K.sha256), "float16")
