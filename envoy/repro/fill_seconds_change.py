"""A new assignment that changes only ``fill_interval.seconds`` is ignored.

Two buckets are assigned 3 per 1 s, emptied, left to refill, then sent 3 per 10 s: one
with ``fill_interval.nanos`` unchanged (0), one with nanos 1 (what the sidecar does).
Expected in both: after a burst that empties the bucket, 1.3 s later admits
floor(0.3 x 1.3) = 0. Observed: what each admitted then (3 = still refilling 3 per
second, the new assignment not applied).
"""

from __future__ import annotations

import time

from harness import HERE, Observed, at, main, run_envoy, token_bucket

NAMES = {"seconds-only": 0, "nanos-flipped": 1}


def probe(binary: str) -> Observed:
    plan = {name: token_bucket(3, 3, 1) for name in NAMES}
    with run_envoy(binary, HERE / "quota.yaml", plan) as envoy:
        for name in NAMES:
            envoy.start_bucket(name)
        before = {name: envoy.admitted(name, 6) for name in NAMES}
        time.sleep(1.3)  # full again at 3 per second
        for name, nanos in NAMES.items():
            envoy.rlqs.push(name, token_bucket(3, 3, 10, nanos=nanos))
        time.sleep(0.3)
        started = time.monotonic()
        emptied = {name: envoy.admitted(name, 6) for name in NAMES}
        at(started, 1.3)
        late = time.monotonic() - started > 1.6  # 3 per second refills a token in 0.33 s
        after = {name: envoy.admitted(name, 6) for name in NAMES}
        return {
            "first_burst": before,
            "burst_after_push": emptied,
            "admitted_1_3s_later": after,
            "too_late_to_tell": late,
        }


if __name__ == "__main__":
    main(probe, __doc__.splitlines()[0])
