"""FullWindows: which requests strict mode may refuse without asking Redis, and which it must not."""

from __future__ import annotations

import pytest

from sidecar.limiter.algorithms import Algorithm
from sidecar.limiter.full_windows import FullWindows
from sidecar.limiter.known_counts import redis_holds
from sidecar.limiter.protocol import Check, Decision, Role

NOW = 1_000.0
LATER = 2_000


def window(name: str, limit: int = 20, hits: int = 1, role: Role = Role.ENFORCED, **extra: object) -> Check:
    return Check((name,), 3600, limit, hits, role, **extra)  # type: ignore[arg-type]


def told(memory: FullWindows, checks: list[Check], counts: list[int], consumed: bool = True) -> None:
    """Redis answered a request on ``checks`` with would-be ``counts``."""
    keys = [check.key[0] for check in checks]
    memory.learn(redis_holds(checks, keys, [LATER] * len(checks), counts, [consumed] * len(checks)), now=NOW)


def ask(memory: FullWindows, checks: list[Check], admit_all: bool = False) -> Decision | None:
    return memory.refusal(checks, [check.key[0] for check in checks], admit_all)


def test_a_window_redis_reported_full_refuses_with_redis_numbers() -> None:
    memory = FullWindows(100)
    hot = window("hot")
    told(memory, [hot], [20])
    assert ask(memory, [hot]) == Decision(False, (True,), (21,), (20,))
    assert ask(memory, [hot._replace(hits=0)]) is None, "a check-only request at the limit is not over"
    assert memory.refusals == 1


def test_an_answer_that_refused_leaves_the_request_hits_out_of_the_count() -> None:
    memory = FullWindows(100)
    hot = window("hot", hits=2)
    told(memory, [hot], [21], consumed=False)  # Redis holds 19: one hit is still free
    assert ask(memory, [hot._replace(hits=1)]) is None
    assert ask(memory, [hot]) is not None


def test_below_the_limit_goes_to_redis() -> None:
    memory = FullWindows(100)
    hot = window("hot")
    told(memory, [hot], [19])
    assert ask(memory, [hot]) is None


def test_other_checks_of_a_refused_request_report_what_redis_last_said() -> None:
    memory = FullWindows(100)
    user, ip = window("user", limit=5), window("ip", limit=2)
    told(memory, [user, ip], [2, 2])
    assert ask(memory, [user, ip]) == Decision(False, (False, True), (3, 3), (5, 2))


@pytest.mark.parametrize("role", [Role.SHADOW, Role.QUOTA])
def test_only_an_enforced_check_refuses_on_its_own(role: Role) -> None:
    memory = FullWindows(100)
    hot = window("hot", role=role)
    told(memory, [hot], [20])
    assert ask(memory, [hot]) is None


@pytest.mark.parametrize(
    "extra",
    [{"count_past": True}, {"ban_seconds": 60}],
    ids=["count_past_limit consumes when refused", "ban_duration starts in Redis"],
)
def test_checks_redis_must_record_go_to_redis(extra: dict[str, object]) -> None:
    memory = FullWindows(100)
    hot = window("hot", **extra)
    told(memory, [hot], [20])
    assert ask(memory, [hot]) is None


def test_global_shadow_mode_sends_everything_to_redis() -> None:
    memory = FullWindows(100)
    hot = window("hot")
    told(memory, [hot], [20])
    assert ask(memory, [hot], admit_all=True) is None


def test_a_check_redis_has_not_reported_on_sends_the_request_to_redis() -> None:
    memory = FullWindows(100)
    hot = window("hot")
    told(memory, [hot], [20])
    assert ask(memory, [hot, window("cold")]) is None
    bucket = Check(("bucket",), 1, 5, 1, Role.ENFORCED, Algorithm.TOKEN_BUCKET, 200_000)
    told(memory, [bucket], [99])
    assert ask(memory, [hot, bucket]) is None, "a token bucket's answer is a time, not a count"
    sliding = window("sliding", algorithm=Algorithm.SLIDING_WINDOW)
    told(memory, [sliding], [25])
    assert ask(memory, [sliding]) is None, "a sliding estimate falls as the previous window fades"


def test_a_counter_named_twice_goes_to_redis() -> None:
    memory = FullWindows(100)
    hot = window("hot")
    told(memory, [hot, hot], [20, 21])  # would-be counts add up within the request: not learned
    assert ask(memory, [hot]) is None
    told(memory, [hot], [20])
    assert ask(memory, [hot, hot]) is None


def test_a_raised_limit_and_a_give_back_send_the_key_to_redis_again() -> None:
    memory = FullWindows(100)
    hot = window("hot")
    told(memory, [hot], [20])
    assert ask(memory, [hot._replace(limit=30)]) is None, "a reload raised the limit"
    memory.forget("hot")
    assert ask(memory, [hot]) is None


def test_an_older_answer_does_not_lower_the_count() -> None:
    memory = FullWindows(100)
    hot = window("hot")
    told(memory, [hot], [20])
    told(memory, [hot], [18])  # an answer that left Redis before the one already read
    assert ask(memory, [hot]) is not None


def test_the_memory_is_bounded_and_forgets_ended_windows_first() -> None:
    memory = FullWindows(10)
    for index in range(10):
        key = f"old-{index}"
        memory.learn([(key, 20, int(NOW) - 1 if index < 5 else LATER)], now=NOW)
    memory.learn([("new", 20, LATER)], now=NOW)
    assert len(memory) == 6
    assert ask(memory, [window("new")]) is not None
    assert ask(memory, [window("old-9")]) is not None
    assert ask(memory, [window("old-0")]) is None
    for index in range(30):
        key = f"more-{index}"
        memory.learn([(key, 20, LATER)], now=NOW)
    assert len(memory) <= 10


def test_a_memory_of_no_keys_remembers_nothing() -> None:
    memory = FullWindows(0)
    hot = window("hot")
    told(memory, [hot], [20])
    assert len(memory) == 0
    assert ask(memory, [hot]) is None
