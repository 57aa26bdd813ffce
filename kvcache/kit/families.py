"""Layout families and random configs: what a random sequence's manager looks like.

``Family`` names the layout (group kinds, caching, EAGLE, lookahead, context
parallelism, the release it needs); ``FAMILIES`` lists them; ``random_config`` draws
a ``ManagerConfig`` of one. Part of ``kvcache.kit.driver``, which re-exports every
name.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from kvcache.kit.config import GroupConfig, ManagerConfig

# ---------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Family:
    """A family of random configs: the group layout and the knobs held fixed.

    ``kinds`` are layout tokens: full, swa, chunked, mamba-align, mamba-all,
    mamba-none, mamba (any mode), mamba-checkpoint ('align' with vLLM 0.33.0's prefill
    checkpoint blocks), cross, rswa (no sink: vLLM 0.25.1 cannot build
    a manager with a sink group). ``enable_caching`` / ``watermark``
    None: drawn at random. ``eagle``: probability of ``use_eagle``.
    ``mixed_block_sizes``: groups may have different block sizes.
    ``distinct_block_sizes``: every group has its own block size (the base times
    a shuffle of 1, 2, 4, ...), never all alike.
    ``retention``: draw a prefix-cache retention interval
    (``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``): 0 or k * scheduler_block_size.
    ``since``: the first vLLM release with the family's kinds (a family of a later
    release than 0.25.1, e.g. ring buffers, is not run against vLLM 0.25.1, which
    cannot build it: ``tests/conformance/test_conformance.py`` checks the refusal).
    ``lookahead``: draw vLLM 0.33.0's lookahead hashing (``num_hash_lookahead_tokens``
    0-3) and prefill lookahead (``num_prefill_lookahead`` 0-3, at most the scheduler
    block with an EAGLE group), last; only in families ``since`` 0.33.0.
    ``cp_geometry``: whose block geometry a one-group context-parallel config gets:
    "0.25.1" (a block spans ``block_size * dcp * pcp``, the config's own rule) or
    "0.33.0" (``block_size * dcp``: 0.33.0 refuses the 0.25.1 geometry under
    ``pcp > 1``), set as the scheduler and hash block; one config in
    ``1 / CP_GEOMETRY_KEPT`` keeps 0.25.1's, so refusals stay compared too.
    """

    name: str
    kinds: tuple[str, ...]
    enable_caching: bool | None = None
    watermark: float | None = None
    eagle: float = 0.15
    mixed_block_sizes: bool = True
    distinct_block_sizes: bool = False
    #: (dcp_world_size, pcp_world_size) choices; empty: no context parallelism.
    context_parallel: tuple[tuple[int, int], ...] = ()
    retention: bool = False
    since: str = "0.25.1"
    lookahead: bool = False
    cp_geometry: str = "0.25.1"


#: Every family the kit knows, by name (fuzz ``--layouts``; the conformance tests).
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("full", ("full",)),
        Family("full+full", ("full", "full")),
        Family("swa", ("swa",)),
        Family("chunked", ("chunked",)),
        Family("mamba", ("mamba",)),
        Family("full+swa", ("full", "swa")),
        Family("full+chunked", ("full", "chunked")),
        Family("full+mamba-align", ("full", "mamba-align")),
        Family("full+mamba-all", ("full", "mamba-all")),
        Family("full+mamba-none", ("full", "mamba-none")),
        Family("full+cross", ("full", "cross"), enable_caching=False),
        Family("full+swa+mamba", ("full", "swa", "mamba")),
        Family("full+swa+swa", ("full", "swa", "swa")),
        Family("swa+mamba", ("swa", "mamba")),
        Family("full+swa+cross", ("full", "swa", "cross"), enable_caching=False),
        Family("eagle-hybrid", ("full", "swa", "mamba-align"), eagle=1.0),
        # Three full-attention groups, each of its own block size: vLLM 0.25.1
        # trims only the first one's hits (docs/divergences.md #17).
        Family("full+full+full", ("full", "full", "full"), distinct_block_sizes=True),
        # Sparse retention: the interval thins out sliding-window and Mamba caching.
        Family("swa-retention", ("swa",), retention=True),
        Family("full+swa-retention", ("full", "swa"), retention=True),
        Family("full+mamba-align-retention", ("full", "mamba-align"), retention=True),
        Family("swa+mamba-retention", ("swa", "mamba"), retention=True),
        Family("full-dcp", ("full",), context_parallel=((2, 1), (4, 1), (1, 2), (2, 2))),
        # vLLM takes context parallelism with any layout when caching is off.
        Family(
            "hybrid-dcp",
            ("full", "swa", "chunked", "mamba"),
            enable_caching=False,
            context_parallel=((2, 1), (4, 1), (1, 2)),
        ),
        Family("mla", ("mla",)),
        Family("full+mla", ("full", "mla")),
        Family("full+swa-mla", ("full", "swa-mla")),
        Family("rswa", ("rswa",)),
        Family("full+rswa", ("full", "rswa")),
        Family("rswa+swa", ("rswa", "swa")),
        # Full attention under other spec classes: blocks reported for zeroing, events'
        # kinds (TurboQuant: full_attention; hidden states: mla_attention).
        Family("tq", ("tq",)),
        Family("full+hidden-state", ("full", "hidden-state")),
        # vLLM 0.33.0's ring buffer (CircularBufferSpec): one block per request, never
        # cached, left out of the hit search.
        Family("full+circular", ("full", "circular"), since="0.33.0"),
        Family("full+swa+circular", ("full", "swa", "circular"), since="0.33.0"),
        # vLLM 0.33.0's lookahead hashing and prefill lookahead (EAGLE / MTP drafters).
        # Not sliding window or Mamba alone: vLLM 0.33.0's hit search of those kinds
        # reads hashes up to the lookup length, past the fewer hashes lookahead leaves
        # (IndexError, in kvcache too); beside full attention its hit bounds theirs.
        # Mamba beside attention: the last families below.
        *(
            Family(name, kinds, eagle=0.3, since="0.33.0", lookahead=True)
            for name, kinds in (
                ("full-lookahead", ("full",)),
                ("full+swa-lookahead", ("full", "swa")),
                ("full+full-lookahead", ("full", "full")),
                ("full+chunked-lookahead", ("full", "chunked")),
            )
        ),
        # vLLM 0.33.0's Mamba prefill checkpoints: an 'align' group with checkpoint
        # blocks saves the state at a reusable position inside a long prefill chunk
        # (the scheduler then lets the chunk run past it), under dense, interval and
        # latest-only retention, with EAGLE often.
        Family("full+mamba-checkpoint", ("full", "mamba-checkpoint"), eagle=0.3, since="0.33.0"),
        Family(
            "full+mamba-checkpoint-retention",
            ("full", "mamba-checkpoint"),
            eagle=0.3,
            retention=True,
            since="0.33.0",
        ),
        Family("mamba-checkpoint", ("mamba-checkpoint",), eagle=0.3, since="0.33.0"),
        # A ring buffer beside Mamba 'align' with fine-grained hits: the partial-hit
        # rule reads only prefix-cacheable groups' managers, so the ring group is left
        # out of it (appended last: the other families keep their seeds).
        Family("full+circular+mamba", ("full", "circular", "mamba-align"), since="0.33.0"),
        # Lookahead beside Mamba 'align' (fine-grained hits, the prompt-tail state;
        # with prefill checkpoints too). The hash lookahead stays within the hash
        # block there: beyond it vLLM 0.33.0 keys an EAGLE request's prompt-tail
        # state past its hashes and asserts (docs/divergences.md, 0.33.0 doubt 7).
        *(
            Family(name, kinds, eagle=0.3, since="0.33.0", lookahead=True)
            for name, kinds in (
                ("full+mamba-align-lookahead", ("full", "mamba-align")),
                ("full+mamba-checkpoint-lookahead", ("full", "mamba-checkpoint")),
            )
        ),
        # Decode context parallelism beside Mamba 'align' with caching (0.33.0's
        # per-group geometry, ``dcp_sharded_geometry``: fine-grained hits at each group's
        # dcp-scaled block, the per-group connector lookup); 0.25.1 refuses these.
        *(
            Family(name, kinds, enable_caching=True, context_parallel=((2, 1), (4, 1)),
                   since="0.33.0")
            for name, kinds in (
                ("full+mamba-align-dcp", ("full", "mamba-align")),
                ("full+mamba-checkpoint-dcp", ("full", "mamba-checkpoint")),
            )
        ),
    ]
}


#: Under ``Family.cp_geometry`` "0.33.0", one context-parallel config in this many
#: keeps 0.25.1's block geometry (chosen from the config, not the draw's ``rng``).
CP_GEOMETRY_KEPT = 5


def release_cp_geometry(config: ManagerConfig, release: str) -> ManagerConfig:
    """``config`` (one group, context-parallel) with the scheduler and hash block of
    ``release``'s rule: 0.25.1's ``block_size * dcp * pcp`` (``config`` as it is) or
    0.33.0's ``block_size * dcp`` (pcp no longer scales a block).

    Raises:
        ValueError: an unknown ``release``.
    """
    if release not in ("0.25.1", "0.33.0"):
        raise ValueError(f"cp geometry release={release!r}; expected 0.25.1 or 0.33.0")
    if release == "0.25.1" or len(config.groups) != 1 or config.context_parallel == 1:
        return config
    if random.Random(f"cp geometry {config!r}").randrange(CP_GEOMETRY_KEPT) == 0:
        return config
    block = config.groups[0].block_size * config.dcp_world_size
    return replace(config, scheduler_block_size_override=block, hash_block_size_override=block)


def random_group(rng: random.Random, token: str, block_size: int, index: int) -> GroupConfig:
    heads = index + 1  # groups of one kind and block size still differ (vLLM needs that)
    if token == "swa":
        return GroupConfig(
            "sliding_window", block_size, sliding_window=rng.randint(1, 12), num_kv_heads=heads
        )
    if token == "chunked":
        return GroupConfig(
            "chunked_local", block_size, attention_chunk_size=rng.randint(1, 12), num_kv_heads=heads
        )
    if token == "mamba-checkpoint":
        return GroupConfig(
            "mamba",
            block_size,
            mamba_cache_mode="align",
            num_speculative_blocks=rng.choice([0, 0, 1, 2]),
            num_kv_heads=heads,
            num_prefill_checkpoint_blocks=rng.choice([1, 1, 2]),
            prefill_checkpoint_alignment=rng.choice([None, 1, 1, 2, 4]),
        )
    if token.startswith("mamba"):
        mode = token.partition("-")[2] or rng.choice(["none", "all", "align", "align"])
        return GroupConfig(
            "mamba",
            block_size,
            mamba_cache_mode=mode,
            num_speculative_blocks=rng.choice([0, 0, 1, 2]),
            num_kv_heads=heads,
        )
    if token == "cross":
        return GroupConfig("cross_attention", block_size, num_kv_heads=heads)
    if token == "swa-mla":
        return GroupConfig(
            "sliding_window_mla", block_size, sliding_window=rng.randint(1, 12), num_kv_heads=heads
        )
    if token == "mla":
        return GroupConfig("mla", block_size, num_kv_heads=heads)
    if token == "tq":
        return GroupConfig("tq_full", block_size, num_kv_heads=heads)
    if token == "hidden-state":
        return GroupConfig("hidden_state", block_size, num_kv_heads=heads)
    if token == "circular":
        return GroupConfig("circular", block_size, num_kv_heads=heads)
    if token == "rswa":  # short windows: decodes of a few tokens pass them
        return GroupConfig("rswa", block_size, rswa_window=rng.randint(1, 5), num_kv_heads=heads)
    return GroupConfig("full", block_size, num_kv_heads=heads)


def random_config(rng: random.Random, family: Family) -> ManagerConfig:
    """A small random config of ``family``: tiny pools and blocks, so that hits,
    evictions and preemptions happen.

    vLLM asserts on chunked local attention with EAGLE, or next to groups of
    other block sizes, when caching (docs/divergences.md); cross attention needs
    caching off: neither is generated.
    """
    kinds = family.kinds
    caching = family.enable_caching
    if caching is None:
        caching = rng.random() < 0.85
    if "cross" in kinds:
        caching = False
    watermark = family.watermark
    if watermark is None:
        watermark = rng.choice([0.0, 0.0, 0.1, 0.25])
    chunked_with_caching = caching and "chunked" in kinds
    if len(kinds) == 1:
        block_sizes = [rng.randint(1, 4)]
        num_blocks = rng.randint(2, 24)
    else:
        base = rng.choice([1, 2]) if family.mixed_block_sizes else rng.randint(1, 4)
        mixed = family.mixed_block_sizes and not chunked_with_caching and rng.random() < 0.6
        block_sizes = [base * (rng.choice([1, 2, 4]) if mixed else 1) for _ in kinds]
        if family.distinct_block_sizes:
            scales = [1 << i for i in range(len(kinds))]
            rng.shuffle(scales)
            block_sizes = [base * scale for scale in scales]
        num_blocks = rng.randint(3, 28) if rng.random() < 0.6 else rng.randint(30, 60)
    groups = [
        random_group(rng, t, b, i) for i, (t, b) in enumerate(zip(kinds, block_sizes, strict=True))
    ]
    eagle_ok = not chunked_with_caching
    if len(kinds) > 1 and eagle_ok and rng.random() < 0.2:
        groups = [
            GroupConfig(**{**g.__dict__, "is_eagle_group": rng.random() < 0.4}) for g in groups
        ]
    config = ManagerConfig(
        num_blocks=num_blocks,
        groups=tuple(groups),
        max_model_len=rng.choice([64, 64, rng.randint(6, 24)]),
        enable_caching=caching,
        watermark=watermark,
        log_stats=rng.random() < 0.9,
        enable_kv_cache_events=rng.random() < 0.9,
        use_eagle=eagle_ok and rng.random() < family.eagle,
        max_num_batched_tokens=rng.choice([None, 32]),
        hash_fn=rng.choice(["sha256", "sha256", "sha256", "sha256_cbor", "xxhash"]),
    )
    if family.context_parallel:  # drawn last: other families' draws stay as they were
        dcp, pcp = rng.choice(family.context_parallel)
        config = replace(config, dcp_world_size=dcp, pcp_world_size=pcp)
        config = release_cp_geometry(config, family.cp_geometry)
    if family.retention:  # drawn last: the other families' configs stay as they were
        interval = rng.choice([0, 0, 1, 2, 2, 3, 4]) * config.scheduler_block_size
        config = replace(config, prefix_cache_retention_interval=interval)
    if family.lookahead:  # drawn last too
        prefill = rng.choice([0, 0, 1, 2, 3])
        if config.enable_caching and config.has_eagle:
            prefill = min(prefill, config.scheduler_block_size)
        hash_lookahead = rng.choice([0, 1, 1, 2, 3])
        if any(kind.startswith("mamba") for kind in family.kinds):
            # vLLM 0.33.0 asserts beyond it (docs/divergences.md, 0.33.0 doubt 7)
            hash_lookahead = min(hash_lookahead, config.hash_block_size)
        config = replace(
            config,
            num_hash_lookahead_tokens=hash_lookahead,
            num_prefill_lookahead=prefill,
        )
    return config
