"""The small protocol: the fewest calls a subject answers to be judged (docs/protocol.md).

A subject here speaks the trace's vocabulary (docs/trace-format.md), not vLLM's
classes: every call is an op name and its JSON arguments, every answer a JSON value.
``Subject`` lists the calls the levels ``admission``, ``hits`` and ``sharing`` need;
``exact`` needs the rest of the trace's ops (``EXACT_OPS``) and ``abstract_state``.

Two ways to plug one in:

* Python: ``--impl module:factory`` where ``factory`` has a ``PROTOCOL`` attribute
  (``"kvcache-kit/1"``); ``factory(config, hash_seed)`` gets the trace header's
  ``config`` object and ``PYTHONHASHSEED`` and returns a ``Subject``. Declared
  features: ``FEATURES`` on the factory (``kvcache.kit.features``).
* Any language: ``--impl exec:CMD`` runs CMD, which reads one JSON request per line
  on stdin and writes one JSON answer per line on stdout (``kvcache.kit.exec_side``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from kvcache.kit.config import ManagerConfig
from kvcache.kit.sides import Adapter, CannotBuild, HarnessError, Side
from kvcache.kit.trace import canon

PROTOCOL = "kvcache-kit/1"

#: The calls every level needs (``Subject``'s methods).
CORE_OPS = (
    "add_request",
    "get_computed_blocks",
    "allocate_slots",
    "free",
    "update_request",
    "append_output_token_ids",
    "get_num_free_blocks",
)
#: The further calls the random scheduler makes, each only when its feature is
#: declared (``features.OP_FEATURES``); at level ``exact`` their results are compared
#: in the trace's canonical form.
EXACT_OPS = (
    "pop_blocks_for_free", "free_blocks", "evict_blocks", "reset_prefix_cache",
    "take_events", "take_new_block_ids", "get_num_common_prefix_blocks", "new_step_starts",
    "make_prefix_cache_stats", "usage", "get_block_ids", "get_blocks",
    "get_block_ids_for_computed_tokens", "cache_blocks", "remove_skipped_blocks",
)

#: Results that are block ids per group: a subject may answer a list of lists.
_TABLES = ("allocate_slots", "get_block_ids", "get_blocks", "get_block_ids_for_computed_tokens")


@runtime_checkable
class Subject(Protocol):
    """A KV-cache manager judged through the small protocol (levels admission, hits,
    sharing). Every method takes the call's arguments as the trace records them."""

    def add_request(self, args: Mapping[str, Any]) -> Any:
        """A new request: ``request_id``, ``prompt_token_ids`` (and any feature's
        fields). Returns its block hashes (compared at ``exact`` only; else any value)."""

    def get_computed_blocks(self, args: Mapping[str, Any]) -> Mapping[str, Any]:
        """The prefix lookup of a waiting request ``request_id``: ``{"block_ids":
        [[id, ...] per group], "num_computed_tokens": n}``, the cached blocks it may
        reuse and the tokens they hold. It changes nothing (the next
        ``allocate_slots`` with ``new_computed_blocks="last"`` takes the blocks)."""

    def allocate_slots(self, args: Mapping[str, Any]) -> Any:
        """Room for ``num_new_tokens`` more tokens of ``request_id`` beyond
        ``num_new_computed_tokens`` hit tokens (whose blocks are the last lookup's when
        ``new_computed_blocks`` is ``"last"``): the newly allocated block ids per group
        (``[[id, ...], ...]``), or None when the pool has no room (then nothing
        changes). Raises when the call is invalid (as the reference does)."""

    def free(self, args: Mapping[str, Any]) -> None:
        """Release every block of ``request_id`` (a finished or preempted request); its
        cached blocks stay reusable until evicted."""

    def update_request(self, args: Mapping[str, Any]) -> None:
        """The scheduler changed request ``request_id``: any of ``status``,
        ``num_computed_tokens``, ``num_preemptions``."""

    def append_output_token_ids(self, args: Mapping[str, Any]) -> Any:
        """``token_ids`` (an int or a list) were generated for ``request_id``. Returns
        the block hashes they completed (compared at ``exact`` only)."""

    def get_num_free_blocks(self, args: Mapping[str, Any]) -> int:
        """Blocks free for allocation now (the pool's free count, cached ones included)."""


class ProtocolAdapter(Adapter):
    """Builds a ``Subject`` from a factory marked with ``PROTOCOL``."""

    def __init__(self, name: str, factory: Callable[..., Any]) -> None:
        super().__init__(name, factory, getattr(factory, "__version__", None))

    def side(self, config: ManagerConfig, hash_seed: str = "0", states: bool = True) -> Side:
        """A side driving a new subject through the protocol."""
        return ProtocolSide(self, config, hash_seed, states)

    def new(self, config: ManagerConfig, hash_seed: str, states: bool = True) -> Any:
        """A new subject for ``config`` (the factory's errors propagate; ``states`` is for
        process subjects, which send a state with each answer only when asked)."""
        return self.factory(config.to_record(), hash_seed)


def normalise(op: str, result: Any) -> Any:
    """A subject's answer in the trace's canonical form: block ids per group as the
    tuple the reference's ``get_block_ids()`` is (a list of lists is taken as one)."""
    value = canon(result)
    if op in _TABLES and isinstance(value, list):
        return {"tuple": value}
    lookup = op.startswith("get_computed_blocks") and isinstance(value, dict)
    if lookup and isinstance(value.get("block_ids"), list):
        value = {**value, "block_ids": {"tuple": value["block_ids"]}}
    return value


class ProtocolSide(Side):
    """A side whose manager is a ``Subject`` (or an ``exec:`` process): calls go out
    by op name with the trace's arguments; answers come back as canonical values."""

    def __init__(self, adapter: ProtocolAdapter, config: ManagerConfig, hash_seed: str = "0",
                 states: bool = True):
        # Not Side.__init__: no kvcache vocabulary to build requests or configs with.
        self.adapter = adapter
        self.name = adapter.name
        self.config = config
        self.requests = {}
        self.last_computed = {}
        self.popped = {}
        self.last_raw = None
        self.last_hit_tokens = {}
        self.timing = contextlib.nullcontext()
        self.chain_module = None
        self.none_hash = None
        try:
            self.manager = adapter.new(config, hash_seed, states)
        except (HarnessError, CannotBuild):
            raise
        except Exception as exc:
            raise CannotBuild(
                adapter.name, f"{adapter.name} rejects the config ({type(exc).__name__}: {exc})"
            ) from exc

    def send(self, op: str, args: Mapping[str, Any]) -> Any:
        """Make one call on the subject; its exceptions propagate.

        Raises:
            HarnessError: the subject has no such call.
        """
        method = getattr(self.manager, op, None)
        if method is None:
            raise HarnessError(
                f"{self.name} has no {op}() (docs/protocol.md; declare the features it lacks)"
            )
        return method(dict(args))

    def call(self, op: str, args: Mapping[str, Any]) -> Any:
        """One call, its answer in canonical form."""
        with self.timing:
            result = self.send(op, args)
        return normalise(op, result)

    def raw_state(self) -> dict[str, Any] | None:
        """The subject's ``abstract_state()`` (docs/contract.md), if it has one."""
        fn = getattr(self.manager, "abstract_state", None)
        return None if fn is None else dict(fn())

    def num_free_blocks(self) -> int:
        """The subject's free block count (``get_num_free_blocks``)."""
        return int(self.send("get_num_free_blocks", {}))
