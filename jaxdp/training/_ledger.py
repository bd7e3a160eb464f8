r"""The privacy ledger of a PNSGD training run, and the ε per record position it implies.

A :class:`PrivacyLedger` records everything the accountant needs (which analysis, the
constants :math:`L, \beta, \rho`, the step :math:`\eta`, the noise :math:`\sigma`, the
diameter :math:`D = 2R`, the number of records :math:`n`, the batch size :math:`b`, the
passes, the steps done and :math:`\delta`), as plain JSON-serialisable Python values, so it
can be checkpointed and audited. :func:`privacy_report` turns it into ε per record position
with the pure accountants of :mod:`jaxdp.accounting`: every number is one call of
:func:`jaxdp.accounting.pnsgd_privacy` on the ledger's event for the steps done
(:meth:`PrivacyLedger.event`); this module only decides which event describes them.

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
from typing import Any, NamedTuple

import numpy as np

from ..accounting import DEFAULT_ORDERS, PNSGD, pnsgd_privacy, poisson_pnsgd_rdp, rdp_to_epsilon
from ._ledger_dp import DPSBCDLedger, DPSGDLedger, _dpsbcd_report, _dpsgd_report
from ._report import NOT_PRIVATE as NOT_PRIVATE
from ._report import PrivacyReport

__all__ = ["DPSBCDLedger", "DPSGDLedger", "PrivacyLedger", "PrivacyReport", "privacy_report"]

_HIDDEN = "hidden-state"
_STOP = "random-stop"
_COMPOSITION = "composition"


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
      sampling: ``"sequential"`` (the fixed order), ``"poisson"`` (secret Poisson batches at
        rate ``q``, cut to ``max_batch_size``; the event is ``PNSGD(..., sampling="poisson")``
        and every record gets the same ε) or ``"shuffle"`` (a fresh secret permutation every
        pass; the event is ``PNSGD(..., sampling="shuffle")``, every record alike).
      q: the Poisson rate :math:`b/N` (``None`` for the fixed order).
      max_batch_size: the cut :math:`B` of the Poisson batches, or ``None``.
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
    sampling: str = "sequential"
    q: float | None = None
    max_batch_size: int | None = None

    def public(self) -> dict[str, Any]:
        """What a report, log, JSON or plot may show: every field but the secret ones.

        With ``schedule="random_stop"`` the number of steps is secret, and so is what depends on
        it (the step counters, the clipping count and the largest gradient norm seen): they
        are left out.
        """
        secret = _SECRET_WITH_RANDOM_STOP if self.schedule == "random_stop" else ()
        if self.sampling == "sequential":  # the fixed order's ledger as before Poisson batches
            secret = (*secret, *_POISSON_FIELDS)
        return {k: v for k, v in self._asdict().items() if k not in secret}

    def to_json(self) -> dict[str, Any]:
        """The public ledger as a JSON-ready dict (:meth:`public`; checkpoints store ``_asdict()``)."""
        return self.public()

    def event(self, passes: int | None = None) -> PNSGD:
        """The :class:`~jaxdp.accounting.PNSGD` event of the first ``passes`` passes (default: all planned).

        ``hidden`` is False once the analysis is composition (every iterate may be released,
        or the update is not known to be a contraction); β is then not used and ``1/η``
        stands in for it. Random stopping, with batches too, is one pass stopped at a
        secret step (:func:`jaxdp.accounting.pnsgd_privacy` covers it); demoted to
        composition, it is the one pass with every record used once.
        """
        hidden = self.analysis != _COMPOSITION
        if self.sampling == "poisson":
            return self._poisson_event((self.passes if passes is None else int(passes)) * self.steps_per_pass, hidden)
        if self.schedule == "random_stop":
            return self._event(1, self.records, hidden=hidden, schedule="random_stop" if hidden else "fixed")
        return self._event(self.passes if passes is None else int(passes), self.records, hidden=hidden)

    def _event(self, passes: int, records: int, *, hidden: bool, schedule: str = "fixed") -> PNSGD:
        amplified = hidden and self.smoothness is not None
        extra = {"sampling": "shuffle"} if self.sampling == "shuffle" else {}
        return PNSGD(self.lipschitz, self.smoothness if amplified else 1.0 / self.learning_rate, self.learning_rate,
                     self.noise_std, self.diameter, num_records=int(records),
                     strong_convexity=self.strong_convexity if amplified else 0.0, batch_size=int(self.batch_size),
                     passes=int(passes), schedule=schedule, hidden=hidden, **extra)

    def _poisson_event(self, num_steps: int, hidden: bool) -> PNSGD:
        """``PNSGD(..., sampling="poisson")`` of ``num_steps`` sampled steps (composition when not ``hidden``)."""
        amplified = hidden and self.smoothness is not None
        return PNSGD(self.lipschitz, self.smoothness if amplified else 0.0, self.learning_rate, self.noise_std,
                     self.diameter, num_records=int(self.records), batch_size=int(self.batch_size),
                     hidden=amplified, relation="add_remove", sampling="poisson", q=float(self.q),
                     num_steps=max(1, int(num_steps)), max_batch_size=self.max_batch_size)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PrivacyLedger:
        """The ledger from a dict of every field (as a checkpoint stores it, ``ledger._asdict()``; a ledger
        written before Poisson batches has the fixed order's defaults)."""
        return cls(**{k: data[k] for k in cls._fields if k in data or k not in _POISSON_FIELDS})


_SECRET_WITH_RANDOM_STOP = ("total_steps", "steps_done", "clipped", "max_grad_norm")
_POISSON_FIELDS = ("sampling", "q", "max_batch_size")


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


_FIXED_ANALYSES = ("contraction", "iteration", "strongly_convex", "shifted_gdp", "composition", "best")
_STOP_ANALYSES = {"random-stop (Thm 5)": "contraction", "random-stop (Thm 26)": "iteration",
                  "composition": "composition", "best": "best"}


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
      ledger: a :class:`PrivacyLedger` (e.g. ``result.ledger``).
      accountant: ``"rdp"`` (default) or, for a :class:`DPSGDLedger` only, ``"pld"``: the
        report then leads with the PLD upper bound (:func:`jaxdp.accounting.epsilon` with ``accountant="pld"``,
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


def worst_epsilon(ledger: PrivacyLedger) -> float:
    """The worst-record ε :func:`privacy_report` gives (the same numbers, without the Poisson report's note)."""
    if ledger.sampling in ("poisson", "shuffle"):
        positions = np.arange(1, ledger.records + 1)
        report = _poisson_report if ledger.sampling == "poisson" else _shuffle_report
        return report(ledger, positions, int(ledger.steps_done), ledger.analysis != _COMPOSITION,
                      note=False).summary()["worst"]
    return privacy_report(ledger).summary()["worst"]


def _report(ledger: PrivacyLedger) -> PrivacyReport:
    """The report as accounting calls on the event that describes the steps done (see :func:`privacy_report`)."""
    n, b, m = ledger.records, ledger.batch_size, ledger.steps_per_pass
    positions = np.arange(1, n + 1)
    s = int(ledger.steps_done)
    amplified_ok = ledger.analysis != _COMPOSITION
    exact = True
    if ledger.sampling == "poisson":
        return _poisson_report(ledger, positions, s, amplified_ok)
    if ledger.sampling == "shuffle":
        return _shuffle_report(ledger, positions, s, amplified_ok)
    if ledger.schedule == "random_stop":
        # The released iterate's guarantee: it does not depend on the drawn (secret) stopping time.
        out = pnsgd_privacy(ledger.event(), ledger.delta)
        comp = np.asarray(out.composition, np.float64)
        amp = np.asarray(out.best, np.float64) if amplified_ok else None
        by = ({k: np.asarray(getattr(out, f), np.float64) for k, f in _STOP_ANALYSES.items()} if amplified_ok
              else {"composition": comp})
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
    names = _FIXED_ANALYSES if amplified_ok else ("composition",)
    if p == 0:
        # The first pass so far: one pass over the first `seen` records; the others have ε = 0. The
        # positions keep one shape every call (one compilation): those past `seen` are evaluated at
        # `seen`, then set to 0.
        seen = min(t * b, n)
        pos = np.minimum(positions, seen).astype(np.float64)
        out = pnsgd_privacy(ledger._event(1, seen, hidden=amplified_ok), ledger.delta, positions=pos)
        by = {k: np.where(positions <= seen, np.asarray(getattr(out, k), np.float64), 0.0) for k in names}
    elif t == 0:
        out = pnsgd_privacy(ledger.event(p), ledger.delta, positions=positions.astype(np.float64))
        by = {k: np.asarray(getattr(out, k), np.float64) for k in names}
    else:
        # Inside a later pass: composition with p + 1 uses of every record (valid, conservative).
        exact = False
        out = pnsgd_privacy(ledger._event(p + 1, n, hidden=False), ledger.delta, positions=positions.astype(np.float64))
        by = {"composition": np.asarray(out.composition, np.float64)}
    comp = by["composition"]
    amp = by.get("best")
    eps = amp if (amp is not None and exact) else comp
    analysis = ledger.analysis if exact else _COMPOSITION
    reason = ledger.reason if exact else "mid-pass after the first pass; " + ledger.reason
    return PrivacyReport(analysis, reason, ledger.delta, s, positions, eps, comp, amp if exact else None, by,
                         ledger.unused, exact)


# Where the Poisson report looks for the plateau of the hidden-state bound (any T beyond the burn-in).
_PLATEAU_STEPS = 10**9


def _poisson_report(ledger: PrivacyLedger, positions, s: int, amplified_ok: bool, note: bool = True) -> PrivacyReport:
    """Poisson batches: every record alike, the hidden-state bound after ``s`` steps (and where it stops growing)."""
    n = positions.size
    names = ("iteration", "composition", "best") if amplified_ok else ("composition",)
    if s == 0:
        by = {k: np.zeros(n) for k in names}
        note = False
    else:
        out = pnsgd_privacy(ledger._poisson_event(s, amplified_ok), ledger.delta)
        by = {k: np.asarray(getattr(out, k), np.float64) for k in names}
        note = _poisson_note(ledger) if (amplified_ok and note) else None
    eps = by["best"] if amplified_ok else by["composition"]
    return PrivacyReport(ledger.analysis, ledger.reason, ledger.delta, s, positions, eps, by["composition"],
                         by.get("best"), by, 0, True, note=note or None)


def _poisson_note(ledger: PrivacyLedger) -> str:
    """:func:`_plateau_note` of the ledger's constants (it does not depend on the steps done)."""
    return _plateau_note(ledger._replace(steps_done=0, total_steps=0, clipped=0, max_grad_norm=0.0, reason="",
                                         analysis=_HIDDEN, order_seed=0, fixed_noise_seed=False))


@functools.lru_cache(maxsize=32)
def _plateau_note(ledger: PrivacyLedger) -> str:
    """The line the report leads with: the hidden-state guarantee, its assumptions, and where it stops growing.

    For each order α the bound is min(T·S_α, f_α(τ_α)) once T > τ_α (the best shift start, returned
    by :func:`~jaxdp.accounting.poisson_pnsgd_rdp`): at most its value at a large T. So from
    T₀ = 1 + max τ_α (over the orders whose shifted bound is the smaller there) to that T, ε is
    at most the plateau ε.
    """
    ev = ledger._poisson_event(_PLATEAU_STEPS, True)
    rdp, tau = poisson_pnsgd_rdp(DEFAULT_ORDERS, ev.q, ev.lipschitz, ev.smoothness, ev.learning_rate, ev.noise_std,
                                 ev.diameter, float(ev.batch_size), _PLATEAU_STEPS, num_records=ev.num_records,
                                 max_batch_size=ev.max_batch_size, return_burn_in=True)
    plateau = float(rdp_to_epsilon(rdp, DEFAULT_ORDERS, ledger.delta).epsilon)
    tau = np.asarray(tau, np.float64)
    shifted = tau[tau < _PLATEAU_STEPS]
    flat = (f"epsilon <= {plateau:.4g} for any number of steps from {int(shifted.max()) + 1:,} to {_PLATEAU_STEPS:.0e} "
            "(flat after the burn-in)" if shifted.size else "no plateau below 1e9 steps (composition binds)")
    return (f"hidden state, Poisson batches: epsilon of the final iterate only, assuming every record's loss convex, "
            f"L={ledger.lipschitz:g}-Lipschitz and beta={ledger.smoothness:g}-smooth on the ball of diameter "
            f"D={ledger.diameter:g}, a data-independent start and a secret Poisson sample; {flat}")


def _shuffle_report(ledger: PrivacyLedger, positions, s: int, amplified_ok: bool, note: bool = True) -> PrivacyReport:
    """Shuffled batches: every record alike. After p whole passes the hidden-state bound of p passes;
    inside a pass the composition of the passes begun (valid: a pass begun uses a record at most once)."""
    n, m = positions.size, ledger.steps_per_pass
    p, t = divmod(s, m)
    exact = t == 0
    names = ("iteration", "shifted_gdp", "composition", "best") if (amplified_ok and exact) else ("composition",)
    if s == 0:
        by = {k: np.zeros(n) for k in names}
        note = False
    else:
        ev = ledger._event(p if exact else p + 1, n, hidden=amplified_ok and exact)
        out = pnsgd_privacy(ev, ledger.delta)
        by = {k: np.asarray(getattr(out, k), np.float64) for k in names}
        note = _shuffle_note(ledger) if (amplified_ok and note) else None
    eps = by["best"] if "best" in by else by["composition"]
    analysis = ledger.analysis if exact else _COMPOSITION
    reason = ledger.reason if exact else "mid-pass; " + ledger.reason
    return PrivacyReport(analysis, reason, ledger.delta, s, positions, eps, by["composition"], by.get("best"), by, 0,
                         exact, note=note or None)


def _shuffle_note(ledger: PrivacyLedger) -> str:
    """The line the report leads with: the guarantee, its assumptions and its value for any number of passes.

    The bound is non-decreasing in the passes k and, from k = 2 on, its shifted terms do not depend on k
    (``docs/hidden_state_poisson.md`` §8): its value at k = 10⁹ bounds every k.
    """
    ev = ledger._event(_PLATEAU_STEPS, ledger.records, hidden=True)
    plateau = float(pnsgd_privacy(ev, ledger.delta, positions=[1]).best[0])
    return (f"hidden state, shuffled batches: epsilon of the final iterate only, assuming every record's loss convex, "
            f"L={ledger.lipschitz:g}-Lipschitz and beta={ledger.smoothness:g}-smooth on the ball of diameter "
            f"D={ledger.diameter:g}, a data-independent start and a fresh secret permutation every pass; "
            f"epsilon <= {plateau:.4g} for any number of passes")
