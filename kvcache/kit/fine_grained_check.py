"""The kit's fine-grained-hit rule (``kvcache.kit.config.fine_grained_hits``) against
vLLM 0.33.0's own decision, over many random layouts.

The ledger and the driver read that rule off the config instead of asking kvcache
(so that they judge it), which leaves a second statement of vLLM's rule that can
drift. This check builds vLLM 0.33.0's real ``KVCacheManager`` for each layout and
compares the coordinator's verdict (``enable_partial_hash_hits``, which vLLM's
``partial_hash_hits_enabled`` decides with the groups' manager classes) with the
kit's. ``make conformance-0.33`` runs it first (``kvcache.kit.conformance``);
``tests/toolkit/test_fine_grained_rule.py`` runs it where vLLM 0.33.0 is installed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from kvcache.kit.config import GroupConfig, ManagerConfig, fine_grained_hits

#: vLLM 0.33.0's version, the only one whose decision this check knows.
VLLM_VERSION = "0.33.0"
#: Group kinds drawn: every kit kind vLLM 0.33.0 builds (it has no TQFullAttentionSpec).
KINDS = (
    "full",
    "mamba",
    "mamba",
    "sliding_window",
    "chunked_local",
    "cross_attention",
    "mla",
    "sliding_window_mla",
    "rswa",
    "sink",
    "hidden_state",
    "circular",
)
BLOCK_SIZES = (2, 4, 8, 16)


def random_group(rng: random.Random, heads: int) -> GroupConfig:
    """One group of a random kind and block size (``heads`` keeps equal specs apart)."""
    kind = rng.choice(KINDS)
    block = rng.choice(BLOCK_SIZES)
    window = rng.choice((4, 8, 16))
    mode = rng.choice(("align", "align", "align", "all", "none"))
    return GroupConfig(
        kind,
        block,
        sliding_window=window if kind in ("sliding_window", "sliding_window_mla") else None,
        attention_chunk_size=block * rng.choice((1, 2)) if kind == "chunked_local" else None,
        mamba_cache_mode=mode if kind == "mamba" else "none",
        rswa_window=window if kind == "rswa" else None,
        sink_len=block if kind == "sink" else None,
        num_kv_heads=heads,
    )


def random_config(rng: random.Random) -> ManagerConfig:
    """A random layout: one to three groups, caching mostly on, a dcp size of 1, 2
    or 4, and sometimes a hash block finer than the groups' GCD."""
    groups = tuple(random_group(rng, heads) for heads in range(1, rng.randint(1, 3) + 1))
    if rng.random() < 0.6:  # most layouts hold a Mamba 'align' group: the rule's subject
        at = rng.randrange(len(groups))
        align = GroupConfig("mamba", rng.choice(BLOCK_SIZES), mamba_cache_mode="align",
                            num_kv_heads=at + 1)  # fmt: skip
        groups = (*groups[:at], align, *groups[at + 1 :])
    enable_caching = rng.random() < 0.85
    dcp = rng.choice((1, 1, 2, 4))
    hash_override = None
    if enable_caching and len(groups) > 1 and rng.random() < 0.3:
        gcd = math.gcd(*(g.block_size for g in groups))
        hash_override = rng.choice([d for d in (1, 2, 4, 8, 16) if gcd % d == 0])
    return ManagerConfig(
        num_blocks=64,
        groups=groups,
        max_model_len=64,
        enable_caching=enable_caching,
        dcp_world_size=dcp,
        hash_block_size_override=hash_override,
        log_stats=False,
        enable_kv_cache_events=False,
    )


def vllm_fine_grained(config: ManagerConfig) -> bool | None:
    """Whether vLLM 0.33.0's manager for ``config`` has fine-grained hits on; None
    when vLLM refuses to build it (nothing to compare)."""
    from kvcache.kit.vllm_side import VllmAdapter

    try:
        manager = VllmAdapter().build_manager(config)
    except (ValueError, AssertionError, NotImplementedError, TypeError, KeyError):
        return None
    return bool(getattr(manager.coordinator, "enable_partial_hash_hits", False))


@dataclass
class RuleCheck:
    """The outcome: layouts drawn, built by vLLM, with fine-grained hits on, and
    the disagreements (one line each)."""

    drawn: int = 0
    built: int = 0
    enabled: int = 0
    mismatches: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line for the log."""
        return (
            f"fine-grained rule vs vLLM {VLLM_VERSION}: {self.drawn} layouts, {self.built} "
            f"built, {self.enabled} with fine-grained hits, "
            f"{len(self.mismatches)} mismatches"
        )


def check_rule(count: int = 400, seed: int = 0) -> RuleCheck:
    """Compare ``fine_grained_hits`` with vLLM 0.33.0 on ``count`` random layouts
    drawn from ``seed``.

    Raises:
        ValueError: ``count`` is not positive.
        RuntimeError: the installed vLLM is not 0.33.0.
    """
    if count < 1:
        raise ValueError(f"count={count!r}; expected a positive int")
    import vllm

    if vllm.__version__ != VLLM_VERSION:
        raise RuntimeError(f"the fine-grained rule check needs vLLM {VLLM_VERSION}, "
                           f"found {vllm.__version__}")  # fmt: skip
    rng = random.Random(f"fine-grained rule {seed}")
    result = RuleCheck()
    for _ in range(count):
        config = random_config(rng)
        result.drawn += 1
        expected = vllm_fine_grained(config)
        if expected is None:
            continue
        result.built += 1
        result.enabled += expected
        if fine_grained_hits(config) != expected:
            result.mismatches.append(
                f"{config.layout} blocks {config.block_sizes} hash {config.hash_block_size} "
                f"dcp {config.dcp_world_size} caching {config.enable_caching}: "
                f"vLLM {expected}, kit {not expected}"
            )
    return result
