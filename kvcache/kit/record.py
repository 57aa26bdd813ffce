"""Record traces: a workload's scheduler simulation, or a random scheduler sequence.

``record_workload`` runs ``kvcache.kit.workloads.simulate`` unchanged on a
recording stand-in for the manager: every manager call the simulation makes
goes through a ``Side`` (so results are normalised exactly as ``replay``
normalises them) and becomes a trace record; the request changes the
simulation makes directly on request objects (computed tokens, preemptions,
sampled tokens) are written as ``update_request`` / ``append_output_token_ids``
records just before the next call that passes that request, which is when the
manager can first observe them.
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass
from typing import Any

from kvcache.kit.adapters import request_args
from kvcache.kit.config import ManagerConfig
from kvcache.kit.driver import FAMILIES, Lockstep, RandomScheduler, random_config
from kvcache.kit.sides import Side, resolve_adapter
from kvcache.kit.trace import canon, make_header
from kvcache.kit.workloads import Impl, RequestSpec, SimResult, Workload, simulate

#: Calls that change nothing: their records carry no state.
READ_ONLY_OPS = frozenset(
    {
        "usage",
        "get_num_free_blocks",
        "get_block_ids",
        "get_blocks",
        "get_block_ids_for_computed_tokens",
    }
)


def _allocate_slots_signature(
    request: Any,
    num_new_tokens: int,
    num_new_computed_tokens: int = 0,
    new_computed_blocks: Any = None,
    num_lookahead_tokens: int = 0,
    num_external_computed_tokens: int = 0,
    delay_cache_blocks: bool = False,
    num_encoder_tokens: int = 0,
    full_sequence_must_fit: bool = False,
    reserved_blocks: int = 0,
    has_scheduled_reqs: bool = True,
) -> None:
    """vLLM 0.25.1's ``KVCacheManager.allocate_slots`` parameters (for binding)."""


ALLOCATE_SLOTS = inspect.signature(_allocate_slots_signature)


@dataclass
class _Snapshot:
    num_computed_tokens: int
    num_preemptions: int
    num_tokens: int
    num_hashes: int


class Recorder:
    """Executes calls on a ``Side`` and keeps them as trace records.

    ``state_every``: record the abstract state after every n-th state-changing
    call (0: never; the last call always gets one when n > 0).
    """

    def __init__(self, side: Side, state_every: int = 1) -> None:
        self.side = side
        self.state_every = state_every
        self.records: list[dict[str, Any]] = []
        self.snapshots: dict[str, _Snapshot] = {}
        self.num_state_changing = 0

    def call(self, op: str, args: dict[str, Any]) -> Any:
        """Run ``op`` on the side, record it, and return its canonical result."""
        record: dict[str, Any] = {"op": op, "args": args}
        self.records.append(record)
        try:
            record["ok"] = self.side.call(op, args)
        except Exception as exc:
            record["raises"] = type(exc).__name__
            raise
        finally:
            self.after(record)
        return record["ok"]

    def after(self, record: dict[str, Any]) -> None:
        if record["op"] in READ_ONLY_OPS or record["op"] == "add_request" or not self.state_every:
            return
        self.num_state_changing += 1
        if self.num_state_changing % self.state_every == 0:
            state = self.side.state()
            if state is not None:
                record["state"] = state

    def finish(self) -> None:
        """Give the last state-changing record a state (if it lacks one)."""
        if not self.state_every:
            return
        for record in reversed(self.records):
            if record["op"] not in READ_ONLY_OPS and record["op"] != "add_request":
                if "state" not in record:
                    state = self.side.state()
                    if state is not None:
                        record["state"] = state
                return

    # ------------------------------------------------------------ requests

    def new_request(self, args: dict[str, Any]) -> Any:
        self.call("add_request", args)
        request = self.side.requests[args["request_id"]]
        self.snapshots[args["request_id"]] = _Snapshot(
            0, 0, int(request.num_tokens), len(request.block_hashes)
        )
        return request

    def set_status(self, request: Any, status: str) -> None:
        self.sync(request)
        request.status = self.side.adapter.status(status)
        self.records.append(
            {
                "op": "update_request",
                "args": {"request_id": request.request_id, "status": status},
                "ok": None,
            }
        )

    def sync(self, request: Any) -> None:
        """Record what the caller changed on ``request`` since it last reached the manager."""
        snap = self.snapshots.get(request.request_id)
        if snap is None:
            return
        rid = request.request_id
        update: dict[str, Any] = {}
        if request.num_computed_tokens != snap.num_computed_tokens:
            update["num_computed_tokens"] = int(request.num_computed_tokens)
        if request.num_preemptions != snap.num_preemptions:
            update["num_preemptions"] = int(request.num_preemptions)
        if update:
            self.records.append(
                {"op": "update_request", "args": {"request_id": rid, **update}, "ok": None}
            )
        if request.num_tokens > snap.num_tokens:
            new_tokens = [int(t) for t in list(request.all_token_ids)[snap.num_tokens :]]
            self.records.append(
                {
                    "op": "append_output_token_ids",
                    "args": {"request_id": rid, "token_ids": new_tokens},
                    "ok": canon(list(request.block_hashes)[snap.num_hashes :]),
                }
            )
        self.snapshots[rid] = _Snapshot(
            int(request.num_computed_tokens),
            int(request.num_preemptions),
            int(request.num_tokens),
            len(request.block_hashes),
        )


class _RecordingPool:
    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder

    def get_num_free_blocks(self) -> int:
        return int(self._recorder.call("get_num_free_blocks", {}))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._recorder.side.manager.block_pool, name)


class RecordingManager:
    """Stands in for a manager: each call goes through the recorder."""

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder
        self._side = recorder.side
        self.block_pool = _RecordingPool(recorder)

    def _with_request(self, op: str, request: Any, **args: Any) -> Any:
        self._recorder.sync(request)
        return self._recorder.call(op, {"request_id": request.request_id, **args})

    def get_computed_blocks(self, request: Any) -> Any:
        self._with_request("get_computed_blocks", request)
        return self._side.last_raw

    def allocate_slots(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        bound = ALLOCATE_SLOTS.bind(request, *args, **kwargs).arguments
        del bound["request"]
        blocks = bound.pop("new_computed_blocks", None)
        if blocks is None:
            which = "none"
        elif blocks is self._side.last_computed.get(request.request_id):
            which = "last"
        elif blocks is self._side.manager.empty_kv_cache_blocks:
            which = "empty"
        else:
            raise ValueError(
                "new_computed_blocks must be the request's last get_computed_blocks result, "
                "empty_kv_cache_blocks or None to be recorded"
            )
        if which != "none":
            bound["new_computed_blocks"] = which
        self._with_request("allocate_slots", request, **bound)
        return self._side.last_raw

    def free(self, request: Any) -> None:
        self._with_request("free", request)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        self._with_request("cache_blocks", request, num_computed_tokens=num_computed_tokens)

    def new_step_starts(self) -> None:
        self._recorder.call("new_step_starts", {})

    @property
    def usage(self) -> float:
        return float(self._recorder.call("usage", {}))

    def take_events(self) -> Any:
        self._recorder.call("take_events", {})
        return []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._side.manager, name)  # unrecorded: check_invariants, ...


@dataclass
class Recording:
    """A recorded run: the trace header and records, and how the run ended."""

    header: dict[str, Any]
    records: list[dict[str, Any]]
    result: SimResult | None = None
    error: BaseException | None = None


def record_workload(workload: Workload, impl: str, state_every: int = 1) -> Recording:
    """Run ``simulate(workload)`` on ``impl`` and record every manager call.

    A call that raises ends the run; the recording then ends with that call
    (its record says what was raised) and ``error`` holds the exception.
    """
    adapter = resolve_adapter(impl)
    config = ManagerConfig.from_workload(workload)
    side = Side(adapter, config, "0")
    recorder = Recorder(side, state_every)
    manager = RecordingManager(recorder)

    def new_request(spec: RequestSpec) -> Any:
        return recorder.new_request(request_args(spec))

    header = make_header(
        config,
        adapter.name,
        adapter.version,
        "0",
        source=f"workload {workload.name}, {len(workload.requests)} requests "
        "(kvcache.kit.workloads.simulate)",
    )
    recording = Recording(header, recorder.records)
    try:
        with side.hashing():  # the simulation appends tokens to the requests itself
            recording.result = simulate(
                workload, Impl(adapter.name, manager, new_request, recorder.set_status)
            )
    except Exception as exc:
        recording.error = exc
    recorder.finish()
    return recording


def record_random(
    family: str, seed: int, impl: str, num_steps: tuple[int, int] = (20, 120)
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Record one random scheduler sequence of ``family`` on ``impl``."""
    rng = random.Random(seed)
    config = random_config(rng, FAMILIES[family])
    run = Lockstep(config, None, impl)
    run.check_state()
    scheduler = RandomScheduler(rng, run)
    for _ in range(rng.randint(*num_steps)):
        scheduler.step()
    scheduler.drain()
    header = run.header(source=f"random sequence: family {family}, seed {seed}")
    return header, run.records
