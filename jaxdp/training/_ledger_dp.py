"""The ledgers of DP-SGD and DP-SBCD runs and their reports (ε per record position).

:func:`~jaxdp.training.privacy_report` dispatches here for a :class:`DPSGDLedger` (the
sampled-Gaussian guarantee, the same for every record) or a :class:`DPSBCDLedger` (Chen &
Liu's hidden-state bound per batch position, and composition).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..accounting import (
    DEFAULT_ORDERS,
    DPSBCD,
    dpsbcd_composition_rdp,
    dpsbcd_rdp_per_batch,
    dpsgd_epsilon,
    dpsgd_event,
    epsilon,
    rdp_to_epsilon,
    shuffled_lower_epsilon,
)
from ._report import PrivacyReport
from .samplers import from_spec

__all__ = ["DPSBCDLedger", "DPSGDLedger"]



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
      sampler: the batch scheme other than Poisson sampling, as
        :meth:`jaxdp.training.samplers.Sampler.spec` (bound to the data set), or ``None``
        for Poisson sampling. Then the guarantee is that sampler's event
        (:meth:`~jaxdp.training.samplers.Sampler.event`), ``q`` is the expected batch over
        :math:`N` and ``batch_size`` the expected batch rounded.
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
    sampler: dict | None = None

    unused = 0  # every record can be sampled

    def public(self) -> dict[str, Any]:
        """What a report, JSON, log or plot may show (everything: this run has no secret count)."""
        return dict(self._asdict())

    def to_json(self) -> dict[str, Any]:
        """The public ledger as a JSON-ready dict (:meth:`public`)."""
        return self.public()

    def event(self, num_steps: int | None = None):
        """The accounting event after ``num_steps`` steps (default: the steps done).

        ``dpsgd_event(q, ν, steps)`` for Poisson sampling, else the sampler's
        (:meth:`jaxdp.training.samplers.Sampler.event`).
        """
        steps = self.steps_done if num_steps is None else int(num_steps)
        if self.sampler is None:
            return dpsgd_event(self.q, self.noise_multiplier, steps)
        return from_spec(self.sampler).event(self.noise_multiplier, steps, self.records)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DPSGDLedger:
        """Inverse of :meth:`to_json` (a ledger written before samplers has ``sampler=None``)."""
        return cls(**{k: data[k] for k in cls._fields if k in data or k != "sampler"})


def _dpsgd_report(ledger: DPSGDLedger, accountant: str = "rdp") -> PrivacyReport:
    if accountant not in ("rdp", "pld"):
        raise ValueError(f"accountant must be 'rdp' or 'pld'; got {accountant!r}.")
    if ledger.sampler is not None:
        return _sampler_report(ledger, accountant)
    n = ledger.records
    positions = np.arange(1, n + 1)
    eps = float(dpsgd_epsilon(ledger.q, ledger.noise_multiplier, ledger.steps_done, ledger.delta)) \
        if ledger.steps_done > 0 else 0.0
    values = np.full(n, eps)
    by = {"dpsgd (sampled Gaussian RDP)": values}
    if accountant == "pld":
        eps_pld = float(epsilon(dpsgd_event(ledger.q, ledger.noise_multiplier, ledger.steps_done), ledger.delta,
                                accountant="pld")) if ledger.steps_done > 0 else 0.0
        values = np.full(n, eps_pld)
        by = {"dpsgd (sampled Gaussian PLD, upper bound)": values, **by}
    return PrivacyReport(_DPSGD, ledger.reason, ledger.delta, ledger.steps_done, positions, values, values, None,
                         by, 0, True, bool(ledger.fixed_noise_seed))


def _sampler_report(ledger: DPSGDLedger, accountant: str) -> PrivacyReport:
    """The report of a DP-SGD run with another batch scheme: the sampler's event, the same for every record."""
    sampler = from_spec(ledger.sampler)
    n, done = ledger.records, ledger.steps_done
    ev = ledger.event()
    eps = float(epsilon(ev, ledger.delta)) if done > 0 else 0.0
    by = {f"dpsgd, {sampler.name} (RDP)": np.full(n, eps)}
    if accountant == "pld":
        try:
            eps_pld = float(epsilon(ev, ledger.delta, accountant="pld")) if done > 0 else 0.0
        except (ValueError, TypeError, NotImplementedError):
            raise ValueError(f"accountant='pld' does not cover the {sampler.name} batch scheme's event; use "
                             "accountant='rdp'.") from None
        by = {f"dpsgd, {sampler.name} (PLD, upper bound)": np.full(n, eps_pld), **by}
    values = next(iter(by.values()))
    note = sampler.note
    passes = done // sampler.steps_per_pass if sampler.name == "shuffle" else 0
    if passes > 0:
        # What shuffling costs at least (Chua et al. 2024): a lower bound on every valid ε of
        # the completed passes (the max-coordinate statistic does not depend on the batch
        # sizes); shown beside the reported upper bound, never as the reported ε.
        low = float(shuffled_lower_epsilon(ledger.noise_multiplier, sampler.steps_per_pass, passes, ledger.delta))
        by[_SHUFFLE_LOWER] = np.full(n, low)
        note = f"{note}; shuffling costs at least epsilon = {low:.4g} here ({_SHUFFLE_LOWER})"
    return PrivacyReport(f"{_DPSGD} ({sampler.name})", ledger.reason, ledger.delta, done, np.arange(1, n + 1),
                         values, values, None, by, 0, True, bool(ledger.fixed_noise_seed), note)


_SHUFFLE_LOWER = "lower bound, Chua et al. 2024"


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

    def public(self) -> dict[str, Any]:
        """What a report, JSON, log or plot may show (everything: this run has no secret count)."""
        return dict(self._asdict())

    def to_json(self) -> dict[str, Any]:
        """The public ledger as a JSON-ready dict (:meth:`public`)."""
        return self.public()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DPSBCDLedger:
        """Inverse of :meth:`to_json`."""
        return cls(**{k: data[k] for k in cls._fields})

    def event(self, passes: int | None = None):
        """The :class:`~jaxdp.accounting.DPSBCD` event of the first ``passes`` passes (default: all planned)."""
        p = self.passes if passes is None else int(passes)
        return DPSBCD(np.asarray(self.noise_temperature, np.float64)[:p], float(self.learning_rate),
                      np.asarray(self.sensitivity, np.float64), np.asarray(self.contraction, np.float64),
                      np.asarray(self.prox_lipschitz, np.float64), num_records=int(self.records),
                      batch_size=int(self.batch_size))


@functools.lru_cache(maxsize=8)
def _dpsbcd_epsilons_fn(num_layers: int, passes: int, per_step: bool, num_records: int, batch_size: int):
    """A jitted ``(temps, eta, sensitivity, contraction, prox_lipschitz, steps_done, delta) -> (hidden, composition)``.

    Both are ε per batch position, shape ``(m,)``; composition counts the ``steps_done``
    first steps (:func:`jaxdp.accounting.dpsbcd_composition_rdp`). One compiled call instead
    of many eager ones (cached on shapes only; traced inside an x64 scope, so float64
    throughout).
    """
    orders = np.asarray(DEFAULT_ORDERS, np.float64)

    def fn(temps, eta, sensitivity, contraction, prox_lipschitz, steps_done, delta):
        kw = dict(learning_rate=eta, sensitivity=sensitivity, num_records=num_records, batch_size=batch_size)
        # The per-position RDP is linear in the order, α·c_j: one order gives c_j. All m
        # positions in one call (shared LSI constants and decay sums: O(passes·m), one scan).
        c = dpsbcd_rdp_per_batch([2.0], temps, contraction=contraction, prox_lipschitz=prox_lipschitz, **kw)[:, 0] / 2.0
        # Composition (every step a Gaussian mechanism, layers and uses composed), linear in the order too
        # (α·2/2 is exact in binary floating point).
        comp = dpsbcd_composition_rdp([2.0], temps, num_steps=steps_done, **kw)[:, 0] / 2.0

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
    n, b, m = ledger.records, ledger.batch_size, ledger.steps_per_pass
    positions = np.arange(1, n + 1)
    s = int(ledger.steps_done)
    p, t = divmod(s, m)
    record_batch = np.arange(n) // b
    temps = np.asarray(ledger.noise_temperature, np.float64)
    sens = np.asarray(ledger.sensitivity, np.float64)
    fn = _dpsbcd_epsilons_fn(sens.size, ledger.passes, temps.ndim == 2, n, b)
    args = (float(ledger.learning_rate), sens, np.asarray(ledger.contraction, np.float64),
            np.asarray(ledger.prox_lipschitz, np.float64))
    with jax.enable_x64(True):
        # All planned passes (one compiled shape; steps not done are masked for composition). The
        # hidden-state bound of the first p < passes passes needs its own shape.
        hid, comp = fn(temps, *args, s, float(ledger.delta))
        if 0 < p < ledger.passes and t == 0:
            fn_p = _dpsbcd_epsilons_fn(sens.size, p, temps.ndim == 2, n, b)
            hid, _ = fn_p(temps[:p], *args, p * m, float(ledger.delta))
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

