r"""Hidden-state RDP of DP-SBCD (Chen & Liu 2024, Theorem 4.6), in a telescoped form that is finite.

DP-SBCD trains a bias-free ReLU network by block coordinate descent; every weight block
:math:`d` takes noisy proximal steps
:math:`θ_d ← \mathrm{Prox}_{η, r_d}(θ_d − η∇F(θ_d) + N(0, 2η\,o_t I))` on batches of
:math:`b` records in one fixed (permute-once, then cyclic) order, :math:`m = n/b` steps per
pass, :math:`K` passes, :math:`T = Km` steps, and only the final weights are released.

**LSI recursion** (Lemma 4.7, in step form): with :math:`a = L_F L_T`,

.. math::

    1/c_0 = 0, \qquad 1/c_{t+1} = a^2 / c_t + 2η L_T^2 o_t .

**Per batch position** :math:`j_0` (the differing record is in batch :math:`j_0` of every
pass; it is touched at steps :math:`t_k = km + j_0`):

.. math::

    \frac{ε(α, j_0)}{α} \le \sum_{k=0}^{K-1} \frac{η S_g^2}{4 b^2 o_{t_k}}
    \prod_{\substack{t_k < t < T \\ t \ne t_l\ (l > k)}}
    \Bigl(1 + \frac{2η\,o_t\,c_t}{L_F^2}\Bigr)^{-1/L_T^2}

(Corollary 4.5: a step touching the record adds :math:`ηS_g^2/(4b^2 o)`, any other step
multiplies the loss by the factor). This is eq. 11 of the paper with its epoch indices
made consistent: printed literally, eq. 11 multiplies over :math:`l = k..K` with
:math:`c_K^{n/b-1}`, which is :math:`+∞` at :math:`j_0 = 0` (the factor
:math:`c_0^1/c_0^0 = 0` raised to a negative power); the product above telescopes to eq. 11
over :math:`l = k+1..K-1` with :math:`c_T`.

**Mixing over the batch position** (Theorem 4.6, joint convexity; :math:`j_0` is uniform
on :math:`\{0..m-1\}` under the random permutation):

.. math::

    ε(α) \le \frac{1}{α-1}\log \frac1m \sum_{j_0} \exp\bigl((α-1)\,ε(α, j_0)\bigr).

**Layers.** Section 4.2 of the paper bounds the whole network by the *sum* over the weight
blocks of the per-block bounds. This summation is asserted without proof and we could not
prove it: each block's analysis treats the other blocks and the per-record lifted
variables as fixed, yet they differ in distribution between the two neighbouring runs, and
the blocks interleave. The accountant follows the paper but composes at a fixed
:math:`j_0` first (the record sits in the same batch for every block), then mixes, and
reports the larger of that and the paper's order (mix per block, then sum).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp

from .. import _validate
from .._numerics import f64, float64
from ._conversion import rdp_to_epsilon
from ._rdp import DEFAULT_ORDERS

__all__ = ["dpsbcd_rdp", "dpsbcd_rdp_per_batch", "dpsbcd_epsilon", "dpsbcd_composition_rdp"]

_ASSUMPTIONS = """
    Assumptions (Chen & Liu 2024; the first two are unproven there and here):

    * **Per-layer summation (unproven).** The network's loss is the sum of the per-block
      bounds (Section 4.2, one sentence, no proof). Each block's analysis (Corollary 4.5)
      treats the other blocks and the lifted per-record variables as identical in the two
      runs, which they are not.
    * **LSI (assumed).** Every iterate's distribution satisfies a log-Sobolev inequality
      with the constants of Lemma 4.7; the spectral-norm rescaling between steps (eq. 2)
      is left out of the analysis, as in the paper.
    * ``sensitivity`` :math:`S_g` bounds, for every parameter value, the difference of two
      single records' gradients of the block's sub-problem (so the batch-mean gradient moves
      by at most :math:`S_g/b`); ``contraction`` :math:`L_F` is a Lipschitz constant of
      :math:`θ ↦ θ − η∇F(θ)` and ``prox_lipschitz`` :math:`L_T` one of the proximal map
      (≤ 1 for the prox of any convex function; :math:`1/(1+η)` for weight decay). All must
      be data-independent; the paper states none of them, so they have no defaults.
    * Batches are one fixed permutation cut into :math:`m = n/b` batches, visited
      cyclically; the noise schedule is fixed in advance; only the final weights are
      released.
"""


def _check(noise_temperature, learning_rate, sensitivity, contraction, prox_lipschitz, num_records, batch_size,
           batch_index):
    for name, v in (("sensitivity", sensitivity), ("contraction", contraction),
                    ("prox_lipschitz", prox_lipschitz), ("learning_rate", learning_rate),
                    ("noise_temperature", noise_temperature)):
        if v is None:
            raise ValueError(f"{name} is required (the paper leaves it unstated; there is no default).")
    for name, v in (("num_records", num_records), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a Python int >= 1 (it fixes shapes); got {v!r}.")
    if num_records % batch_size:
        raise ValueError(
            f"num_records must be a multiple of batch_size (permute-once cyclic batches of equal size, as "
            f"Theorem 4.6 requires); got num_records={num_records}, batch_size={batch_size}."
        )
    m = num_records // batch_size
    if batch_index is not None and (isinstance(batch_index, bool) or not isinstance(batch_index, (int, np.integer))
                                    or not 0 <= batch_index < m):
        raise ValueError(f"batch_index must be a Python int in [0, {m - 1}] (0-based batch position, "
                         f"num_records/batch_size = {m} batches); got {batch_index!r}.")
    shape = np.shape(noise_temperature)
    if len(shape) not in (1, 2) or shape[0] < 1 or (len(shape) == 2 and shape[1] != m):
        raise ValueError(
            f"noise_temperature must have shape (passes,) (one value per pass) or (passes, {m}) (one per step "
            f"of each pass); got shape {shape}."
        )
    if _validate.is_concrete(noise_temperature):
        o = np.asarray(noise_temperature, dtype=np.float64)
        bad = ~(np.isfinite(o) & (o > 0))
        if np.any(bad):
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"noise_temperature must be > 0 and finite at every step (a schedule that goes negative or to "
                f"zero has no privacy); got {o[idx]:g} at index {idx} (pass, step)."
            )
    _validate.check_in_range("learning_rate", learning_rate, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("sensitivity", sensitivity, 0.0, math.inf)
    _validate.check_in_range("contraction", contraction, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("prox_lipschitz", prox_lipschitz, 0.0, math.inf, lo_open=True)
    for name, v in (("sensitivity", sensitivity), ("contraction", contraction), ("prox_lipschitz", prox_lipschitz)):
        if np.ndim(v) > 1:
            raise ValueError(f"{name} must be a scalar or a 1-D array with one value per layer; got shape "
                             f"{np.shape(v)}.")


def _exclusive_cumsum(x, axis: int, reverse: bool = False):
    """Sum of the entries strictly before (or after, ``reverse``) each one along ``axis``."""
    if reverse:
        return jnp.flip(_exclusive_cumsum(jnp.flip(x, axis), axis), axis)
    c = jnp.cumsum(x, axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (1, 0)
    return jnp.pad(jax.lax.slice_in_dim(c, 0, x.shape[axis] - 1, axis=axis), pad)


def _per_position(noise_temperature, learning_rate, sensitivity, contraction, prox_lipschitz, num_records,
                  batch_size):
    """``log(ε(α, j0)/α)`` for every batch position and layer: shape ``(m, L)``, plus validity."""
    m = num_records // batch_size
    o = f64(noise_temperature)
    passes = o.shape[0]
    o = jnp.broadcast_to(o[:, None] if o.ndim == 1 else o, (passes, m))
    eta = f64(learning_rate)
    s, lf, lt = jnp.broadcast_arrays(*(jnp.atleast_1d(f64(v)) for v in (sensitivity, contraction, prox_lipschitz)))
    valid = (jnp.all(o > 0) & jnp.all(jnp.isfinite(o)) & (eta > 0) & jnp.isfinite(eta) & jnp.all(s >= 0)
             & jnp.all(jnp.isfinite(s)) & jnp.all(lf > 0) & jnp.all(lt > 0) & jnp.all(jnp.isfinite(lf * lt)))
    # Double where: invalid inputs are replaced by harmless values so that NaN stays out of
    # the gradients of the valid branch; the output is NaN where invalid.
    o = jnp.where(valid, o, 1.0)
    eta = jnp.where(valid, eta, 1.0)
    s, lf, lt = (jnp.where(valid, v, 1.0) for v in (s, lf, lt))

    flat = o.reshape(-1)  # step t = k m + j
    a2 = (lf * lt) ** 2
    add = 2.0 * eta * lt**2  # (L,)

    def body(inv_c, o_t):
        return a2 * inv_c + add * o_t, inv_c

    _, inv_c = jax.lax.scan(body, jnp.zeros_like(lf), flat)  # inv_c[t] = 1/c_t, shape (T, L)
    # log of the per-step decay factor (1 + 2η o_t c_t / L_F²)^(-1/L_T²) = -(1/L_T²) log1p(2η o_t/(L_F² /c_t)).
    # t = 0 has 1/c_0 = 0 (a point-mass start, factor 0); it is never multiplied in (only
    # steps after a touching step are), so it is set to 0 here rather than -inf.
    first = (jnp.arange(flat.shape[0]) == 0)[:, None]
    inv_c_safe = jnp.where(first, 1.0, inv_c)
    g = jnp.where(first, 0.0, -jnp.log1p(2.0 * eta * flat[:, None] / (lf**2 * inv_c_safe)) / lt**2)
    g = g.reshape(passes, m, -1)  # (K, m, L), every entry ≤ 0
    # All sums below add non-positive terms (no cancellation): within a pass, the steps after
    # position j (suffix) and before it (prefix); over later passes, every step but j.
    suffix = _exclusive_cumsum(g, 1, reverse=True)  # Σ_{j' > j}
    prefix = _exclusive_cumsum(g, 1)  # Σ_{j' < j}
    others = prefix + suffix  # Σ_{j' ≠ j} within the pass
    later = _exclusive_cumsum(others, 0, reverse=True)  # Σ_{l > k} Σ_{j' ≠ j}
    log_decay = suffix + later  # (K, m, L)
    # log of η S² / (4 b² o); S = 0 gives -inf (no loss), kept finite-safe for gradients.
    s_pos = s > 0
    log_s2 = jnp.where(s_pos, 2.0 * jnp.log(jnp.where(s_pos, s, 1.0)), -jnp.inf)
    log_cost = jnp.log(eta) + log_s2 - math.log(4.0 * batch_size**2) - jnp.log(o)[..., None]
    log_eps_over_alpha = logsumexp(log_cost + log_decay, axis=0)  # (m, L)
    return log_eps_over_alpha, valid


def _per_batch_curves(orders, log_a):
    """RDP at ``orders`` of every batch position, layers summed: ``(m, k)`` from ``(m, L)``.

    ``ε(α, j0) = α · Σ_layers ε(α, j0)/α`` (Corollary 4.5 is linear in α); the layers' sum
    is shared by all orders.
    """
    return jnp.sum(jnp.exp(log_a), axis=-1)[:, None] * f64(orders)[None, :]


def _curve(orders, log_a, batch_index, m):
    """RDP at ``orders`` from ``log(ε(α, j0)/α)`` of shape ``(m, L)``."""
    if batch_index is not None:
        return _per_batch_curves(orders, log_a[batch_index:batch_index + 1])[0]
    alpha = f64(orders)[:, None]  # (k, 1)
    a = jnp.exp(log_a)  # (m, L)
    log_m = math.log(m)

    def mix(per_position):  # (k, m) of ε(α, j0) -> (k,)
        return (logsumexp((alpha - 1.0) * per_position, axis=-1) - log_m) / (alpha[:, 0] - 1.0)

    joint = mix(alpha * jnp.sum(a, axis=-1)[None, :])  # compose the layers at fixed j0, then mix
    per_layer = sum(mix(alpha * a[None, :, d]) for d in range(a.shape[-1]))  # the paper's order
    return jnp.maximum(joint, per_layer)


@functools.partial(jax.jit, static_argnames=("num_records", "batch_size", "batch_index", "per_batch"))
def _rdp_core(orders, noise_temperature, learning_rate, sensitivity, contraction, prox_lipschitz, *,
              num_records, batch_size, batch_index, per_batch):
    """The curve(s), NaN where invalid: one compiled program per shape (an eager call would
    dispatch and compile each of the few dozen operations separately)."""
    log_a, valid = _per_position(noise_temperature, learning_rate, sensitivity, contraction, prox_lipschitz,
                                 num_records, batch_size)
    if per_batch:
        curve = _per_batch_curves(orders, log_a)
    else:
        curve = _curve(orders, log_a, batch_index, num_records // batch_size)
    return jnp.where(valid, curve, jnp.nan)


@float64
def dpsbcd_rdp(orders, noise_temperature, *, learning_rate, sensitivity, contraction, prox_lipschitz,
               num_records: int, batch_size: int, batch_index: int | None = None) -> jax.Array:
    r"""RDP curve of DP-SBCD's released weights (hidden state), summed over the layers.

    See the module docstring for the formulas. With ``batch_index=j0`` the bound for a
    record in batch :math:`j_0` (no mixing); otherwise the mixture over the uniformly random
    batch position (Theorem 4.6).

    Args:
      orders: Rényi orders > 1, a concrete 1-D sequence.
      noise_temperature: :math:`o > 0`, the noise of a weight step is
        :math:`N(0, 2η\,o\,I)`; shape ``(passes,)`` (constant within a pass, as all the
        paper's schedules) or ``(passes, num_records // batch_size)`` (one per step).
      learning_rate: η > 0.
      sensitivity: :math:`S_g ≥ 0`, one per layer (shape ``(L,)``) or one for all.
      contraction: :math:`L_F > 0`, Lipschitz constant of the gradient map of each block
        (Lemma 4.1: :math:`\max(|1-ηω|, |1-ηβ|)`), per layer or one for all.
      prox_lipschitz: :math:`L_T > 0`, Lipschitz constant of each block's proximal map
        (1 for no regulariser, :math:`1/(1+η)` for weight decay), per layer or one.
      num_records: n, a multiple of ``batch_size`` (static).
      batch_size: b (static).
      batch_index: ``None`` (mix over positions) or a 0-based batch position in
        ``[0, n/b - 1]`` (static).

    Returns:
      float64 array of shape ``(len(orders),)``; NaN under ``jit`` for invalid values.

    Raises:
      ValueError: naming the parameter, for a non-positive or non-finite
        ``noise_temperature`` anywhere in the schedule, ``num_records`` not a multiple of
        ``batch_size``, ``batch_index`` outside ``[0, n/b - 1]``, a missing (``None``) or
        out-of-range constant.
    {assumptions}
    References:
      C. Chen, D. Liu, "Differentially Private Neural Network Training under Hidden State
      Assumption", arXiv:2407.08233v1 (2024): Corollary 4.5, Lemma 4.7, Theorem 4.6
      (eq. 11), Section 4.2. J. Ye, R. Shokri, "Differentially Private Learning Needs
      Hidden State (Or Much Faster Convergence)", NeurIPS 2022.

    Examples:
      >>> import jaxdp
      >>> # One pass, one batch (b = n): a single noisy step, ε(α) = α η S²/(4 b² o).
      >>> r = jaxdp.accounting.dpsbcd_rdp([2.0], [0.01], learning_rate=0.01, sensitivity=2.0,
      ...     contraction=1.0, prox_lipschitz=1.0, num_records=10, batch_size=10)
      >>> round(float(r[0]), 12), 2 * 0.01 * 4 / (4 * 100 * 0.01)
      (0.02, 0.02)
    """
    _check(noise_temperature, learning_rate, sensitivity, contraction, prox_lipschitz, num_records, batch_size,
           batch_index)
    return _rdp_core(f64(_validate.concrete_orders(orders)), *(f64(v) for v in (
        noise_temperature, learning_rate, sensitivity, contraction, prox_lipschitz)), num_records=num_records,
        batch_size=batch_size, batch_index=batch_index, per_batch=False)


@float64
def dpsbcd_rdp_per_batch(orders, noise_temperature, *, learning_rate, sensitivity, contraction, prox_lipschitz,
                         num_records: int, batch_size: int) -> jax.Array:
    r"""RDP curves of DP-SBCD's released weights for a record in each batch position, in one call.

    Row :math:`j_0` is :func:`dpsbcd_rdp` with ``batch_index=j0`` (no mixing), summed over the
    layers:

    .. math::

        ε(α, j_0) = α \sum_{\text{layers}} \sum_{k=0}^{K-1} \frac{η S_g^2}{4 b^2 o_{t_k}}
        \prod_{\substack{t_k < t < T \\ t \ne t_l\ (l > k)}}
        \Bigl(1 + \frac{2η\,o_t\,c_t}{L_F^2}\Bigr)^{-1/L_T^2}, \qquad t_k = km + j_0 .

    The LSI constants and the per-step decay factors are computed once and shared by all
    :math:`m = n/b` positions (prefix and suffix sums of the log factors), so the cost is
    :math:`O(Km)` for the whole vector, where :math:`m` calls of :func:`dpsbcd_rdp` cost
    :math:`O(Km^2)` and a compiled program that grows with :math:`m`. Use it when the batch
    order is public (a ledger reports the worst position, not the mixture).

    Args:
      orders: Rényi orders > 1, a concrete 1-D sequence.
      noise_temperature, learning_rate, sensitivity, contraction, prox_lipschitz,
        num_records, batch_size: as in :func:`dpsbcd_rdp` (required; no defaults).

    Returns:
      float64 array of shape ``(num_records // batch_size, len(orders))``: row ``j0`` is the
      RDP curve of a record in batch ``j0`` (0-based); NaN under ``jit`` for invalid values.

    Raises:
      ValueError: as :func:`dpsbcd_rdp`, naming the parameter.
    {assumptions}
    References:
      C. Chen, D. Liu, "Differentially Private Neural Network Training under Hidden State
      Assumption", arXiv:2407.08233v1 (2024): Corollary 4.5, Lemma 4.7, eq. 11 (per batch
      position, before the mixture of Theorem 4.6), Section 4.2.

    Examples:
      >>> import jaxdp
      >>> # One pass of two batches, L_F = L_T = 1: the record in the last batch is touched by
      >>> # the last step (α η S²/(4 b² o)); the first batch's step is followed by one more.
      >>> r = jaxdp.accounting.dpsbcd_rdp_per_batch([2.0], [0.01], learning_rate=0.01, sensitivity=2.0,
      ...     contraction=1.0, prox_lipschitz=1.0, num_records=20, batch_size=10)
      >>> r.shape, round(float(r[1, 0]), 12), bool(r[0, 0] < r[1, 0])
      ((2, 1), 0.02, True)
    """
    _check(noise_temperature, learning_rate, sensitivity, contraction, prox_lipschitz, num_records, batch_size,
           None)
    return _rdp_core(f64(_validate.concrete_orders(orders)), *(f64(v) for v in (
        noise_temperature, learning_rate, sensitivity, contraction, prox_lipschitz)), num_records=num_records,
        batch_size=batch_size, batch_index=None, per_batch=True)


@float64
def dpsbcd_epsilon(delta, noise_temperature, *, learning_rate, sensitivity, contraction, prox_lipschitz,
                   num_records: int, batch_size: int, orders=DEFAULT_ORDERS) -> jax.Array:
    r"""(ε, δ) of DP-SBCD's released weights: :func:`dpsbcd_rdp` converted by :func:`rdp_to_epsilon`.

    :math:`ε = \min_α \bigl[ε(α) + \log(1-1/α) - \log(δα)/(α-1)\bigr]` over ``orders``
    (Canonne, Kamath & Steinke 2020, Proposition 12). The paper reports only RDP at α = 100.

    Args:
      delta: δ in (0, 1).
      noise_temperature, learning_rate, sensitivity, contraction, prox_lipschitz,
        num_records, batch_size: as in :func:`dpsbcd_rdp` (required; no defaults).
      orders: Rényi orders (static), default dp_accounting's grid.

    Returns:
      float64 ε ≥ 0 (NaN under ``jit`` for invalid values).
    {assumptions}
    References:
      C. Chen, D. Liu, arXiv:2407.08233v1 (2024), Theorem 4.6 and Section 4.2;
      C. Canonne, G. Kamath, T. Steinke, NeurIPS 2020, Proposition 12.

    Examples:
      >>> import jaxdp
      >>> e = jaxdp.accounting.dpsbcd_epsilon(1e-5, [0.01] * 10, learning_rate=0.01,
      ...     sensitivity=2.0, contraction=0.99, prox_lipschitz=1.0, num_records=4800, batch_size=960)
      >>> 0.0 < float(e) < 1.0
      True
    """
    _validate.check_delta(delta)
    curve = dpsbcd_rdp(orders, noise_temperature, learning_rate=learning_rate, sensitivity=sensitivity,
                       contraction=contraction, prox_lipschitz=prox_lipschitz, num_records=num_records,
                       batch_size=batch_size)
    return rdp_to_epsilon(curve, _validate.concrete_orders(orders), delta).epsilon


# One statement of the assumptions in both docstrings (users must see it where they call).
dpsbcd_rdp.__doc__ = dpsbcd_rdp.__doc__.replace("    {assumptions}\n", _ASSUMPTIONS)
dpsbcd_epsilon.__doc__ = dpsbcd_epsilon.__doc__.replace("    {assumptions}\n", _ASSUMPTIONS)
dpsbcd_rdp_per_batch.__doc__ = dpsbcd_rdp_per_batch.__doc__.replace("    {assumptions}\n", _ASSUMPTIONS)


@float64
def dpsbcd_composition_rdp(orders, noise_temperature, *, learning_rate, sensitivity, num_records: int,
                           batch_size: int, num_steps=None) -> jax.Array:
    r"""RDP of DP-SBCD per batch position when every iterate is released: the composed Gaussian steps.

    A step that touches the record moves each layer's block by at most :math:`ηS_g/b`
    (the batch-mean gradient moves by :math:`S_g/b`) under noise :math:`N(0, 2η\,o_t I)`: a
    Gaussian mechanism of RDP :math:`α\,ηS_g^2/(4b^2o_t)`. The record in batch :math:`j_0`
    is touched at steps :math:`t ≡ j_0 \pmod m`; the steps and the layers compose
    adaptively:

    .. math::

        ε(α, j_0) = α \sum_{\text{layers}} \sum_{t < T,\ t ≡ j_0 \ (m)} \frac{η S_g^2}{4 b^2 o_t}.

    Unlike :func:`dpsbcd_rdp` it needs neither the LSI assumption nor the per-layer
    summation (both unproven); it is the guarantee of every iterate, hence also of the last.

    Args:
      orders: Rényi orders > 1, a concrete 1-D sequence.
      noise_temperature: o > 0, shape ``(passes,)`` or ``(passes, num_records // batch_size)``.
      learning_rate: η > 0.
      sensitivity: :math:`S_g ≥ 0` per layer, shape ``(layers,)`` (a scalar: one layer).
      num_records, batch_size: n, a multiple of b (Python ints).
      num_steps: steps done, T in ``0..passes·m`` (default: all); an integer, traceable.

    Returns:
      float64 array ``(num_records // batch_size, len(orders))``: row ``j0`` is the RDP curve
      of a record in batch ``j0`` (0-based).

    References:
      I. Mironov, "Rényi Differential Privacy", CSF 2017, Propositions 1 and 7; C. Chen,
      D. Liu, arXiv:2407.08233v1 (2024), the update of Algorithm 1.

    Examples:
      >>> import jaxdp
      >>> r = jaxdp.accounting.dpsbcd_composition_rdp([2.0], [0.01, 0.01], learning_rate=0.01, sensitivity=2.0,
      ...     num_records=20, batch_size=10, num_steps=3)
      >>> [round(float(v), 12) for v in r[:, 0]]  # batch 0 touched twice, batch 1 once: 2 · 0.02, 0.02
      [0.04, 0.02]
    """
    for name, v in (("num_records", num_records), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a Python int >= 1 (it fixes shapes); got {v!r}.")
    if num_records % batch_size:
        raise ValueError(f"num_records must be a multiple of batch_size; got num_records={num_records}, "
                         f"batch_size={batch_size}.")
    m = num_records // batch_size
    shape = np.shape(noise_temperature)
    if len(shape) not in (1, 2) or shape[0] < 1 or (len(shape) == 2 and shape[1] != m):
        raise ValueError(f"noise_temperature must have shape (passes,) or (passes, {m}); got shape {shape}.")
    if _validate.is_concrete(noise_temperature) and not np.all(
            np.isfinite(np.asarray(noise_temperature, np.float64)) & (np.asarray(noise_temperature, np.float64) > 0)):
        raise ValueError("noise_temperature must be > 0 and finite at every step (a schedule that goes negative or "
                         "to zero has no privacy).")
    _validate.check_in_range("learning_rate", learning_rate, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("sensitivity", sensitivity, 0.0, math.inf)
    total = shape[0] * m
    if num_steps is None:
        num_steps = total
    elif _validate.is_concrete(num_steps) and not (
            float(num_steps) == int(float(num_steps)) and 0 <= int(float(num_steps)) <= total):
        raise ValueError(f"num_steps must be an integer in [0, {total}] (passes · m); got {num_steps!r}.")
    temps = f64(noise_temperature)
    if temps.ndim == 1:
        temps = jnp.repeat(temps[:, None], m, axis=1)
    used = (jnp.arange(total) < f64(num_steps)).reshape(shape[0], m)
    # Each use is, per layer, a Gaussian mechanism with RDP α ηS²/(4b²o) (noise std sqrt(2ηo) on a
    # step moved by ηS/b), summed over layers and uses.
    sens = jnp.atleast_1d(f64(sensitivity))
    coef = jnp.sum(jnp.where(used, f64(learning_rate) * jnp.sum(sens**2) / (4.0 * batch_size**2 * temps), 0.0),
                   axis=0)
    coef = jnp.where(jnp.all(temps > 0) & jnp.all(jnp.isfinite(temps)), coef, jnp.nan)  # under jit: NaN
    return coef[:, None] * f64(_validate.concrete_orders(orders))[None, :]
