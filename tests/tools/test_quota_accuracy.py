"""loadtest/quota_accuracy.py's cluster_failover scenario, the cheap parts: that it is
registered (and run only when named), that the master it kills is the one holding the
bucket's share keys, and how a run's seconds are judged. The scenario itself runs real
Envoys and a 6-node Cluster: its figures are in docs/quota.md, not a test."""

from __future__ import annotations

from redis.crc import key_slot

from loadtest.quota_accuracy import ALL_SCENARIOS, SCENARIOS, Tally, build_parser, summarize
from loadtest.quota_failover import CLUSTER_SCENARIOS, recovery, share_key_names, share_slot
from sidecar.quota.buckets import bucket_key
from sidecar.quota.redis_shares import bucket_digest
from stack.quota_envoy import bucket_settings


def test_cluster_failover_is_registered_but_runs_only_when_named() -> None:
    assert "cluster_failover" in ALL_SCENARIOS
    assert "cluster_failover" in CLUSTER_SCENARIOS
    assert build_parser().parse_args([]).scenarios == list(SCENARIOS)
    assert "cluster_failover" not in SCENARIOS
    assert build_parser().parse_args(["--scenarios", "cluster_failover"]).scenarios == ["cluster_failover"]


def test_the_share_keys_are_those_of_the_bucket_envoy_builds() -> None:
    """The bucket id Envoy reports (stack/quota_envoy.py's builder: domain, entry.0.tier from
    x-tier, entry.1.client from x-client) names the keys and slot the scenario kills."""
    builder = bucket_settings("ALLOW_ALL")["typed_config"]["bucket_id_builder"]["bucket_id_builder"]
    assert set(builder) == {"domain", "entry.0.tier", "entry.1.client"}
    assert builder["domain"] == {"string_value": "quota"}
    digest = bucket_digest(bucket_key({"domain": "quota", "entry.0.tier": "shared", "entry.1.client": "c-1"}))
    keys = share_key_names("c-1")
    assert keys[:2] == [f"rls:quota:{{{digest}}}:replicas", f"rls:quota:{{{digest}}}:meta"]
    assert share_slot("c-1") == key_slot(digest.encode()) == key_slot(keys[0].encode())


def test_the_slot_follows_the_client_tier_and_prefix() -> None:
    slots = {share_slot(f"cluster_failover-{index}") for index in range(50)}
    assert len(slots) > 40  # spread over the Cluster, not one fixed slot
    assert share_slot("c-1", prefix="other") == share_slot("c-1")  # the hash tag is the digest alone
    assert share_slot("c-1", tier="other") != share_slot("c-1")


def test_recovery_counts_from_the_kill_to_the_last_second_outside_the_band() -> None:
    steady = dict.fromkeys(range(10), 200)
    assert recovery(steady, 200, 5).back == "0 s (never left)"
    dipped = {**steady, 6: 150, 7: 189, 8: 195}
    found = recovery(dipped, 200, 5)
    assert (found.back, found.lowest, found.highest) == ("3 s", 150, 200)
    assert recovery({**steady, 9: 300}, 200, 5).back == "no"
    assert recovery({**steady, 2: 50}, 200, 5).back == "0 s (never left)"  # before the kill: not counted


def test_summarize_reports_the_seconds_over_the_bound() -> None:
    tally = Tally()
    for second in range(30):
        admitted = 401 if second == 20 else 200
        for replica in range(3):
            for _ in range(admitted // 3 + (replica < admitted % 3)):
                tally.add(second, replica, ok=True)
            tally.add(second, replica, ok=False)
    outcome = summarize("cluster_failover", tally, 200, 15, "killed")
    assert outcome.worst == 201
    assert outcome.bound == 1
    assert outcome.converge == "6 s"
    assert "seconds over the bound: 1" in outcome.note
    assert outcome.false_rejections == 0
