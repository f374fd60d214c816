"""Rotary position embeddings, with Llama 3 frequency scaling.

cos/sin come from a table built once: a gather by position is exact, so a token gets the same
rotation whichever forward (prefill, draft step, verification) computes its key.
"""

from __future__ import annotations

import math

import torch

from vericache.model.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Applies RoPE to [N, H, D] queries or keys at absolute positions [N].

    The rotation is x * cos + roll(x, D/2) * sin', where sin' is sin with its first half negated:
    the same bits as the reference's x * cos + cat(-x[D/2:], x[:D/2]) * sin (a negation is exact
    on either factor), in two fewer operators."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, device, dtype):
        inv_freq = inverse_frequencies(rope, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, D/2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.cos = angles.cos().to(device=device, dtype=dtype)
        sign = torch.ones(head_dim, dtype=dtype)
        sign[: head_dim // 2] = -1
        self.signed_sin = angles.sin().to(device=device, dtype=dtype) * sign.to(device)  # [P, D]
        self.max_positions = max_positions

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin' at `positions` (any shape): [*positions.shape, D] each. A forward
        gathers them once for all its layers."""
        return self.cos[positions], self.signed_sin[positions]

    @staticmethod
    def turn(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x [..., D] rotated by `angles` broadcast to it (negate sin' for the inverse)."""
        return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, signed_sin = self.angles(positions)
        return self.turn(x, cos.unsqueeze(1), signed_sin.unsqueeze(1))  # [N, 1, D] each
