"""kvcache's ``Request`` carries what vLLM 0.25.1's ``Scheduler`` reads from a request.

The scheduler keeps its own bookkeeping on the request object (``max_tokens``,
``resumable``, ``streaming_queue``, ``is_prefill_chunk``, events, ...). A
request built by kvcache must have every one of those names, with vLLM's
initial values, or a scheduler written against vLLM's ``Request`` breaks on it.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

import kvcache as K
from kvcache.request import FinishReason, RequestEvent

# Names of vLLM's Request that kvcache's leaves out, with the reason.
NOT_MIRRORED = {
    "from_engine_core_request": "builds from vLLM's EngineCoreRequest, an engine-side message",
}


def test_scheduler_side_attributes_start_as_in_vllm() -> None:
    request = K.Request("a", [1, 2, 3], resumable=True, trace_headers={"t": "1"})
    assert request.resumable and request.trace_headers == {"t": "1"}
    assert request.streaming_queue is None and not request.abort_immediately
    assert (request.num_output_placeholders, request.async_tokens_to_discard) == (0, 0)
    assert (request.next_decode_eligible_step, request.last_sched_seq) == (0, 0)
    assert not request.is_prefill_chunk and request.num_nans_in_logits == 0
    assert request.stop_reason is None and request.kv_transfer_params is None
    assert not request.use_structured_output and not request.has_encoder_inputs
    assert request.max_tokens is None and request.take_events() is None
    assert K.Request("p", [1], pooling_params=object()).max_tokens == 1


def test_events_and_finish_reason() -> None:
    request = K.Request("a", [1])
    request.record_event("QUEUED", timestamp=2.5)
    request.record_event("SCHEDULED")
    events = request.take_events()
    assert events is not None and events[0] == RequestEvent("QUEUED", 2.5)
    assert [e.type for e in events] == ["QUEUED", "SCHEDULED"]
    assert request.take_events() is None
    assert request.get_finished_reason() is None
    request.status = K.RequestStatus.FINISHED_IGNORED
    assert request.get_finished_reason() is FinishReason.LENGTH


def test_priority_order_and_encoder_inputs() -> None:
    feature = K.MultiModalFeatureSpec("img", K.PlaceholderRange(offset=0, length=3))
    early = K.Request("b", [1, 2, 3], priority=0, arrival_time=1.0, mm_features=[feature])
    late = K.Request("a", [1], priority=0, arrival_time=2.0)
    urgent = K.Request("c", [1], priority=-1, arrival_time=9.0)
    assert sorted([late, early, urgent]) == [urgent, early, late]
    assert early.num_encoder_inputs == 1 and early.get_num_encoder_embeds(0) == 3


def test_structured_outputs_are_refused_clearly() -> None:
    class Params:
        structured_outputs = ("json", "{}")

    with pytest.raises(NotImplementedError, match="structured_outputs"):
        K.Request("a", [1], sampling_params=Params())


def public_names(obj: Any) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("__")}


def test_every_name_of_vllms_request_exists(vllm_reference: ModuleType) -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import FinishReason as VllmFinishReason
    from vllm.v1.request import Request as VllmRequest
    from vllm.v1.request import RequestStatus as VllmStatus

    params = SamplingParams(max_tokens=5, extra_args={"kv_transfer_params": {"k": 1}})
    theirs = VllmRequest("a", [1, 2], params, None, arrival_time=0.0)
    ours = K.Request("a", [1, 2], sampling_params=params)
    missing = public_names(theirs) - public_names(ours) - set(NOT_MIRRORED)
    assert not missing, f"kvcache.Request lacks {sorted(missing)}"
    for name in sorted(vars(theirs)):
        value = getattr(theirs, name)
        if name in ("sampling_params", "prefill_stats", "structured_output_request",
                    "output_token_ids", "all_token_ids", "_block_hasher"):
            continue  # the same object, a vLLM-only class, or a read-only view
        assert getattr(ours, name) == value, name
    assert list(ours.all_token_ids) == list(theirs.all_token_ids)
    assert {m.name: m.value for m in FinishReason} == {
        m.name: m.value for m in VllmFinishReason
    }
    for status in K.RequestStatus:
        theirs.status, ours.status = VllmStatus[status.name], status
        reason, expected = ours.get_finished_reason(), theirs.get_finished_reason()
        assert (None if reason is None else int(reason)) == (
            None if expected is None else int(expected)
        ), status
