"""How many cache slots a sequence reserves, and the bytes of one: torch-free, so that the
simulator (vericache/sim) reserves for a request exactly what the engine and the coordinator
reserve, and tells its scheduler the same bytes."""

from __future__ import annotations

# Buffers grow in multiples of this many slots.
SLOT_ALIGNMENT = 256
# Batch-invariant attention reads keys in whole blocks of this many slots (model/kernels.py), so a
# request's full KV is reserved in whole blocks from the start, not on growth.
KEY_ALIGN = 1024
POSITION_BYTES = 4  # one int32 position per KV head of each layer


def aligned(num_slots: int, multiple: int = SLOT_ALIGNMENT) -> int:
    return -(-num_slots // multiple) * multiple


def cache_capacity(num_tokens: int, max_positions: int) -> int:
    """Slots to reserve for a sequence that may reach `num_tokens` tokens, within the model's
    context."""
    return aligned(min(num_tokens, max_positions), KEY_ALIGN)


def slot_bytes(kv_bytes_per_token: int, num_layers: int, num_kv_heads: int) -> int:
    """Bytes one token takes in a dense cache: its keys and values, and its positions."""
    return kv_bytes_per_token + POSITION_BYTES * num_layers * num_kv_heads


def full_kv_slots(
    num_prompt_tokens: int,
    max_new_tokens: int,
    draft_len: int,
    max_positions: int,
    num_shared_tokens: int = 0,
) -> int:
    """Slots a request's full KV reserves: the prompt, every output token and one round's drafts
    with the verifier's own token (every driver reserves this). Over a shared prefix of
    `num_shared_tokens` (kv/prefixed.py) exactly that many: the session's own layer holds what
    follows the prefix and is never read in KEY_ALIGN blocks, which would cost it up to a block of
    unused slots."""
    num_tokens = num_prompt_tokens + max_new_tokens + draft_len + 1
    if num_shared_tokens:
        return min(num_tokens, max_positions)
    return cache_capacity(num_tokens, max_positions)


def own_full_kv_slots(
    num_prompt_tokens: int,
    max_new_tokens: int,
    draft_len: int,
    max_positions: int,
    num_shared_tokens: int,
) -> int:
    """Slots of its `full_kv_slots` that a session over a shared prefix holds of its own."""
    num_slots = full_kv_slots(
        num_prompt_tokens, max_new_tokens, draft_len, max_positions, num_shared_tokens
    )
    return num_slots - num_shared_tokens


def reserved_full_kv_bytes(
    num_prompt_tokens: int,
    max_new_tokens: int,
    draft_len: int,
    max_positions: int,
    bytes_per_slot: int,
) -> int:
    """What a request's full KV reserves, in bytes: what the engine and the coordinator book with
    their schedulers, and what the verifier's residency counts."""
    num_slots = full_kv_slots(num_prompt_tokens, max_new_tokens, draft_len, max_positions)
    return num_slots * bytes_per_slot
