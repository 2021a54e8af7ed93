"""A refused request keeps one typed form from where it is found to the HTTP answer: the engine's
and router's `RequestError`s, the replica's wire form of them, and the server's `APIError`."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.api.errors import as_api_error
from cluster.engine.client import NoReplicaAvailable
from cluster.engine.scheduler import RequestRejected
from cluster.replica import admission_error
from workers.request_errors import InvalidRequest, QueueFull, RequestError, Unavailable
from workers.sampling_params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize("exc,status,param,code", [
    (SamplingParamsError("top_p", "must be in (0, 1], got 2"), 400, "top_p", None),
    (RequestRejected("prompt", "the prompt is longer than the model's context"), 400, "prompt",
     "context_length_exceeded"),
    (QueueFull("64 requests waiting"), 503, None, "queue_full"),
    (NoReplicaAvailable("no healthy replica"), 503, None, "no_replica"),
])
def test_each_kind_has_its_http_answer_and_survives_the_replica_hop(exc, status, param, code):
    err = as_api_error(exc)
    assert (err.status, err.param, err.code) == (status, param, code)
    assert str(exc) in err.message
    if status == 503:
        assert err.headers == {"Retry-After": "1"}
    # The replica sends it to the router as a finished output; the router raises it again.
    out = admission_error("r1", exc)
    assert (out.finished, out.error_type, out.error_param, out.error) == (True, exc.kind, exc.param, str(exc))
    again = RequestError.of(out.error_type, out.error, out.error_param)
    assert type(again).kind == exc.kind and again.param == exc.param
    back = as_api_error(again)
    assert (back.status, back.param, back.code, back.message) == (err.status, err.param, err.code, err.message)


def test_kinds_and_unexpected_errors():
    assert isinstance(SamplingParamsError("x", "y"), InvalidRequest)
    assert isinstance(RequestRejected("x", "y"), InvalidRequest) and isinstance(NoReplicaAvailable("x"), Unavailable)
    assert admission_error("r", RuntimeError("boom")).error_type == "internal"
    assert as_api_error(RuntimeError("secret detail")).status == 500
    assert "secret" not in as_api_error(RuntimeError("secret detail")).message


def test_params_are_validated_once_per_vocabulary():
    p = SamplingParams(stop_token_ids=(7,))
    assert p.validate(10) is p
    assert p.validate(10) is p and p.validate() is p  # checked already: nothing runs again
    with pytest.raises(SamplingParamsError) as ei:  # another vocabulary is checked again
        p.validate(5)
    assert ei.value.param == "stop_token_ids"
    with pytest.raises(SamplingParamsError):  # a changed copy is a new object to check
        dataclasses.replace(p, max_tokens=0).validate(10)
    assert p == SamplingParams(stop_token_ids=(7,))  # the mark takes no part in equality
