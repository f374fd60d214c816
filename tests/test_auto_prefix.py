"""The block-hash index of automatic prefix caching: the longest registered prefix leading a prompt,
whatever its length against the block size, only among the tenant's own, and never the whole
prompt."""

from __future__ import annotations

from vericache.serve.auto_prefix import BLOCK_TOKENS, PrefixIndex, block_digests
from vericache.serve.catalog import PrefixRecord


def record(prefix_id: str, token_ids, tenant: str = "a") -> PrefixRecord:
    return PrefixRecord(
        prefix_id, tuple(token_ids), True, {"name": "x", "params": {}}, 0, 0, tenant
    )


PROMPT = tuple(range(100, 100 + 5 * BLOCK_TOKENS + 7))


def test_the_longest_leading_prefix_is_found_at_any_length():
    index = PrefixIndex()
    lengths = [3, BLOCK_TOKENS, 2 * BLOCK_TOKENS + 5, 4 * BLOCK_TOKENS]
    for length in lengths:
        index.add(record(f"p{length}", PROMPT[:length]))
    index.add(record("other", (1, 2, 3) + PROMPT[3 : 5 * BLOCK_TOKENS]))  # differs at the start
    assert index.longest_match("a", PROMPT).prefix_id == f"p{4 * BLOCK_TOKENS}"
    assert (
        index.longest_match("a", PROMPT[: 3 * BLOCK_TOKENS]).prefix_id == f"p{2 * BLOCK_TOKENS + 5}"
    )
    assert index.longest_match("a", PROMPT[:10]).prefix_id == "p3"
    assert index.longest_match("a", (7,) + PROMPT) is None


def test_a_prefix_must_leave_a_token_after_it():
    index = PrefixIndex()
    index.add(record("whole", PROMPT[:BLOCK_TOKENS]))
    assert index.longest_match("a", PROMPT[:BLOCK_TOKENS]) is None
    assert index.longest_match("a", PROMPT[: BLOCK_TOKENS + 1]).prefix_id == "whole"


def test_a_tail_that_differs_in_its_last_token_does_not_match():
    index = PrefixIndex()
    index.add(record("p", PROMPT[: BLOCK_TOKENS + 4]))
    changed = PROMPT[: BLOCK_TOKENS + 3] + (1,) + PROMPT[BLOCK_TOKENS + 4 :]
    assert index.longest_match("a", changed) is None


def test_only_the_tenants_own_prefixes_match_and_removed_ones_no_more():
    index = PrefixIndex()
    index.add(record("of-b", PROMPT[:40], tenant="b"))
    assert index.longest_match("a", PROMPT) is None
    assert index.longest_match("b", PROMPT).prefix_id == "of-b"
    index.remove("of-b")
    index.remove("of-b")  # twice: nothing happens
    assert index.longest_match("b", PROMPT) is None


def test_block_digests_chain_over_full_blocks():
    digests = block_digests(PROMPT)
    assert len(digests) == len(PROMPT) // BLOCK_TOKENS + 1
    changed = (0,) + PROMPT[1:]
    assert all(a != b for a, b in zip(block_digests(changed)[1:], digests[1:]))


def test_a_lookup_does_the_same_work_whatever_other_tenants_registered(monkeypatch):
    """Another tenant's prefix cannot show in a lookup's timing: the lookup hashes the same
    blocks and reads the same entries whether or not another tenant registered its prompt."""
    from vericache.serve import auto_prefix

    hashed, real_digest = [], auto_prefix._digest
    monkeypatch.setattr(auto_prefix, "_digest", lambda *a: hashed.append(a) or real_digest(*a))
    index = PrefixIndex()
    index.add(record("of-a", PROMPT[:20], tenant="a"))
    index.add(record("of-a-too", (7,) * 40, tenant="a"))

    def lookup() -> tuple[list, dict, PrefixRecord | None]:
        hashed.clear()
        found = index.longest_match("a", PROMPT)
        return list(hashed), dict(index._by_tenant["a"]), found

    alone = lookup()
    index.add(record("of-b", PROMPT[: 3 * BLOCK_TOKENS + 2], tenant="b"))  # what A looks up
    index.add(record("of-b-too", PROMPT[:20], tenant="b"))
    assert lookup() == alone
    assert alone[2].prefix_id == "of-a"
