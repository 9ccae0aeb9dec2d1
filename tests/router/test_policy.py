from __future__ import annotations

from skyline.router.policy import Policy
from skyline.router.replica import Replica, normalize_url


def fleet(*in_flight: int) -> list[Replica]:
    return [Replica(i, f"http://127.0.0.1:{8000 + i}", healthy=True, in_flight=n)
            for i, n in enumerate(in_flight)]


def test_round_robin_ignores_cache_and_load():
    p = Policy("round-robin")
    rs = fleet(9, 0)
    assert [p.choose(rs, {0: 5}).replica.index for _ in range(4)] == [0, 1, 0, 1]


def test_least_load_then_queue_then_kv():
    p = Policy("least-load")
    rs = fleet(3, 1, 1)
    rs[1].load = {"num_waiting": 2.0}
    assert p.choose(rs, {}).replica.index == 2
    rs[2].load = {"num_waiting": 2.0, "kv_usage": 0.9}
    assert p.choose(rs, {}).replica.index == 1


def test_cache_aware_prefers_the_longest_hit():
    p = Policy("cache-aware", balance_abs=4, balance_rel=1.5)
    rs = fleet(2, 0, 0)
    c = p.choose(rs, {0: 7, 1: 3, 2: 0})
    assert c.replica.index == 0 and c.hit_blocks == 7


def test_cache_aware_balances_an_overloaded_replica():
    p = Policy("cache-aware", balance_abs=4, balance_rel=1.5)
    rs = fleet(5, 0, 1)
    # 5 open against 0: overloaded; the next best hit that is not overloaded wins
    assert p.choose(rs, {0: 7, 1: 0, 2: 3}).replica.index == 2
    rs = fleet(5, 2)  # 3 more but not 4 more: still fine
    assert p.choose(rs, {0: 7}).replica.index == 0
    rs = fleet(2, 0)
    rs[0].load = {"kv_usage": 0.99, "num_waiting": 3.0}  # full cache with a queue
    assert p.choose(rs, {0: 7}).replica.index == 1


def test_cache_aware_without_hits_spreads_by_load():
    p = Policy("cache-aware")
    rs = fleet(2, 1, 3)
    assert p.choose(rs, {}).replica.index == 1
    rs = fleet(0, 0)
    assert {p.choose(rs, {}).replica.index for _ in range(4)} == {0, 1}  # ties in turn


def test_normalize_url():
    assert normalize_url("127.0.0.1:8001") == "http://127.0.0.1:8001"
    assert normalize_url("http://h:8001/v1/") == "http://h:8001"
    for bad in ("ftp://h:1", "http://h", "http://:80"):
        try:
            normalize_url(bad)
        except ValueError as e:
            assert "http://HOST:PORT" in str(e)
        else:
            raise AssertionError(bad)
