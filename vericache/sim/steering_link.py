"""What steering a remote drafter's kept set (compress/steering.py) costs its link, as the simulator
and `mode: auto`'s prices (serve/backends/path_costs.py) count it.

After every `steer_every` verified rounds the central verifier sends the drafter a refresh: per
replaced (layer, head, position) entry of the kept set, the head and the position it drops and the
one it keeps instead, and that position's key and value (compress/kept_set.py `LayerRefresh`). A
refresh replaces a share of the set's entries, measured by `bench acceptance`
(`steering_refresh_share`). A drafter whose node verifies its own rounds (warm, or the long-context
engine) refreshes in place and sends nothing. A composition's quantized groups (`snapkv+kivi`)
cannot give up one entry alone: its refresh resends the kept set's whole groups, quantized again
(compress/kept_set.py `LayerRegrouped`), about its compressed bytes.
"""

from __future__ import annotations

# The share of a kept set's entries one refresh replaces, steered every round: SnapKV 8x in bf16,
# whole rounds at x=30 over 10 code and 10 tool prompts of contexts cut to 2048 tokens
# (bench/results/acceptance_steering_prefix_2048.json, `steering_refresh_share`: 0.32 on code,
# 0.36 on tools, their mean).
STEERED_REFRESH_SHARE = 0.34
# Steered every k rounds, a refresh replaces STEERED_REFRESH_SHARE * k ** this (at most all): the
# same runs every 2 and 4 rounds replaced 0.40 and 0.55 (acceptance_steering_every_2.json, _4.json;
# the fit gives 0.43 and 0.55).
REFRESH_SHARE_GROWTH = 0.35
# A replaced entry's bytes besides its key and value: its head (int64), the position it drops and
# the one it keeps (int32 each).
ENTRY_INDEX_BYTES = 16
KEPT_ELEMENT_SIZE = 2  # a steerable dropper's kept slots, in bf16 as the served ones store them


def refresh_bytes_per_round(
    compressed_prefix_bytes: float, steer_every: int, head_dim: int, regrouped: bool = False
) -> float:
    """The link bytes a central verifier's refreshes add to a round, on average, for a drafter
    whose kept set over the prefix is `compressed_prefix_bytes` (0: not steered)."""
    if steer_every < 0 or head_dim < 1:
        raise ValueError(f"steer_every >= 0 and head_dim >= 1, got {steer_every}, {head_dim}")
    if not steer_every:
        return 0.0
    return refresh_bytes(compressed_prefix_bytes, head_dim, regrouped, steer_every) / steer_every


def refresh_bytes(
    compressed_prefix_bytes: float, head_dim: int, regrouped: bool = False, steer_every: int = 1
) -> float:
    """One refresh's bytes, every `steer_every` rounds: the replaced share of the set's entries,
    each its key and value (2 x head_dim elements) and its indices; a composition's, its groups
    whole."""
    if regrouped:
        return compressed_prefix_bytes
    share = min(1.0, STEERED_REFRESH_SHARE * steer_every**REFRESH_SHARE_GROWTH)
    entry_bytes = 2 * head_dim * KEPT_ELEMENT_SIZE
    return share * compressed_prefix_bytes * (1 + ENTRY_INDEX_BYTES / entry_bytes)
