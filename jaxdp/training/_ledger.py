r"""The privacy ledger of a PNSGD training run, and the ε per record position it implies.

A :class:`PrivacyLedger` records everything the accountant needs (which analysis, the
constants :math:`L, \beta, \rho`, the step :math:`\eta`, the noise :math:`\sigma`, the
diameter :math:`D = 2R`, the number of records :math:`n`, the batch size :math:`b`, the
passes, the steps done and :math:`\delta`), as plain JSON-serialisable Python values, so it
can be checkpointed and audited. :func:`privacy_report` turns it into ε per record position
with the pure accountants of :mod:`jaxdp.accounting`.

Which guarantee is reported:

* ``"hidden-state"``: the element-wise best of the contraction (Asoodeh et al. Thm 4),
  amplification-by-iteration (Feldman et al. Thm 23), strongly convex, shifted-interpolation
  GDP (Bok et al. 2024) and composition bounds of :func:`jaxdp.accounting.pnsgd_privacy`. It needs a convex,
  :math:`L`-Lipschitz, :math:`\beta`-smooth loss, :math:`\eta \le 2/(\beta+\rho)`, clipping that
  never acts (so each update is a gradient step on that loss: a clipped gradient of a
  convex loss is not the gradient of a convex function), and only the final iterate
  released.
* ``"random-stop"``: one pass stopped after :math:`T \sim \mathrm{Uniform}\{1..m\}`
  steps (:math:`m` batches), released :math:`Y_T` only: the smallest of Theorem 5 of
  Asoodeh et al. (exact sum, per position), Theorem 26 of Feldman et al. (Stop-PNSGD)
  and the single-use composition bound.
* ``"composition"``: every iterate may be released, or the update is not known to be a
  contraction (non-convex model, clipping that acted, clip norm below the Lipschitz
  bound). Each record's :math:`k` uses are composed exactly (Gaussian mechanism with
  ratio :math:`2C\sqrt k/(b\sigma)`); valid for any model.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import numpy as np

__all__ = ["DPSBCDLedger", "DPSGDLedger", "PrivacyLedger", "PrivacyReport", "privacy_report"]

_HIDDEN = "hidden-state"
_STOP = "random-stop"
_COMPOSITION = "composition"
NOT_PRIVATE = ("NOT PRIVATE: the noise came from a fixed noise_seed, so anyone who knows it can regenerate the "
               "noise and remove it; the epsilon below holds only if that seed is secret (use for tests and "
               "reproductions only)")


class PrivacyLedger(NamedTuple):
    """What a PNSGD run has spent, in the accountant's terms (JSON-serialisable).

    Attributes:
      analysis: the guarantee that currently holds: ``"hidden-state"``, ``"random-stop"``
        or ``"composition"`` (see the module docs). Training demotes it to
        ``"composition"`` when an assumption of the amplified analyses fails.
      reason: why that analysis (one sentence, for the report).
      convex: whether the loss was declared convex with known constants.
      lipschitz: :math:`L` used by the accountant (per-example gradient norm bound).
      smoothness: :math:`\\beta`, or ``None`` when unknown (non-convex model).
      strong_convexity: :math:`\\rho \\ge 0`.
      learning_rate: :math:`\\eta`.
      noise_multiplier: :math:`\\nu`, the noise std relative to the sensitivity
        :math:`2C/b` of the averaged clipped gradient.
      noise_std: :math:`\\sigma = \\nu\\cdot 2C/b`, the absolute std of the noise on the
        averaged gradient (the accountants' :math:`\\sigma`).
      clip_norm: :math:`C`.
      lipschitz_bound: the model's Lipschitz bound from the feature norm, or ``None``.
      diameter: :math:`D = 2R`.
      records: :math:`n`, the records used per pass (after dropping a remainder).
      unused: records of the data set never used (dropped remainder), ε = 0 for them.
      batch_size: :math:`b`.
      passes: :math:`k`, planned passes in the same order.
      steps_per_pass: batches per pass, :math:`m = \\lceil n/b\\rceil`.
      schedule: ``"fixed"`` (every pass in the same shuffled-once order) or
        ``"random_stop"``.
      order_seed: the public seed of the processing order (may be published).
      fixed_noise_seed: ``True`` when the noise and stopping-time randomness came from a
        fixed ``noise_seed`` instead of the operating system's entropy: anyone who knows
        that seed can regenerate the noise, so the run is **not private**. The secret key
        itself is never part of the ledger (only of checkpoints).
      total_steps: steps the run will do. For ``"random_stop"`` this is the drawn
        stopping time :math:`T`, which must stay **secret**: do not publish it.
      steps_done: steps already done (updated as training goes; checkpointed).
      delta: target :math:`\\delta`.
      clipped: number of per-example gradients whose norm exceeded :math:`C` so far.
      max_grad_norm: the largest unclipped per-example gradient norm seen so far.
      intermediates_released: whether the caller asked for the intermediate iterates.
    """

    analysis: str
    reason: str
    convex: bool
    lipschitz: float
    smoothness: float | None
    strong_convexity: float
    learning_rate: float
    noise_multiplier: float
    noise_std: float
    clip_norm: float
    lipschitz_bound: float | None
    diameter: float
    records: int
    unused: int
    batch_size: int
    passes: int
    steps_per_pass: int
    schedule: str
    order_seed: int
    fixed_noise_seed: bool
    total_steps: int
    steps_done: int
    delta: float
    clipped: int
    max_grad_norm: float
    intermediates_released: bool

    def to_json(self) -> dict[str, Any]:
        """The ledger as a JSON-ready dict, secrets included: for checkpoints only (see :meth:`public`)."""
        return {k: v for k, v in self._asdict().items()}

    def public(self) -> dict[str, Any]:
        """What a report, JSON, log or plot may show.

        With random stopping the number of steps is secret, and so is what depends on it
        (the step counters, the clipping count and the largest gradient norm seen): they
        are left out.
        """
        out = self.to_json()
        if self.schedule == "random_stop":
            for name in _SECRET_WITH_RANDOM_STOP:
                out.pop(name)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PrivacyLedger:
        """Inverse of :meth:`to_json`."""
        return cls(**{k: data[k] for k in cls._fields})


_SECRET_WITH_RANDOM_STOP = ("total_steps", "steps_done", "clipped", "max_grad_norm")


def demote(ledger: PrivacyLedger, reason: str) -> PrivacyLedger:
    """Return ``ledger`` switched to the composition analysis (idempotent: keeps the first reason)."""
    if ledger.analysis == _COMPOSITION:
        return ledger
    return ledger._replace(analysis=_COMPOSITION, reason=reason)


def _clipping_reason(ledger: PrivacyLedger) -> str | None:
    if ledger.clipped > 0 and getattr(ledger, "schedule", "fixed") == "random_stop":
        # The count and the largest norm depend on the secret stopping time: not shown.
        return (
            f"a per-example gradient exceeded the clip norm C={ledger.clip_norm:g}: a clipped gradient is not "
            "the gradient of the convex loss, so the update is not known to be a contraction"
        )
    if ledger.clipped > 0:
        return (
            f"{ledger.clipped} per-example gradient(s) exceeded the clip norm C={ledger.clip_norm:g} "
            f"(largest norm {ledger.max_grad_norm:.6g}): a clipped gradient is not the gradient of the "
            "convex loss, so the update is not known to be a contraction"
        )
    return None


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
        for name, values in self.by_analysis.items():
            v = np.asarray(values, dtype=np.float64)
            if name not in ("best", "composition") and v.size and not np.any(v < comp):
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
        head = f"epsilon per record position at delta={self.delta:g} {run}; reported: {self.analysis}"
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


# ----------------------------------------------------------------------------------------
# The one place that calls the hidden-state accountant.
# ----------------------------------------------------------------------------------------


def _pnsgd_epsilons(*, lipschitz, smoothness, strong_convexity, learning_rate, noise_std, diameter, records,
                    batch_size, passes, delta, positions, amplified: bool) -> dict[str, np.ndarray]:
    """ε per position from :func:`jaxdp.accounting.pnsgd_privacy` (the only call site).

    ``noise_std`` is the absolute std σ of the noise on the averaged gradient, i.e.
    ``pnsgd_noise_std(ν, C, b)``. With ``amplified=False`` only the composition bound is
    returned; it depends on neither β nor η nor D, so a stand-in smoothness ``1/η`` (which
    makes the step valid) is passed when β is unknown.
    """
    from ..accounting import pnsgd_privacy

    if not amplified or smoothness is None:
        smoothness, strong_convexity = 1.0 / float(learning_rate), 0.0
    out = pnsgd_privacy(
        lipschitz=float(lipschitz), smoothness=float(smoothness), learning_rate=float(learning_rate),
        noise_std=float(noise_std), diameter=float(diameter), num_records=int(records), delta=float(delta),
        strong_convexity=float(strong_convexity), batch_size=int(batch_size), passes=int(passes),
        positions=positions,
    )
    if not amplified:
        return {"composition": np.asarray(out.composition, np.float64)}
    return {name: np.asarray(getattr(out, name), np.float64)
            for name in ("contraction", "iteration", "strongly_convex", "shifted_gdp", "composition", "best")}


def _stop_epsilons(ledger: PrivacyLedger) -> dict[str, np.ndarray]:
    r"""ε per record of the randomly stopped run, by two analyses, expanded from batches.

    Batches are the steps: step :math:`j`'s averaged gradient has sensitivity
    :math:`2L/b_j`, so each analysis (stated for :math:`b = 1`) applies with Lipschitz
    constant :math:`L/b_{\min}` (conservatively, the smallest batch) and :math:`m` steps;
    a record's position is its batch's index.

    * ``"random-stop (Thm 5)"``: Asoodeh et al. Theorem 5, exact sum per position.
    * ``"random-stop (Thm 26)"``: Feldman et al. Theorem 26 (Stop-PNSGD), in the
      ``"logmeanexp"`` form of :func:`~jaxdp.accounting.stop_pnsgd_iteration_rdp` (no
      condition on σ): given the stopping time :math:`T \ge j`, a record of batch
      :math:`j` has :math:`D_α \le 2α(L/b)^2/(σ^2 (T - j + 1))` (Theorem 23 run for
      :math:`T` steps), :math:`0` for :math:`T < j`, and the uniform mixture over
      :math:`T` is bounded by Lemma 25. Converted to ε over ``DEFAULT_ORDERS`` with the
      improved conversion.
    """
    from ..accounting import (
        DEFAULT_ORDERS,
        rdp_to_epsilon,
        step_contraction,
        stop_pnsgd_contraction_epsilon,
        stop_pnsgd_iteration_rdp,
    )

    n, b, m = ledger.records, ledger.batch_size, ledger.steps_per_pass
    b_min = min(b, n - (m - 1) * b)
    batches = np.arange(1, m + 1, dtype=np.float64)
    contraction = float(step_contraction(ledger.learning_rate, ledger.smoothness, ledger.strong_convexity))
    thm5 = np.asarray(stop_pnsgd_contraction_epsilon(
        ledger.delta, m, ledger.lipschitz / b_min, ledger.noise_std, ledger.learning_rate,
        ledger.diameter, contraction, positions=batches), np.float64)
    rdp = stop_pnsgd_iteration_rdp(DEFAULT_ORDERS, m, ledger.lipschitz / b_min, ledger.noise_std,
                                   positions=batches, form="logmeanexp")
    thm26 = np.asarray(rdp_to_epsilon(rdp, DEFAULT_ORDERS, ledger.delta).epsilon, np.float64)
    record_batch = np.arange(n) // b
    return {"random-stop (Thm 5)": thm5[record_batch], "random-stop (Thm 26)": thm26[record_batch]}


def privacy_report(ledger: PrivacyLedger | DPSGDLedger | DPSBCDLedger, accountant: str = "rdp") -> PrivacyReport:
    r"""ε per record position for the steps recorded in ``ledger``.

    A :class:`DPSGDLedger` gives DP-SGD's guarantee, the same for every record:
    ``dpsgd_epsilon(q, noise_multiplier, steps_done, delta)``. A :class:`DPSBCDLedger` gives
    DP-SBCD's hidden-state bound per batch position (see there). For a PNSGD ledger:

    With :math:`s` steps done, :math:`m` steps per pass, :math:`s = pm + t`:

    * :math:`p = 0` (first pass): the run so far is PNSGD over the first
      :math:`\min(tb, n)` records, one pass; later records have ε = 0.
    * :math:`t = 0`: :math:`p` full passes in the same order.
    * otherwise (inside a later pass): the composition bound with :math:`p + 1` uses for
      every record (valid, conservative; ``exact=False``).

    For ``"random_stop"`` the guarantee of the released (randomly stopped) iterate is
    reported whatever the progress: it does not depend on the drawn :math:`T`.

    Args:
      ledger: a :class:`PrivacyLedger` (e.g. ``result.state.ledger``).
      accountant: ``"rdp"`` (default) or, for a :class:`DPSGDLedger` only, ``"pld"``: the
        report then leads with the PLD upper bound (:func:`jaxdp.accounting.pld_epsilon`,
        tighter) and lists the RDP value as a second line.

    Returns:
      :class:`PrivacyReport`.

    References:
      Feldman, Mironov, Talwar, Thakurta, "Privacy amplification by iteration" (FOCS 2018),
      Thm 23; Asoodeh, Diaz, Calmon, "Privacy amplification of iterative algorithms via
      contraction coefficients" (ISIT 2020), Thms 4 and 5.

    Examples:
      >>> led = PrivacyLedger(analysis="hidden-state", reason="convex", convex=True, lipschitz=2.0,
      ...     smoothness=1.0, strong_convexity=0.0, learning_rate=1.0, noise_multiplier=2.0,
      ...     noise_std=2.0, clip_norm=2.0, lipschitz_bound=2.0, diameter=2.0, records=8, unused=0,
      ...     batch_size=4, passes=1, steps_per_pass=2, schedule="fixed", order_seed=0,
      ...     fixed_noise_seed=False, total_steps=2,
      ...     steps_done=2, delta=1e-5, clipped=0, max_grad_norm=1.5, intermediates_released=False)
      >>> rep = privacy_report(led)
      >>> rep.positions.tolist()
      [1, 2, 3, 4, 5, 6, 7, 8]
      >>> bool(rep.epsilon[0] < rep.epsilon[-1] <= rep.composition[-1])
      True
    """
    if isinstance(ledger, DPSGDLedger):
        return _dpsgd_report(ledger, accountant)
    if isinstance(ledger, DPSBCDLedger):
        if accountant != "rdp":
            raise ValueError(f"accountant={accountant!r} covers DP-SGD ledgers only; DP-SBCD reports use RDP.")
        return _dpsbcd_report(ledger)
    if accountant != "rdp":
        raise ValueError(f"accountant={accountant!r} covers DP-SGD ledgers only; PNSGD reports use their own analyses.")
    return _report(ledger)._replace(not_private=bool(ledger.fixed_noise_seed))


def _report(ledger: PrivacyLedger) -> PrivacyReport:
    n, b, m = ledger.records, ledger.batch_size, ledger.steps_per_pass
    positions = np.arange(1, n + 1)
    s = int(ledger.steps_done)
    amplified_ok = ledger.analysis != _COMPOSITION
    common = dict(lipschitz=ledger.lipschitz, smoothness=ledger.smoothness,
                  strong_convexity=ledger.strong_convexity, learning_rate=ledger.learning_rate,
                  noise_std=ledger.noise_std, diameter=ledger.diameter, batch_size=b, delta=ledger.delta)
    exact = True
    if ledger.schedule == "random_stop":
        # The released iterate's guarantee: every record possibly used once.
        comp = _pnsgd_epsilons(**common, records=n, passes=1, positions=positions, amplified=False)
        comp = comp["composition"]
        by = {"composition": comp}
        amp = None
        if amplified_ok:
            by = _stop_epsilons(ledger)
            amp = np.minimum(np.minimum(*by.values()), comp)
            by.update({"composition": comp, "best": amp})
        eps = amp if amp is not None else comp
        # No step count: the stopping time is secret, and the guarantee does not depend on it.
        return PrivacyReport(ledger.analysis, ledger.reason, ledger.delta, None, positions, eps, comp,
                             amp, by, ledger.unused, exact)
    p, t = divmod(s, m)
    if s == 0:
        zeros = np.zeros(n)
        by = {"composition": zeros} if not amplified_ok else {"best": zeros, "composition": zeros}
        return PrivacyReport(ledger.analysis, ledger.reason, ledger.delta, s, positions, zeros, zeros,
                             None if not amplified_ok else zeros, by, ledger.unused, exact)
    if p == 0:
        seen = min(t * b, n)
        # Same positions shape every call (one compilation); positions past `seen` are
        # evaluated at `seen` and then set to 0 (not used yet).
        pos = np.minimum(positions, seen).astype(np.float64)
        by = _pnsgd_epsilons(**common, records=seen, passes=1, positions=pos, amplified=amplified_ok)
        by = {k: np.where(positions <= seen, v, 0.0) for k, v in by.items()}
    elif t == 0:
        by = _pnsgd_epsilons(**common, records=n, passes=p, positions=positions.astype(np.float64),
                             amplified=amplified_ok)
    else:
        exact = False
        by = _pnsgd_epsilons(**common, records=n, passes=p + 1, positions=positions.astype(np.float64),
                             amplified=False)
    comp = by["composition"]
    amp = by.get("best")
    eps = amp if (amp is not None and exact) else comp
    analysis = ledger.analysis if exact else _COMPOSITION
    reason = ledger.reason if exact else "mid-pass after the first pass; " + ledger.reason
    return PrivacyReport(analysis, reason, ledger.delta, s, positions, eps, comp, amp if exact else None, by,
                         ledger.unused, exact)


# ----------------------------------------------------------------------------------------
# DP-SGD runs
# ----------------------------------------------------------------------------------------

_DPSGD = "dpsgd"


class DPSGDLedger(NamedTuple):
    r"""What a DP-SGD run has spent, in the accountant's terms (JSON-serialisable).

    The guarantee is the Poisson-subsampled Gaussian mechanism composed over the steps done
    (:func:`jaxdp.accounting.dpsgd_epsilon` with ``(q, noise_multiplier, steps_done)``),
    add/remove neighbours, every intermediate model possibly released; it is the same for
    every record.

    Attributes:
      analysis: ``"dpsgd"``.
      reason: the assumptions, for the report.
      q: Poisson sampling rate (``batch_size / records``).
      noise_multiplier: :math:`\nu`, noise std over the clip norm :math:`C` on the clipped
        sum (as in Opacus and dp_accounting).
      clip_norm: :math:`C`.
      learning_rate: the SGD learning rate, or ``None`` with a user's optax optimizer.
      batch_size: the expected batch size :math:`qN`.
      records: :math:`N`.
      passes: planned passes (:math:`T = \mathrm{passes}\cdot\lceil N/b\rceil` steps).
      steps_per_pass: :math:`\lceil N/b\rceil`.
      total_steps: :math:`T`.
      steps_done: steps done so far.
      capacity: static padded batch size (speed only; overflow runs a second chunk).
      delta: target :math:`\delta`.
      order_seed: unused by DP-SGD's sampling (kept for the model's public initialisation).
      fixed_noise_seed: ``True`` when the noise and the sampling came from a fixed seed
        (then **not private**).
      max_grad_norm: the largest unclipped per-example gradient norm seen so far.
    """

    analysis: str
    reason: str
    q: float
    noise_multiplier: float
    clip_norm: float
    learning_rate: float | None
    batch_size: int
    records: int
    passes: int
    steps_per_pass: int
    total_steps: int
    steps_done: int
    capacity: int
    delta: float
    order_seed: int
    fixed_noise_seed: bool
    max_grad_norm: float

    unused = 0  # every record can be sampled

    def to_json(self) -> dict[str, Any]:
        """The ledger as a JSON-ready dict."""
        return dict(self._asdict())

    def public(self) -> dict[str, Any]:
        """What a report, JSON, log or plot may show (everything: this run has no secret count)."""
        return self.to_json()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DPSGDLedger:
        """Inverse of :meth:`to_json`."""
        return cls(**{k: data[k] for k in cls._fields})


def _dpsgd_report(ledger: DPSGDLedger, accountant: str = "rdp") -> PrivacyReport:
    from ..accounting import dpsgd_epsilon, dpsgd_event, pld_epsilon

    if accountant not in ("rdp", "pld"):
        raise ValueError(f"accountant must be 'rdp' or 'pld'; got {accountant!r}.")
    n = ledger.records
    positions = np.arange(1, n + 1)
    eps = float(dpsgd_epsilon(ledger.q, ledger.noise_multiplier, ledger.steps_done, ledger.delta)) \
        if ledger.steps_done > 0 else 0.0
    values = np.full(n, eps)
    by = {"dpsgd (sampled Gaussian RDP)": values}
    if accountant == "pld":
        eps_pld = float(pld_epsilon(dpsgd_event(ledger.q, ledger.noise_multiplier, ledger.steps_done),
                                    ledger.delta)) if ledger.steps_done > 0 else 0.0
        values = np.full(n, eps_pld)
        by = {"dpsgd (sampled Gaussian PLD, upper bound)": values, **by}
    return PrivacyReport(_DPSGD, ledger.reason, ledger.delta, ledger.steps_done, positions, values, values, None,
                         by, 0, True, bool(ledger.fixed_noise_seed))


# ----------------------------------------------------------------------------------------
# DP-SBCD runs
# ----------------------------------------------------------------------------------------

_DPSBCD = "dpsbcd"
_DPSBCD_HIDDEN = "dpsbcd hidden-state (Chen & Liu Thm 4.6, layers summed)"
_DPSBCD_COMPOSITION = "composition"


class DPSBCDLedger(NamedTuple):
    r"""What a DP-SBCD run has spent, in the accountant's terms (JSON-serialisable).

    The reported guarantee is :func:`jaxdp.accounting.dpsbcd_rdp` **per batch position**
    (``batch_index`` :math:`j_0`, the record's batch in the public order; all positions at
    once with :func:`jaxdp.accounting.dpsbcd_rdp_per_batch`) over the passes
    done, converted with :func:`jaxdp.accounting.rdp_to_epsilon`; the worst position is
    the release's guarantee. The order comes from the public ``order_seed``, so the
    paper's mixture over a uniformly random :math:`j_0` (:func:`~jaxdp.accounting.dpsbcd_epsilon`,
    Theorem 4.6) does not apply: the worst position is at least that value. It rests on
    the paper's **unproven per-layer summation** and its LSI assumption (see
    :func:`~jaxdp.accounting.dpsbcd_rdp`). The report also lists the composition bound
    (every iterate released: each layer's step is a Gaussian mechanism with sensitivity
    :math:`S_g/b`, composed over layers and uses), which needs neither assumption.

    Attributes:
      analysis: ``"dpsbcd"``.
      reason: the assumptions, for the report.
      learning_rate: η.
      noise_temperature: o, per pass ``[passes]`` or per step ``[passes][steps_per_pass]``.
      sensitivity: :math:`S_g = 2C` per layer.
      contraction: :math:`L_F` per layer, as stated by the user.
      prox_lipschitz: :math:`L_T = 1/(1 + ηλ)` per layer.
      clip_norm: :math:`C`.
      weight_decay: λ.
      penalty: γ of the lifted objective.
      records: records used per pass (:math:`m b`).
      unused: records never used (the :math:`n \bmod b` left over), ε = 0.
      batch_size: b.
      passes: planned passes.
      steps_per_pass: :math:`m = \lfloor n/b\rfloor`.
      total_steps: ``passes·m``.
      steps_done: steps done so far.
      delta: target δ.
      order_seed: public seed of the one permutation.
      fixed_noise_seed: ``True`` when the noise came from a fixed seed (then **not private**).
      max_grad_norm: largest unclipped per-record block gradient norm seen so far.
    """

    analysis: str
    reason: str
    learning_rate: float
    noise_temperature: list
    sensitivity: list
    contraction: list
    prox_lipschitz: list
    clip_norm: float
    weight_decay: float
    penalty: float
    records: int
    unused: int
    batch_size: int
    passes: int
    steps_per_pass: int
    total_steps: int
    steps_done: int
    delta: float
    order_seed: int
    fixed_noise_seed: bool
    max_grad_norm: float

    def to_json(self) -> dict[str, Any]:
        """The ledger as a JSON-ready dict."""
        return dict(self._asdict())

    def public(self) -> dict[str, Any]:
        """What a report, JSON, log or plot may show (everything: this run has no secret count)."""
        return self.to_json()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DPSBCDLedger:
        """Inverse of :meth:`to_json`."""
        return cls(**{k: data[k] for k in cls._fields})

    def event(self, passes: int | None = None):
        """The :class:`~jaxdp.accounting.DPSBCD` event of the first ``passes`` passes (default: all planned)."""
        from ..accounting import DPSBCD

        p = self.passes if passes is None else int(passes)
        return DPSBCD(np.asarray(self.noise_temperature, np.float64)[:p], float(self.learning_rate),
                      np.asarray(self.sensitivity, np.float64), np.asarray(self.contraction, np.float64),
                      np.asarray(self.prox_lipschitz, np.float64), num_records=int(self.records),
                      batch_size=int(self.batch_size))


@functools.lru_cache(maxsize=8)
def _dpsbcd_epsilons_fn(num_layers: int, passes: int, per_step: bool, num_records: int, batch_size: int):
    """A jitted ``(temps, eta, sensitivity, contraction, prox_lipschitz, used, delta) -> (hidden, composition)``.

    Both are ε per batch position, shape ``(m,)``; ``used`` is the ``(passes, m)`` mask of
    the steps done (composition). One compiled call instead of many eager ones (cached on
    shapes only; traced inside an x64 scope, so float64 throughout).
    """
    import jax
    import jax.numpy as jnp

    from ..accounting import DEFAULT_ORDERS, dpsbcd_rdp_per_batch, rdp_to_epsilon

    m = num_records // batch_size
    orders = np.asarray(DEFAULT_ORDERS, np.float64)

    def fn(temps, eta, sensitivity, contraction, prox_lipschitz, used, delta):
        kw = dict(learning_rate=eta, sensitivity=sensitivity, contraction=contraction, prox_lipschitz=prox_lipschitz,
                  num_records=num_records, batch_size=batch_size)
        # The per-position RDP is linear in the order, α·c_j: one order gives c_j. All m
        # positions in one call (shared LSI constants and decay sums: O(passes·m), one scan).
        c = dpsbcd_rdp_per_batch([2.0], temps, **kw)[:, 0] / 2.0
        per_step_temps = temps if per_step else jnp.repeat(temps[:, None], m, axis=1)
        # Composition: each use is, per layer, a Gaussian mechanism with RDP α ηS²/(4b²o)
        # (noise std sqrt(2ηo) on a step moved by ηS/b), summed over layers and uses.
        comp = jnp.sum(jnp.where(used, eta * jnp.sum(sensitivity**2) / (4.0 * batch_size**2 * per_step_temps), 0.0),
                       axis=0)

        def eps(cj):
            return rdp_to_epsilon(orders * cj, orders, delta).epsilon

        return jax.vmap(eps)(c), jnp.where(comp > 0, jax.vmap(eps)(comp), 0.0)

    return jax.jit(fn)


def _dpsbcd_report(ledger: DPSBCDLedger) -> PrivacyReport:
    r"""ε per record position of a DP-SBCD run after ``steps_done`` steps.

    At a pass boundary (:math:`p` passes done): the hidden-state bound of the first
    :math:`p` passes for the record's batch position, and the composition bound
    :math:`ρ(α) = α\sum_{\text{layers}}\sum_{k<p} ηS_g^2/(4b^2o_{km+j_0})` (the Gaussian
    mechanism of every touching step; no LSI, no per-layer assumption). Inside a pass no
    hidden-state bound is certified (``exact=False``): composition over the steps done.
    """
    import jax

    n, b, m = ledger.records, ledger.batch_size, ledger.steps_per_pass
    positions = np.arange(1, n + 1)
    s = int(ledger.steps_done)
    p, t = divmod(s, m)
    record_batch = np.arange(n) // b
    temps = np.asarray(ledger.noise_temperature, np.float64)
    used = np.zeros((ledger.passes, m), bool)
    used.reshape(-1)[:s] = True
    sens = np.asarray(ledger.sensitivity, np.float64)
    fn = _dpsbcd_epsilons_fn(sens.size, ledger.passes, temps.ndim == 2, n, b)
    args = (float(ledger.learning_rate), sens, np.asarray(ledger.contraction, np.float64),
            np.asarray(ledger.prox_lipschitz, np.float64))
    with jax.enable_x64(True):
        # All planned passes (one compiled shape; steps not done are masked for composition). The
        # hidden-state bound of the first p < passes passes needs its own shape.
        hid, comp = fn(temps, *args, used, float(ledger.delta))
        if 0 < p < ledger.passes and t == 0:
            fn_p = _dpsbcd_epsilons_fn(sens.size, p, temps.ndim == 2, n, b)
            hid, _ = fn_p(temps[:p], *args, used[:p], float(ledger.delta))
    comp = np.asarray(comp, np.float64)[record_batch]
    exact = t == 0
    if s == 0:
        hidden = np.zeros(n)
    elif exact:
        # The hidden-state bound never exceeds composition in exact arithmetic; keep the smaller.
        hidden = np.minimum(np.asarray(hid, np.float64)[record_batch], comp)
    else:
        hidden = None
    if hidden is None:
        by = {_DPSBCD_COMPOSITION: comp}
        analysis, reason = _DPSBCD_COMPOSITION, "mid-pass (hidden-state bound at pass ends only); " + ledger.reason
        eps = comp
    else:
        by = {_DPSBCD_HIDDEN: hidden, _DPSBCD_COMPOSITION: comp}
        analysis, reason, eps = _DPSBCD, ledger.reason, hidden
    return PrivacyReport(analysis, reason, ledger.delta, s, positions, eps, comp, hidden, by, ledger.unused, exact,
                         bool(ledger.fixed_noise_seed))
