"""Envoy reports usage every 5 s whatever ``reporting_interval`` says.

quota.yaml asks for a report every second. One bucket gets traffic; the RLQS server
notes when each report of it arrives and its ``time_elapsed``. Expected: reports about
1 s apart, ``time_elapsed`` near 1 s. Observed: the gaps between reports (seconds, read
by the server) and each report's ``time_elapsed``.
"""

from __future__ import annotations

import itertools
import time

from harness import HERE, Observed, main, run_envoy, token_bucket


def probe(binary: str) -> Observed:
    with run_envoy(binary, HERE / "quota.yaml", {"reported": token_bucket(100, 100, 1)}) as envoy:
        envoy.start_bucket("reported")
        deadline = time.monotonic() + 13
        while len(envoy.rlqs.of("reported")) < 3 and time.monotonic() < deadline:
            envoy.burst("reported", 1)
            time.sleep(0.25)
        reports = envoy.rlqs.of("reported")
        gaps = [round(later.at - earlier.at, 2) for earlier, later in itertools.pairwise(reports)]
        return {
            "reports": len(reports),
            "gaps_s": gaps,
            "time_elapsed_s": [round(report.elapsed, 3) for report in reports],
        }


if __name__ == "__main__":
    main(probe, __doc__.splitlines()[0])
