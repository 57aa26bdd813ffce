"""The spec's release profiles: which named switches each modelled vLLM release turns on.

The same switch names and values as kvcache's ``kvcache/profile.py`` (a test holds
the two equal); the spec keeps its own copy because it imports nothing from
kvcache. ``Profile("0.25.1")`` (the default) has every switch off. The spec
consults every switch in ``MODELLED`` at its own points of difference.
"""

from __future__ import annotations

RELEASES = ("0.25.1", "0.33.0")

SWITCHES = (
    "stats_at_admission", "stats_hits_by_source", "event_new_fields", "tagged_extra_keys",
    "mm_keys_by_window", "none_hash_fixed_seed", "new_block_ids_zeroing_only",
    "pop_drops_null_head", "cascade_always_zero", "trim_every_full_group",
    "partial_prompt_tail_entries", "eagle_master_switch", "eagle_peek_to_hashed_length",
    "adopt_computed_without_new_tokens", "free_on_processed_tokens", "mamba_align_only",
    "mamba_frees_processed_states", "zero_every_attention_group", "mamba_no_eagle_margin",
    "mamba_prompt_tail_state", "retention_replay_boundaries", "retention_zero_without_window",
    "shared_prefix_junctions", "mamba_caps_new_state_blocks", "circular_buffer_groups",
    "lookahead_arguments", "cache_within_hashed_tokens", "pcp_not_scaled",
    "dcp_sharded_geometry", "mamba_fine_grained_hits", "partial_hit_copy_on_write",
    "event_session_id", "full_report_mode", "external_blocks_floor_zero",
    "mamba_prefill_checkpoints", "hisparse_groups",
)  # fmt: skip
"""Every switch, in kvcache's order."""

ON = {"0.25.1": frozenset[str](), "0.33.0": frozenset(SWITCHES)}
"""The switches each release turns on."""

MODELLED = frozenset(SWITCHES)
"""The switches the spec's code consults (all of them)."""


class Profile:
    """One release's switches, as attributes (``profile.cascade_always_zero``...).

    Raises ValueError for a release the spec has no profile for.
    """

    def __init__(self, release: str = "0.25.1") -> None:
        if release not in ON:
            raise ValueError(f"release={release!r}: the spec has profiles for {RELEASES}")
        self.release = release
        self.on = ON[release]

    def __getattr__(self, name: str) -> bool:
        if name in SWITCHES:
            return name in self.on
        raise AttributeError(name)

    def switches(self) -> dict[str, bool]:
        """Every switch's value, by name."""
        return {name: name in self.on for name in SWITCHES}


def resolve_profile(profile: object) -> Profile:
    """None -> the default release, a release string -> its profile, a Profile -> itself.

    Anything else (e.g. kvcache's own Profile object) is read by its ``release``.
    """
    if profile is None:
        return Profile()
    if isinstance(profile, Profile):
        return profile
    if isinstance(profile, str):
        return Profile(profile)
    release = getattr(profile, "release", None)
    if not isinstance(release, str):
        raise ValueError(f"profile={profile!r}: expected a release string or a Profile")
    return Profile(release)
