"""The stateful machines under vLLM 0.33.0's profile: kvcache's against the spec's.

``test_manager_machine.py`` and ``test_hybrid_machine.py`` hold kvcache to the spec
under the default profile (vLLM 0.25.1). Here the same machines, rules and
invariants run with ``Profile("0.33.0")`` on both sides (kvcache's drop-in
``kvcache.vllm_0_33``, the spec with its own copy of the table, ``spec/profile.py``),
on every layout the hybrid machine draws: full attention, sliding window, chunked
local, cross attention and Mamba, one to three groups, and (the new-kinds machine)
MLA variants and one full-attention group under dcp / pcp. (A Mamba group in mode
'all' or 'none' with caching cannot be built under 0.33.0: both sides refuse it
alike and the machine draws another layout. Mamba prefill checkpoints: the hybrid
machine draws them on 'align' groups once kvcache's ``MambaSpec`` has the fields (the
spec models them, ``docs/profiles.md``); fine-grained hits and their
copy-on-write copies are, and are held by ``tests/conformance/test_profile_0_33.py``
and ``tests/test_injected_bugs_fine_grained.py``.) The requests' hashes come from
kvcache's hasher with the profile's hashing switches, and the invariant compares
them with the spec's, byte for byte.

A third machine, ``manager-lookahead``, runs the manager machine with 0.33.0's
lookahead hashing (two tokens) and prefill lookahead (three, fitted to the scheduler
block with EAGLE) on both sides and the requests' hasher.

A reduced run (a twelfth of the CI profile's examples for each machine) keeps the
budget; ``HYPOTHESIS_PROFILE=nightly`` scales it as it scales the others.

Teeth: with one switch turned back to 0.25.1's value in the spec only, the
machine must fail, so each switch tried is one the machines actually reach.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
from hypothesis import Phase, seed, settings
from hypothesis.stateful import run_state_machine_as_test

import spec
import spec.profile as spec_profile
from kvcache import vllm_0_33

from .programs import Step, replay, tokens
from .runner import run_machine
from .test_hybrid_machine import HybridMachine, admit, start
from .test_manager_machine import ManagerMachine
from .test_new_kinds_machine import NewKindsMachine

RELEASE = "0.33.0"
# Of the CI profile's 600 examples: each machine runs this many under the 0.33.0 profile.
CI_EXAMPLES = 40


class DropInManager(vllm_0_33.KVCacheManager):
    """kvcache's 0.33.0 drop-in (``kvcache.vllm_0_33``: the profile's switches plus
    0.33.0's vocabulary, its stats and event classes) under the names the machines
    call, which are 0.25.1's: ``max_num_batched_tokens``, the retention interval as
    an argument (0.33.0 reads it from the config), a lookup returning a pair."""

    def __init__(
        self,
        kv_cache_config: Any,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_num_batched_tokens: int | None = None,
        *,
        prefix_cache_retention_interval: int | None = None,
        **kwargs: Any,
    ) -> None:
        kv_cache_config.prefix_cache_retention_interval = prefix_cache_retention_interval
        super().__init__(
            kv_cache_config,
            max_model_len,
            scheduler_block_size,
            hash_block_size,
            max_in_flight_tokens=max_num_batched_tokens,
            **kwargs,
        )

    def get_computed_blocks(  # type: ignore[override]
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[Any, int]:
        """0.25.1's pair; the shared-prefix boundary (0.33.0's third value) is 0 or past
        the hit (where a longer single-kind hit ended). The machines play 0.25.1's
        scheduler, which does not store it on the request."""
        blocks, num_hit_tokens, boundary = super().get_computed_blocks(
            request, max_cache_hit_length
        )
        assert boundary == 0 or boundary > num_hit_tokens, (boundary, num_hit_tokens)
        return blocks, num_hit_tokens


def spec_profile_with(flipped: str | None) -> spec_profile.Profile:
    """The spec's 0.33.0 profile, with switch ``flipped`` (if any) set to 0.25.1's value."""
    if flipped is None:
        return spec_profile.Profile(RELEASE)
    if flipped not in spec_profile.SWITCHES:
        raise ValueError(f"flipped={flipped!r} is no switch of spec/profile.py")
    return spec_profile.Profile(RELEASE, **{flipped: flipped not in spec_profile.ON[RELEASE]})


def machine_class(
    base: type[ManagerMachine], flipped: str | None = None, **lookahead: int
) -> type[ManagerMachine]:
    """``base`` with both managers built under the 0.33.0 profile (the spec's with
    ``flipped`` turned back, for the teeth); ``lookahead``: 0.33.0's
    ``num_hash_lookahead_tokens`` / ``num_prefill_lookahead`` for both managers (and
    the requests' hasher)."""
    impl_profile = vllm_0_33.PROFILE
    spec_side = spec_profile_with(flipped)

    def lookahead_for(kwargs: dict[str, Any]) -> dict[str, int]:
        # With caching and EAGLE the scheduler block must hold the prefill lookahead.
        fitted = dict(lookahead)
        if "num_prefill_lookahead" in fitted and kwargs["enable_caching"] and kwargs["use_eagle"]:
            fitted["num_prefill_lookahead"] = min(
                fitted["num_prefill_lookahead"], kwargs["scheduler_block_size"]
            )
        return fitted

    def spec_factory(config: Any, **kwargs: Any) -> Any:
        return spec.KVCacheManager(config, **kwargs, **lookahead_for(kwargs), profile=spec_side)

    def impl_factory(config: Any, **kwargs: Any) -> Any:
        return DropInManager(config, **kwargs, **lookahead_for(kwargs))

    namespace: dict[str, Any] = {
        "spec_manager_cls": staticmethod(spec_factory),
        "impl_manager_cls": staticmethod(impl_factory),
        "hasher_switches": {
            "tagged_extra_keys": impl_profile.tagged_extra_keys,
            "mm_keys_by_window": impl_profile.mm_keys_by_window,
            **{k: v for k, v in lookahead.items() if k == "num_hash_lookahead_tokens"},
        },
        "counters": {"steps": 0, "examples": 0},
        # Mamba prefill checkpoints (vLLM 0.33.0's MambaSpec fields) on 'align' groups.
        "CHECKPOINTS": True,
    }
    name = f"{base.__name__}_0_33" + (f"_without_{flipped}" if flipped else "")
    name += "_lookahead" if lookahead else ""
    return type(name, (base,), namespace)


MACHINES: dict[str, type[ManagerMachine]] = {
    "manager": machine_class(ManagerMachine),
    "hybrid": machine_class(HybridMachine),
    # MLA variants, and one full-attention group under dcp / pcp: 0.33.0's geometry
    # (pcp_not_scaled; the machine's hash block is 0.25.1's block_size * dcp * pcp, so
    # under pcp with caching both sides refuse the layout and the machine redraws).
    "new-kinds": machine_class(NewKindsMachine),
    # Lookahead hashing (two tokens) and prefill lookahead (three: two re-prefilled
    # tokens) on the manager machine's full-attention layouts.
    "manager-lookahead": machine_class(
        ManagerMachine, num_hash_lookahead_tokens=2, num_prefill_lookahead=3
    ),
}


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_machine_under_0_33(
    name: str, stateful_settings: settings, record_property: Any
) -> None:
    """kvcache's 0.33.0 profile agrees with the spec's on every step of the machine."""
    cls = MACHINES[name]
    added = run_machine(cls, stateful_settings, record_property, share=CI_EXAMPLES)
    # The run reached managers of the 0.33.0 profile (not only refused layouts).
    assert added["steps"] > 0


# (machine, switch, the machine's method whose check fails): each switch turned back in
# the spec alone must make the machine fail there. (Switches the machines do not reach:
# free_on_processed_tokens and adopt_computed_without_new_tokens, as 0.25.1's scheduler
# the machines play has no in-flight tokens and never adopts computed tokens without new
# ones; trim_every_full_group needs three full-attention groups, which the hybrid machine
# draws too rarely for a bounded run. partial_prompt_tail_entries and event_locality,
# stats_hits_by_source, zero_every_attention_group and mamba_align_only are reached too,
# within 1-15 s: left out of the budget. Not reached in 300 examples: the Mamba switches
# mamba_frees_processed_states, mamba_caps_new_state_blocks, mamba_prompt_tail_state and
# mamba_no_eagle_margin; nor retention_replay_boundaries (sparse retention with EAGLE
# beside a window: tests/conformance/test_profile_0_33.py plants that bug instead); nor
# external_blocks_floor_zero, though the hybrid machine's external tokens do reach it:
# turned off on both sides it changes the seeded runs.)
TEETH = [
    ("manager", "cascade_always_zero", ("get_num_common_prefix_blocks",)),  # zeros vs a count
    ("manager", "tagged_extra_keys", ("states_agree",)),  # LoRA / salt / multimodal hashes
    ("hybrid", "pop_drops_null_head", ("release",)),  # sliding-window tables' null heads
    # EAGLE groups without use_eagle: the hits differ, or the tables they leave, or a
    # hit loses a block no rule of the layout explains (the effectiveness judge).
    ("hybrid", "eagle_master_switch", ("get_computed_blocks", "states_agree", "judge_lookup")),
    ("hybrid", "new_block_ids_zeroing_only", ("states_agree",)),  # new_block_ids, no Mamba
    # Under pcp with caching the spec builds 0.25.1's geometry, kvcache refuses it.
    ("new-kinds", "pcp_not_scaled", ("init_managers",)),
]


@pytest.mark.parametrize(("name", "switch", "where"), TEETH, ids=[f"{n}-{s}" for n, s, _ in TEETH])
def test_machine_fails_with_a_switch_flipped_in_spec(
    name: str, switch: str, where: tuple[str, ...]
) -> None:
    """The 0.33.0 machines have teeth: the spec with one switch at 0.25.1's value
    disagrees with kvcache's 0.33.0 profile within a bounded, seeded run, at the
    check that compares what the switch changes. The first of ``TEETH_SEEDS`` whose
    run fails counts: a rule that changes the machine's states moves every seed's
    search path (fine-grained hits moved seed 0's past the EAGLE case), and one
    seed's luck is no measure of the teeth."""
    base = {"manager": ManagerMachine, "hybrid": HybridMachine, "new-kinds": NewKindsMachine}[name]
    cls = machine_class(base, flipped=switch)
    assert getattr(spec_profile_with(switch), switch) is False
    assert getattr(vllm_0_33.PROFILE, switch) is True
    frame = first_failure(cls)
    assert frame is not None, f"{switch} flipped in the spec: no run of seeds {TEETH_SEEDS} failed"
    assert frame.name in where, frame


def first_failure(cls: type[ManagerMachine]) -> traceback.FrameSummary | None:
    """Where the first of ``TEETH_SEEDS`` whose bounded run (300 examples of 100
    steps, no shrinking) fails machine ``cls`` fails: the check's frame; None if
    every seed's run passes."""
    bounded = settings(
        max_examples=300,
        stateful_step_count=100,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # the first failure is enough: no shrinking
        suppress_health_check=list(settings.default.suppress_health_check)
        + list(stateful_health_checks()),
    )
    for run_seed in TEETH_SEEDS:

        @seed(run_seed)
        def machine() -> ManagerMachine:
            return cls()

        try:
            run_state_machine_as_test(machine, settings=bounded)
        except AssertionError as error:
            return traceback.extract_tb(error.__traceback__)[-1]
    return None


TEETH_SEEDS = (0, 1, 2)


def stateful_health_checks() -> tuple[Any, ...]:
    """The health checks the stateful profiles suppress (tests/stateful/conftest.py)."""
    from hypothesis import HealthCheck

    return (
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.large_base_example,
        HealthCheck.data_too_large,
    )


def test_a_step_vllm_asserts_on_is_refused_alike() -> None:
    """Full attention and 'align' Mamba with one prefill checkpoint block (block and
    hash block size 1). r0's one-token prompt is computed and samples a token; its
    decode step schedules 3 tokens (2 drafts), so the checkpoint falls at token 3,
    past the 2 hashed tokens: vLLM 0.33.0 asserts (``_get_partial_block_hash``).
    Both sides refuse the step with ValueError, leave equal states, and kvcache
    checks before it drops the block's keys; the machine then drops the example,
    as no engine goes on (found by CI's random seed 10503027653260157981)."""
    program = [
        start(11, 1, ["full", "mamba"], token_budget=5, mode="align", spec_blocks=0,
              checkpoint_blocks=1, checkpoint_alignment=1, use_eagle=False,
              **tokens("tokens", [0])),
        admit("r0", mode="sync"),
        Step("allocate_slots", {}, {"schedule r0": True, "drafts": 2}),
    ]  # fmt: skip
    with pytest.raises(AssertionError, match="step 2: allocate_slots rejected it"):
        replay(MACHINES["hybrid"], program)
