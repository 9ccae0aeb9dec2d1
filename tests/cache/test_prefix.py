from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

from skyline.cache.prefix import ROOT_HASH, extend_block_hashes, hash_block, hash_token_blocks

ROOT = Path(__file__).resolve().parents[2]


def test_chain_depends_on_whole_prefix():
    a = hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = hash_token_blocks([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2  # the partial block has no hash
    assert a[0] == hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert a[1] == hash_block(a[0], [5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different parent
    assert hash_token_blocks([1, 2, 3, 4], 4, salt=b"tenant") != a[:1]


def test_incremental_equals_full():
    rng = random.Random(0)
    tokens: list[int] = []
    hashes: list[bytes] = []
    for _ in range(200):
        tokens += [rng.randrange(100_000) for _ in range(rng.randrange(0, 7))]
        before = len(hashes)
        added = extend_block_hashes(hashes, tokens, 8)
        assert added == len(hashes) - before
        assert hashes == hash_token_blocks(tokens, 8)


def test_deterministic_across_processes():
    code = (
        "from skyline.cache.prefix import hash_token_blocks;"
        "print(hash_token_blocks(list(range(40)), 16)[-1].hex())"
    )
    outs = {
        subprocess.check_output(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            cwd=ROOT,
            text=True,
        ).strip()
        for seed in ("1", "2")
    }
    assert outs == {hash_token_blocks(list(range(40)), 16)[-1].hex()}
