"""What a prefix-cache lookup could have reused, and which rule cost the rest.

An equality oracle reproduces a release's losses faithfully; this module states
what a lookup *could* reuse, from the pool's contents alone, so that a lookup
that reuses less, with no rule to say why, is flagged.

The model is content-level and knows nothing of any search algorithm:

* **Content.** The pool holds, for each group, blocks cached under keys; for a
  request, group ``g``'s key at token boundary ``P`` (a multiple of the hash block)
  is the request's hash of its first ``P`` tokens. A cached key at ``P`` means the
  pool holds the KV (or the state) of the group's block that ends at ``P``.
* **Resume rules, one row per kind** (``KINDS``). To resume a request at ``L``
  computed tokens, a group needs the KV of a token range before ``L`` (the whole
  prefix for full attention, the window for sliding window, the current chunk for
  chunked local attention) or, for a state kind (Mamba), the state at exactly ``L``.
  A kind outside prefix caching (cross attention, ring buffers) needs nothing.
* **Achievable**: the largest ``L`` (a multiple of the hash block, at most the
  request's hashed tokens) every group can resume at.
* **Loss rules** (``LOSS_RULES``), applied in order, each a condition a realized
  hit must also meet; the loss a rule explains is how far it lowers the best ``L``.
  Realized below what the rules leave is an *unexplained* loss (a finding);
  realized above the achievable is a *false hit* (an error).

The rules are lower bounds a correct manager meets; a release may reuse more
(vLLM 0.33.0's hybrid EAGLE lookahead up to the hashed tokens does), never less.

Plain data in, plain data out; imports nothing of kvcache or vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["KINDS", "LOSS_RULES", "Group", "Lookup", "Verdict", "achievable", "explain"]


class Group(NamedTuple):
    """One KV-cache group as the resume rules see it.

    ``kind``: a key of ``KINDS``; ``block_size``: tokens per block (context
    parallelism included); ``span``: the window (sliding window) or chunk (chunked
    local); ``eagle``: the group drops a hit's last block for an EAGLE drafter.
    """

    kind: str
    block_size: int
    span: int = 0
    eagle: bool = False


def _prefix(L: int, span: int) -> tuple[int, int]:
    return 0, L


def _window(L: int, span: int) -> tuple[int, int]:
    # A window of one token still needs the block before L (vLLM finds a
    # sliding-window hit only at a cached block).
    return max(0, L - max(span, 2) + 1), L


def _chunk(L: int, span: int) -> tuple[int, int]:
    return L // span * span, L


#: Kind -> the token range whose KV it needs to resume at ``L`` (None: the state at
#: exactly ``L``; "nothing": no constraint). One row per kind the kit draws.
KINDS: dict[str, Callable[[int, int], tuple[int, int]] | str | None] = {
    "full": _prefix,
    "mla": _prefix,
    "rswa": _prefix,
    "sink": _prefix,
    "tq_full": _prefix,
    "hidden_state": _prefix,
    "sliding_window": _window,
    "sliding_window_mla": _window,
    "chunked_local": _chunk,
    "mamba": None,
    "cross_attention": "nothing",
    "circular": "nothing",
}


def holds(group: Group, cached: frozenset[int], start: int, end: int) -> bool:
    """Whether the pool holds group's KV of tokens ``[start, end)``: every block
    meeting the range is cached at its end, or (a partial entry) at a boundary
    inside it no earlier than ``end``."""
    size = group.block_size
    for index in range(start // size, -(-end // size)):
        block_end = (index + 1) * size
        if block_end in cached:
            continue
        need = min(end, block_end)
        if need == block_end or not any(need <= p < block_end for p in cached):
            return False
    return True


def resumable(group: Group, cached: frozenset[int], L: int) -> bool:
    """Whether ``group`` can resume a request at ``L`` tokens from the pool."""
    rule = KINDS[group.kind]
    if rule == "nothing" or L == 0:
        return True
    if rule is None:
        return L in cached
    assert callable(rule)
    start, end = rule(L, group.span)
    return holds(group, cached, start, end)


@dataclass(frozen=True)
class Lookup:
    """One lookup, as plain data.

    ``cached[i]``: the token boundaries at which group ``i`` has this request's key
    cached. ``alignment``: the token multiple a hit must end on (the scheduler
    block; the hash block where hits may end inside a block). ``eagle_step``: how
    far an EAGLE group looks past the hit (its block, or the hash block).
    """

    groups: tuple[Group, ...]
    cached: tuple[frozenset[int], ...]
    num_tokens: int
    hashed_tokens: int
    hash_block: int
    alignment: int
    caching: bool = True
    skips_reading: bool = False
    eagle_step: tuple[int, ...] = ()


class LossRule(NamedTuple):
    """A named rule a realized hit obeys: ``allows(lookup, L)``."""

    name: str
    what: str
    allows: Callable[[Lookup, int], bool]


def _eagle_allows(lookup: Lookup, L: int) -> bool:
    for i, group in enumerate(lookup.groups):
        if not group.eagle or KINDS[group.kind] is None or KINDS[group.kind] == "nothing":
            continue
        step = lookup.eagle_step[i] if lookup.eagle_step else group.block_size
        if L + step > lookup.num_tokens - 1 or not resumable(group, lookup.cached[i], L + step):
            return False
    return True


LOSS_RULES: tuple[LossRule, ...] = (
    LossRule("caching_off", "prefix caching is off: no lookup hits", lambda k, L: k.caching),
    LossRule(
        "request_skips_cache",
        "the request reads no prefix cache (skip_reading_prefix_cache: prompt logprobs...)",
        lambda k, L: not k.skips_reading,
    ),
    LossRule(
        "last_token",
        "the last token is always recomputed (its logits): a hit ends by num_tokens - 1",
        lambda k, L: k.num_tokens - 1 >= L,
    ),
    LossRule(
        "block_alignment",
        "a hit ends on the alignment (scheduler block, or hash block with fine-grained hits)",
        lambda k, L: L % k.alignment == 0,
    ),
    LossRule(
        "eagle_drop",
        "an EAGLE group (not a state kind) also holds the block after the hit, within "
        "num_tokens - 1: its last hit block is recomputed for the drafter",
        _eagle_allows,
    ),
)


@dataclass(frozen=True)
class Verdict:
    """A lookup judged: tokens achievable, left by the rules, realized; the loss
    each rule explains; what no rule explains; whether the hit was false."""

    achievable: int
    expected: int
    realized: int
    losses: dict[str, int] = field(default_factory=dict)

    @property
    def unexplained(self) -> int:
        """Tokens the rules leave that the lookup did not reuse."""
        return max(0, self.expected - self.realized)

    @property
    def false_hit(self) -> bool:
        """A hit longer than the pool's contents can serve."""
        return self.realized > self.achievable


def candidates(lookup: Lookup) -> list[int]:
    """Every ``L`` (hash-block multiples up to the hashed tokens) all groups can
    resume at, longest first."""
    h = lookup.hash_block
    top = lookup.hashed_tokens // h * h
    return [
        L
        for L in range(top, -1, -h)
        if all(resumable(g, c, L) for g, c in zip(lookup.groups, lookup.cached, strict=True))
    ]


def achievable(lookup: Lookup) -> int:
    """The longest prefix the pool's contents could serve (0 when none)."""
    return candidates(lookup)[0]


def explain(lookup: Lookup, realized: int, rules: Sequence[LossRule] = LOSS_RULES) -> Verdict:
    """Judge a lookup that reused ``realized`` tokens: the achievable hit, the loss
    each rule explains (in ``rules`` order), and what the rules leave."""
    left = candidates(lookup)
    best = most = left[0]
    losses: dict[str, int] = {}
    for rule in rules:
        left = [L for L in left if rule.allows(lookup, L)] or [0]
        if left[0] < best:
            losses[rule.name] = best - left[0]
            best = left[0]
    return Verdict(most, best, realized, losses)
