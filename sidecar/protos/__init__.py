"""Generated Envoy API modules, copied from xds-protos==1.85.0 by scripts/vendor_envoy_protos.py.

Do not edit: rerun the script. Why the sidecar carries them instead of depending on
xds-protos is in that script's docstring and in docs/deployment.md (Install).
Use them as `from sidecar.protos.envoy.service.ratelimit.v3 import rls_pb2`.
"""
