r"""PNSGD with Poisson batches: the batches, the contraction check, the reason and the scanned steps.

:class:`~jaxdp.training.PNSGDMechanism` with ``sampling="poisson"`` runs

.. math::

    Y_{t+1} = \Pi_K\Bigl(Y_t - \eta\Bigl(\frac1b\sum_{i\in B_t}\bar g_i(Y_t) + Z_t\Bigr)\Bigr),
    \qquad Z_t \sim \mathcal N(0, \sigma^2 I),\quad \sigma = \nu\,\frac{2C}{b},

with :math:`B_t` a secret Poisson sample at rate :math:`q = b/N` (each record independently),
cut to a uniformly random ``max_batch_size`` :math:`B` records when more are drawn, and the
fixed denominator :math:`b`, as the accountant :func:`~jaxdp.accounting.poisson_pnsgd_rdp`
analyses it (``docs/hidden_state_poisson.md``). The batches come from
:mod:`jaxdp.training.samplers` (:class:`~jaxdp.training.samplers.TruncatedPoisson`, or
:class:`~jaxdp.training.samplers.Poisson` uncut) as fixed-shape padded index arrays, and the
clipped sum over them is :func:`~jaxdp.training.dpsgd_step`'s (padding masked; an uncut batch
above its capacity runs a second chunk, nothing dropped); :func:`~jaxdp.training.pnsgd`
adds the noise, steps and projects. The noise multiplier keeps PNSGD's convention (relative
to :math:`2C/b`): the add/remove sensitivity of the averaged gradient is :math:`C/b`, and the
accountant is told the absolute :math:`\sigma`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from ._dpsgd import dpsgd_step
from ._run import _Plan, _segments
from ._transforms import pnsgd
from .samplers import Poisson, TruncatedPoisson

__all__: list[str] = []


def check_contraction(learning_rate: float, smoothness: float, largest_batch: int, batch_size: int,
                      uncut: bool = False) -> None:
    """ValueError unless ηβB/b ≤ 2: every batch's gradient step is then 1-Lipschitz (Feldman et al. Prop. 18)."""
    if learning_rate * smoothness * largest_batch > 2.0 * batch_size:
        which = "N + 1 (uncut Poisson batches; set max_batch_size to cut them)" if uncut else "max_batch_size"
        raise ValueError(
            f"learning_rate must be at most 2*batch_size/(smoothness*B) = {2.0 * batch_size / (smoothness * largest_batch):.6g} "
            f"with Poisson batches (every batch's step must be a contraction: eta*beta*B/b <= 2, B = {which}); got "
            f"learning_rate={learning_rate:g}, smoothness={smoothness:g}, B={largest_batch}, batch_size={batch_size}.")


def bind_sampler(n: int, batch_size: int, max_batch_size: int | None):
    """The bound sampler of the run: Poisson at q = b/N, cut to B when given."""
    if batch_size > n:
        raise ValueError(f"batch_size must be <= the number of training examples ({n}); got {batch_size}.")
    sampler = Poisson() if max_batch_size is None else TruncatedPoisson(max_batch_size=int(max_batch_size))
    return sampler.bind(n, batch_size)


def plan_poisson(pp, sampler, batch_size: int, eta_max: float):
    """``(reason, fields)``: the contraction checked for a convex run, the reason naming the batches, and the
    ledger's (and the checkpoint configuration's) Poisson fields."""
    n, cap = sampler.num_records, getattr(sampler, "max_batch_size", None)
    largest = n + 1 if cap is None else min(int(cap), n + 1)
    batches = (f"secret Poisson batches (q={sampler.q:.6g}" + ("" if cap is None else f", cut to {cap} records")
               + f", the clipped sum divided by b={batch_size}), add/remove neighbours")
    reason = f"{pp.reason}; {batches}"
    if pp.analysis == "hidden-state":
        check_contraction(eta_max, float(pp.smoothness), largest, batch_size, uncut=cap is None)
        reason = (f"{pp.reason.replace(' <= 2/(beta+rho)', '')}, eta*beta*B/b = "
                  f"{eta_max * float(pp.smoothness) * largest / batch_size:.4g} <= 2 (B={largest}); {batches}")
    return reason, {"sampling": "poisson", "q": float(sampler.q), "max_batch_size": None if cap is None else int(cap)}


def poisson_steps(sampler, graphdef, rest, loss_fn, X, Y, *, learning_rate, noise_multiplier, clip_norm, radius,
                  key, batch_size, steps_per_call, use_fast_path, mesh, keep):
    """``(tx, run, segments, report_at)`` of the Poisson run (``run`` as :class:`~jaxdp.training._run.Run`'s)."""
    tx = optax.chain(optax.scale(1.0 / batch_size),
                     pnsgd(learning_rate, noise_multiplier, clip_norm, radius, key, batch_size=batch_size))
    m = sampler.steps_per_pass
    plan = _Plan(sampler.num_records, sampler.num_records, m, 0, m)

    def one(carry):
        params, opt_state, step, maxn, clipped, skey = carry
        skey, indices, size = sampler.sample(skey, step)
        params, opt_state, out = dpsgd_step(loss_fn, graphdef, rest, tx, params, opt_state, None, X, Y, sampler.q,
                                            clip_norm, sampler.capacity, use_fast_path=use_fast_path, mesh=mesh,
                                            batch=(indices, size))
        return (params, opt_state, step + 1, jnp.maximum(maxn, out.max_grad_norm.astype(maxn.dtype)),
                clipped + out.clipped, skey)

    def body(c, _):
        c = one(c)
        return c, (c[0] if keep else None)

    def scan(carry, length):
        return jax.lax.scan(body, carry, None, length=length)

    scan_jit = jax.jit(scan, static_argnames=("length",))

    def run(st, first, length, partial):
        carry = (st.params, st.opt_state, st.step, st.max_grad_norm, st.clipped, st.sample_key)
        carry, ys = scan_jit(carry, length=length)
        return st._replace(params=carry[0], opt_state=carry[1], step=carry[2], max_grad_norm=carry[3],
                           clipped=carry[4], sample_key=carry[5]), ys

    return tx, run, (lambda start, stop: _segments(start, stop, plan, steps_per_call)), (lambda p: p % m == 0)

