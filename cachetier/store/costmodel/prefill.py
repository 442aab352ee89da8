"""The engine's measured prefill speed: a step's seconds fitted online from its forwards."""

from __future__ import annotations

import math
import threading
from collections import deque
from typing import Any

from cachetier.store.costmodel.error import EstimateError

# A step stays part of the measured range while its weight in the fit is at least this: past
# that, the fit no longer answers for steps of its size (after a restart over a full folder
# an engine computes only short suffixes, and a long calibration step fades out of the fit).
_RANGE_WEIGHT = 0.1


class _WindowMax:
    """The largest value among the last ``window`` pushed (all of them for ``None``)."""

    def __init__(self, window: int | None) -> None:
        self._window = window
        self._items: deque[tuple[int, float]] = deque()  # (index, value), values decreasing

    def push(self, index: int, value: float) -> None:
        while self._items and self._items[-1][1] <= value:
            self._items.pop()
        self._items.append((index, value))
        if self._window is not None:
            while self._items[0][0] <= index - self._window:
                self._items.popleft()

    @property
    def value(self) -> float:
        return self._items[0][1] if self._items else 0.0


class PrefillModel:
    """Seconds of one forward step as ``c0 + c1 x tokens + c2 x attention``, fitted online by
    least squares with exponential forgetting. Thread-safe.

    ``attention`` is the sum over the step's sequences of new tokens x (cached context + half
    the new tokens): the work of causal attention over the context, quadratic in prompt length.

    The model answers only inside what it measured: the most tokens of a step and the most
    attention work of a step, among the steps that still weigh in the fit. A step beyond
    either is an extrapolation (``covers``), which no refusal is made on: a line fitted to
    16-token steps put a 347-token prompt at less than a tenth of its real time.

    Args:
        decay: weight kept by past samples at each new one (0.98: the last ~50 steps count).
        min_samples: steps to see before estimating anything.
        error: the measured error of the estimates refusals were made on (a fresh one with
            its defaults if ``None``).
    """

    _FEATURES = 3

    def __init__(
        self, *, decay: float = 0.98, min_samples: int = 2, error: EstimateError | None = None
    ) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self._decay = decay
        self._min_samples = min_samples
        self.error = error if error is not None else EstimateError()
        window = None if decay == 1 else math.ceil(math.log(_RANGE_WEIGHT) / math.log(decay))
        self._max_tokens = _WindowMax(window)
        self._max_attention = _WindowMax(window)
        self._lock = threading.Lock()
        n = self._FEATURES
        self._xtx = [[0.0] * n for _ in range(n)]
        self._xty = [0.0] * n
        self._yty = 0.0
        self._count = 0
        self._coef: tuple[float, float, float] | None = None

    @staticmethod
    def attention_work(num_new: int, num_cached: int) -> float:
        """The ``attention`` feature of one sequence computing ``num_new`` tokens after
        ``num_cached``."""
        return num_new * (num_cached + num_new / 2)

    def observe(self, num_tokens: int, attention: float, seconds: float) -> None:
        """One step computed ``num_tokens`` with ``attention`` work in ``seconds``."""
        if num_tokens <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        x = (1.0, float(num_tokens), float(attention))
        with self._lock:
            d = self._decay
            for i in range(self._FEATURES):
                for j in range(self._FEATURES):
                    self._xtx[i][j] = d * self._xtx[i][j] + x[i] * x[j]
                self._xty[i] = d * self._xty[i] + x[i] * seconds
            self._yty = d * self._yty + seconds * seconds
            self._max_tokens.push(self._count, float(num_tokens))
            self._max_attention.push(self._count, max(float(attention), 0.0))
            self._count += 1
            self._coef = self._fit() if self._count >= self._min_samples else None

    def _fit(self) -> tuple[float, float, float] | None:
        # Least squares with every coefficient >= 0 (time never shrinks with more work): solve
        # on each subset of features and keep the best non-negative fit. Three features make
        # seven subsets of at most 3x3 systems, microseconds per step.
        best: tuple[float, tuple[float, float, float]] | None = None
        for mask in range(1, 1 << self._FEATURES):
            idx = [i for i in range(self._FEATURES) if mask >> i & 1]
            sol = _solve([[self._xtx[i][j] for j in idx] for i in idx], [self._xty[i] for i in idx])
            if sol is None or any(c < 0 for c in sol):
                continue
            coef = [0.0] * self._FEATURES
            for i, c in zip(idx, sol):
                coef[i] = c
            resid = self._yty - 2 * sum(c * self._xty[i] for i, c in enumerate(coef))
            resid += sum(
                coef[i] * coef[j] * self._xtx[i][j]
                for i in range(self._FEATURES)
                for j in range(self._FEATURES)
            )
            if best is None or resid < best[0] - 1e-15:
                best = (resid, (coef[0], coef[1], coef[2]))
        return None if best is None else best[1]

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """``(c0, c1, c2)``, or ``None`` before enough steps were seen."""
        with self._lock:
            return self._coef

    @property
    def measured_range(self) -> tuple[int, float]:
        """``(tokens, attention)``: the most tokens and the most attention work of one step,
        among the steps still weighing in the fit."""
        with self._lock:
            return int(self._max_tokens.value), self._max_attention.value

    def covers(self, start: int, end: int, chunk_tokens: int) -> bool:
        """Whether every step of computing ``[start, end)`` (see ``recompute_s``) lies inside
        the measured range: no more tokens, no more attention work, than a measured step."""
        max_tokens, max_attention = self.measured_range
        pos = start
        while pos < end:
            n = min(chunk_tokens, end - pos)
            if n > max_tokens or self.attention_work(n, pos) > max_attention:
                return False
            pos += n
        return True

    def recompute_s(self, start: int, end: int, chunk_tokens: int) -> float | None:
        """Estimated seconds to compute tokens ``[start, end)`` with ``[0, start)`` cached, in
        steps of at most ``chunk_tokens`` (``None`` before enough steps were seen). Outside
        ``covers`` the figure is an extrapolation: the plan does not refuse on it."""
        coef = self.coefficients
        if coef is None:
            return None
        c0, c1, c2 = coef
        total = 0.0
        pos = start
        while pos < end:
            n = min(chunk_tokens, end - pos)
            total += c0 + c1 * n + c2 * self.attention_work(n, pos)
            pos += n
        return total

    def snapshot(self) -> dict[str, Any]:
        coef = self.coefficients
        max_tokens, max_attention = self.measured_range
        return {
            "samples": self._count,
            "max_step_tokens": max_tokens,
            "max_step_attention": max_attention,
            "error": self.error.snapshot(),
            "step_s": None if coef is None else round(coef[0], 6),
            "s_per_token": None if coef is None else coef[1],
            "s_per_attention": None if coef is None else coef[2],
        }


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; ``None`` for a singular system."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max((abs(v) for row in a for v in row), default=0.0)
    if scale == 0:
        return None
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-12 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][c] * out[c] for c in range(r + 1, n))) / m[r][r]
    return out
