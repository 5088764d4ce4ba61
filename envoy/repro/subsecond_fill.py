"""A token bucket whose ``fill_interval`` is under a second limits nothing; longer ones are
cut to whole seconds.

Three buckets are assigned ``max_tokens``/``tokens_per_fill`` over a fill interval of
0.5 s (2 per fill), 1 s (2, the control) and 1.5 s (3 per fill, 2 per second). Expected:
a burst of 10 admits 2 in the first two; in the third, after a burst that empties it, 1.1 s
later admits floor(2 x 1.1) = 2. Observed: what each admitted (3 for the third means Envoy
refilled 3 per second: 1.5 s cut to 1 s).
"""

from __future__ import annotations

import time

from harness import HERE, Observed, at, main, run_envoy, token_bucket


def probe(binary: str) -> Observed:
    plan = {
        "half": token_bucket(2, 2, 0, nanos=500_000_000),
        "whole": token_bucket(2, 2, 1),
        "one-and-half": token_bucket(3, 3, 1, nanos=500_000_000),
    }
    with run_envoy(binary, HERE / "quota.yaml", plan) as envoy:
        for name in plan:
            envoy.start_bucket(name)
        half, whole = envoy.admitted("half", 10), envoy.admitted("whole", 10)
        started = time.monotonic()
        emptied = envoy.admitted("one-and-half", 6)
        at(started, 1.1)
        late = time.monotonic() - started > 1.45  # past 1.5 s even 2 per second refills 3
        refilled = envoy.admitted("one-and-half", 6)
        return {
            "half_second_fill_admitted_of_10": half,
            "one_second_fill_admitted_of_10": whole,
            "fill_1_5s_first_burst": emptied,
            "fill_1_5s_admitted_after_1_1s": refilled,
            "too_late_to_tell": late,
        }


if __name__ == "__main__":
    main(probe, __doc__.splitlines()[0])
