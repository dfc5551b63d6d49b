"""The memo of recent block keys (kvpilot/kv/block_keys.py `_KeyMemo`): a key found there is the key the scheme
computes, for each scheme, seed and extra key, and the memo's memory stays bounded."""

from __future__ import annotations

from kvpilot.kv.block_keys import _MEMO, HASH_ALGOS, KeyScheme, _entry_bytes, _KeyMemo

PROMPT = list(range(500, 500 + 16 * 4))


def computed(scheme: KeyScheme, salt: str | None) -> list[bytes]:
    """The chain computed block by block without the memo."""
    out: list[bytes] = []
    extra = scheme.first_extra(salt, None)
    for i in range(0, len(PROMPT), 16):
        parent = out[-1] if out else scheme._root
        out.append(scheme._hash_block(parent, tuple(PROMPT[i : i + 16]), extra if i == 0 else None))
    return out


def test_a_remembered_key_is_the_computed_one() -> None:
    for algo in HASH_ALGOS:
        for scheme in (KeyScheme(algo), KeyScheme(algo, "another seed")):
            for salt in (None, "tenant-a"):
                first = scheme.prompt_hashes(PROMPT, 16, salt)
                again = scheme.prompt_hashes(PROMPT, 16, salt)  # from the memo
                assert first == again == computed(scheme, salt), (algo, scheme.seed, salt)
    # a seed, an algo and a salt each make other keys, remembered or not
    keys = {
        tuple(KeyScheme(a, s).prompt_hashes(PROMPT, 16, t))
        for a in HASH_ALGOS[:2]
        for s in ("x", "y")
        for t in (None, "t")
    }
    assert len(keys) == 8


def memo_key(i: int, tokens: int = 16, salt: str | None = None) -> tuple:
    return ("sha256", "", None, tuple(range(i, i + tokens)), (("cache_salt", salt),) if salt else None)


def test_the_memo_keeps_two_generations_at_most_by_bytes() -> None:
    entry = _entry_bytes(memo_key(0))
    memo = _KeyMemo(max_bytes=4 * entry)
    for i in range(20):
        memo.put(memo_key(i), bytes([i]))
    assert len(memo) <= 8
    assert memo.get(memo_key(19)) == bytes([19]) and memo.get(memo_key(0)) is None
    # an old entry that is asked for again moves to the young generation and outlives the next turnover
    memo = _KeyMemo(max_bytes=2 * entry)
    for name in "abc":
        memo.put(memo_key(ord(name)), name.encode())  # a and b are the old generation after c
    assert memo.get(memo_key(ord("a"))) == b"a"  # promoted
    memo.put(memo_key(ord("d")), b"d")  # turnover: b dropped, a kept
    assert memo.get(memo_key(ord("a"))) == b"a" and memo.get(memo_key(ord("b"))) is None
    assert _MEMO.max_bytes >= 1024 * entry  # the module's memo is sized for shared prefixes, not one request


def test_salts_and_long_blocks_count_by_their_bytes() -> None:
    """Entries of 4 KiB salts or of 64k-token blocks (a pod's block size reaches the router's memo): the
    memo holds what fits in its bytes, not 4,096 of them (a count bound let ~4 MiB salts take gigabytes)."""
    memo = _KeyMemo(max_bytes=1 << 20)
    for i in range(1000):
        memo.put(memo_key(i, salt=f"{i}" + "s" * 4095), bytes(32))
    assert len(memo) <= 2 * (1 << 20) // 4096
    memo = _KeyMemo(max_bytes=1 << 20)
    for i in range(100):
        memo.put(memo_key(i, tokens=1 << 16), bytes(32))
    assert len(memo) <= 2 * ((1 << 20) // (36 << 16) + 1)
