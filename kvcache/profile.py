"""Release profiles: the named switches where vLLM 0.25.1 and 0.33.0 behave differently.

kvcache has one implementation of the KV-cache lifecycle. Where vLLM releases
differ, the code consults a switch of the manager's ``Profile`` at the point of
difference; there is no forked module per release. ``Profile("0.25.1")`` (the
default) is bit-for-bit vLLM 0.25.1; ``Profile("0.33.0")`` turns on the switches
vLLM 0.33.0 needs. ``kvcache.vllm_0_33`` is the drop-in import path that builds
managers with the 0.33.0 profile and 0.33.0's names.

``SWITCHES`` documents every switch: what it changes, and the entry of the
known-differences ledger (``kvcache/kit/ledger.toml``) it covers. The spec keeps
its own copy of the switch values (``spec/profile.py``; the spec imports nothing
from kvcache); a test checks that both agree.

This module is part of the vocabulary: it is never compiled (``kvcache._builds``).
Compiled managers copy the switches they read into their own attributes at
construction, so a switch costs one attribute read at the point of difference.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["DEFAULT_RELEASE", "RELEASES", "SWITCHES", "Profile", "Switch"]

RELEASES = ("0.25.1", "0.33.0")
"""The vLLM releases kvcache has a profile for, oldest first."""

DEFAULT_RELEASE = "0.25.1"
"""The profile a manager gets when none is given."""


class Switch(NamedTuple):
    """One documented switch: its name, the ledger entry it covers ("": a difference
    no kit rule needs, as the kit never drives that case or both sides already agree
    there), what it changes, and the first release where it is on."""

    name: str
    ledger_id: str
    what: str
    since: str


SWITCHES: tuple[Switch, ...] = (
    Switch(
        "stats_at_admission",
        "stats-at-admission",
        "get_computed_blocks records no prefix-cache stats; the scheduler records them "
        "with record_prefix_cache_stats(request, num_hits) once the request is admitted.",
        "0.33.0",
    ),
    Switch(
        "stats_hits_by_source",
        "stats-hits-by-source",
        "PrefixCacheStats carries hits_by_source (connector hits by tier; empty for "
        "local lookups).",
        "0.33.0",
    ),
    Switch(
        "event_new_fields",
        "event-new-fields",
        "BlockStored / BlockRemoved / AllBlocksCleared carry 0.33.0's new fields "
        "(locality, ownership, session_id, lookahead_token_ids; their defaults).",
        "0.33.0",
    ),
    Switch(
        "tagged_extra_keys",
        "tagged-extra-keys",
        "Block-hash extra keys are tagged: ('lora', name, path), ('mm', identifier, "
        "offset), ('cache_salt', salt), ('prompt_embeds', digest).",
        "0.33.0",
    ),
    Switch(
        "mm_keys_by_window",
        "bug-mm-output-block-hash",
        "A block hashed after the first hashing call finds its multimodal items by "
        "their token window (every item overlapping the block), not from the last "
        "item only.",
        "0.33.0",
    ),
    Switch(
        "none_hash_fixed_seed",
        "",
        "Without PYTHONHASHSEED, NONE_HASH is derived from the fixed seed "
        "'vllm-none-hash' for the cryptographic hashes (sha256, sha256_cbor) instead "
        "of 32 random bytes (the xxhash ones stay random).",
        "0.33.0",
    ),
    Switch(
        "new_block_ids_zeroing_only",
        "new-block-ids-zeroing-only",
        "new_block_ids (take_new_block_ids) records newly allocated blocks only when "
        "the KV cache needs zeroing (a Mamba group); never for attention-only layouts.",
        "0.33.0",
    ),
    Switch(
        "pop_drops_null_head",
        "pop-drops-null-head",
        "pop_blocks_for_free leaves out the null blocks a group holds in front of a "
        "request's blocks.",
        "0.33.0",
    ),
    Switch(
        "cascade_always_zero",
        "cascade-always-zero",
        "get_num_common_prefix_blocks returns 0 for every group without looking at "
        "the request (cascade attention removed).",
        "0.33.0",
    ),
    Switch(
        "trim_every_full_group",
        "bug-three-full-groups-trim",
        "A hybrid lookup trims every full-attention group's hits to the common "
        "length, not only the first group's.",
        "0.33.0",
    ),
    Switch(
        "partial_prompt_tail_entries",
        "sub-block-prefix-entries",
        "A full-attention group whose blocks are larger than the hash block also "
        "caches its block holding the prompt's last reachable hash boundary under that "
        "boundary's hash (a partial, sub-block entry).",
        "0.33.0",
    ),
    Switch(
        "eagle_master_switch",
        "eagle-flag-needs-use-eagle",
        "use_eagle is the master switch: without it, groups marked is_eagle_group "
        "drop no hit block (0.25.1 drops for marked groups whatever use_eagle says).",
        "0.33.0",
    ),
    Switch(
        "eagle_peek_to_hashed_length",
        "eagle-lookahead-whole-prompt",
        "A hybrid lookup's EAGLE group peeks one block past the candidate length up "
        "to the request's hashed tokens (0.25.1: up to max_cache_hit_length); so does "
        "the per-group lookup's, Mamba's aside (0.25.1: no peek there).",
        "0.33.0",
    ),
    Switch(
        "adopt_computed_without_new_tokens",
        "",
        "allocate_slots accepts num_new_tokens == 0 when new computed tokens are "
        "adopted (not only with external computed tokens).",
        "0.33.0",
    ),
    Switch(
        "free_on_processed_tokens",
        "",
        "allocate_slots frees skipped blocks up to the processed tokens only "
        "(total computed tokens minus request.num_in_flight_tokens).",
        "0.33.0",
    ),
    Switch(
        "mamba_align_only",
        "mamba-all-removed",
        "With prefix caching on, a Mamba group must be in 'align' mode: a manager with "
        "a Mamba group in 'all' (removed) or 'none' cannot be built (AssertionError).",
        "0.33.0",
    ),
    Switch(
        "mamba_frees_processed_states",
        "mamba-freed-on-processed-tokens",
        "Mamba frees states by the processed tokens it is given (no "
        "num_speculative_blocks margin subtracted); in 'align' mode it retires every "
        "live state before the latest, past the null gaps prefill leaves, from where "
        "the last removal stopped, and a request counts as allocated after any "
        "allocate_new_blocks call, even one that adds no block.",
        "0.33.0",
    ),
    Switch(
        "zero_every_attention_group",
        "new-block-ids-zeroing-only",
        "Beside a Mamba group (the KV cache needs zeroing), every attention group "
        "records its newly allocated block ids (sliding window, chunked local, cross "
        "attention too), not only full-attention-class groups.",
        "0.33.0",
    ),
    Switch(
        "mamba_no_eagle_margin",
        "bug-mamba-eagle-long-hit",
        "A hybrid lookup gives a Mamba group with EAGLE no peek past the candidate "
        "length (its finder never drops a block), so the Mamba hit cannot outgrow the "
        "other groups' hit.",
        "0.33.0",
    ),
    Switch(
        "mamba_prompt_tail_state",
        "mamba-prompt-boundary-rekey",
        "An 'align' Mamba group caching up to the prompt's last reusable hash boundary "
        "(num_prompt_tokens - 1 rounded down; with EAGLE the prompt rounded down less "
        "one hash block) keys the state block there unless it already is (a state "
        "evict_blocks unkeyed is keyed again, with its BlockStored event).",
        "0.33.0",
    ),
    Switch(
        "retention_replay_boundaries",
        "bug-retention-eagle-replay-boundary",
        "Sparse retention keeps the sliding-window tails (Mamba states) before each of "
        "replay_boundaries: num_prompt_tokens - 1 without EAGLE; with an EAGLE group "
        "{resend - b, extension - b} (resend: num_prompt_tokens - 1 rounded down to the "
        "scheduler block b, extension: num_prompt_tokens rounded down), each aligned "
        "and shifted by the group's own EAGLE bit (0.25.1: only num_prompt_tokens - 1).",
        "0.33.0",
    ),
    Switch(
        "retention_zero_without_window",
        "",
        "A retention interval of 0 is accepted (and changes nothing) when no group is "
        "sliding-window or Mamba; a positive one is refused there with 0.33.0's "
        "message (0.25.1 refuses any interval set without such a group).",
        "0.33.0",
    ),
    Switch(
        "shared_prefix_junctions",
        "lookup-three-values",
        "get_computed_blocks' third value is the shared-prefix boundary (the hit plus "
        "the shared prefix a sparse-retention group has not cached yet; 0 if none), and "
        "sparse retention keeps the tails before a request's shared_prefix_boundary "
        "(one block lower too for an EAGLE group).",
        "0.33.0",
    ),
    Switch(
        "mamba_caps_new_state_blocks",
        "",
        "An 'align' Mamba group's block count is its shortfall capped at one state "
        "block (plus the speculative blocks on the first allocation); 0.25.1 reports "
        "the cap itself whenever anything is short.",
        "0.33.0",
    ),
    Switch(
        "circular_buffer_groups",
        "circular-buffer-kind",
        "A CircularBufferSpec group (one ring block per request for its whole life, "
        "never prefix-cached) is built with CircularBufferManager and left out of the "
        "hybrid hit search; 0.25.1 has no such kind, so a manager with one cannot be "
        "built (NotImplementedError naming the class).",
        "0.33.0",
    ),
    Switch(
        "lookahead_arguments",
        "lookahead-arguments-added",
        "The manager takes num_hash_lookahead_tokens and num_prefill_lookahead (vLLM "
        "0.33.0's lookahead hashing and prefill lookahead, for EAGLE / MTP drafters); "
        "vLLM 0.25.1 has neither argument, so a non-zero value under 0.25.1 is refused "
        "(ValueError naming the argument).",
        "0.33.0",
    ),
    Switch(
        "cache_within_hashed_tokens",
        "",
        "A group caches only the full blocks the request has hashes for (with lookahead "
        "hashing a block's hash waits for the tokens after it); 0.25.1 asserts that "
        "every full block within the tokens to cache has one.",
        "0.33.0",
    ),
    Switch(
        "pcp_not_scaled",
        "pcp-not-scaled",
        "A block spans block_size * dcp_world_size tokens: prefill context parallelism "
        "no longer scales it (0.25.1: block_size * dcp * pcp), so a lone group's hash "
        "block must equal block_size * dcp (AssertionError otherwise) and full-attention "
        "lookups read blocks of that size.",
        "0.33.0",
    ),
    Switch(
        "dcp_sharded_geometry",
        "mamba-not-dcp-sharded",
        "Context parallelism is per group: only specs marked dcp_sharded (attention "
        "specs, unless they opt out) take dcp_world_size and pcp_world_size; the others "
        "(Mamba, replicated drafts) keep blocks of block_size tokens. Several "
        "prefix-caching groups accept it when every group is full attention or "
        "replicated (under pcp: full attention or a replicated attention group); "
        "AssertionError otherwise, as vLLM asserts.",
        "0.33.0",
    ),
    Switch(
        "mamba_fine_grained_hits",
        "mamba-fine-grained-hits",
        "Beside a Mamba 'align' group whose block is larger than the hash block (under "
        "dcp_world_size > 1 at least the hash block; every other prefix-cacheable group "
        "full attention, Mamba, or hashed at its own block size), a hybrid lookup's hits "
        "land on hash-block boundaries (each group searched at its own block): full attention "
        "and Mamba find hits ending inside a block, an EAGLE group drops one hash block, "
        "and the coordinator caches unrounded token counts.",
        "0.33.0",
    ),
    Switch(
        "partial_hit_copy_on_write",
        "mamba-partial-tail-copy",
        "A hit ending inside a block is copied on write: the request gets a fresh block "
        "in the hit block's place (counted by the admission check, recorded in "
        "new_block_ids, both blocks kept for take_kv_cache_block_copies). An 'align' "
        "Mamba group keys its state at the prompt's last reusable hash boundary inside "
        "a block too, and moves that entry to a fresh copy when the request goes on.",
        "0.33.0",
    ),
    Switch(
        "event_session_id",
        "",
        "BlockStored events carry the request's session_id (vLLM 0.33.0's Request "
        "field; None for a request without one), full and partial entries alike.",
        "0.33.0",
    ),
    Switch(
        "full_report_mode",
        "",
        "A lookup for a request whose kv_cache_report_mode is 'full' queues, with "
        "events on, one BlockStored per group for the blocks it hit (the pool's "
        "emit_cached_block_events); 0.25.1 reports only newly cached blocks.",
        "0.33.0",
    ),
    Switch(
        "external_blocks_floor_zero",
        "",
        "allocate_external_computed_blocks takes no block when the request already "
        "holds as many as the computed tokens need (e.g. after a speculative "
        "over-allocation); 0.25.1 asks the pool for the negative count.",
        "0.33.0",
    ),
    Switch(
        "mamba_prefill_checkpoints",
        "mamba-prefill-checkpoints",
        "An 'align' Mamba group whose spec has num_prefill_checkpoint_blocks > 0 and a "
        "prefill_checkpoint_alignment reserves a block for the state its backend "
        "exports inside a prefill chunk (the prompt-tail boundary rule applied to the "
        "chunk's end; under latest-only retention only on the chunk reaching the "
        "prefill end) and keys it at that position if a later lookup can reuse it "
        "(the prompt's checkpoint, a retained block boundary, the request's "
        "shared-prefix boundary), else drops the column's keys; 'align' groups also "
        "offer the states they cache to a KV connector (boundary-state offloads). "
        "0.25.1's MambaSpec has neither field: its profile refuses a spec with one set.",
        "0.33.0",
    ),
    Switch(
        "hisparse_groups",
        "",
        "HiSparse layouts (vLLM 0.33.0): a group with role 'hisparse_source' gets "
        "HiSparseSourceManager (full attention over a private host pool, its hit kept "
        "longer than the hybrid hit), HiSparseResidentSpec / HiSparseHotSpec groups get "
        "HiSparseResidentManager / HiSparseHotManager; 0.25.1 has none of these names, "
        "so a manager with such a group cannot be built (NotImplementedError naming "
        "the class).",
        "0.33.0",
    ),
)
"""Every switch, in the order of the ledger's entries."""

_SWITCH_NAMES = tuple(s.name for s in SWITCHES)


class Profile:
    """The switch values of one vLLM release (see ``SWITCHES``).

    Args:
        release: One of ``RELEASES`` (default ``"0.25.1"``).

    Raises:
        ValueError: for a release kvcache has no profile for.
    """

    __slots__ = ("release", *_SWITCH_NAMES)

    release: str
    stats_at_admission: bool
    stats_hits_by_source: bool
    event_new_fields: bool
    tagged_extra_keys: bool
    mm_keys_by_window: bool
    none_hash_fixed_seed: bool
    new_block_ids_zeroing_only: bool
    pop_drops_null_head: bool
    cascade_always_zero: bool
    trim_every_full_group: bool
    partial_prompt_tail_entries: bool
    eagle_master_switch: bool
    eagle_peek_to_hashed_length: bool
    adopt_computed_without_new_tokens: bool
    free_on_processed_tokens: bool
    mamba_align_only: bool
    mamba_frees_processed_states: bool
    zero_every_attention_group: bool
    mamba_no_eagle_margin: bool
    mamba_prompt_tail_state: bool
    mamba_caps_new_state_blocks: bool
    retention_replay_boundaries: bool
    retention_zero_without_window: bool
    shared_prefix_junctions: bool
    circular_buffer_groups: bool
    lookahead_arguments: bool
    cache_within_hashed_tokens: bool
    pcp_not_scaled: bool
    dcp_sharded_geometry: bool
    mamba_fine_grained_hits: bool
    partial_hit_copy_on_write: bool
    event_session_id: bool
    full_report_mode: bool
    external_blocks_floor_zero: bool
    mamba_prefill_checkpoints: bool
    hisparse_groups: bool

    def __init__(self, release: str = DEFAULT_RELEASE) -> None:
        if release not in RELEASES:
            raise ValueError(
                f"release={release!r}: kvcache has profiles for {', '.join(RELEASES)}"
            )
        self.release = release
        index = RELEASES.index(release)
        for switch in SWITCHES:
            setattr(self, switch.name, index >= RELEASES.index(switch.since))

    def switches(self) -> dict[str, bool]:
        """Every switch's value, by name (for reports and tests)."""
        return {name: bool(getattr(self, name)) for name in _SWITCH_NAMES}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Profile) and other.release == self.release

    def __hash__(self) -> int:
        return hash(self.release)

    def __repr__(self) -> str:
        return f"Profile({self.release!r})"


def resolve_profile(profile: Profile | str | None) -> Profile:
    """``profile`` as a ``Profile``: None is the default release, a string a release.

    Raises:
        ValueError: for an unknown release or a value that is no profile.
    """
    if profile is None:
        return Profile(DEFAULT_RELEASE)
    if isinstance(profile, str):
        return Profile(profile)
    if not isinstance(profile, Profile):
        raise ValueError(f"profile={profile!r}: expected a kvcache Profile or a release string")
    return profile
