"""ShouldRateLimit, health and reflection over real gRPC against one shared sidecar process.

Every test uses fresh descriptor values (key-only rules count each value apart), so
tests sharing the process never share a counter.
"""

from __future__ import annotations

import math
import random
import time
import uuid

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2
from tests.support.sidecars import (
    METHOD,
    OK,
    OVER_LIMIT,
    SERVICE_NAME,
    Sidecar,
    in_one_window,
    request,
    window_of,
)

pytestmark = pytest.mark.slow

MINUTE = rls_pb2.RateLimitResponse.RateLimit.MINUTE
SECOND = rls_pb2.RateLimitResponse.RateLimit.SECOND
UNLIMITED_REMAINING = 2**32 - 1


def fresh(prefix: str = "v") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# -- counting -----------------------------------------------------------------------


def test_counts_to_the_limit_then_over_limit(shared_sidecar: Sidecar) -> None:
    def attempt() -> tuple[float, float, list[rls_pb2.RateLimitResponse]]:
        value = fresh()
        before = time.time()
        answers = [shared_sidecar.ask(request("it", [("per_minute", value)])) for _ in range(7)]
        return before, time.time(), answers

    before, after, answers = in_one_window(60, attempt)

    codes = [answer.overall_code for answer in answers]
    assert codes == [OK] * 5 + [OVER_LIMIT] * 2
    assert [answer.statuses[0].code for answer in answers] == codes
    assert [answer.statuses[0].limit_remaining for answer in answers] == [4, 3, 2, 1, 0, 0, 0]
    window_end = window_of(before, 60) + 60
    for answer in answers:
        (status,) = answer.statuses
        assert status.current_limit.name == "five_per_minute"
        assert status.current_limit.requests_per_unit == 5
        assert status.current_limit.unit == MINUTE
        # Whole seconds to the window's end, rounded up, as seen at some moment in the run.
        reset = status.duration_until_reset
        assert reset.nanos == 0
        assert math.ceil(window_end - after) <= reset.seconds <= math.ceil(window_end - before)
        assert 1 <= reset.seconds <= 60


def test_hits_addend_spends_several_hits_and_rejected_hits_are_not_counted(
    shared_sidecar: Sidecar,
) -> None:
    def attempt() -> list[rls_pb2.RateLimitResponse]:
        value = fresh()
        return [shared_sidecar.ask(request("it", [("per_minute", value)], hits=hits)) for hits in (3, 3, 2, 1)]

    answers = in_one_window(60, attempt)
    # 3 admitted (2 left); 3 more would make 6 > 5: refused and not counted;
    # 2 fit exactly; then the window is full.
    assert [a.overall_code for a in answers] == [OK, OVER_LIMIT, OK, OVER_LIMIT]
    assert [a.statuses[0].limit_remaining for a in answers] == [2, 0, 0, 0]


def test_request_is_all_or_nothing_across_descriptors(shared_sidecar: Sidecar) -> None:
    def attempt() -> list[rls_pb2.RateLimitResponse]:
        value = fresh()
        both = request("it", [("pair_a", value)], [("pair_b", value)])
        answers = [shared_sidecar.ask(both) for _ in range(3)]
        answers.append(shared_sidecar.ask(request("it", [("pair_a", value)])))
        return answers

    first, second, third, alone = in_one_window(60, attempt)
    for answer in (first, second):
        assert answer.overall_code == OK
        assert [s.code for s in answer.statuses] == [OK, OK]
    assert [s.limit_remaining for s in first.statuses] == [9, 1]
    assert [s.limit_remaining for s in second.statuses] == [8, 0]
    # pair_b (2 per minute) is full: the whole request is refused...
    assert third.overall_code == OVER_LIMIT
    assert [s.code for s in third.statuses] == [OK, OVER_LIMIT]
    assert third.statuses[0].current_limit.requests_per_unit == 10
    assert third.statuses[1].current_limit.requests_per_unit == 2
    # ...and pair_a did not spend a hit on it: 2 admitted + this one = 3 of 10.
    assert alone.overall_code == OK
    assert alone.statuses[0].limit_remaining == 7


def test_unknown_domain_and_unmatched_descriptors_are_ok(shared_sidecar: Sidecar) -> None:
    answer = shared_sidecar.ask(request("no-such-domain", [("per_minute", "x")], [("a", "b")]))
    assert answer.overall_code == OK
    assert [s.code for s in answer.statuses] == [OK, OK]
    assert not any(s.HasField("current_limit") for s in answer.statuses)

    answer = shared_sidecar.ask(request("it", [("no_rule_for_this_key", fresh())]))
    assert answer.overall_code == OK
    assert answer.statuses[0].code == OK
    assert not answer.statuses[0].HasField("current_limit")


def test_unlimited_rule_reports_maximum_remaining(shared_sidecar: Sidecar) -> None:
    for _ in range(3):
        answer = shared_sidecar.ask(request("it", [("free", fresh())]))
        assert answer.overall_code == OK
        assert answer.statuses[0].limit_remaining == UNLIMITED_REMAINING
        assert not answer.statuses[0].HasField("current_limit")


def test_per_second_window_resets_at_the_boundary(shared_sidecar: Sidecar) -> None:
    value_holder: list[str] = []

    def attempt() -> tuple[float, list[rls_pb2.RateLimitResponse]]:
        value = fresh()
        value_holder.append(value)
        answers = [shared_sidecar.ask(request("it", [("per_second", value)])) for _ in range(4)]
        return time.time(), answers

    after, answers = in_one_window(1, attempt)
    value = value_holder[-1]
    assert [a.overall_code for a in answers] == [OK, OK, OK, OVER_LIMIT]
    assert [a.statuses[0].limit_remaining for a in answers] == [2, 1, 0, 0]
    assert all(a.statuses[0].current_limit.unit == SECOND for a in answers)
    assert all(a.statuses[0].duration_until_reset.seconds == 1 for a in answers)

    # Sleep past the next second boundary (a small margin for clock granularity).
    time.sleep(max(0.0, math.floor(after) + 1 - time.time()) + 0.02)
    fresh_window = shared_sidecar.ask(request("it", [("per_second", value)]))
    assert fresh_window.overall_code == OK
    assert fresh_window.statuses[0].limit_remaining == 2


# -- bad input ---------------------------------------------------------------------------


BAD_REQUESTS = [
    pytest.param(request("", [("k", "v")]), "domain: must not be empty", id="empty-domain"),
    pytest.param(request("d" * 257, [("k", "v")]), "domain: longer than 256", id="long-domain"),
    pytest.param(request("it"), "descriptors: at least one descriptor", id="no-descriptors"),
    pytest.param(request("it", *([("k", "v")],) * 65), "descriptors: more than 64", id="many-descriptors"),
    pytest.param(
        request("it", [("generous", "x"), ("", "v")]),
        "descriptors[0].entries[1].key: must not be empty",
        id="empty-key",
    ),
    pytest.param(
        request("it", [("k" * 257, "v")]),
        "descriptors[0].entries[0].key: longer than 256",
        id="long-key",
    ),
    pytest.param(
        request("it", [("generous", "v" * 4097)]),
        "descriptors[0].entries[0].value: longer than 4096",
        id="long-value",
    ),
]


@pytest.mark.parametrize(("bad", "message"), BAD_REQUESTS)
def test_bad_request_is_invalid_argument_naming_the_part(
    shared_sidecar: Sidecar, bad: rls_pb2.RateLimitRequest, message: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        shared_sidecar.ask(bad)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(message)


def test_burst_of_bad_requests_leaves_the_process_serving(shared_sidecar: Sidecar) -> None:
    bad = [param.values[0] for param in BAD_REQUESTS] * 40
    futures = [shared_sidecar.rls.ShouldRateLimit.future(req, timeout=30) for req in bad]
    codes = {future.exception().code() for future in futures}
    assert codes == {grpc.StatusCode.INVALID_ARGUMENT}
    assert shared_sidecar.alive()
    assert "Traceback" not in shared_sidecar.stderr()
    assert shared_sidecar.health_status() == health_pb2.HealthCheckResponse.SERVING
    answer = shared_sidecar.ask(request("it", [("per_minute", fresh())]))
    assert answer.overall_code == OK
    assert answer.statuses[0].limit_remaining == 4


def test_garbage_bytes_do_not_kill_the_process(shared_sidecar: Sidecar) -> None:
    assert shared_sidecar.channel is not None
    raw = shared_sidecar.channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)

    # An empty payload is a valid, empty RateLimitRequest: refused for its empty domain.
    with pytest.raises(grpc.RpcError) as caught:
        raw(b"", timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("domain:")

    # Payloads that cannot be parsed: invalid UTF-8 in the domain, a truncated
    # length-delimited field, a wrong wire type.
    # The sidecar's tolerant parser turns these into INVALID_ARGUMENT naming the request.
    for payload in (b"\x0a\x02\xff\xfe", b"\x0a\xff\xff\xff\x0f", b"\x0f"):
        with pytest.raises(grpc.RpcError) as caught:
            raw(payload, timeout=5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        assert caught.value.details() == "request: not a valid RateLimitRequest message"

    # Larger than the server's 1 MiB message cap.
    with pytest.raises(grpc.RpcError) as caught:
        raw(b"\x0a" + b"\xff" * (1024 * 1024 + 16), timeout=5)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    # Random bytes: whatever each one parses to, the answer is a status, never a crash.
    generator = random.Random(20240601)
    payloads = [generator.randbytes(generator.randint(1, 512)) for _ in range(200)]
    futures = [raw.future(payload, timeout=30) for payload in payloads]
    for future in futures:
        error = future.exception()
        if error is not None:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error

    assert shared_sidecar.alive()
    assert "Traceback" not in shared_sidecar.stderr()
    assert shared_sidecar.health_status() == health_pb2.HealthCheckResponse.SERVING
    answer = shared_sidecar.ask(request("it", [("per_minute", fresh())]))
    assert answer.overall_code == OK


# -- health and reflection -------------------------------------------------------------------


@pytest.mark.parametrize("service", ["", SERVICE_NAME])
def test_health_reports_serving(shared_sidecar: Sidecar, service: str) -> None:
    assert shared_sidecar.health_status(service) == health_pb2.HealthCheckResponse.SERVING


def test_health_of_unknown_service_is_not_found(shared_sidecar: Sidecar) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        shared_sidecar.health_status("no.such.Service")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def _reflect(sidecar: Sidecar, **query: str) -> reflection_pb2.ServerReflectionResponse:
    assert sidecar.channel is not None
    stub = reflection_pb2_grpc.ServerReflectionStub(sidecar.channel)
    (answer,) = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(**query)]), timeout=5))
    return answer


def test_reflection_lists_the_services(shared_sidecar: Sidecar) -> None:
    answer = _reflect(shared_sidecar, list_services="")
    names = {service.name for service in answer.list_services_response.service}
    assert names >= {
        SERVICE_NAME,
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }


def test_reflection_describes_the_rate_limit_service(shared_sidecar: Sidecar) -> None:
    answer = _reflect(shared_sidecar, file_containing_symbol=SERVICE_NAME)
    assert not answer.HasField("error_response"), answer.error_response
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in answer.file_descriptor_response.file_descriptor_proto
    ]
    services = {
        f"{file.package}.{service.name}": [method.name for method in service.method]
        for file in files
        for service in file.service
    }
    assert services[SERVICE_NAME] == ["ShouldRateLimit"]
