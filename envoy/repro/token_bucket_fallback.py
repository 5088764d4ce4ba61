"""Envoy segfaults on a bucket whose ``no_assignment_behavior`` is a token bucket.

token_bucket_fallback.yaml gives every new bucket a fallback token bucket of 2 per 60 s;
the RLQS server never assigns one. Five requests of one bucket should get 200, 200, 429,
429, 429 (the fallback's two tokens, then none). Observed: ``statuses`` (0 = no answer) and
whether Envoy died (``crashed``, ``exit_code``: -11 is SIGSEGV).
"""

from __future__ import annotations

import time

from harness import HERE, Observed, main, run_envoy


def probe(binary: str) -> Observed:
    with run_envoy(binary, HERE / "token_bucket_fallback.yaml") as envoy:
        statuses = envoy.burst("fallback", 5)
        time.sleep(0.5)
        return {
            "statuses": statuses,
            "crashed": not envoy.alive(),
            "exit_code": envoy.process.poll(),
        }


if __name__ == "__main__":
    main(probe, __doc__.splitlines()[0])
