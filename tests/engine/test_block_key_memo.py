"""The memo of recent block keys (kvpilot/kv/block_keys.py `_KeyMemo`): a key found there is the key the scheme
computes, for each scheme, seed and extra key, and the memo's memory stays bounded."""

from __future__ import annotations

from kvpilot.kv.block_keys import _MEMO, HASH_ALGOS, KeyScheme, _KeyMemo

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


def test_the_memo_keeps_two_generations_at_most() -> None:
    memo = _KeyMemo(max_entries=4)
    for i in range(20):
        memo.put((i,), bytes([i]))
    assert len(memo._young) + len(memo._old) <= 8
    assert memo.get((19,)) == bytes([19]) and memo.get((0,)) is None
    # an old entry that is asked for again moves to the young generation and outlives the next turnover
    memo = _KeyMemo(max_entries=2)
    memo.put(("a",), b"a")
    memo.put(("b",), b"b")
    memo.put(("c",), b"c")  # a and b are the old generation now
    assert memo.get(("a",)) == b"a"  # promoted
    memo.put(("d",), b"d")  # turnover: b dropped, a kept
    assert memo.get(("a",)) == b"a" and memo.get(("b",)) is None
    assert _MEMO.max_entries >= 1024  # the module's memo is sized for shared prefixes, not one request
