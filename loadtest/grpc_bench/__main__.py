"""``python -m loadtest.grpc_bench run|compare|inproc``: see :mod:`loadtest.grpc_bench`."""

import sys

from loadtest.grpc_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
