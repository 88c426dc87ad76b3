"""Weights asked into the L2 while the memory bus idles.

In a decode step of a small batch every GEMM streams its weights from HBM at the bus's limit,
while the kernels between the GEMMs (the attention, the norms, the activation) leave HBM nearly
idle. At a point of the forward just before such a window, a kernel on a side stream asks the L2
for the weights of the GEMM after it (Hopper's bulk prefetch, `cp.async.bulk.prefetch.L2`: a
hint, nothing comes back to the SMs), so that GEMM finds them there.

Points (a plan of each model, `prefetch_plans`), each with a budget of bytes:
- in SelfAttention, at its attention: the o_proj weight, then the head of the MLP's gate_up
  weight (read after the o_proj GEMM and the norm); with `inline`, asked by the Triton decode
  kernel itself where it runs the step's attention;
- in GatedMLP, after its gate_up GEMM (before the activation): the head of the down weight;
- in the decoder layer, as it starts (before its input norm): the head of its qkv weight;
- at the model's final norm: the head of the lm_head's weight (the layer-start budget).

The side stream forks from the step's stream at each point and joins it once, at the end of the
model's forward (CausalLM.forward): nothing on the step's stream waits for a prefetch. Numbers are
untouched (cache hints only). CUDA on Hopper or later only; Triton's interpreter cannot run the
prefetch instruction, so there the kernel writes its chunks out instead (`chunks`, for tests).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from models.attention.triton_ops import (  # noqa: F401 (ask_l2: the kernel's)
    ASKS_PER_PROGRAM,
    PF_CHUNK,
    ask_l2,
    ask_programs,
    bulk_prefetch_runs_on,
    interpreting,
    prefetch_mode,
)

CHUNK = PF_CHUNK  # bytes one prefetch instruction asks for
BLOCK = ASKS_PER_PROGRAM  # chunks a program issues: one a thread of its one warp


def _kernel():
    return _build(interpreting())


@functools.cache
def _build(interpret: bool):
    # NOTE: Triton decides at decoration whether a kernel is interpreted, hence one build each
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["a0", "n0", "a1", "n1"])
    def l2_prefetch_kernel(
        a0, n0, a1, n1, out_ptr,
        CHUNK: tl.constexpr, BLOCK: tl.constexpr, PREFETCH: tl.constexpr,
    ):  # fmt: skip
        # two byte ranges cut into CHUNK-byte chunks, BLOCK a program (ask_l2). PREFETCH: 1,
        # asked of the L2; 2, asked to be the last it evicts; 0, the chunks written out
        # instead: [programs * BLOCK, 2] (address, bytes)
        pid, nprog = tl.program_id(0), tl.num_programs(0)
        ask_l2(pid, nprog, a0, n0, a1, n1, CHUNK, out_ptr, BLOCK, PREFETCH == 0, PREFETCH == 2)

    return l2_prefetch_kernel


Range = tuple[int, int]  # (address, bytes): 16-byte aligned, a multiple of 16 bytes


def _launch(
    ranges: tuple[Range, Range],
    prefetch: bool,
    out: torch.Tensor,
    chunk: int = CHUNK,
    keep: bool = False,
) -> None:
    """prefetch: ask the L2 (keep: to evict these lines last), else write the chunks to out."""
    (a0, n0), (a1, n1) = ranges
    mode = prefetch_mode(prefetch, keep)
    _kernel()[(ask_programs(ranges, chunk),)](
        a0, n0, a1, n1, out, CHUNK=chunk, BLOCK=BLOCK, PREFETCH=mode, num_warps=1
    )


def chunks(ranges: list[Range], device="cpu") -> list[tuple[int, int]]:
    """The (address, bytes) chunks the kernel asks for over `ranges`, in order, as its build
    without the prefetch writes them out (that build runs under Triton's interpreter)."""
    got = []
    for pair in _pairs(ranges):
        out = torch.zeros(ask_programs(pair) * BLOCK, 2, dtype=torch.int64, device=device)
        _launch(pair, False, out)
        got += [(a, n) for a, n in out.tolist() if n]
    return got


def _pairs(ranges: list[Range]) -> list[tuple[Range, Range]]:
    """ranges two at a time (the kernel takes two), the last padded with an empty range."""
    padded = list(ranges) + [(0, 0)] * (len(ranges) % 2)
    return [(padded[i], padded[i + 1]) for i in range(0, len(padded), 2)]


def _head(w: torch.Tensor, budget: int) -> Range | None:
    """The first bytes of w, at most budget (rounded down to 16), or None if none fit or w is
    not one contiguous run of 16-byte aligned memory."""
    n = min(w.numel() * w.element_size(), budget) // 16 * 16
    if n == 0 or not w.is_contiguous() or w.data_ptr() % 16:
        return None
    return (w.data_ptr(), n)


def _take(weights: list[torch.Tensor], budget: int) -> list[Range]:
    """Heads of weights in order, until budget bytes are taken."""
    out = []
    for w in weights:
        r = _head(w, budget)
        if r is None:
            continue
        out.append(r)
        budget -= r[1]
    return out


def prefetch_plans(
    model: nn.Module, attn_bytes: int, mlp_bytes: int, norm_bytes: int = 0
) -> dict[nn.Module, list[Range]]:
    """Each point's byte ranges, keyed by the module whose forward issues them: every decoder
    layer (a module with `self_attn` and `mlp`) whose attention has a qkv_proj and an o_proj and
    whose MLP a gate_up_proj and a down_proj, and the model's final norm (its lm_head's).
    Budgets: attn_bytes at the attention, mlp_bytes at the activation, norm_bytes at the layer's
    start and the final norm."""
    plans: dict[nn.Module, list[Range]] = {}
    for layer in model.modules():
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        qkv, o = getattr(attn, "qkv_proj", None), getattr(attn, "o_proj", None)
        gate_up, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
        if None in (qkv, o, gate_up, down):
            continue
        for module, weights, budget in (
            (layer, [qkv.weight], norm_bytes),
            (attn, [o.weight, gate_up.weight], attn_bytes),
            (mlp, [down.weight], mlp_bytes),
        ):
            ranges = _take(weights, budget)
            if ranges:
                plans[module] = ranges
    norm = getattr(getattr(model, "model", None), "norm", None)
    head = getattr(model, "lm_head", None)
    if norm is not None and head is not None and plans:
        ranges = _take([head.weight], norm_bytes)
        if ranges:
            plans[norm] = ranges
    return plans


class L2Prefetcher:
    """A model's prefetch points (`prefetch_plans`) and its side stream. A forward through
    `ForwardContext(prefetcher=...)` issues them (`issue`, at each point) and joins the side
    stream at its end (`join`). A model's steps run one at a time, so one side stream serves them
    all, captured graphs included."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        budgets: tuple[int, int, int],
        inline: bool = False,
        keep: bool = False,
    ):
        """budgets: bytes asked at the attention, the activation, a layer's start. inline: an
        attention kernel that can asks for its point's bytes itself (as its programs start: no
        launch of its own, no stream to fork), where the step's attention backend can. keep:
        the L2 evicts what is asked last (an evict_last policy)."""
        self.device, self.inline, self.keep = device, inline, keep
        self.plans = {m: _pairs(r) for m, r in prefetch_plans(model, *budgets).items()}
        self.stream = torch.cuda.Stream(device)
        self._out = torch.empty(1, dtype=torch.int64, device=device)
        self._open = False

    @property
    def bytes_per_step(self) -> int:
        return sum(n for pairs in self.plans.values() for pair in pairs for _, n in pair)

    def issue(self, module: nn.Module) -> None:
        """The prefetches of module's point, on the side stream after the work queued so far."""
        pairs = self.plans.get(module)
        if not pairs:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._open = True  # forked: joined even if a launch below raises
        # (Triton launches on the current device's current stream: both made the model's)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for pair in pairs:
                _launch(pair, True, self._out, keep=self.keep)

    def pair(self, module: nn.Module) -> tuple[Range, Range] | None:
        """module's point as the one pair of ranges a kernel takes (None: none, or more)."""
        pairs = self.plans.get(module)
        return pairs[0] if pairs is not None and len(pairs) == 1 else None

    def join(self) -> None:
        """The step's stream waits for the side stream (the end of a forward)."""
        if self._open:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._open = False


def load_prefetcher(
    model: nn.Module,
    device: torch.device,
    budgets: tuple[int, int, int],
    inline: bool = False,
    keep: bool = False,
) -> tuple[L2Prefetcher | None, str | None]:
    """The model's prefetcher, its kernel built and run once over every point here, or None and
    why it cannot run (not CUDA, before Hopper, no Triton, a kernel that fails, nothing to ask)."""
    if device.type != "cuda":
        return None, "not a CUDA device"
    if not bulk_prefetch_runs_on(device):
        return None, "the bulk L2 prefetch needs Triton, and Hopper (compute capability 9.0) on"
    try:
        p = L2Prefetcher(model, device, budgets, inline, keep)
        if not p.plans:
            return None, "nothing to ask: no budget, or no layer with the projections planned"
        for module in p.plans:
            p.issue(module)
        p.join()
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 (a kernel that does not build here: go without)
        return None, f"its kernel failed ({type(e).__name__}: {str(e)[:200]})"
    return p, None
