"""The rate_limit_quota filter has no stats of its own.

One bucket is assigned 2 per 60 s and sent 10 requests (2 allowed, 8 denied), and its
report is awaited. Expected: counters of allowed/denied requests or of the RLQS stream
under the filter's stat prefix, as the ``ratelimit`` and ``local_ratelimit`` filters
have. Observed: every admin stat whose name holds ``quota`` (the ``rlqs`` cluster's
own gRPC counters left out: they count the stream, not requests).
"""

from __future__ import annotations

from harness import HERE, Observed, main, run_envoy, token_bucket, wait_for


def probe(binary: str) -> Observed:
    with run_envoy(binary, HERE / "quota.yaml", {"counted": token_bucket(2, 2, 60)}) as envoy:
        envoy.start_bucket("counted")
        admitted = envoy.admitted("counted", 10)
        wait_for(lambda: any(report.denied for report in envoy.rlqs.of("counted")), 12, "the report of the denials")
        names = [line.partition(":")[0] for line in envoy.admin_get("/stats").splitlines()]
        return {
            "admitted_of_10": admitted,
            "quota_stats": sorted(name for name in names if "quota" in name and not name.startswith("cluster.rlqs.")),
        }


if __name__ == "__main__":
    main(probe, __doc__.splitlines()[0])
