"""The local stack: redis-server, sidecars, Envoys, HAProxy and a sample upstream on 127.0.0.1.

Not part of the installed ``sidecar`` package: the demo (``scripts/demo``), the
end-to-end tests and the load and comparison tools start real processes through it,
from the repository checkout.
"""
