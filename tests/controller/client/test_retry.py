"""The clients ride through a controller restart (scripted): what is retried, what is not, and the budget.
The real restart (SIGTERM and kill -9 mid-call) is in test_restart.py."""
from __future__ import annotations

import ssl

import httpx
import pytest

from support.client_fake import Stream, Ticks, ndjson, status, traj

from rolloutd.client import ConnectionFailed, RolloutdError, retry

JOB = {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": "j", "resourceVersion": "1"},
       "spec": {"samplesPerPrompt": 1}, "status": {"phase": "Running"}}


def stopping() -> httpx.Response:
    r = status(503, "ServiceUnavailable", "the controller is stopping")
    r.headers["Retry-After"] = "0"
    return r


def test_refused_connections_and_a_stopping_controller_are_retried(api, fake):
    fake.on("GET", "j", httpx.ConnectError("refused"), httpx.ConnectError("refused"), stopping(),
            httpx.Response(200, json=JOB))
    assert api("get", "j")["metadata"]["name"] == "j"
    assert len(fake.calls("GET", "j")) == 4


def test_a_request_over_its_rate_is_sent_again_after_retry_after_even_a_post(api, fake):
    over = status(429, "TooManyRequests", "request rate of this token exceeded")
    over.headers["Retry-After"] = "0"
    fake.on("POST", "j/policy", over, httpx.Response(200, json={"version": 2}))
    assert api("announce_policy", "j", 2)["version"] == 2   # a 429 is refused before any work: safe to resend
    assert len(fake.calls("POST", "j/policy")) == 2


def test_a_lost_answer_is_resent_only_when_the_call_is_idempotent(api, fake):
    fake.on("GET", "j", httpx.ReadError("reset"), httpx.Response(200, json=JOB))
    assert api("get", "j")["metadata"]["name"] == "j"
    fake.on("POST", "j/policy", httpx.ReadError("reset"), httpx.Response(200, json={"version": 2}))
    with pytest.raises(ConnectionFailed):   # the announcement may have been applied: the caller decides
        api("announce_policy", "j", 2)
    assert len(fake.calls("POST", "j/policy")) == 1
    fake.on("POST", "j/batches", httpx.ReadError("reset"), httpx.Response(200, json={"batch": 1, "state": "open"}))
    assert api("request_batch", "j")["batch"] == 1   # the server answers the open batch again


def test_retrying_ends_at_the_budget_with_the_last_cause(api, fake, monkeypatch):
    monkeypatch.setattr(retry, "time", Ticks())
    api.client.retry_for, api.client.retry_backoff = 0.3, 0.01
    fake.on("GET", "j", stopping())
    with pytest.raises(RolloutdError) as e:
        api("get", "j")
    assert e.value.code == 503 and len(fake.calls("GET", "j")) == 4   # tried at 0.1, 0.2, 0.3; 0.4 is past 0.1 + 0.3
    fake.on("GET", "j/policy", status(500, "InternalError", "a bug"))
    with pytest.raises(RolloutdError):   # a 500 is not a restart: raised at once
        api("policy", "j")
    assert len(fake.calls("GET", "j/policy")) == 1


def refused_certificate() -> httpx.ConnectError:
    """What httpx raises when the handshake fails on a certificate the client does not trust."""
    e = httpx.ConnectError("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate")
    e.__cause__ = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")
    return e


def test_a_certificate_the_client_does_not_trust_is_raised_at_once_naming_the_ca_setting(api, fake):
    """Not a restart: every try would be refused the same way (the trainer waited out its 120 s budget before)."""
    fake.on("GET", "j", refused_certificate(), httpx.Response(200, json=JOB))
    with pytest.raises(ConnectionFailed, match="does not trust.*ROLLOUTD_CA_FILE"):
        api("get", "j")
    assert len(fake.calls("GET", "j")) == 1


def test_a_follow_stream_the_controller_ended_while_the_job_runs_resumes_from_its_cursor(api, fake):
    fake.on("GET", "j/trajectories",
            lambda r: httpx.Response(200, stream=Stream([ndjson([traj(1), traj(2)])])),   # a clean end: stopping
            stopping(),
            lambda r: httpx.Response(200, stream=Stream([ndjson([traj(3)])])))
    done = {**JOB, "status": {"phase": "Succeeded"}}
    fake.on("GET", "j", httpx.Response(200, json=JOB), httpx.Response(200, json=done))
    assert [t["seq"] for t in api("trajectories", "j", follow=True)] == [1, 2, 3]
    assert [int(r.url.params["cursor"]) for r in fake.calls("GET", "j/trajectories")] == [0, 2, 2]


def test_a_batch_long_poll_rides_through_a_stop(api, fake):
    open_ = {"batch": 1, "state": "open", "target": 1, "counted": 0, "groups": []}
    full = {**open_, "state": "complete", "counted": 1,
            "groups": [{"group": 0, "prompt": 0, "samples": [traj(1)], "rewards": [1.0], "state": "complete"}]}
    fake.on("POST", "j/batches", httpx.Response(200, json=open_))
    fake.on("GET", "j/batches/1", httpx.Response(200, json=open_), stopping(), httpx.ConnectError("refused"),
            httpx.Response(200, json=full))
    assert api("next_batch", "j", timeout=30).complete
