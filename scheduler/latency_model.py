"""The latency model of one model on one device: how long a step takes, from its shape.

A step computes `tokens` new tokens over `seqs` sequences. Its attention has two costs that scale
differently: the (query, key) pairs it scores, `attn` = sum over sequences of
new * (cached + (new + 1) / 2), which is compute and dominates a prefill; and the KV it reads,
`kv` = sum over sequences of cached + new tokens, which is memory traffic and dominates a decode
step (one query per sequence reads its whole context). One coefficient for both would price a
decode step's context at a prefill's compute rate, or a prefill's attention at a decode's memory
rate: off by ten times one way or the other. And a step with prefill tokens pays a fixed cost a
decode step does not: it runs eagerly, kernel by kernel, where a decode step replays a CUDA graph
(on the H200 some 25 ms for a 7B model's 500-token chunk, more than its tokens cost). The model is
linear in those features:

    seconds = c0 + c_tok * tokens + c_seq * seqs + c_attn * attn + c_kv * kv + c_pf * prefill

(prefill: 1 for a step with prefill tokens, else 0), which covers prefill (tokens dominate,
attention grows with the prompt), chunked prefill (cached context), and decode (one token per
sequence, KV reads over each context). In a decode step tokens = seqs, attn = kv and prefill = 0,
so decode steps alone fix only the sums; prefill steps tell the parts apart. The coefficients are
fitted by non-negative least squares on a short profile taken at the first activation, and kept
current online: every measured step joins a window of recent samples and the fit is redone every
few steps, so the model follows the device (clocks, another model's copy, contention). Steps that
carry prefill tokens keep a window of their own, so that a long run of decode steps cannot push
them out and leave the split to whatever the decode noise makes of it. The relative error of each
estimate before its measurement is tracked as an EWMA and published.

Pure: no clock; callers pass measured durations in.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_ATTN_SCALE = 1e-3  # attn and kv are counted in thousands (keeps the normal equations tame)


@dataclass(frozen=True)
class StepShape:
    tokens: int = 0
    seqs: int = 0
    attn: float = 0.0  # (query, key) pairs scored
    kv: int = 0  # KV tokens read: each sequence's cached and new tokens

    @classmethod
    def of(cls, chunks: Iterable[tuple[int, int]]) -> StepShape:
        """chunks: (cached, new) tokens of each sequence in the step."""
        tokens = seqs = kv = 0
        attn = 0.0
        for cached, new in chunks:
            tokens += new
            seqs += 1
            attn += new * (cached + (new + 1) / 2)
            kv += cached + new
        return cls(tokens, seqs, attn, kv)

    @classmethod
    def prefill(cls, new: int, cached: int = 0) -> StepShape:
        return cls.of([(cached, new)])

    @classmethod
    def decode(cls, batch: int, context_tokens: int) -> StepShape:
        """batch sequences of one new token each, over context_tokens cached tokens in all."""
        return cls(batch, batch, float(context_tokens + batch), context_tokens + batch)

    def __add__(self, other: StepShape) -> StepShape:
        return StepShape(
            self.tokens + other.tokens,
            self.seqs + other.seqs,
            self.attn + other.attn,
            self.kv + other.kv,
        )

    @property
    def has_prefill(self) -> bool:
        """Whether the step carries prefill tokens (more tokens than sequences)."""
        return self.tokens > self.seqs

    def features(self) -> tuple[float, float, float, float, float, float]:
        return (
            1.0,
            float(self.tokens),
            float(self.seqs),
            self.attn * _ATTN_SCALE,
            self.kv * _ATTN_SCALE,
            1.0 if self.has_prefill else 0.0,
        )


# Before any measurement: a GPU-class guess (2 ms a step, 20 us a token, 20 us per thousand KV
# tokens read, 5 ms more for a prefill step), replaced by the profile
DEFAULT_COEFFICIENTS = (2e-3, 2e-5, 1e-5, 1e-6, 2e-5, 5e-3)


EXACT_EVERY = 4096  # measured samples between two sums of the window from scratch


class LatencyModel:
    def __init__(
        self,
        coefficients: Sequence[float] = DEFAULT_COEFFICIENTS,
        window: int = 256,
        prefill_window: int = 64,
        refit_every: int = 16,
        error_alpha: float = 0.1,
    ):
        # a shorter tuple (a record from before the kv and prefill terms) reads as zeros for them
        n = len(DEFAULT_COEFFICIENTS)
        self.coefficients = tuple(float(c) for c in coefficients)[:n]
        self.coefficients += (0.0,) * (n - len(self.coefficients))
        self.profile: list[tuple[StepShape, float]] = []  # kept for good: they anchor the fit
        self.recent: deque[tuple[StepShape, float]] = deque(maxlen=window)  # decode steps
        self.recent_prefill: deque[tuple[StepShape, float]] = deque(maxlen=prefill_window)
        self.refit_every = refit_every
        self.error_alpha = error_alpha
        self.error: float | None = None  # EWMA of |estimate - measured| / measured
        self.observed = 0  # online samples since creation
        self._since_fit = 0
        # the fit's normal equations, kept as samples come and go (a refit then costs a solve of
        # six unknowns, not a pass over every sample): the profile's, and the measured window's
        # (summed again from the window every EXACT_EVERY samples, so rounding cannot drift)
        self._profile_sums = _Sums(n)
        self._measured_sums = _Sums(n)
        self._since_exact = 0

    @property
    def profiled(self) -> bool:
        return bool(self.profile)

    # ---- estimates ----------------------------------------------------------------------------
    def estimate(self, shape: StepShape) -> float:
        return sum(c * f for c, f in zip(self.coefficients, shape.features()))

    def prefill_s(self, tokens: int, cached: int = 0) -> float:
        return self.estimate(StepShape.prefill(tokens, cached))

    def chunked_prefill_s(self, tokens: int, cached: int = 0, chunk: int | None = None) -> float:
        """A prefill of `tokens` run in steps of at most `chunk` tokens (a step's token limit):
        each step pays the fixed costs again, so a prompt longer than a step costs more than
        one step of its whole length would."""
        if chunk is None or chunk <= 0 or tokens <= chunk:
            return self.prefill_s(tokens, cached)
        total, done = 0.0, 0
        while done < tokens:
            n = min(chunk, tokens - done)
            total += self.prefill_s(n, cached + done)
            done += n
        return total

    def decode_s(self, batch: int, context_tokens: int) -> float:
        return self.estimate(StepShape.decode(batch, context_tokens))

    def knee_tokens(self) -> int:
        """The smallest prefill chunk whose tokens cost at least the step's fixed cost (the
        step's own, its sequence's and a prefill step's): below it a chunked prefill spends more
        on steps than on tokens, so it is the smallest chunk worth a step."""
        c0, c_tok, c_seq, _, _, c_pf = self.coefficients
        if c_tok <= 0:
            return 1
        return max(1, math.ceil((c0 + c_seq + c_pf) / c_tok))

    def max_new_tokens(self, budget_s: float, base: StepShape, cached: int, cap: int) -> int:
        """The most prefill tokens (one sequence, `cached` tokens already in its KV) that a step
        already holding `base` can add and still take at most budget_s; 0..cap."""
        if self.estimate(base + StepShape.prefill(1, cached)) > budget_s:
            return 0
        lo, hi = 1, cap  # estimate is increasing in the chunk: bisect the largest that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.estimate(base + StepShape.prefill(mid, cached)) <= budget_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ---- learning -----------------------------------------------------------------------------
    def fit_profile(self, samples: Iterable[tuple[StepShape, float]]) -> None:
        """Replace the profile with these measured steps and refit."""
        self.profile = [(s, float(t)) for s, t in samples if t > 0]
        self._profile_sums = _Sums.of(self.profile)
        self._refit()

    def observe(self, shape: StepShape, seconds: float) -> float:
        """A measured step: track the estimate's error, and refit every refit_every samples.
        Returns the estimate the step had before its measurement."""
        estimate = self.estimate(shape)
        if seconds <= 0:
            return estimate
        rel = abs(estimate - seconds) / seconds
        a = self.error_alpha
        self.error = rel if self.error is None else (1 - a) * self.error + a * rel
        window = self.recent_prefill if shape.has_prefill else self.recent
        if len(window) == window.maxlen:
            self._measured_sums.add(*window[0], sign=-1.0)  # the sample about to leave
        window.append((shape, seconds))
        self._measured_sums.add(shape, seconds)
        self._since_exact += 1
        if self._since_exact >= EXACT_EVERY:
            self._since_exact = 0
            self._measured_sums = _Sums.of([*self.recent, *self.recent_prefill])
        self.observed += 1
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self._refit()
        return estimate

    def _refit(self) -> None:
        self._since_fit = 0
        # the profile covers shapes the traffic may not (long prefills): it stays in the fit, but
        # counts less as the window of measured steps fills, so the model follows the device
        held = len(self.recent) + len(self.recent_prefill)
        w = max(0.1, 1.0 - held / ((self.recent.maxlen or 1) + (self.recent_prefill.maxlen or 1)))
        if len(self.profile) + held >= 2:
            # relative least squares: each sample's row is its features / its seconds (so short
            # decode steps count as much as long prefills), the profile's scaled by w
            p, m = self._profile_sums, self._measured_sums
            ata = [[w * w * a + b for a, b in zip(pa, ma)] for pa, ma in zip(p.ata, m.ata)]
            aty = [w * w * a + b for a, b in zip(p.aty, m.aty)]
            self.coefficients = tuple(nnls_normal(ata, aty))


class _Sums:
    """A^T A and A^T y of the relative least squares: a step's row is its features / seconds,
    its target 1."""

    def __init__(self, n: int):
        self.ata = [[0.0] * n for _ in range(n)]
        self.aty = [0.0] * n

    @classmethod
    def of(cls, samples: Iterable[tuple[StepShape, float]]) -> _Sums:
        sums = cls(len(DEFAULT_COEFFICIENTS))
        for shape, seconds in samples:
            sums.add(shape, seconds)
        return sums

    def add(self, shape: StepShape, seconds: float, sign: float = 1.0) -> None:
        row = [f / seconds for f in shape.features()]
        for i, ri in enumerate(row):
            if ri:
                self.aty[i] += sign * ri
                ata_i = self.ata[i]
                for j, rj in enumerate(row):
                    ata_i[j] += sign * ri * rj


def nnls(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Non-negative least squares, min |A x - y| with x >= 0 (see nnls_normal)."""
    n = len(rows[0])
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    aty = [sum(r[i] * v for r, v in zip(rows, y)) for i in range(n)]
    return nnls_normal(ata, aty)


def nnls_normal(ata: Sequence[Sequence[float]], aty: Sequence[float]) -> list[float]:
    """Non-negative least squares from its normal equations (A^T A, A^T y), for a few columns:
    solve them on the free columns, clamp the most negative to zero (or drop a column that adds
    nothing to the ones before it), repeat. The columns are scaled to unit norm first: a step's
    features span ten orders of magnitude (a constant beside millions of attention pairs), and
    unscaled, a small column's pivot looks singular."""
    n = len(aty)
    norms = [math.sqrt(max(ata[i][i], 0.0)) or 1.0 for i in range(n)]
    scaled = [[ata[i][j] / (norms[i] * norms[j]) for j in range(n)] for i in range(n)]
    rhs = [aty[i] / norms[i] for i in range(n)]
    free = list(range(n))
    x = [0.0] * n
    while free:
        sub = [[scaled[i][j] for j in free] for i in free]
        sol = _solve(sub, [rhs[i] for i in free])
        if isinstance(sol, int):  # a column without a signal of its own: dropped
            free.pop(sol)
            continue
        worst = min(range(len(free)), key=lambda k: sol[k])
        if sol[worst] >= 0:
            for k, i in enumerate(free):
                x[i] = sol[k] / norms[i]
            return x
        free.pop(worst)
    return x


def _solve(a: list[list[float]], b: list[float]) -> list[float] | int:
    """Solves the normal equations a x = b (a symmetric, positive semi-definite, unit diagonal)
    by elimination in column order; or, where a column is a combination of the ones before it
    (a feature the samples never vary apart from others: one sequence per step, say), its
    index, to be dropped."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        if m[col][col] <= 1e-9:  # what is left of the column once the earlier ones are out
            return col
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
