"""Tensor parallelism: one model's layers split over several devices of this process.

Each device holds a shard: the model's own architecture, built from a config whose attention
heads, KV heads and MLP width are divided by the degree. A shard's q/k/v and gate/up rows are
its slice of the whole model's (column-parallel), its o_proj and down_proj columns likewise
(row-parallel: each shard's output is a partial sum); embeddings, norms and lm_head are whole
on every shard. So the whole model's output after o_proj (and down_proj) is the sum of the
shards' outputs, which `ForwardContext.reduce` makes.

The shards run in lockstep in the calling thread: each runs the model's own forward in a
greenlet, and every reduce point yields to the driver, which sums the shards' partial outputs
once every shard has reached it (in place: NCCL's all-reduce across the GPUs, or a sum on the
host) and resumes each with the total. The host launches both devices' kernels from one thread,
one layer at a time, so the devices run side by side. Each shard has its own paged KV cache
(its KV heads) on its device, with the same block tables.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

import torch
from torch import nn

from models.attention.base import ForwardContext
from models.config import ModelConfig
from models.layers.merged_linear import MergedLinear

ROW_PARALLEL = ("o_proj", "down_proj")  # input columns split, output summed over the shards

AllReduce = Callable[[list[torch.Tensor]], None]


def shard_config(config: ModelConfig, degree: int) -> ModelConfig:
    """The config of one of `degree` shards: heads, KV heads and MLP width divided."""
    for what, n in (
        ("attention heads", config.num_heads),
        ("KV heads", config.num_kv_heads),
        ("MLP width", config.intermediate_size),
    ):
        if degree < 1 or n % degree:
            raise ValueError(f"cannot split {n} {what} over {degree} devices")
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // degree,
        num_kv_heads=config.num_kv_heads // degree,
        intermediate_size=config.intermediate_size // degree,
    )


@torch.no_grad()
def copy_shard(whole: nn.Module, shard: nn.Module, rank: int) -> None:
    """Fills shard (built from shard_config) with rank's slice of whole's parameters."""
    wholes = dict(whole.named_modules())
    for name, mod in shard.named_modules():
        src = wholes[name]
        if isinstance(mod, MergedLinear):  # each stacked projection: rank's block of rows
            for part, rows in mod.shards.items():
                lo = src.shard_rows(part).start + rank * rows
                dst = mod.shard_rows(part)
                mod.weight[dst].copy_(src.weight[lo : lo + rows])
                if mod.bias is not None:
                    mod.bias[dst].copy_(src.bias[lo : lo + rows])
        elif isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in ROW_PARALLEL:
            cols = mod.in_features
            mod.weight.copy_(src.weight[:, rank * cols : (rank + 1) * cols])
            if mod.bias is not None:  # added once, by the first shard
                mod.bias.copy_(src.bias if rank == 0 else torch.zeros_like(src.bias))
        else:
            for pname, p in mod.named_parameters(recurse=False):
                p.copy_(getattr(src, pname))


def host_all_reduce(xs: list[torch.Tensor]) -> None:
    """Sums the shards' tensors into each of them (on the host, or devices without NCCL)."""
    total = xs[0].clone()
    for x in xs[1:]:
        total += x.to(total.device)
    for x in xs:
        x.copy_(total)


# Held while a split model queues work on several GPUs (its step's copies and collectives):
# two split models stepped from two threads would otherwise queue them on the GPUs' streams in
# different orders, each GPU then waiting for the other's.
collective_order = threading.RLock()


def nccl_all_reduce(xs: list[torch.Tensor]) -> None:
    """Sums the shards' tensors (one per GPU, contiguous) into each of them: NCCL's all-reduce,
    launched on each GPU's current stream from this one process (in collective_order)."""
    with collective_order:
        torch.cuda.nccl.all_reduce(xs)


def default_all_reduce(devices: Sequence[torch.device]) -> AllReduce:
    """NCCL's where every shard has a GPU of its own and torch has NCCL, else the host sum."""
    gpus = all(d.type == "cuda" for d in devices) and len(set(devices)) == len(devices)
    return nccl_all_reduce if gpus and hasattr(torch._C, "_nccl_all_reduce") else host_all_reduce


class TensorParallel:
    """A model split into shards (one per device); forward runs them in lockstep."""

    def __init__(
        self,
        shards: Sequence[nn.Module],
        devices: Sequence[torch.device],
        all_reduce: AllReduce | None = None,
    ):
        if len(shards) != len(devices) or len(shards) < 2:
            raise ValueError("tensor parallelism takes one shard per device, two or more")
        self.shards, self.devices = list(shards), list(devices)
        self.all_reduce = all_reduce or default_all_reduce(self.devices)
        self.config = shards[0].config

    @classmethod
    def split(
        cls,
        whole: nn.Module,
        devices: Sequence[torch.device],
        all_reduce: AllReduce | None = None,
    ) -> TensorParallel:
        """Shards of a whole model, built on the host and moved to their devices."""
        cfg = shard_config(whole.config, len(devices))
        first = next(whole.parameters())
        shards = []
        for rank, dev in enumerate(devices):
            shard = type(whole)(cfg).to(first.dtype).eval().requires_grad_(False)
            copy_shard(whole, shard, rank)
            shards.append(shard.to(dev))
        return cls(shards, devices, all_reduce)

    def parameters(self):
        """Every shard's parameters."""
        for s in self.shards:
            yield from s.parameters()

    def _on(self, rank: int) -> None:
        if self.devices[rank].type == "cuda":
            torch.cuda.set_device(self.devices[rank])

    def forward(
        self,
        input_ids: Sequence[torch.Tensor],
        positions: Sequence[torch.Tensor],
        ctxs: Sequence[ForwardContext],
    ) -> list[torch.Tensor]:
        """Each shard's inputs on its device (the same tokens) -> each shard's final hidden
        states [T, hidden] (equal across shards)."""
        from greenlet import getcurrent, greenlet

        driver = getcurrent()
        n = len(self.shards)

        def runner(rank: int):
            def run():
                ctx = dataclasses.replace(ctxs[rank], reduce=driver.switch)
                return self.shards[rank](input_ids[rank], positions[rank], ctx)

            return greenlet(run)

        lets = [runner(r) for r in range(n)]
        gpu = self.devices[0].type == "cuda"
        home = torch.cuda.current_device() if gpu else None
        try:
            got = []
            for r, g in enumerate(lets):  # each to its first reduce point (or its end)
                self._on(r)
                got.append(g.switch())
            while not lets[0].dead:
                if any(g.dead for g in lets):
                    raise RuntimeError("the shards of a tensor-parallel model fell out of step")
                self.all_reduce(got)
                for r, g in enumerate(lets):
                    self._on(r)
                    got[r] = g.switch(got[r])
            if not all(g.dead for g in lets):
                raise RuntimeError("the shards of a tensor-parallel model fell out of step")
        finally:
            if home is not None:  # the caller's device current again
                torch.cuda.set_device(home)
        return got

    __call__ = forward

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The first shard's lm_head (whole on every shard) over its hidden states."""
        return self.shards[0].compute_logits(hidden)
