"""What a KV-cache manager is built from, as plain data every adapter understands.

``ManagerConfig`` holds vLLM 0.25.1's ``KVCacheManager`` constructor arguments
plus the KV-cache groups (``GroupConfig``): one per group, each a kind (full
attention, sliding window, chunked local attention, Mamba, cross attention),
a block size and the kind's parameters. Adapters (``kvcache.kit.sides``) turn a
config into their own ``KVCacheConfig``; traces store it in their header.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

GROUP_KINDS = (
    "full",
    "sliding_window",
    "chunked_local",
    "mamba",
    "cross_attention",
    "mla",
    "sliding_window_mla",
    "rswa",
    "sink",
    "tq_full",
    "hidden_state",
    "circular",
)
MAMBA_CACHE_MODES = ("none", "all", "align")
HASH_FNS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


@dataclass(frozen=True)
class GroupConfig:
    """One KV-cache group.

    Attributes:
        kind: full | sliding_window | chunked_local | mamba | cross_attention |
            mla (``MLAAttentionSpec``) | sliding_window_mla (``SlidingWindowMLASpec``) |
            rswa (``RSWASpec``) | sink (``SinkFullAttentionSpec``) |
            tq_full (``TQFullAttentionSpec``) | hidden_state (``HiddenStateCacheSpec``) |
            circular (``CircularBufferSpec``, vLLM 0.33.0: one ring block per request).
        block_size: Tokens per block.
        sliding_window: Window of a sliding_window (or sliding_window_mla) group.
        attention_chunk_size: Chunk of a chunked_local group.
        mamba_cache_mode: none | all | align, for a mamba group.
        num_speculative_blocks: Extra state blocks of a mamba group (speculative decoding).
        is_eagle_group: vLLM's ``KVCacheGroupSpec.is_eagle_group``.
        num_kv_heads: Attention heads; groups with equal specs must differ here.
        rswa_window: Decode window of an rswa (reference sliding-window) group.
        sink_len: Sink tokens of a sink (full attention with sinks) group.
        num_prefill_checkpoint_blocks: vLLM 0.33.0's ``MambaSpec`` field: state blocks a
            mamba group may reserve for prefill checkpoints (0: none; 0.25.1 has no
            such field, so a group with it cannot be built there).
        prefill_checkpoint_alignment: vLLM 0.33.0's ``MambaSpec`` field: the spacing of
            the checkpoints the layer can export (None: none).
    """

    kind: str
    block_size: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    is_eagle_group: bool = False
    num_kv_heads: int = 1
    rswa_window: int | None = None
    sink_len: int | None = None
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"group kind={self.kind!r}; expected one of {', '.join(GROUP_KINDS)}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size={self.block_size!r}; expected a positive int")
        if self.kind in ("sliding_window", "sliding_window_mla") and not self.sliding_window:
            raise ValueError(f"a {self.kind} group needs sliding_window")
        if self.kind == "chunked_local" and not self.attention_chunk_size:
            raise ValueError("a chunked_local group needs attention_chunk_size")
        if self.kind == "rswa" and not self.rswa_window:
            raise ValueError("an rswa group needs rswa_window")
        if self.kind == "sink" and not self.sink_len:
            raise ValueError("a sink group needs sink_len")
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(f"mamba_cache_mode={self.mamba_cache_mode!r}")
        blocks, alignment = self.num_prefill_checkpoint_blocks, self.prefill_checkpoint_alignment
        if type(blocks) is not int or blocks < 0:
            raise ValueError(
                f"num_prefill_checkpoint_blocks={blocks!r}; expected a non-negative int"
            )
        if alignment is not None and (type(alignment) is not int or alignment < 1):
            raise ValueError(
                f"prefill_checkpoint_alignment={alignment!r}; expected a positive int or None"
            )
        if self.has_checkpoint_fields and self.kind != "mamba":
            raise ValueError(f"a {self.kind} group has no prefill checkpoint fields")

    @property
    def has_checkpoint_fields(self) -> bool:
        """Whether 0.33.0's prefill checkpoint fields are set (not at their defaults)."""
        return (
            self.num_prefill_checkpoint_blocks != 0 or self.prefill_checkpoint_alignment is not None
        )

    def record(self) -> dict[str, Any]:
        """JSON form; the checkpoint fields only when set (older headers lack them)."""
        record = asdict(self)
        for name in CHECKPOINT_FIELDS:
            if record[name] == GROUP_DEFAULTS[name]:
                del record[name]
        return record

    @property
    def label(self) -> str:
        """Short name for reports: full, swa, chunked, mamba-align, cross, ..."""
        if self.kind == "sliding_window":
            return "swa"
        if self.kind == "chunked_local":
            return "chunked"
        if self.kind == "mamba":
            return f"mamba-{self.mamba_cache_mode}"
        if self.kind == "cross_attention":
            return "cross"
        if self.kind == "mla":
            return "mla"
        if self.kind == "sliding_window_mla":
            return "swa-mla"
        if self.kind in ("rswa", "sink", "circular"):
            return self.kind
        if self.kind == "tq_full":
            return "tq"
        if self.kind == "hidden_state":
            return "hidden-state"
        return "full"


CHECKPOINT_FIELDS = ("num_prefill_checkpoint_blocks", "prefill_checkpoint_alignment")
"""vLLM 0.33.0's Mamba prefill checkpoint fields of ``GroupConfig`` (omitted when unset)."""
GROUP_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(GroupConfig)}

LOOKAHEAD_FIELDS = ("num_hash_lookahead_tokens", "num_prefill_lookahead")
"""vLLM 0.33.0's lookahead arguments of ``ManagerConfig`` (omitted when 0)."""


def _check_positive_int(field_name: str, value: Any) -> None:
    """A record's size field (``config.num_blocks``) must be a positive int: a
    trace that says otherwise is bad input, not a config to try."""
    if type(value) is not int or value < 1:
        raise ValueError(f"{field_name} is {value!r}; expected a positive int")


@dataclass(frozen=True)
class ManagerConfig:
    """Everything needed to build the same ``KVCacheManager`` in every implementation.

    The keyword arguments are vLLM 0.25.1's; ``scheduler_block_size`` and
    ``hash_block_size`` follow vLLM's engine (LCM and, when caching with several
    groups, GCD of the group block sizes) unless overridden.
    ``prefix_cache_retention_interval`` is vLLM 0.25.1's
    ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL`` (None: unset); adapters set the
    variable while the manager is built (``kvcache.kit.sides.retention_env``).
    ``num_hash_lookahead_tokens`` and ``num_prefill_lookahead`` are vLLM 0.33.0's
    lookahead hashing and prefill lookahead (0: none; 0.25.1 has neither): passed to
    the manager only when set, and the requests' hasher hashes with the same lookahead.
    """

    num_blocks: int
    groups: tuple[GroupConfig, ...]
    max_model_len: int
    enable_caching: bool = True
    watermark: float = 0.0
    log_stats: bool = True
    enable_kv_cache_events: bool = True
    use_eagle: bool = False
    max_num_batched_tokens: int | None = None
    hash_fn: str = "sha256"
    head_size: int = 8
    scheduler_block_size_override: int | None = None
    hash_block_size_override: int | None = None
    dcp_world_size: int = 1
    pcp_world_size: int = 1
    prefix_cache_retention_interval: int | None = None
    num_hash_lookahead_tokens: int = 0
    num_prefill_lookahead: int = 0

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a manager config needs at least one group")
        for name in ("dcp_world_size", "pcp_world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}; expected a positive int")
        for name in LOOKAHEAD_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r}; expected a non-negative int")
        retention = self.prefix_cache_retention_interval
        if retention is not None and type(retention) is not int:
            raise ValueError(
                f"prefix_cache_retention_interval={retention!r}; expected an int or None"
            )
        if self.hash_fn not in HASH_FNS:
            raise ValueError(f"hash_fn={self.hash_fn!r}; expected one of {', '.join(HASH_FNS)}")

    @classmethod
    def full_attention(
        cls, num_blocks: int, block_size: int, max_model_len: int, **kwargs: Any
    ) -> ManagerConfig:
        """One full-attention group: the core case."""
        return cls(num_blocks, (GroupConfig("full", block_size),), max_model_len, **kwargs)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(g.block_size for g in self.groups)

    @property
    def context_parallel(self) -> int:
        """``dcp_world_size * pcp_world_size``: tokens of a block are spread over
        that many ranks, so one group's block spans ``block_size`` times it."""
        return self.dcp_world_size * self.pcp_world_size

    @property
    def scheduler_block_size(self) -> int:
        """LCM of the group block sizes; one group's block size times the
        context-parallel size (vLLM's ``resolve_kv_cache_block_sizes``)."""
        if self.scheduler_block_size_override is not None:
            return self.scheduler_block_size_override
        if len(self.groups) == 1:
            return self.groups[0].block_size * self.context_parallel
        return math.lcm(*self.block_sizes)

    @property
    def hash_block_size(self) -> int:
        """GCD of the group block sizes when caching with several groups, else the
        scheduler block size."""
        if self.hash_block_size_override is not None:
            return self.hash_block_size_override
        if len(self.groups) == 1 or not self.enable_caching:
            return self.scheduler_block_size
        return math.gcd(*self.block_sizes)

    @property
    def layout(self) -> str:
        """The groups' kinds as a label: ``full``, ``full+swa``, ``full+mamba-align``."""
        return "+".join(g.label for g in self.groups)

    @property
    def has_eagle(self) -> bool:
        return self.use_eagle or any(g.is_eagle_group for g in self.groups)

    @property
    def has_mixed_block_sizes(self) -> bool:
        return len(set(self.block_sizes)) > 1

    def manager_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``KVCacheManager(kv_cache_config, **kwargs)``."""
        return {
            "max_model_len": self.max_model_len,
            "scheduler_block_size": self.scheduler_block_size,
            "hash_block_size": self.hash_block_size,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "enable_caching": self.enable_caching,
            "use_eagle": self.use_eagle,
            "log_stats": self.log_stats,
            "enable_kv_cache_events": self.enable_kv_cache_events,
            "watermark": self.watermark,
            # Only when set, so factories written before context parallelism still fit.
            **{
                name: getattr(self, name)
                for name in ("dcp_world_size", "pcp_world_size")
                if getattr(self, name) != 1
            },
            # Likewise: 0.25.1's factories know no lookahead.
            **{name: getattr(self, name) for name in LOOKAHEAD_FIELDS if getattr(self, name)},
        }

    def to_record(self) -> dict[str, Any]:
        """JSON form (the ``config`` of a trace header)."""
        record = asdict(self)
        record["groups"] = [g.record() for g in self.groups]
        for name in ("dcp_world_size", "pcp_world_size"):
            if record[name] == 1:  # the default: headers stay as before context parallelism
                del record[name]
        if record["prefix_cache_retention_interval"] is None:
            del record["prefix_cache_retention_interval"]  # headers of older traces
        for name in LOOKAHEAD_FIELDS:
            if record[name] == 0:
                del record[name]
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ManagerConfig:
        """Inverse of ``to_record``.

        Raises:
            ValueError: unknown or missing fields, or values out of range.
        """
        if not isinstance(record, Mapping):
            raise ValueError(f"config must be an object, got {type(record).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(record) - names)
        if unknown:
            raise ValueError(f"unknown config field(s) {unknown}")
        groups = record.get("groups")
        if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
            raise ValueError("config.groups must be a list of objects")
        group_names = {f.name for f in fields(GroupConfig)}
        built = []
        for i, group in enumerate(groups):
            bad = sorted(set(group) - group_names)
            if bad:
                raise ValueError(f"unknown field(s) {bad} in config.groups[{i}]")
            for name in ("block_size", "num_kv_heads"):
                _check_positive_int(f"config.groups[{i}].{name}", group.get(name, 1))
            try:
                built.append(GroupConfig(**group))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"config.groups[{i}]: {exc}") from None
        for name in ("num_blocks", "max_model_len", "head_size"):
            _check_positive_int(f"config.{name}", record.get(name, 1))
        try:
            return cls(**{**record, "groups": tuple(built)})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"config: {exc}") from None

    @classmethod
    def from_workload(cls, workload: Any) -> ManagerConfig:
        """The config ``kvcache.kit.adapters.make_impl`` builds for a ``Workload``."""
        groups = tuple(
            GroupConfig(
                kind=g.kind,
                block_size=g.block_size,
                sliding_window=g.sliding_window,
                attention_chunk_size=g.attention_chunk_size,
                mamba_cache_mode=g.mamba_cache_mode,
            )
            for g in workload.groups
        )
        return cls(
            num_blocks=workload.num_blocks,
            groups=groups,
            max_model_len=workload.max_model_len,
            enable_caching=workload.enable_caching,
            max_num_batched_tokens=workload.token_budget,
            log_stats=False,
            enable_kv_cache_events=False,
            head_size=64,
            scheduler_block_size_override=workload.scheduler_block_size,
            hash_block_size_override=workload.hash_block_size,
        )


#: Group kinds whose vLLM 0.33.0 manager finds hits ending inside one of its blocks
#: (``supports_fine_grained_hash_lookup``: full attention and its variants, Mamba).
FINE_GRAINED_KINDS = frozenset({"full", "mla", "rswa", "sink", "tq_full", "hidden_state", "mamba"})
#: Group kinds outside prefix caching in vLLM 0.33.0 (``prefix_cacheable`` False):
#: they take no part in whether hits may end inside a block.
NOT_PREFIX_CACHEABLE_KINDS = frozenset({"circular"})


def fine_grained_hits(config: ManagerConfig) -> bool:
    """Whether vLLM 0.33.0's manager for ``config`` finds sub-block ("partial hash")
    prefix hits, which end on hash-block boundaries (kvcache's switch
    ``mamba_fine_grained_hits``).

    The kit's own statement of the rule, kept apart from kvcache's so that the
    ledger and the driver judge kvcache rather than repeat it: a hybrid manager
    (caching, several groups) with a Mamba 'align' group whose block is larger than
    the hash block (under ``dcp_world_size > 1`` at least as large: the attention
    blocks it is compared with are dcp-scaled), and every other prefix-caching group
    either of a kind that finds sub-block hits or hashed at its own block size
    (attention blocks scaled by ``dcp_world_size``, Mamba's not). A ring-buffer
    group is outside prefix caching and does not count.
    """
    if not config.enable_caching or len(config.groups) < 2:
        return False
    hash_block = config.hash_block_size
    dcp = config.dcp_world_size
    if not any(
        g.kind == "mamba"
        and g.mamba_cache_mode == "align"
        and (g.block_size > hash_block or (dcp > 1 and g.block_size == hash_block))
        for g in config.groups
    ):
        return False
    for g in config.groups:
        if g.kind in NOT_PREFIX_CACHEABLE_KINDS or g.kind in FINE_GRAINED_KINDS:
            continue
        if g.block_size * dcp != hash_block:  # every kind left is attention: dcp-sharded
            return False
    return True
