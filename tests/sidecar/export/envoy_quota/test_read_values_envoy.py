"""Entries read from the request (empty, absent, ``skip_if_absent``) through a real Envoy in
the ``list`` shape (the filters alone, as printed without ``--full``), where every route's
alternatives share one filter and a request whose empty value reaches no rule must not fall
to a later route's entry: the same requests must be admitted as through the per-request path.

The ``route`` shape (``--full``) runs the same case in ``tests/e2e/test_quota_envoy_corpus.py``
(case ``read_values``), whose fixtures this reuses.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from sidecar.config import load_config
from sidecar.export.envoy_quota.export import DEFAULT_CLUSTER, export_quota, quota_document
from tests.e2e.test_quota_envoy_corpus import CORPUS, run_config, services

__all__ = ["services"]  # the corpus's fixture (one sidecar, one upstream), used here by name

pytestmark = [pytest.mark.slow, pytest.mark.envoy]
CASE = CORPUS / "read_values"


def test_the_list_shape_admits_what_the_per_request_path_admits(services: SimpleNamespace) -> None:
    spec = yaml.safe_load((CASE / "requests.yaml").read_text())
    groups, expected = spec["groups"], [int(group["admitted"]) for group in spec["groups"]]
    document = yaml.safe_load((CASE / "envoy.yaml").read_text())
    origin = Path(CASE / "envoy.yaml")
    result = export_quota(load_config(str(CASE / "rules.yaml")).domains, document, origin)
    assert result.dropped == ()
    assert len(result.filters) == 1  # one rate_limits entry per route: its alternatives share a filter
    config = quota_document(document, origin, result.filters, DEFAULT_CLUSTER)
    admitted, calls = run_config(services, "read-values-list", config, groups)
    assert admitted == expected
    assert calls == 0  # no request asked the sidecar per request
