"""The kit's fine-grained-hit rule (``kvcache.kit.config.fine_grained_hits``) on
hand-made layouts. Against vLLM 0.33.0's own decision it is checked where vLLM 0.33.0
is installed: ``make conformance-0.33`` runs ``kvcache.kit.fine_grained_check`` first
(400 random layouts) and fails on any disagreement."""

from __future__ import annotations

from kvcache.kit.config import GroupConfig, ManagerConfig, fine_grained_hits

ALIGN4 = GroupConfig("mamba", 4, mamba_cache_mode="align", num_kv_heads=2)


def _config(
    *groups: GroupConfig, dcp_world_size: int = 1, enable_caching: bool = True
) -> ManagerConfig:
    return ManagerConfig(
        num_blocks=16,
        groups=groups,
        max_model_len=32,
        dcp_world_size=dcp_world_size,
        enable_caching=enable_caching,
    )


def test_an_equal_mamba_block_turns_hits_on_only_under_dcp() -> None:
    full = GroupConfig("full", 4)
    assert not fine_grained_hits(_config(full, ALIGN4))  # hash block 4 = Mamba's block
    assert fine_grained_hits(_config(full, ALIGN4, dcp_world_size=2))
    # ... and only in 'align' mode, with caching on.
    assert not fine_grained_hits(_config(full, GroupConfig("mamba", 4), dcp_world_size=2))
    assert not fine_grained_hits(_config(full, ALIGN4, dcp_world_size=2, enable_caching=False))


def test_a_ring_buffer_group_takes_no_part_and_attention_blocks_scale_with_dcp() -> None:
    ring = GroupConfig("circular", 4, num_kv_heads=3)
    assert fine_grained_hits(_config(GroupConfig("full", 2), ring, ALIGN4))
    # A sliding window hashed at its own block counts only at its dcp-scaled size.
    swa = GroupConfig("sliding_window", 2, sliding_window=4, num_kv_heads=3)
    assert fine_grained_hits(_config(GroupConfig("full", 2), swa, ALIGN4))
    assert not fine_grained_hits(_config(GroupConfig("full", 2), swa, ALIGN4, dcp_world_size=2))
    # Cross attention caches (prefix_cacheable) and finds no sub-block hits.
    cross = GroupConfig("cross_attention", 4, num_kv_heads=3)
    assert not fine_grained_hits(_config(GroupConfig("full", 2), cross, ALIGN4))
