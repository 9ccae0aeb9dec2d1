from __future__ import annotations

from skyline.router.index import PrefixIndex


def hs(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


def test_match_counts_leading_blocks_per_replica():
    idx = PrefixIndex()
    idx.store(0, hs("a", "b", "c"))
    idx.store(1, hs("a", "b"))
    idx.store(2, hs("b", "c"))  # not a prefix: no match
    assert idx.match(hs("a", "b", "c", "d"), [0, 1, 2, 3]) == {0: 3, 1: 2, 2: 0, 3: 0}
    assert idx.match(hs("a", "b"), [0, 1]) == {0: 2, 1: 2}
    assert idx.match([], [0]) == {0: 0}


def test_remove_clear_replace():
    idx = PrefixIndex()
    idx.store(0, hs("a", "b"))
    idx.store(1, hs("a", "b"))
    idx.remove(0, hs("b", "zz"))
    assert idx.match(hs("a", "b"), [0, 1]) == {0: 1, 1: 2}
    idx.clear(1)
    assert idx.num_hashes(1) == 0 and idx.match(hs("a"), [0, 1]) == {0: 1, 1: 0}
    idx.replace(0, hs("x"))
    assert idx.match(hs("x"), [0]) == {0: 1} and idx.match(hs("a"), [0]) == {0: 0}
    idx.clear(0)
    assert idx._holders == {}


def test_cap_forgets_oldest_first():
    idx = PrefixIndex()
    idx.store(0, hs("a", "b"), cap=3)
    idx.store(0, hs("a", "c", "d"), cap=3)  # 'a' refreshed: 'b' is the oldest
    assert idx.num_hashes(0) == 3
    assert idx.match(hs("a", "c", "d"), [0]) == {0: 3}
    assert idx.match(hs("b"), [0]) == {0: 0}
