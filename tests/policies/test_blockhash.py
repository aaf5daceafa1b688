"""Block hashes equal vLLM 0.32's.

The expected values were computed once with vLLM 0.32.0's own ``hash_block_tokens`` /
``init_none_hash`` / ``maybe_convert_block_hash`` (block size 16) for the token ids below; the
real-engine suite (tests/realvllm/test_kv_events.py) checks the same against live BlockStored
events.
"""

from __future__ import annotations

import hashlib
import random

import cbor2
import pytest

from policies.beliefs.blockhash import HashSpec, block_digests, block_hashes, cbor_dumps

TOKENS = [*range(1000, 1040), 0, 23, 24, 255, 256, 65535, 65536, 2**31, 150000]  # CBOR size edges

GOLDEN = {  # (algo, PYTHONHASHSEED) -> (NONE_HASH hex, [published int hashes of the 3 full blocks])
    ("sha256", None): (
        "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
        [7322446309363477352, 17027874615116373601, 325070342832746254],
    ),
    ("sha256_cbor", None): (
        "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
        [3753563854825738204, 2378715151359315973, 9708029584200742828],
    ),
    ("sha256", "42"): (
        "c0bc02c9fc92a4944335649961b9e55cc41b194bece4801e8c6ef0f0f3f5884a",
        [9457895465985418569, 10419666624685564459, 5872210119615888056],
    ),
    ("sha256_cbor", "42"): (
        "9fa6eb003f14425eb9c8e6baacfbcaab26257357b829c7bfa74ffcc4f31c1780",
        [13356853646056301512, 13336132202528004482, 12871283864371362571],
    ),
}
FIRST_DIGEST = {  # the full first-block digest, for int_hashes=False
    ("sha256", None): "9d9c413731095d0ee811a14814414907cafccd751ce2052f659e8e1f547aeb68",
    ("sha256_cbor", "42"): "8bc90083e256e33ce5412b0cf36581760664c7249eca7d0cb95d139f9a1123c8",
}
SALTED = {  # PYTHONHASHSEED=42, cache_salt "s1"
    "sha256": [14995182030679818644, 17793315604307450562, 11219401625155607187],
    "sha256_cbor": [11057708868332785451, 17257349651632474574, 4340820957114430823],
}
LORA_SALTED = {  # PYTHONHASHSEED=7, LoRA ("adp", "/models/adp"), cache_salt "s1"
    "sha256": [5837132641156864810, 7591218245228687343, 16998071093653926717],
    "sha256_cbor": [14870056312188565176, 10867154283323582724, 10996910447158022227],
}


@pytest.mark.parametrize(("algo", "seed"), list(GOLDEN))
def test_hashes_equal_vllm(algo: str, seed: str | None) -> None:
    none_hash, expected = GOLDEN[(algo, seed)]
    spec = HashSpec(block_size=16, algo=algo, seed=seed)
    assert spec.none_hash.hex() == none_hash
    assert block_hashes(TOKENS, spec) == expected
    assert spec.reproducible


@pytest.mark.parametrize(("algo", "seed"), list(FIRST_DIGEST))
def test_bytes_hashes(algo: str, seed: str | None) -> None:
    spec = HashSpec(block_size=16, algo=algo, seed=seed, int_hashes=False)
    out = block_hashes(TOKENS, spec)
    assert out[0].hex() == FIRST_DIGEST[(algo, seed)]
    assert all(isinstance(h, bytes) and len(h) == 32 for h in out)
    # the published int is the digest's last 8 bytes
    assert [int.from_bytes(h[-8:], "big") for h in out] == GOLDEN[(algo, seed)][1]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_extra_keys_equal_vllm(algo: str) -> None:
    assert block_hashes(TOKENS, HashSpec(16, algo, "42"), cache_salt="s1") == SALTED[algo]
    assert (
        block_hashes(TOKENS, HashSpec(16, algo, "7"), cache_salt="s1", lora=("adp", "/models/adp"))
        == (LORA_SALTED[algo])
    )


def test_only_full_blocks_and_prefix_property() -> None:
    spec = HashSpec(block_size=16)
    assert block_hashes(TOKENS[:15], spec) == []
    full = block_hashes(TOKENS, spec)
    assert len(full) == len(TOKENS) // 16
    assert block_hashes(TOKENS[:33], spec) == full[:2]  # a prefix's hashes are a prefix
    other = block_hashes([1, *TOKENS[1:]], spec)
    assert all(a != b for a, b in zip(other, full, strict=True))  # chained: one token changes all


def test_hash_block_size_takes_boundary_hashes() -> None:
    fine = HashSpec(block_size=16)
    coarse = HashSpec(block_size=32, hash_block_size=16)
    assert block_hashes(TOKENS, coarse) == block_hashes(TOKENS, fine)[1::2]
    with pytest.raises(ValueError):
        HashSpec(block_size=24, hash_block_size=16)


def test_spec_validation_and_equality() -> None:
    with pytest.raises(ValueError):
        HashSpec(block_size=16, algo="md5")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        HashSpec(block_size=0)
    assert HashSpec(16, "sha256", "1") == HashSpec(16, "sha256", "1")
    assert hash(HashSpec(16)) == hash(HashSpec(16))
    assert HashSpec(16) != HashSpec(16, seed="1")


def test_unreproducible_xxhash_without_seed() -> None:
    spec = HashSpec(block_size=16, algo="xxhash", seed=None)
    assert not spec.reproducible
    # the gateway keeps its own deterministic chain (sha256, default seed) for translation
    assert block_hashes(TOKENS, spec) == GOLDEN[("sha256", None)][1]


def test_xxhash_with_seed_needs_the_package() -> None:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="xxhash"):
            HashSpec(block_size=16, algo="xxhash", seed="0")
    else:
        spec = HashSpec(block_size=16, algo="xxhash", seed="0")
        assert len(block_hashes(TOKENS, spec)) == 3


def test_cbor_encoding() -> None:
    """cbor2 in canonical mode, as vLLM calls it: shortest heads, sorted map keys, shortest floats."""
    assert cbor_dumps(None) == b"\xf6"
    assert cbor_dumps((1, 23, 24, 255, 256, 65535, 65536)) == bytes.fromhex("870117181818ff19010019ffff1a00010000")
    assert cbor_dumps(-1) == b"\x20"
    assert cbor_dumps(b"ab") == b"\x42ab"
    assert cbor_dumps(("s",)) == b"\x81\x61s"
    assert cbor_dumps(2**64) == bytes.fromhex("c249010000000000000000")  # a bignum, as vLLM would hash it
    assert cbor_dumps(1.5) == bytes.fromhex("f93e00")  # canonical: the shortest exact float
    assert cbor_dumps({"b": 1, "a": 2}) == cbor_dumps({"a": 2, "b": 1})


def test_cbor_digest_is_vllms_call() -> None:
    """The *_cbor digest is sha256 of ``cbor2.dumps(key, canonical=True)``, vLLM's own call, for a
    block key with extra keys (LoRA, cache_salt)."""
    spec = HashSpec(16, "sha256_cbor", "7")
    key = (spec.none_hash, tuple(TOKENS[:16]), (("lora", "adp", "/models/adp"), ("cache_salt", "s1")))
    assert spec._digest(key) == hashlib.sha256(cbor2.dumps(key, canonical=True)).digest()
    digest = block_digests(
        TOKENS[:16], spec, first_extra=(("cache_salt", "s1"),), every_extra=(("lora", "adp", "/models/adp"),)
    )
    assert digest == [spec._digest(key)]
    assert int.from_bytes(digest[0][-8:], "big") == LORA_SALTED["sha256_cbor"][0]


def test_memo_continues_a_conversation() -> None:
    """block_digests (the simulator's and the event translator's path) memoizes per block."""
    spec = HashSpec(block_size=16, memo_size=10_000)
    rng = random.Random(1)
    turn1 = [rng.randrange(150_000) for _ in range(8192)]
    first = block_digests(turn1, spec)
    assert spec.memo_len() == 512
    turn2 = turn1 + [rng.randrange(150_000) for _ in range(200)]
    second = block_digests(turn2, spec)
    assert second[:512] == first
    assert spec.memo_len() == len(turn2) // 16  # only the new blocks were hashed
    assert block_hashes(turn2, HashSpec(block_size=16)) == [int.from_bytes(d[-8:], "big") for d in second]
    # chain continuation from a digest equals hashing the whole prompt
    digests = block_digests(turn2, spec)
    assert block_digests(turn2[512 * 16 :], spec, parent=digests[511]) == digests[512:]


def test_memo_is_bounded() -> None:
    spec = HashSpec(block_size=16, memo_size=8)
    block_digests(list(range(16 * 20)), spec)
    assert spec.memo_len() == 8


def test_next_turn_hashes_only_its_new_blocks() -> None:
    """A conversation coming back with one more turn reuses its last prompt's hashes: only new
    blocks are hashed (the decision-time budget counts on it; timings are in bench.decision)."""
    rng = random.Random(2)
    prompt = [rng.randrange(150_000) for _ in range(8192)]
    spec = HashSpec(block_size=16)
    calls = []
    digest = spec._digest
    object.__setattr__(spec, "_digest", lambda obj: calls.append(1) or digest(obj))
    first = block_hashes(prompt, spec)
    assert len(calls) == 512
    calls.clear()
    assert block_hashes([*prompt, 5, 6, 7], spec) == first and calls == []
    turn = [*prompt, *range(40)]
    assert block_hashes(turn, spec)[:512] == first and len(calls) == 2
    # the same answer as hashing from scratch
    assert block_hashes(turn, spec) == block_hashes(turn, HashSpec(block_size=16))
    # another conversation with the same start shares only that start
    calls.clear()
    other = [*prompt[:1000], *range(7000)]
    assert block_hashes(other, spec) == block_hashes(other, HashSpec(block_size=16))
    assert len(calls) == 8000 // 16 - 1000 // 16


def _counting(spec: HashSpec) -> list[int]:
    """Count the blocks ``spec`` hashes from now on."""
    calls: list[int] = []
    digest = spec._digest
    object.__setattr__(spec, "_digest", lambda obj: calls.append(1) or digest(obj))
    return calls


def test_memo_is_an_lru() -> None:
    """A block looked up again becomes the most recent: the least recently used one goes first."""
    spec = HashSpec(block_size=4, memo_size=2)
    calls = _counting(spec)
    x, y, z = [1] * 4, [2] * 4, [3] * 4
    for block in (x, y, x, z):  # x is hit on its second use; z then evicts y, not x
        block_digests(block, spec)
    assert len(calls) == 3 and spec.memo_len() == 2
    block_digests(x, spec)
    assert len(calls) == 3  # still memoized
    block_digests(y, spec)
    assert len(calls) == 4  # hashed again


def test_recent_prompts_are_an_lru() -> None:
    """Conversations are remembered by their first block, least recently used dropped first."""
    spec = HashSpec(block_size=4, recent_size=2)
    calls = _counting(spec)
    a, b, c = ([k] * 40 for k in (1, 2, 3))  # 10 blocks each, different first blocks
    for prompt in (a, b, a, c):  # a's second turn is a hit; c then evicts b
        block_hashes(prompt, spec)
    assert len(calls) == 30
    calls.clear()
    block_hashes([*a, 9, 9, 9, 9], spec)
    assert len(calls) == 1  # a's next turn: only its new block
    block_hashes([*b, 9, 9, 9, 9], spec)
    assert len(calls) == 1 + 11  # b was forgotten: every block hashed again
    spec.clear_memo()
    calls.clear()
    block_hashes(a, spec)
    assert len(calls) == 10


def test_cache_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="memo_size"):
        HashSpec(block_size=16, memo_size=0)
    with pytest.raises(ValueError, match="recent_size"):
        HashSpec(block_size=16, recent_size=0)
