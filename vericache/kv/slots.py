"""How many cache slots a sequence reserves, and the bytes of one: torch-free, so that the
simulator (vericache/sim) reserves for a request exactly what the engine and the coordinator
reserve, and tells its scheduler the same bytes."""

from __future__ import annotations

# Buffers grow in multiples of this many slots.
SLOT_ALIGNMENT = 256
# Batch-invariant attention reads keys in whole blocks of this many slots (model/kernels.py), so a
# request's full KV is reserved in whole blocks from the start, not on growth.
KEY_ALIGN = 1024
# A prefix shared by sessions (kv/prefixed.py) is shared in whole blocks of this many slots, a
# multiple of every attention kernel's block of keys (the CPU kernel's 128, Triton's 32 or 64), and
# small, since each session copies the prefix's tokens past its last whole block: a
# row's online softmax then runs the same steps over [shared prefix | own tokens] as over one
# buffer, so sharing changes no bit of any result.
SHARED_PREFIX_ALIGN = 128
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
    num_prompt_tokens: int, max_new_tokens: int, draft_len: int, max_positions: int
) -> int:
    """Slots a request's full KV reserves: the prompt, every output token and one round's drafts
    with the verifier's own token (every driver reserves this)."""
    return cache_capacity(num_prompt_tokens + max_new_tokens + draft_len + 1, max_positions)


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
