from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vericache.compress.scoring import token_budget
from vericache.compress.snapkv import SnapKV
from vericache.errors import InvalidRequestError


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """SnapKV's scores with layer-wise budgets: many tokens low in the model, few at the top.

    Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
    2024, https://arxiv.org/abs/2406.02069. Lower layers attend broadly and upper layers
    concentrate on few tokens, so budgets fall linearly from the bottom layer to the top one;
    the top layer gets 1/`beta` of the mean budget and the total matches SnapKV's at `ratio`.
    """

    name: ClassVar[str] = "pyramidkv"

    beta: float = 20.0

    def __post_init__(self):
        super().__post_init__()
        if not self.beta >= 1:
            raise InvalidRequestError(f"pyramidkv beta must be >= 1, got {self.beta}")

    def layer_budgets(self, num_tokens: int, num_layers: int) -> list[int]:
        mean = token_budget(num_tokens, self.ratio)
        if num_layers == 1:
            return [mean]
        low = mean / self.beta
        high = 2 * mean - low  # the linear ramp from high (layer 0) to low averages to `mean`
        step = (high - low) / (num_layers - 1)
        budgets = [round(high - index * step) for index in range(num_layers)]
        return [min(num_tokens, max(1, budget)) for budget in budgets]
