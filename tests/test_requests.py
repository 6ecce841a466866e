"""The one request validator (`validate_request` against `RequestLimits`) and the request values."""

from __future__ import annotations

import threading

import pytest

from jaxspec.engine.fake import FakeEngine
from jaxspec.menu import Menu
from jaxspec.scheduling.requests import (
    FinishReason,
    InvalidRequestError,
    Request,
    RequestHandle,
    RequestLimits,
    RequestOutput,
    RequestResult,
    validate_request,
)
from jaxspec.types import SamplingParams

LIMITS = RequestLimits(max_len=16, vocab_size=10, stop_strings_allowed=True)


def reason(request: Request, limits: RequestLimits = LIMITS) -> str:
    with pytest.raises(InvalidRequestError) as info:
        validate_request(request, limits)
    return info.value.reason


def test_a_valid_request_gets_its_max_tokens_capped_to_the_cache():
    assert validate_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=5)), LIMITS) == 5
    assert validate_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=50)), LIMITS) == 13
    assert validate_request(Request("a", [9] * 15, SamplingParams(max_tokens=50)), LIMITS) == 1


@pytest.mark.parametrize("request_, why", [
    (Request("e", [], SamplingParams()), "empty prompt"),
    (Request("long", [1] * 16, SamplingParams()), "prompt of 16 tokens leaves no room to generate (max_len 16)"),
    (Request("tok", [1, 10, -1, 3], SamplingParams()), "token ids outside [0, 10): [10, -1]"),
    (Request("t", [1], SamplingParams(temperature=-0.5)), "temperature must be in [0, 100]"),
    (Request("t", [1], SamplingParams(temperature=float("nan"))), "temperature must be in [0, 100]"),
    (Request("p", [1], SamplingParams(top_p=0.0)), "top_p must be in (0, 1]"),
    (Request("k", [1], SamplingParams(top_k=-1)), "top_k must be >= 0"),
    (Request("m", [1], SamplingParams(max_tokens=0)), "max_tokens must be > 0"),
    (Request("s", [1], SamplingParams(seed=2**31)), "seed must be in [0, 2^31)"),
    (Request("x", [1], SamplingParams(stop_strings=("ok", ""))), "stop strings must be non-empty strings"),
    (Request("x", [1], SamplingParams(stop_strings=(3,))), "stop strings must be non-empty strings"),
])
def test_each_rejection_says_why(request_, why):
    assert why in reason(request_)


def test_the_message_names_the_request():
    with pytest.raises(InvalidRequestError, match=r"^request 'e': empty prompt$") as info:
        validate_request(Request("e", [], SamplingParams()), LIMITS)
    assert info.value.request_id == "e" and isinstance(info.value, ValueError)


@pytest.mark.parametrize("rid", ["", None, 7])
def test_request_id_must_be_a_non_empty_string(rid):
    assert "request_id must be a non-empty string" in reason(Request(rid, [1], SamplingParams()))


def test_stop_strings_need_a_tokenizer():
    ids_only = RequestLimits(max_len=16, vocab_size=10, stop_strings_allowed=False)
    assert reason(Request("x", [1], SamplingParams(stop_strings=("a",))), ids_only) == "stop strings need a tokenizer"
    assert validate_request(Request("x", [1], SamplingParams(stop_token_ids=(3,))), ids_only) == 15


def test_max_tokens_limit():
    limited = RequestLimits(max_len=16, vocab_size=10, stop_strings_allowed=True, max_tokens_limit=4)
    assert validate_request(Request("x", [1], SamplingParams(max_tokens=4)), limited) == 4
    assert reason(Request("x", [1], SamplingParams(max_tokens=5)), limited) == "max_tokens must be <= 4, got 5"


def test_limits_of_an_engine():
    engine = FakeEngine(Menu(num_slots=2, max_len=32, batch_buckets=(2,), k_menu=(0,), window_buckets=(32,),
                             prefill_buckets=(8,)), vocab_size=50)
    assert RequestLimits.for_engine(engine, None) == RequestLimits(32, 50, False)
    assert RequestLimits.for_engine(engine, object(), max_tokens_limit=9) == RequestLimits(32, 50, True, 9)


@pytest.mark.parametrize("fields, error", [
    (dict(max_len=1, vocab_size=10), "max_len"), (dict(max_len=8, vocab_size=0), "vocab_size"),
    (dict(max_len=8, vocab_size=10, max_tokens_limit=0), "max_tokens_limit"),
])
def test_limits_are_checked(fields, error):
    with pytest.raises(ValueError, match=error):
        RequestLimits(stop_strings_allowed=True, **fields)


def test_rejected_result():
    result = RequestResult.rejected(Request("r", [1, 2], SamplingParams()), "why")
    assert (result.finish_reason, result.error, result.token_ids, result.prompt_len) == (FinishReason.ERROR, "why",
                                                                                         (), 2)
    assert result.acceptance_rate is None and result.stats()["completion_tokens"] == 0


def test_handle_streams_events_and_waits_for_the_result():
    cancelled = []
    handle = RequestHandle("h", lambda rid: cancelled.append(rid) or True)
    result = RequestResult.rejected(Request("h", [1], SamplingParams()), "done")
    handle.publish(RequestOutput("h", (1,), "a"), stream=True)
    handle.publish(RequestOutput("h", (2,), "b"), stream=False)  # not streamed: dropped
    assert not handle.done()
    with pytest.raises(TimeoutError):
        handle.result(timeout=0)
    threading.Timer(0.01, handle.publish, (RequestOutput("h", (3,), "c", True, result), True)).start()
    assert handle.result(timeout=10) is result
    assert [e.token_ids for e in handle] == [(1,), (3,)]
    assert handle.cancel() and cancelled == ["h"]
