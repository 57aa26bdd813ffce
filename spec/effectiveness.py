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
* **Write side.** A boundary an earlier request *computed* for this prefix but the
  pool never held (``Lookup.uncached``) counts too: the lookup starts from what the
  pool could serve had it kept everything computed (``Verdict.computed``). The
  ``retention`` rule explains the boundaries a sparse retention interval drops
  (``kept``); a boundary the rule keeps and the pool never held is a loss no rule
  explains (a retention tail not kept, a state the release keeps at the wrong place).
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

__all__ = [
    "KINDS", "LOSS_RULES", "SPARSE_KINDS", "Group", "Lookup", "Verdict", "achievable",
    "explain", "kept", "written",
]  # fmt: skip


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
    # sliding-window hit only at a cached block); under EAGLE that block is the one
    # after the hit instead, which the eagle_drop rule asks for (``resumable``).
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


def written(group: Group, computed: int, replay: int) -> range:
    """The write rule: the boundaries at which ``group`` holds a request's KV, keyed once
    a manager caches it, when the request has computed ``computed`` tokens: every full
    block an attention kind still reads there (the whole prefix, the window's tokens
    before ``computed`` (none for a one-token window), the chunk); for a state kind the
    state at the request's replay boundary ``replay`` (where a repeat of its prompt
    resumes), the one state every retention keeps; nothing for the other kinds."""
    rule = KINDS[group.kind]
    if rule == "nothing" or computed <= 0:
        return range(0)
    if rule is None:
        return range(computed, computed + 1) if computed == replay else range(0)
    assert callable(rule)
    start = computed - group.span + 1 if rule is _window else rule(computed, group.span)[0]
    size = group.block_size
    return range((max(start, 0) // size + 1) * size, computed + 1, size)


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
    """Whether ``group`` can resume a request at ``L`` tokens from the pool. An EAGLE
    group of a one-token window reads nothing before ``L``: vLLM anchors its hit at
    the EAGLE block after it, which the ``eagle_drop`` rule asks for."""
    rule = KINDS[group.kind]
    if rule == "nothing" or L == 0:
        return True
    if rule is None:
        return L in cached
    assert callable(rule)
    if rule is _window and group.span <= 1 and group.eagle:
        return True  # reads no earlier token; its search's anchor is the EAGLE block
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
    #: Per group: boundaries an earlier request computed for this prefix that the
    #: pool never held (so none of them was evicted).
    uncached: tuple[frozenset[int], ...] = ()
    #: The retention interval in tokens (None: dense, every computed boundary kept).
    retention: int | None = None
    #: The reusable boundaries of the requests that computed this prefix: where a
    #: repeat of each one's prompt resumes (the replay boundary a retention keeps).
    replay: frozenset[int] = frozenset()

    def holdings(self, view: str) -> tuple[frozenset[int], ...]:
        """Per group, the boundaries held in ``view``: ``"pool"`` (cached now),
        ``"kept"`` (plus what the retention rule keeps of ``uncached``) or
        ``"computed"`` (plus all of ``uncached``)."""
        if not self.uncached or view == "pool":
            return self.cached
        return tuple(
            cached | frozenset(p for p in extra if view == "computed" or kept(self, g, p))
            for cached, extra, g in zip(self.cached, self.uncached, self.groups, strict=True)
        )


#: Kinds a sparse retention interval thins out (the others keep every block).
SPARSE_KINDS = frozenset({"sliding_window", "sliding_window_mla", "mamba"})


def kept(lookup: Lookup, group: Group, p: int) -> bool:
    """The retention rule: whether ``group`` must keep the boundary ``p`` it computed.
    Dense retention keeps everything; a sparse interval ``r`` keeps, for windows
    and states, each multiple of ``r`` (none when ``r`` is 0) and each replay
    boundary (``Lookup.replay``): a state exactly there, a window block where the
    window of one of those boundaries reads it."""
    r = lookup.retention
    if r is None or group.kind not in SPARSE_KINDS:
        return True
    boundaries = set(lookup.replay)
    if r > 0:
        boundaries |= set(range(r, lookup.hashed_tokens + group.span + r, r))
    if KINDS[group.kind] is None:
        return p in boundaries
    rule = KINDS[group.kind]
    assert callable(rule)
    for b in boundaries:
        start, end = rule(b, group.span)
        if p > start and p - group.block_size < end:
            return True
    return False


class LossRule(NamedTuple):
    """A named rule a realized hit obeys: ``allows(lookup, L)``."""

    name: str
    what: str
    allows: Callable[[Lookup, int], bool]


def _every_group_resumes(lookup: Lookup, view: str, L: int) -> bool:
    held = lookup.holdings(view)
    return all(resumable(g, c, L) for g, c in zip(lookup.groups, held, strict=True))


def _eagle_allows(lookup: Lookup, L: int) -> bool:
    held = lookup.holdings("kept")
    for i, group in enumerate(lookup.groups):
        if not group.eagle or KINDS[group.kind] is None or KINDS[group.kind] == "nothing":
            continue
        step = lookup.eagle_step[i] if lookup.eagle_step else group.block_size
        anchor = group._replace(eagle=False)  # the block after the hit, as any hit's own
        if L + step > lookup.num_tokens - 1 or not resumable(anchor, held[i], L + step):
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
        "retention",
        "a sparse retention interval keeps only some states and window blocks (each "
        "multiple of the interval, the replay boundaries); what it drops was never cached",
        lambda k, L: _every_group_resumes(k, "kept", L),
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
    #: What the pool could serve had it kept everything computed (>= achievable).
    computed: int = 0

    @property
    def unexplained(self) -> int:
        """Tokens the rules leave that the lookup did not reuse."""
        return max(0, self.expected - self.realized)

    @property
    def false_hit(self) -> bool:
        """A hit longer than the pool's contents can serve."""
        return self.realized > self.achievable


def candidates(lookup: Lookup, view: str = "pool") -> list[int]:
    """Every ``L`` (hash-block multiples up to the hashed tokens) all groups can
    resume at from ``view`` (``Lookup.holdings``), longest first."""
    h = lookup.hash_block
    top = lookup.hashed_tokens // h * h
    return [L for L in range(top, -1, -h) if _every_group_resumes(lookup, view, L)]


def achievable(lookup: Lookup) -> int:
    """The longest prefix the pool's contents could serve (0 when none)."""
    return candidates(lookup)[0]


def explain(lookup: Lookup, realized: int, rules: Sequence[LossRule] = LOSS_RULES) -> Verdict:
    """Judge a lookup that reused ``realized`` tokens: from what the pool could serve
    had it kept everything computed, the loss each rule explains (in ``rules``
    order) and what the rules leave; and the achievable hit from the pool now."""
    left = candidates(lookup, "computed")
    best = most = left[0]
    losses: dict[str, int] = {}
    for rule in rules:
        left = [L for L in left if rule.allows(lookup, L)] or [0]
        if left[0] < best:
            losses[rule.name] = best - left[0]
            best = left[0]
    return Verdict(achievable(lookup), best, realized, losses, most)
