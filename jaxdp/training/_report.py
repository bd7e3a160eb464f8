"""The report of a training run: ε per record position, led by the guarantee of the release."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = ["NOT_PRIVATE", "PrivacyReport"]

NOT_PRIVATE = ("NOT PRIVATE: the noise came from a fixed noise_seed, so anyone who knows it can regenerate the "
               "noise and remove it; the epsilon below holds only if that seed is secret (use for tests and "
               "reproductions only)")




class PrivacyReport(NamedTuple):
    """ε per record position (1-based, in the order the records are processed).

    Attributes:
      analysis: the guarantee reported (``"hidden-state"``, ``"random-stop"`` or
        ``"composition"``).
      reason: why this analysis.
      delta: the δ of every ε.
      steps_done: steps accounted for; ``None`` for random stopping, whose number of steps
        is secret (the guarantee covers the randomly stopped pass whatever it was).
      positions: int array ``1..n``.
      epsilon: the reported ε per position (the best valid bound for ``analysis``).
      composition: ε per position if every iterate were released (always valid).
      amplified: ε per position of the amplified analysis (best of contraction,
        iteration, strongly convex, shifted-interpolation GDP and composition; for random stopping, Asoodeh et al.
        Theorem 5, Feldman et al. Theorem 26 and composition), or ``None`` when its
        assumptions do not hold.
      by_analysis: every analysis computed, name → ε per position.
      unused: records never used (ε = 0), not included in ``positions``.
      exact: False when the bound is a conservative stand-in (mid-pass after the first
        pass: composition over the pass in progress).
      not_private: True when the run's noise came from a fixed, known ``noise_seed``
        (:attr:`PrivacyLedger.fixed_noise_seed`): the ε values then hold only if that seed
        is secret, and the report says so first.
      note: a line the table leads with (after the not-private warning), or ``None``: a
        DP-SGD run whose batch scheme has no certified amplification says so before any ε.
    """

    analysis: str
    reason: str
    delta: float
    steps_done: int | None
    positions: np.ndarray
    epsilon: np.ndarray
    composition: np.ndarray
    amplified: np.ndarray | None
    by_analysis: dict
    unused: int
    exact: bool
    not_private: bool = False
    note: str | None = None

    def summary(self, values: np.ndarray | None = None) -> dict[str, float]:
        """Best (smallest), median and worst (largest) ε over the positions."""
        v = np.asarray(self.epsilon if values is None else values, dtype=np.float64)
        if v.size == 0:
            return {"best": 0.0, "median": 0.0, "worst": 0.0}
        return {"best": float(np.min(v)), "median": float(np.median(v)), "worst": float(np.max(v))}

    def record_epsilon(self, order) -> np.ndarray:
        """ε per record of the original data set: ``order[p-1]`` is the record at position p.

        Records never used get 0.
        """
        order = np.asarray(order)
        out = np.zeros(order.shape[0], dtype=np.float64)
        out[order[: self.epsilon.shape[0]]] = self.epsilon
        return out

    def table(self) -> str:
        """A text table: best / median / worst ε over positions for each analysis."""
        rows = [("analysis", "best", "median", "worst")]
        # An analysis no better than composition anywhere is vacuous for this run: named, not printed
        # (a headline of 4.6e5 or inf helps nobody).
        comp = np.asarray(self.composition, dtype=np.float64)
        hidden = []
        reported = np.asarray(self.epsilon, dtype=np.float64)
        for name, values in self.by_analysis.items():
            v = np.asarray(values, dtype=np.float64)
            if (name not in ("best", "composition") and v.size and not np.any(v < comp)
                    and not np.array_equal(v, reported)):
                hidden.append(name)
                continue
            s = self.summary(values)
            rows.append((name, *(_fmt(s[k]) for k in ("best", "median", "worst"))))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        run = ("of one pass stopped at a secret uniform step" if self.steps_done is None
               else f"after {self.steps_done} steps")
        head = (f"epsilon = {_fmt(self.summary()['worst'])} at delta = {self.delta:g} for every record (worst "
                f"position), by {self.analysis}\n"
                f"epsilon per record position at delta={self.delta:g} {run}; reported: {self.analysis}")
        if self.note:
            head = f"{self.note}\n{head}"
        if self.not_private:
            head = f"{NOT_PRIVATE}\n{head}"
        tail = [f"reason: {self.reason}"]
        if hidden:
            tail.append(f"not shown (no better than composition for any record here): {', '.join(hidden)}")
        if self.unused:
            tail.append(f"{self.unused} record(s) never used (epsilon = 0), not listed")
        if not self.exact:
            tail.append("mid-pass: composition over the pass in progress (exact bounds at pass ends)")
        return "\n".join([head, *lines, *tail])


def _fmt(x: float) -> str:
    if math.isinf(x):
        return "inf"
    if math.isnan(x):
        return "nan"
    return f"{x:.4g}"
