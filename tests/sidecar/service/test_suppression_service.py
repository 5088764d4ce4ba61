"""``overload: suppress`` through the service: a suppressed request is an ordinary OVER_LIMIT
with its status, counted as ``suppressed`` next to ``over_limit`` (service and rule), shown in
``/config`` (the option) and in the sampled debug log with the counter's ``p``."""

from __future__ import annotations

from typing import Any

from structlog.testing import capture_logs

from sidecar.admin import config_json
from sidecar.metrics import OVER_LIMIT, SUPPRESSED
from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2

RULES = """
domain: d
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 10, overload: suppress}
"""


async def test_suppressed_answers_are_counted_and_logged_with_p(h: Any) -> None:
    clock = h.FakeClock(1_700_000_000.0)
    service = h.memory_service(RULES, clock, response_headers=True)
    service.limiter.suppression.random.seed(4)
    service.log_every = 1
    request = h.rate_request("d", h.descriptor(("k", "v")))
    with capture_logs() as logs:
        answers = []
        for _ in range(60):  # 60 attempts in one 100 ms slice against 1 allowed there: p = 1/60
            answers.append(rls_pb2.RateLimitResponse.FromString(await service.handle(request)))
            clock.advance(0.001)
    refused = [answer for answer in answers if answer.overall_code == rls_pb2.RateLimitResponse.OVER_LIMIT]
    assert refused, "the draw refused some"
    assert all(answer.statuses[0].limit_remaining == 0 for answer in refused)
    stats = service.stats
    assert 0 < stats.suppressed_requests <= stats.over_limit_requests == len(refused)
    row = stats.rules.rows["d.k"]
    assert row[SUPPRESSED] == stats.suppressed_requests and row[OVER_LIMIT] == len(refused)
    decisions = [entry for entry in logs if entry["event"] == "decision"]
    assert decisions[-1]["p"][0] < 0.1 and True in [entry["suppressed"] == [True] for entry in decisions]
    shown = config_json(service.config, 0.0)
    assert shown["domains"]["d"]["rules"][0]["overload"] == "suppress"
    busy = service.limiter.suppression.describe(clock())
    assert busy[0]["counter"][-1] == "v" and busy[0]["p"] < 0.1
