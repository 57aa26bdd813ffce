"""The random scheduler: calls made the way vLLM's ``Scheduler`` would make them.

``RandomScheduler`` drives a ``Lockstep`` (``vllm/v1/core/sched/scheduler.py``'s
rules): prefix lookups only for waiting requests with no computed tokens, chunked
prefill (split at block multiples when a Mamba group caches in "align" mode), decode
with draft tokens and lookahead slots, encoder tokens for cross attention,
preemption when an allocation fails, async KV loads (``delay_cache_blocks``),
deferred frees, plus the admin calls (evict, reset, events, stats). Part of
``kvcache.kit.driver``, which re-exports every name.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvcache.kit.config import ManagerConfig, fine_grained_hits
from kvcache.kit.ledger import REFERENCE_LINE
from kvcache.kit.lockstep import LOOKUP_OPS, PROMPT_EMBEDS_DRAWN, DriverError, Lockstep, side_line
from kvcache.kit.oracle import spec_module

# ---------------------------------------------------------------- random driver

#: How often a decode with drafts in a Mamba checkpoint layout keeps a hash block or
#: more of drafts, where vLLM 0.33.0 can reserve a checkpoint inside them and assert
#: (kvcache raises ``PartialBlockError`` at the same call); otherwise fewer drafts.
DRAFTS_PAST_HASHES_RATE = 0.5
#: What a reference raises there (vLLM's assert, the spec's or kvcache's refusal).
CHECKPOINT_IN_DRAFTS_RAISES = ("AssertionError", "ValueError", "PartialBlockError")

#: The share of configs (0.33 line) whose scheduler has a KV connector taking divergent
#: hybrid hits (``LOOKUP_OPS``; ``RandomScheduler.connector_lookup``).
CONNECTOR_LOOKUP_RATE = 0.5

#: vLLM 0.33.0's request fields the kit draws for sides of that line (its
#: ``Request(session_id=...)`` and ``SamplingParams.extra_args["kv_cache_report_mode"]``).
REQUEST_FIELDS_0_33 = ("session_id", "kv_cache_report_mode")


def full_report_works(config: ManagerConfig) -> bool:
    """Whether vLLM 0.33.0 can report a lookup's hits in the "full" report mode for
    ``config``. It cannot (a vLLM bug, kvcache raises ValueError there instead) under
    ``dcp_world_size > 1``, where the coordinator hands the pool the spec's unscaled
    block size and the hash view asserts, nor with fine-grained hits, where a hit
    ending inside a block names one block more than the request has hashes of that
    size (IndexError)."""
    return config.dcp_world_size == 1 and not fine_grained_hits(config)


def draw_request_fields_0_33(
    rng: random.Random, full_report: bool = True, session: bool = True
) -> dict[str, Any]:
    """A request's vLLM 0.33.0 fields: a session id (two sessions) in about a third
    of requests where ``session`` (every side's request takes one), the "full" report
    mode in about a quarter where ``full_report`` (``full_report_works``) and
    "incremental", the default, spelled out in some; the draws are the same either
    way."""
    fields: dict[str, Any] = {}
    if rng.random() < 0.35:
        session_id = rng.choice(["session-a", "session-b"])
        if session:
            fields["session_id"] = session_id
    mode = rng.random()
    if mode < 0.25:
        if full_report:
            fields["kv_cache_report_mode"] = "full"
    elif mode < 0.35:
        fields["kv_cache_report_mode"] = "incremental"
    return fields


def zeroing_duties(side: Any) -> bool:
    """Whether a side's manager takes vLLM's zeroing duties with a KV connector:
    ``allocate_slots(skip_zeroing_group_ids=...)`` and ``record_blocks_for_zeroing``
    (a side without a manager in this process, or whose signature cannot be read,
    is taken at its release line's word)."""
    manager = getattr(side, "manager", None)
    if manager is None or not hasattr(manager, "record_blocks_for_zeroing"):
        return manager is None
    try:
        return "skip_zeroing_group_ids" in inspect.signature(manager.allocate_slots).parameters
    except (TypeError, ValueError):  # a compiled method without a signature
        return True


@dataclass
class Req:
    """The driver's (scheduler's) view of one request."""

    request_id: str
    num_prompt_tokens: int
    num_tokens: int
    max_tokens: int
    num_output_tokens: int = 0
    status: str = "WAITING"
    num_computed_tokens: int = 0
    num_preemptions: int = 0


class RandomScheduler:
    """Makes the calls a vLLM scheduler would, with random choices at each step."""

    MAX_LIVE_REQUESTS = 6

    def __init__(self, rng: random.Random, run: Lockstep) -> None:
        self.rng = rng
        self.run = run
        self.config = config = run.config
        self.block_size = config.scheduler_block_size
        self.live: dict[str, Req] = {}
        self.running: list[str] = []
        self.all_ids: list[str] = []
        self.added: list[dict[str, Any]] = []
        self.deferred: list[int] = []
        self.next_handle = 0
        self.lookahead = 0 if rng.random() < 0.6 else rng.randint(1, 3)
        self.full_sequence_must_fit = rng.random() < 0.3
        mamba = [g for g in config.groups if g.kind == "mamba"]
        # vLLM 0.33.0's prefill checkpoints: longer prompts (a checkpoint sits inside a
        # chunk of at least two blocks), and its scheduler's split (``mamba_split``)
        # where every Mamba group has checkpoint blocks; the alignment is the first
        # Mamba group's, as vLLM's scheduler takes it.
        self.long_prompts = any(g.has_checkpoint_fields for g in mamba)
        self.checkpoints = bool(mamba) and all(g.num_prefill_checkpoint_blocks > 0 for g in mamba)
        self.checkpoint_alignment = mamba[0].prefill_checkpoint_alignment if mamba else None
        self.prompt_blocks = 5 if self.long_prompts else 2  # blocks of a prompt's tail
        stem_blocks = 6 if self.long_prompts else 3
        self.stems = [
            [rng.randrange(3) for _ in range(rng.randint(0, stem_blocks * self.block_size + 1))]
            for _ in range(3)
        ]
        # vLLM's scheduler splits prefill chunks at block multiples when a Mamba
        # group caches in "align" mode (Scheduler._mamba_block_aligned_split).
        self.mamba_align = any(g.mamba_cache_mode == "align" for g in mamba)
        # Layouts where vLLM 0.33.0 has fine-grained (sub-block) hits
        # (``fine_grained_hits``): its scheduler then also stops a prefill chunk at the
        # prompt's last reusable hash boundary (the Mamba prompt-tail state) and at the
        # end of a block a chunk starts inside.
        hbs = config.hash_block_size
        self.fine_grained = fine_grained_hits(config)
        # Draft tokens need a speculative state block each in every Mamba group.
        self.max_draft_tokens = min((g.num_speculative_blocks for g in mamba), default=3)
        self.encoder_decoder = any(g.kind == "cross_attention" for g in config.groups)
        self.rswa = any(g.kind == "rswa" for g in config.groups)
        # vLLM 0.33.0's scheduler drains the copy-on-write copies after each step's
        # allocations (take_kv_cache_block_copies) and frees the blocks they retain:
        # at once, or (deferred block freeing: a KV consumer with overlapping
        # batches) once the step running the copies is processed, which is after the
        # next step is scheduled. Only when every side is of a line that has copies,
        # and in layouts that can copy (a cached Mamba 'align' group with blocks
        # larger than the hash block: elsewhere the take is always empty, and an
        # unexpected copy shows in the ref counts). Its choices come from the
        # config, not ``rng``: the sequences' other calls stay as they were.
        sides = [run.reference] + ([run.subject] if run.subject is not None else [])
        self.takes_copies = (
            all(side_line(side) != REFERENCE_LINE for side in sides)
            and config.enable_caching is not False
            and any(g.mamba_cache_mode == "align" and g.block_size > hbs for g in mamba)
        )
        self.defer_copy_frees = random.Random(f"copies {config!r}").random() < 0.5
        # vLLM 0.33.0's scheduler also drains the boundary-state offloads every step
        # (take_boundary_state_offloads: the Mamba 'align' states a KV connector may
        # save, with exact block ids), and with a KV producer asks a finishing
        # request's own partial prompt-tail state (finalize_partial_tail_offloads)
        # before freeing it (unsafe, so refused, while tokens are in flight: a
        # finishing request then sometimes has some, ``num_in_flight_tokens``). Only
        # when every side is of the 0.33 line and has both (the spec models them;
        # kvcache's and vLLM's 0.25.1 managers have neither), in cached layouts with a
        # Mamba 'align' group; the producer's choices come from the config, not
        # ``rng``: the sequences' other calls stay as they were.
        self.takes_offloads = (
            self.mamba_align
            and config.enable_caching is not False
            and all(
                side_line(side) != REFERENCE_LINE
                and hasattr(side.manager, "take_boundary_state_offloads")
                and hasattr(side.manager, "finalize_partial_tail_offloads")
                for side in sides
            )
        )
        self.producer_rng = random.Random(f"producer {config!r}")
        self.kv_producer = self.producer_rng.random() < 0.5
        # A step schedules several requests (a preemption among them, a free dropping
        # a request's offers) before its one drain: the driver's one-request steps
        # sometimes leave the drain to a later one.
        self.offload_rng = random.Random(f"offloads {config!r}")
        self.copy_frees: list[int] = []  # deferred: freed at the next step's end
        # vLLM 0.33.0's request fields the manager reads (``REQUEST_FIELDS_0_33``): a
        # ``session_id`` its BlockStored events carry, and ``kv_cache_report_mode``
        # "full", under which a lookup's hit blocks are reported as stored again. Only
        # when every side is of a line that has them; drawn from a generator of their
        # own, so that the sequences' other calls stay as they were.
        self.request_fields_rng = (
            random.Random(f"request fields {config!r}")
            if all(side_line(side) != REFERENCE_LINE for side in sides)
            else None
        )
        self.full_report = full_report_works(config)
        self.draws_session_id = all(
            getattr(side.adapter, "takes_session_id", True) for side in sides
        )
        # vLLM 0.33.0's scheduler with a KV connector that takes divergent hybrid hits
        # (``supports_divergent_local_hybrid_hits``) looks every request up with
        # ``get_computed_blocks_for_connector``, and again with ``get_computed_blocks``
        # when that hit diverged and the connector has no tokens for it. A choice of
        # the config's (its own generator: the sequences' other calls stay as they
        # were), only when every side is of a line that has the method. Not with
        # lookahead hashing: vLLM 0.33.0's config turns it off under a KV connector
        # (``VllmConfig.num_hash_lookahead_tokens``), and its per-group lookup of a
        # Mamba group would read past the fewer hashes (IndexError).
        self.connector_lookup = (
            config.num_hash_lookahead_tokens == 0
            and all(
                side_line(side) != REFERENCE_LINE
                and hasattr(side.manager, "get_computed_blocks_for_connector")
                for side in sides
            )
            and random.Random(f"connector lookup {config!r}").random() < CONNECTOR_LOOKUP_RATE
        )
        # vLLM 0.33.0's zeroing duties with a KV connector: an async load names the
        # groups it writes (``skip_zeroing_group_ids``: their blocks for the external
        # tokens are not reported for zeroing), and a failed load reports the
        # request's blocks past the valid prefix for zeroing again
        # (``record_blocks_for_zeroing``). Only when every side's manager has both
        # (vLLM's from 0.32.0 on, kvcache's 0.33.0 drop-in, the spec; not kvcache's
        # ``KVCacheManager(profile=...)``); drawn from a generator of their own (the
        # other calls stay as they were).
        self.zeroing_rng = (
            random.Random(f"zeroing {config!r}")
            if all(side_line(side) != REFERENCE_LINE and zeroing_duties(side) for side in sides)
            else None
        )

    # ------------------------------------------------------------ helpers

    def report_mode(self, request_id: str) -> str:
        """The request's ``kv_cache_report_mode`` (vLLM 0.33.0's default: incremental)."""
        for args in reversed(self.added):
            if args["request_id"] == request_id:
                return str(args.get("kv_cache_report_mode", "incremental"))
        return "incremental"

    def waiting(self) -> list[str]:
        return [r for r, q in self.live.items() if q.status in ("WAITING", "PREEMPTED")]

    def remote(self) -> list[str]:
        return [r for r, q in self.live.items() if q.status == "WAITING_FOR_REMOTE_KVS"]

    def chunk(self, remaining: int) -> int:
        """Tokens scheduled out of ``remaining``: often all, else a random chunk."""
        if remaining <= 1 or self.rng.random() < 0.6:
            return remaining
        return self.rng.randint(1, remaining)

    def lookahead_tokens(self) -> int:
        return self.lookahead if self.rng.random() < 0.9 else self.rng.randint(0, 3)

    def mamba_split(self, req: Req, num_new_tokens: int, num_new_computed_tokens: int = 0) -> int:
        """vLLM's block-aligned prefill split for Mamba "align" caching (without the
        Marconi common-prefix hint, which needs coordinator internals)."""
        if not self.mamba_align:
            return num_new_tokens
        num_computed = req.num_computed_tokens + num_new_computed_tokens
        if num_computed >= max(req.num_prompt_tokens, req.num_tokens - 1):
            return num_new_tokens  # decoding
        bs = self.block_size
        last_cache_position = req.num_tokens - req.num_tokens % bs
        if self.config.use_eagle:
            last_cache_position = max(last_cache_position - bs, 0)
        # A chunk whose layer saves the prompt's checkpoint inside it is not cut there.
        internal = self.internal_checkpoint(req, num_computed, num_computed + num_new_tokens)
        if internal:
            last_cache_position = 0
            self.run.stats.events["checkpoint_chunk"] += 1
        after = num_computed + num_new_tokens
        if after < last_cache_position:
            num_new_tokens = num_new_tokens // bs * bs
        elif num_computed < last_cache_position < after:
            num_new_tokens = last_cache_position - num_computed
        if self.fine_grained:
            hbs = self.config.hash_block_size
            tail = req.num_prompt_tokens if self.config.use_eagle else req.num_prompt_tokens - 1
            tail = max(tail, 0) // hbs * hbs - (hbs if self.config.use_eagle else 0)
            stops = [
                (num_computed // bs + 1) * bs if num_computed % bs and not internal else 0,
                tail if last_cache_position < tail < req.num_prompt_tokens and not internal else 0,
            ]
            end = num_computed + num_new_tokens
            inside = [p for p in stops if num_computed < p < end]
            if inside:
                num_new_tokens = min(inside) - num_computed
        return num_new_tokens

    def internal_checkpoint(self, req: Req, start: int, end: int) -> bool:
        """vLLM 0.33.0's scheduler: whether the prefill chunk ``[start, end)`` reaching
        the prefill's end lets the Mamba layers save the prompt's checkpoint inside it
        (every Mamba group has checkpoint blocks; the position exportable there)."""
        if not self.checkpoints:
            return False
        pure = spec_module("pure")  # the oracle's arithmetic: the kit imports spec lazily

        prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1)
        if end < prefill_end:
            return False
        hbs = self.config.hash_block_size
        position = pure.mamba_prompt_tail_boundary(
            prefill_end,
            hbs if self.fine_grained else self.block_size,
            self.config.use_eagle,
            self.config.num_hash_lookahead_tokens,
        )
        return bool(pure.mamba_checkpoint_exportable(
            start, end, position, hbs, self.block_size, self.checkpoint_alignment
        ))

    # ------------------------------------------------------------ actions

    def step(self) -> None:
        rng = self.rng
        actions: list[tuple[float, Callable[[], None]]] = [
            (0.5, self.evict_blocks),
            (0.25, self.reset_prefix_cache),
            (1.5, lambda: self.run.ok("take_events")),
            (0.8, lambda: self.run.ok("take_new_block_ids")),
            (0.4, lambda: self.run.ok("new_step_starts")),
            (0.5, lambda: self.run.ok("make_prefix_cache_stats")),
            (0.4, lambda: self.run.ok("usage")),
            (0.2, self.invalid_call),
        ]
        if len(self.live) < self.MAX_LIVE_REQUESTS:
            actions.append((3.0, self.add_request))
        if self.waiting():
            actions.append((4.0, self.schedule_waiting))
        if self.running:
            actions.append((6.0, self.schedule_running))
            actions.append((0.8, self.preempt_random))
            actions.append((1.0, self.common_prefix))
            actions.append((0.3, self.remove_skipped_blocks))
        if self.remote():
            actions.append((2.0, self.finish_remote_load))
        if self.live:
            actions.append((1.0, self.finish_random))
            actions.append((0.8, self.query_blocks))
        if self.deferred:
            actions.append((1.0, self.drain_deferred))
        weights = [w for w, _ in actions]
        rng.choices([a for _, a in actions], weights)[0]()

    def add_request(self) -> None:
        rng = self.rng
        request_id = f"r{len(self.all_ids)}"
        if self.added and rng.random() < 0.15:
            args = dict(rng.choice(self.added), request_id=request_id)
        else:
            stem = rng.choice(self.stems)
            tail_len = rng.randint(0, self.prompt_blocks * self.block_size + 1)
            tail = [rng.randrange(3) for _ in range(tail_len)]
            prompt = (stem + tail)[: self.config.max_model_len - 1] or [rng.randrange(3)]
            args = {"request_id": request_id, "prompt_token_ids": prompt}
            # R-SWA frees its gap only once a decode passes its window: longer decodes.
            args["max_tokens"] = rng.randint(1, 24 if self.rswa else 12)
            if rng.random() < 0.15:
                args["lora"] = rng.choice([["lora-a", 1], ["lora-b", 2]])
            if rng.random() < 0.1:
                args["cache_salt"] = rng.choice(["salt-x", "salt-y"])
            if rng.random() < 0.15:
                args["mm_features"] = self.random_mm_features(len(prompt))
            if rng.random() < 0.05:
                args["skip_reading_prefix_cache"] = True
            if rng.random() < 0.1:
                embeds = self.random_prompt_embeds(prompt)
                embeds_alone = rng.random() < 0.3
                if PROMPT_EMBEDS_DRAWN:  # the same draws either way: the same sequences
                    args["prompt_embeds"] = embeds
                    if embeds_alone:
                        args["prompt_token_ids"] = None  # the embeddings alone are the prompt
            if self.request_fields_rng is not None:
                args.update(
                    draw_request_fields_0_33(
                        self.request_fields_rng, self.full_report, self.draws_session_id
                    )
                )
        self.added.append(args)
        self.all_ids.append(request_id)
        self.run.ok("add_request", **args)
        prompt_len = len(args["prompt_token_ids"] or args.get("prompt_embeds") or [])
        self.live[request_id] = Req(request_id, prompt_len, prompt_len, args["max_tokens"])

    def random_prompt_embeds(self, prompt: list[int]) -> list[list[float]]:
        """Two-wide embedding rows, one per prompt token: the token and one of two
        "styles", so that equal prompts in one style share their prefix and the
        same tokens in the other style must not (exact binary fractions, so the
        float32 tensors and their digests are the same on every side)."""
        style = self.rng.choice([0.0, 0.5])
        return [[float(token), style] for token in prompt]

    def random_mm_features(self, prompt_len: int) -> list[list[Any]]:
        """1-2 sorted, non-overlapping placeholder ranges inside the prompt."""
        features: list[list[Any]] = []
        start = 0
        for _ in range(self.rng.randint(1, 2)):
            if start >= prompt_len:
                break
            offset = self.rng.randint(start, prompt_len - 1)
            length = self.rng.randint(1, min(2 * self.block_size, prompt_len - offset))
            features.append([self.rng.choice(["img-0", "img-1"]), offset, length])
            start = offset + length
        return features

    def schedule_waiting(self) -> None:
        """Admit a waiting or preempted request (the scheduler's WAITING loop)."""
        rng = self.rng
        req = self.live[rng.choice(self.waiting())]
        rid = req.request_id
        hit: dict[str, Any] = {}
        if req.num_computed_tokens == 0:
            lookup = LOOKUP_OPS[1] if self.connector_lookup else LOOKUP_OPS[0]
            hit = self.run.ok(lookup, request_id=rid)
            num_hit_tokens = hit["num_computed_tokens"]
            which = "last"
            if num_hit_tokens and self.report_mode(rid) == "full":
                self.run.stats.events["full_report_hit"] += 1
        else:  # after an async KV load: no new lookup
            num_hit_tokens = 0
            which = "empty"
        num_external = 0
        load_async = False
        room = req.num_tokens - req.num_computed_tokens - num_hit_tokens
        if req.num_computed_tokens == 0 and rng.random() < 0.15:
            if rng.random() < 0.4 and room >= 1:
                load_async = True
                num_external = rng.randint(1, room)
            elif room >= 2:
                num_external = rng.randint(1, room - 1)
            if self.mamba_align:  # connectors hand over whole blocks of Mamba state
                bs = self.block_size
                num_external = (num_hit_tokens + num_external) // bs * bs - num_hit_tokens
                num_external = max(num_external, 0)
                load_async = load_async and num_external > 0
        if num_external and self.untrimmed_hit(hit, num_hit_tokens + num_external):
            num_external = 0  # vLLM 0.25.1 would miscount its pool (docs/divergences.md #17)
            load_async = False
        if hit.get("hit_diverged"):
            if num_external:
                self.run.stats.events["connector_diverged_external"] += 1
            else:
                # As vLLM 0.33.0's scheduler: no external tokens back the deeper local
                # hit (a group has no state there), so look up the length all agree on.
                self.run.stats.events["connector_fallback"] += 1
                hit = self.run.ok("get_computed_blocks", request_id=rid)
                num_hit_tokens = hit["num_computed_tokens"]
        total = req.num_computed_tokens + num_hit_tokens + num_external
        num_new_tokens = 0
        if not load_async:
            num_new_tokens = self.mamba_split(
                req, self.chunk(req.num_tokens - total), num_hit_tokens + num_external
            )
            if num_new_tokens == 0:
                return  # no block-aligned chunk fits: vLLM leaves it waiting
        has_scheduled = bool(self.running) if rng.random() < 0.85 else rng.random() < 0.5
        zeroing: dict[str, Any] = {}
        if load_async and self.zeroing_rng is not None:
            # the groups the connector's load writes, as vLLM 0.33.0's scheduler asks it
            skipped = [g for g in range(len(self.config.groups)) if self.zeroing_rng.random() < 0.5]
            if skipped:
                zeroing["skip_zeroing_group_ids"] = skipped
                self.run.stats.events["skip_zeroing"] += 1
        ok, blocks = self.allocate(
            rid,
            num_new_tokens=num_new_tokens,
            num_new_computed_tokens=num_hit_tokens,
            new_computed_blocks=which,
            num_lookahead_tokens=0 if load_async else self.lookahead_tokens(),
            num_external_computed_tokens=num_external,
            delay_cache_blocks=load_async or rng.random() < 0.05,
            num_encoder_tokens=rng.randint(1, 12) if self.encoder_decoder else 0,
            full_sequence_must_fit=self.full_sequence_must_fit != (rng.random() < 0.1),
            reserved_blocks=0 if rng.random() < 0.85 else rng.randint(1, 3),
            has_scheduled_reqs=has_scheduled,
            **zeroing,
        )
        if not ok or blocks is None:
            return
        if load_async:
            req.status = "WAITING_FOR_REMOTE_KVS"
            req.num_computed_tokens = total
            self.run.ok(
                "update_request", request_id=rid, status=req.status, num_computed_tokens=total
            )
            return
        req.status = "RUNNING"
        self.running.append(rid)
        self.computed(req, num_new_tokens, total, num_draft_tokens=0)

    def schedule_running(self) -> None:
        """Schedule a running request: a prefill chunk, or a decode with drafts."""
        rng = self.rng
        rid = rng.choice(self.running)
        req = self.live[rid]
        remaining = req.num_tokens - req.num_computed_tokens
        cap = self.config.max_model_len - req.num_computed_tokens - 1
        num_new_tokens = self.mamba_split(req, min(self.chunk(remaining), cap))
        num_draft_tokens = 0
        drafts_past_hashes = False
        if remaining == 1 and rng.random() < (0.4 if self.lookahead else 0.1):
            num_draft_tokens = min(rng.randint(1, 3), cap - num_new_tokens, self.max_draft_tokens)
            if self.checkpoints:
                # vLLM 0.33.0 can reserve a checkpoint inside draft tokens that span a
                # hash block, and then asserts keying it past the hashed tokens
                # (docs/divergences.md, "vLLM 0.33.0: matched although doubtful"):
                # half of such decodes keep their drafts (a few cases per hundred
                # sequences), the others get fewer than a hash block.
                drafts_past_hashes = rng.random() < DRAFTS_PAST_HASHES_RATE
                if not drafts_past_hashes:
                    num_draft_tokens = min(num_draft_tokens, self.config.hash_block_size - 1)
            num_draft_tokens = max(num_draft_tokens, 0)
        drafts_past_hashes = drafts_past_hashes and num_draft_tokens >= self.config.hash_block_size
        if num_new_tokens <= 0:
            return
        while True:
            ok, blocks = self.allocate(
                rid,
                num_new_tokens=num_new_tokens + num_draft_tokens,
                num_lookahead_tokens=self.lookahead_tokens(),
                may_assert=drafts_past_hashes,
            )
            if not ok:
                return
            if blocks is not None:
                break
            if rng.random() < 0.3:
                return  # the scheduler gives up on this request for this step
            victim = self.running[-1] if rng.random() < 0.7 else rng.choice(self.running)
            self.preempt(victim)
            if victim == rid:
                return
        self.computed(
            req, num_new_tokens + num_draft_tokens, req.num_computed_tokens, num_draft_tokens
        )

    def untrimmed_hit(self, hit: Mapping[str, Any], num_tokens: int) -> bool:
        """Whether a lookup left a group more hit blocks than ``num_tokens`` need.

        vLLM 0.25.1 trims only the first full-attention group's hits (three or
        more full groups); external tokens then make it ask its pool for a
        negative number of blocks, which inflates its free count and can later
        hand out its sentinel block (id -1). A scheduler meets this only with a
        KV connector; the driver does not generate it (docs/divergences.md #17).
        """
        block_ids = hit.get("block_ids", {})
        groups = block_ids.get("tuple") if isinstance(block_ids, dict) else None
        if not isinstance(groups, list):
            return False
        return any(
            len(blocks) > -(-num_tokens // group.block_size)
            for blocks, group in zip(groups, self.config.groups, strict=False)
        )

    def allocate(self, rid: str, may_assert: bool = False, **args: Any) -> tuple[bool, Any]:
        """``allocate_slots``; returns (ok, block ids or None).

        vLLM's admission check undercounts a few hybrid cases (external tokens
        beside Mamba and sliding-window groups), so the pool can run dry
        inside ``allocate_slots``: ValueError "Cannot get N free blocks".
        kvcache must do the same; the driver then aborts the request, as an
        engine would after the error. With ``may_assert`` (a decode whose drafts
        span a hash block in a checkpoint layout) the reference may also refuse a
        checkpoint inside the drafts (``CHECKPOINT_IN_DRAFTS_RAISES``): counted as
        ``checkpoint_in_drafts``, and the request is aborted the same way.
        """
        expected = self.run.call("allocate_slots", request_id=rid, **args)
        if "raises" not in expected:
            if expected["ok"] is not None:
                self.take_offloads(maybe=True)
                self.take_copies()
            return True, expected["ok"]
        refused = str(expected.get("message", "")).startswith("Cannot get")
        if may_assert and not refused and expected["raises"] in CHECKPOINT_IN_DRAFTS_RAISES:
            # A checkpoint inside draft tokens: vLLM 0.33.0 asserts, kvcache and the
            # spec raise ValueError (both sides compared at the call). The engine
            # would stop; the request is aborted.
            self.run.stats.events["checkpoint_in_drafts"] += 1
            self.finish(rid, "FINISHED_ABORTED")
            return False, None
        if expected["raises"] != "ValueError":
            raise DriverError(
                f"{self.run.reference_name} raised {expected['raises']} on "
                f"allocate_slots({rid}, {args}): {expected.get('message')}"
            )
        self.run.stats.events["allocate_pool_ran_dry"] += 1
        self.finish(rid, "FINISHED_ABORTED")
        return False, None

    def computed(
        self, req: Req, num_scheduled: int, num_computed_before: int, num_draft_tokens: int
    ) -> None:
        """After a step: advance computed tokens, and sample if the prefill is done."""
        rng = self.rng
        num_computed = num_computed_before + num_scheduled
        if num_computed < req.num_tokens:
            req.num_computed_tokens = num_computed
            self.run.ok(
                "update_request",
                request_id=req.request_id,
                status=req.status,
                num_computed_tokens=num_computed,
            )
            return
        num_accepted = rng.randint(0, num_draft_tokens)
        num_computed -= num_draft_tokens - num_accepted
        req.num_computed_tokens = num_computed
        self.run.ok(
            "update_request",
            request_id=req.request_id,
            status=req.status,
            num_computed_tokens=num_computed,
        )
        new_tokens = [rng.randrange(2) for _ in range(num_accepted + 1)]
        self.run.ok(
            "append_output_token_ids",
            request_id=req.request_id,
            token_ids=new_tokens[0] if len(new_tokens) == 1 and rng.random() < 0.5 else new_tokens,
        )
        req.num_tokens += len(new_tokens)
        req.num_output_tokens += len(new_tokens)
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            self.finish(req.request_id, "FINISHED_LENGTH_CAPPED")
        elif rng.random() < 0.05:
            self.finish(req.request_id, "FINISHED_STOPPED")

    def free_request_blocks(self, rid: str) -> None:
        """``free``, or ``pop_blocks_for_free`` now and ``free_blocks`` later."""
        if self.rng.random() < 0.75:
            self.run.ok("free", request_id=rid)
            return
        handle = self.next_handle
        self.next_handle += 1
        self.run.ok("pop_blocks_for_free", request_id=rid, handle=handle)
        self.deferred.append(handle)

    def preempt(self, rid: str) -> None:
        req = self.live[rid]
        self.running.remove(rid)
        self.free_request_blocks(rid)
        req.status = "PREEMPTED"
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.run.ok(
            "update_request",
            request_id=rid,
            status="PREEMPTED",
            num_computed_tokens=0,
            num_preemptions=req.num_preemptions,
        )

    def preempt_random(self) -> None:
        self.preempt(self.rng.choice(self.running))

    def finish(self, rid: str, status: str) -> None:
        self.live.pop(rid)
        if rid in self.running:
            self.running.remove(rid)
        in_flight = 0
        if self.takes_offloads and self.kv_producer:
            in_flight = self.producer_rng.choice([0, 0, 0, 1, 2])
        if in_flight:
            self.run.ok(
                "update_request", request_id=rid, status=status, num_in_flight_tokens=in_flight
            )
        else:
            self.run.ok("update_request", request_id=rid, status=status)
        if self.takes_offloads and self.kv_producer:
            tails = self.run.ok("finalize_partial_tail_offloads", request_id=rid)
            self.run.stats.events["partial_tail_offloads"] += len(tails)
        self.free_request_blocks(rid)

    def finish_random(self) -> None:
        self.finish(self.rng.choice(sorted(self.live)), "FINISHED_ABORTED")

    def finish_remote_load(self) -> None:
        """The connector reports an async KV load done (sometimes with failed blocks)."""
        rng = self.rng
        req = self.live[rng.choice(self.remote())]
        rid = req.request_id
        if rng.random() < 0.8:
            self.run.ok("cache_blocks", request_id=rid, num_computed_tokens=req.num_computed_tokens)
            if req.num_computed_tokens == req.num_tokens:
                req.num_computed_tokens = req.num_tokens - 1
        else:  # invalid blocks: keep the longest valid block-aligned prefix
            bs = self.block_size
            num_valid_blocks = min(req.num_computed_tokens, req.num_tokens - 1) // bs
            req.num_computed_tokens = rng.randint(0, num_valid_blocks) * bs
            self.run.ok(
                "update_request", request_id=rid, num_computed_tokens=req.num_computed_tokens
            )
            if req.num_computed_tokens:
                self.run.ok(
                    "cache_blocks", request_id=rid, num_computed_tokens=req.num_computed_tokens
                )
                cp = self.config.dcp_world_size * self.config.pcp_world_size
                if self.zeroing_rng is not None and all(
                    req.num_computed_tokens % (g.block_size * cp) == 0 for g in self.config.groups
                ):  # a multiple of every group's block (under context parallelism too)
                    # vLLM 0.33.0's scheduler: the blocks past the valid prefix were
                    # never written, and their zeroing was skipped; zero them now
                    self.run.ok(
                        "record_blocks_for_zeroing",
                        request_id=rid,
                        start_token=req.num_computed_tokens,
                    )
            else:
                self.run.ok("free", request_id=rid)
        req.status = "PREEMPTED" if req.num_preemptions else "WAITING"
        self.run.ok(
            "update_request",
            request_id=rid,
            status=req.status,
            num_computed_tokens=req.num_computed_tokens,
        )

    def take_copies(self, last: bool = False) -> None:
        """The end of a scheduler step (0.33 line; the driver's steps schedule one
        request): take the copy-on-write copies and free the blocks they retain, at
        once, or (``defer_copy_frees``) at the end of the next step, when the step
        that ran the copies has been processed; ``last``: the final one, all freed."""
        if not self.takes_copies:
            return
        processed, self.copy_frees = self.copy_frees, []
        handle = self.next_handle
        result = self.run.ok("take_kv_cache_block_copies", handle=handle)
        if result["copies"]:  # else the scheduler frees nothing
            self.next_handle += 1
            self.run.stats.events["cow_copies"] += len(result["copies"])
            if self.defer_copy_frees and not last:
                self.copy_frees.append(handle)
                self.run.stats.events["cow_frees_deferred"] += 1
            else:
                processed.append(handle)
        for done in processed:
            self.run.ok("free_blocks", handle=done)

    def take_offloads(self, maybe: bool = False) -> None:
        """The boundary-state offloads of the step (``takes_offloads``), counted;
        ``maybe``: one time in four left to a later step (``offload_rng``)."""
        if not self.takes_offloads or (maybe and self.offload_rng.random() < 0.25):
            return
        offloads = self.run.ok("take_boundary_state_offloads")
        self.run.stats.events["boundary_offloads"] += sum(len(v) for v in offloads.values())

    def drain_deferred(self) -> None:
        for _ in range(self.rng.randint(1, len(self.deferred))):
            self.run.ok("free_blocks", handle=self.deferred.pop(0))

    def evict_blocks(self) -> None:
        n = self.config.num_blocks
        block_ids = sorted(self.rng.sample(range(n), self.rng.randint(1, min(3, n))))
        self.run.ok("evict_blocks", block_ids=block_ids)

    def reset_prefix_cache(self) -> None:
        self.run.ok("reset_prefix_cache")

    def common_prefix(self) -> None:
        if self.rng.random() < 0.05:
            rid = self.rng.choice(self.all_ids)  # vLLM then records an empty entry
        else:
            rid = self.rng.choice(self.running)
        self.run.ok("get_num_common_prefix_blocks", request_id=rid)

    def remove_skipped_blocks(self) -> None:
        req = self.live[self.rng.choice(self.running)]
        self.run.ok(
            "remove_skipped_blocks",
            request_id=req.request_id,
            total_computed_tokens=req.num_computed_tokens,
            num_prompt_tokens=req.num_prompt_tokens,
        )

    def query_blocks(self) -> None:
        req = self.live[self.rng.choice(sorted(self.live))]
        op = self.rng.choice(["get_block_ids", "get_blocks", "get_block_ids_for_computed_tokens"])
        if op == "get_block_ids_for_computed_tokens":
            self.run.ok(op, request_id=req.request_id, num_computed_tokens=req.num_computed_tokens)
        else:
            self.run.ok(op, request_id=req.request_id)

    def invalid_call(self) -> None:
        """Calls vLLM rejects before changing anything."""
        if self.live and self.rng.random() < 0.5:
            rid = self.rng.choice(sorted(self.live))
            self.run.raises("allocate_slots", request_id=rid, num_new_tokens=0)
        else:
            bad_id = self.config.num_blocks + self.rng.randint(0, 3)
            self.run.raises("evict_blocks", block_ids=[bad_id])

    def drain(self) -> None:
        """Finish everything, then check the pool comes back whole."""
        for rid in sorted(self.live):
            self.finish(rid, "FINISHED_ABORTED")
        self.take_offloads()
        self.take_copies(last=True)
        while self.deferred:
            self.run.ok("free_blocks", handle=self.deferred.pop(0))
        for op in ("take_events", "take_new_block_ids", "make_prefix_cache_stats", "usage"):
            self.run.ok(op)
        self.run.ok("reset_prefix_cache")
        self.run.ok("take_events")
