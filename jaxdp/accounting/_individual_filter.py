r"""Individual privacy accounting with a Rényi filter (Feldman and Zrnic 2021).

:func:`individual_filter_step` and :func:`individual_filter_privacy`: the per-step
per-instance Rényi DP of :mod:`._per_instance_rdp` (one Poisson-sampled Gaussian step for a point
whose clipped gradient norm over the clipping norm is ``r``) charged to each point's ledger,
and the point dropped for the rest of training once its next step would exceed the budget
at some order. A certified guarantee under fully adaptive composition, on condition that
training enforced the filter; like every per-instance bound it holds for one fixed point
and one fixed data set, not differential privacy.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .._numerics import f64, float64
from ._conversion import rdp_to_epsilon
from ._per_instance_rdp import PerInstancePrivacy, _check_common, _pi_rdp

__all__ = ["individual_filter_step", "individual_filter_privacy"]


@float64
def individual_filter_step(consumed, halted, orders, q, noise_multiplier, r, budget):
    r"""One step of an individual Rényi filter: who may take part, and the updated ledger.

    A point takes part in the step iff it has not been dropped and
    :math:`\mathrm{consumed}(α) + ε_t(α) ≤ B(α)` at every order, where :math:`ε_t` is its
    per-instance RDP for this step (:func:`per_instance_sampled_gaussian_rdp` at the ``r``
    computed on the model the step starts from). Otherwise it is **dropped for the rest
    of training** (its gradient must not enter this or any later step) and its ledger
    stops. Run this before each step and use ``active`` as the per-example mask.

    Args:
      consumed: individual RDP consumed so far, shape ``points + (k,)`` (zeros at start).
      halted: bool, shape ``points`` (False at start).
      orders: Rényi orders (static), length k.
      q: Poisson sampling rate in [0, 1].
      noise_multiplier: noise std over the clipping norm, > 0.
      r: this step's clipped norm over C in [0, 1], shape ``points``.
      budget: RDP budget per order, ≥ 0 (may be ``inf``), broadcastable to ``(k,)``.

    Returns:
      ``(active, consumed, halted)``: bool ``points``, float64 ``points + (k,)``, bool.

    References:
      V. Feldman, T. Zrnic, "Individual Privacy Accounting via a Rényi Filter",
      NeurIPS 2021 (arXiv:2008.11193), the Rényi filter and its individual form (§3–4).

    Examples:
      >>> import jaxdp, jax.numpy as jnp
      >>> a, c, h = jaxdp.accounting.individual_filter_step(
      ...     jnp.zeros((2, 1)), jnp.zeros(2, bool), [2.0], 1.0, 1.0, jnp.array([1.0, 0.1]), 0.5)
      >>> a.tolist(), h.tolist()
      ([False, True], [True, False])
    """
    orders_np = _validate.concrete_orders(orders)
    _check_common(q, noise_multiplier, r)
    _validate.check_in_range("budget", budget, 0.0, math.inf, allow_inf=True)
    _validate.check_in_range("consumed", consumed, 0.0, math.inf)
    return _filter_step(orders_np, f64(consumed), jnp.asarray(halted, bool), f64(q), f64(noise_multiplier), f64(r),
                        f64(budget))


def _filter_step(orders_np, consumed, halted, q, noise_multiplier, r, budget):
    rho = _pi_rdp(orders_np, q, noise_multiplier, r)
    cand = consumed + rho
    fits = jnp.all(cand <= budget, axis=-1)  # NaN compares False: an invalid value drops the point
    active = fits & ~halted
    consumed = jnp.where(active[..., None], cand, consumed)
    return active, consumed, halted | ~fits


@functools.partial(jax.jit, static_argnums=(0, 1))
def _filter_jit(orders_key, method, q, noise_multiplier, r, budget, delta):
    orders_np = np.asarray(orders_key, dtype=np.float64)
    k = len(orders_key)
    batch = r.shape[:-1]
    budget_k = jnp.broadcast_to(budget, (k,))

    def body(carry, r_t):
        consumed, halted, count = carry
        active, consumed, halted = _filter_step(orders_np, consumed, halted, q, noise_multiplier, r_t, budget_k)
        return (consumed, halted, count + active.astype(jnp.int32)), None

    init = (jnp.zeros(batch + (k,)), jnp.zeros(batch, bool), jnp.zeros(batch, jnp.int32))
    (consumed, _, count), _ = jax.lax.scan(body, init, jnp.moveaxis(r, -1, 0))
    eps = rdp_to_epsilon(jnp.broadcast_to(budget_k, batch + (k,)), orders_np, delta, method=method)
    bad = jnp.any(~((r >= 0) & (r <= 1)), axis=-1) | ~((q >= 0) & (q <= 1)) | ~(noise_multiplier > 0)
    return consumed, jnp.where(bad, jnp.nan, eps.epsilon), eps.order, count


@float64
def individual_filter_privacy(orders, q, noise_multiplier, r, budget, delta, *, method: str = "improved"):
    r"""Individual privacy accounting of DP-SGD with a Rényi filter (Feldman and Zrnic 2021).

    Replays :func:`individual_filter_step` over the steps: a point takes part in step t
    while its accumulated per-instance RDP plus :math:`ε_t` stays within the budget
    :math:`B(α)` at every order; the first step that would exceed it drops the point for
    the rest of training. Because every point's total is then at most B(α) for **every**
    trajectory, the Rényi filter theorem makes the whole adaptive run
    :math:`(α, B(α))`-RDP for each point at every order, and

    .. math:: ε_i = \min_α \mathrm{conv}_δ(B(α))

    is the same certified guarantee for every point. What differs between points is how
    long they took part (``halt_step``) and what they actually consumed (``rdp``).

    Args:
      orders: Rényi orders (static), length k.
      q: Poisson sampling rate in [0, 1].
      noise_multiplier: noise std over the clipping norm, > 0.
      r: clipped norm over C in [0, 1] at **every** step, shape ``points + (num_steps,)``,
        from the training that enforced the filter (checkpoints are not enough: the
        filter must see each step).
      budget: RDP budget per order, ≥ 0, ``inf`` for an order without a budget,
        broadcastable to ``(k,)``.
      delta: δ in (0, 1).
      method: RDP → DP conversion, ``"improved"`` (default) or ``"classic"``.

    Returns:
      :class:`PerInstancePrivacy` with ``epsilon`` (from the budget), ``order``,
      ``rdp`` = consumed individual RDP ``points + (k,)``, and ``halt_step`` (int32, steps
      taken part in; ``num_steps`` if never dropped). NaN ε under ``jit`` for invalid input.

    Assumptions (also in the result): the guarantee holds only if training applied this
    filter, i.e. excluded each point's gradient from the step that would exceed its
    budget and from every later step; ``r`` at step t is computed from the model before
    step t and the point alone (so the per-step bound is predictable); add/remove
    neighbours, Poisson sampling, sum rule. It is a per-point guarantee for the given data
    set, valid under fully adaptive composition; the halting times depend on the data.

    References:
      V. Feldman, T. Zrnic, "Individual Privacy Accounting via a Rényi Filter",
      NeurIPS 2021 (arXiv:2008.11193), the Rényi filter (§3) and individual privacy
      filtering for noisy gradient descent (§4).

    Examples:
      >>> import jaxdp, numpy as np
      >>> r = np.array([[1.0] * 6, [0.1] * 6])
      >>> res = jaxdp.accounting.individual_filter_privacy([2.0, 8.0], 0.5, 2.0, r, [0.3, np.inf], 1e-5)
      >>> res.halt_step.tolist()
      [4, 6]
    """
    orders_np = _validate.concrete_orders(orders)
    _check_common(q, noise_multiplier, r)
    _validate.check_in_range("budget", budget, 0.0, math.inf, allow_inf=True)
    _validate.check_delta(delta)
    _validate.check_static_choice("method", method, ("improved", "classic"))
    r = f64(r)
    if r.ndim < 1:
        raise ValueError(f"r must have a step axis; got shape {r.shape}.")
    consumed, eps, order, count = _filter_jit(
        tuple(orders_np.tolist()), method, f64(q), f64(noise_multiplier), r, f64(budget), f64(delta)
    )
    assumptions = (
        "Feldman and Zrnic 2021 individual Renyi filter: valid under fully adaptive composition ONLY IF training "
        "applied the filter (a point's gradient is excluded from the step that would exceed its budget at any "
        "order and from every later step).",
        "Per-step individual RDP: the per-instance sampled Gaussian bound (Thudi et al. 2024 Theorem 3.2; "
        "add/remove neighbours, Poisson sampling at rate q, sum rule, clipping at C, noise N(0, "
        "(noise_multiplier*C)^2)), with r computed from the model before the step and the point alone.",
        "r known at every step of the filtered run (no interpolation).",
        "epsilon is the guarantee of the budget, the same for every filtered point; rdp is what each point "
        "consumed and halt_step how many steps it took part in (both data-dependent, not to be released "
        "without accounting for them).",
    )
    return PerInstancePrivacy(eps, order, consumed, count, "feldman_zrnic2021_individual_renyi_filter", assumptions)
