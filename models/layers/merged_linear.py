"""MergedLinear: several HF projections of one input fused into one matmul (q/k/v, gate/up)."""

from __future__ import annotations

from torch import nn


class MergedLinear(nn.Linear):
    """An nn.Linear whose output rows are the HF projections `shards`, stacked in order.

    The weight loader copies HF's `<parent>.<shard>.weight` (and `.bias`) into `shard_rows(shard)`
    of this module's parameters (vLLM's stacked_params_mapping, declared on the module).
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = dict(shards)  # HF projection name -> output rows, in stacking order

    def shard_rows(self, shard: str) -> slice:
        start = 0
        for name, rows in self.shards.items():
            if name == shard:
                return slice(start, start + rows)
            start += rows
        raise KeyError(shard)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, shards={self.shards}"
