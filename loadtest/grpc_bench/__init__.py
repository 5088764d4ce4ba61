"""gRPC load benchmark for the sidecar's ``ShouldRateLimit``.

Three subcommands, each bounded in time and request count and stopping by itself:

``run``
    Drive a running server (``--target HOST:PORT``, loopback only) with
    ``--concurrency`` calls in flight for ``--duration`` seconds (and at most
    ``--max-requests``), from one or more load-generator processes, and print
    requests/s, latency percentiles, errors by gRPC status and OK / OVER_LIMIT counts.
    ``--server-pid`` adds the server's CPU use; ``--rate`` offers a fixed load instead
    of running flat out, to compare latencies at equal load.
``compare``
    Start a bare servicer (``loadtest/bare_servicer.py``: same stack, does nothing)
    and the real sidecar with the example config (memory backend), each on a free
    127.0.0.1 port; pin both servers to one core and the load generator to the
    others (on 2 cores: servers on cpu 0, generator on cpu 1; ``--no-pin`` to
    disable); run the same request mix against each alternately for ``--rounds``
    rounds and print medians, the sidecar/bare ratios and the goal verdict
    (throughput ratio >= 0.85). ``--calibrate-us`` and ``--partial`` add bare
    servicers that burn a known CPU time or do part of the sidecar's work, to split
    its cost under real load. Every child process is stopped at the end, also on
    Ctrl-C, SIGTERM or error.
``inproc``
    CPU cost per call of ``RateLimitService.answer`` and of the other steps of the
    request path, in this process, without gRPC; ``--profile N`` adds a cProfile table,
    ``--response-headers`` prices the sidecar's ``--response-headers``.

Examples::

    python -m loadtest.grpc_bench compare --duration 5 --concurrency 32 --rounds 3
    python -m loadtest.grpc_bench run --target 127.0.0.1:8081 --duration 10 --pattern mixed
    python -m loadtest.grpc_bench inproc --pattern mixed --calls 100000

Reading the figures. Each run reports the server's CPU per call ("srv us/call"),
the generator's CPU ("gen cpu", in cores) and what everything else on the machine
used meanwhile ("other cpu"). When "srv cpu" is near 1.0 and "gen cpu" well below
its cores, the server is the bottleneck, as it should be. On a shared, small
machine other load comes and goes: ``compare`` waits for a quiet second before
each run and redoes runs disturbed by other load (``--quiet-*``,
``--redo-disturbed``), flags what remains, and also gives the throughput ratio
implied by server CPU per call, which other load disturbs least. Compare ratios
from one ``compare`` run, not absolute figures from different runs. Every report
starts with the exact command line that reproduces it, the core count and the
Python / grpcio / protobuf / uvloop versions.
"""
