"""An assignment without ``assignment_time_to_live`` expires at once.

Two buckets get a token bucket of 2 per 60 s, one without a TTL, one with 60 s. Expected:
a burst of 10 admits 2 in both (the RLQS API documents an unset TTL as no expiry).
Observed: what each admitted (10 = the assignment is gone and the ALLOW_ALL
``no_assignment_behavior`` applies).
"""

from __future__ import annotations

from harness import HERE, Observed, main, run_envoy, token_bucket


def probe(binary: str) -> Observed:
    plan = {"no-ttl": token_bucket(2, 2, 60, ttl=None), "ttl": token_bucket(2, 2, 60, ttl=60)}
    with run_envoy(binary, HERE / "quota.yaml", plan) as envoy:
        for name in plan:
            envoy.start_bucket(name)
        return {
            "unset_ttl_admitted_of_10": envoy.admitted("no-ttl", 10),
            "ttl_60s_admitted_of_10": envoy.admitted("ttl", 10),
        }


if __name__ == "__main__":
    main(probe, __doc__.splitlines()[0])
