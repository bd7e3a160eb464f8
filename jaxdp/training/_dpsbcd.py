r"""DP-SBCD: private stochastic block coordinate descent on a Lipschitz ReLU network (Chen & Liu 2024).

The network :math:`f(x) = \mathrm{relu}(\cdots\mathrm{relu}(x W_0)\cdots) W_D` (row vectors,
bias-free :class:`~jaxdp.models.LipschitzMLP`) is trained on the lifted ("three-splitting")
objective of the paper's eq. 4, with γ = ``penalty``,

.. math::

    F = \frac1b\sum_{i∈B}\Bigl[\tfrac12\lVert x_D^i W_D - y^i\rVert^2
        + \tfrac{γ}{2}\sum_{d<D}\bigl(\lVert x_{d+1}^i - \mathrm{relu}(U_d^i)\rVert^2
        + \lVert U_d^i - x_d^i W_d\rVert^2\bigr)\Bigr],

where the activations :math:`x_d` (d = 1..D) and pre-activations :math:`U_d` (d = 0..D-1)
are free variables, one row per training record (:math:`x_0` is the data). For every batch,
layer by layer (d = 0..D, the order listed in the paper's Algorithm 1):

1. :math:`x_d` (d ≥ 1) ← its closed-form minimiser (eq. 5; for d = D the prox of the
   squared loss): :math:`x_d = (\mathrm{relu}(U_{d-1}) + U_d W_d^\top)(I + W_d W_d^\top)^{-1}`
   and :math:`x_D = (γ\,\mathrm{relu}(U_{D-1}) + y W_D^\top)(γI + W_D W_D^\top)^{-1}`;
2. :math:`U_d` (d < D) ← the exact elementwise minimiser of
   :math:`(x_{d+1} - \mathrm{relu}(u))^2 + (u - x_d W_d)^2` (eq. 6);
3. :math:`W_d ← W_d \min(ρ/\tilde λ, 1)` (eq. 2, power iteration);
4. :math:`W_d ← \mathrm{Prox}_{η, r}\bigl(W_d - η\bar g + N(0, 2η\,o_t I)\bigr)` (eq. 8), with
   :math:`\bar g` the batch mean of per-record gradients of :math:`F` in :math:`W_d`,
   each clipped to norm ``clip_norm`` C (so the sensitivity is :math:`S_g = 2C` whatever
   the data: the paper gives no way to bound it), and
   :math:`r = \frac{λ}{2}\lVert W\rVert_F^2`, :math:`\mathrm{Prox}_{η,r}(W) = W/(1 + ηλ)`
   (λ = ``weight_decay``; the paper prints :math:`ηW/(1+η)` for λ = 1, a typo).

Batches: the records are permuted once with the public ``order_seed`` and cut into
:math:`m = \lfloor n/b\rfloor` batches visited cyclically every pass (Theorem 4.6 needs this);
the :math:`n \bmod b` records left over are never used. The noise key is secret (OS
entropy unless ``noise_seed`` is given). Only the final weights are released: the lifted
variables (derived from the raw records) and the intermediate weights stay inside the
jitted loop and are discarded.
"""

from __future__ import annotations

import functools
import math
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import accounting
from ..models import LipschitzMLP
from ._loop import _secret_key, _unpack_data, accuracy

__all__ = ["DPSBCDResult", "train_dpsbcd"]


class DPSBCDResult(NamedTuple):
    """What :func:`train_dpsbcd` returns.

    Attributes:
      model: the trained :class:`~jaxdp.models.LipschitzMLP` (final weights only).
      epsilon: ε at ``delta`` of :func:`~jaxdp.accounting.dpsbcd_epsilon` (as claimed by
        Chen & Liu 2024; see its assumptions).
      delta: δ.
      event: the :class:`~jaxdp.accounting.DPSBCD` event of the run.
      test_accuracy: accuracy on the test split (None without one).
      seconds: wall-clock training time (compilation included).
    """

    model: LipschitzMLP
    epsilon: float
    delta: float
    event: accounting.DPSBCD
    test_accuracy: float | None
    seconds: float


# ----------------------------------------------------------------------------------------
# The block updates (pure functions of arrays; rows are records).
# ----------------------------------------------------------------------------------------


def weight_decay_prox(params, learning_rate, weight_decay):
    r"""Prox of :math:`r = \frac{λ}{2}\lVert θ\rVert^2`: :math:`θ/(1 + ηλ)`, Lipschitz :math:`1/(1+ηλ)`."""
    return params / (1.0 + learning_rate * weight_decay)


def preactivation_update(a, w):
    """Exact elementwise minimiser of ``(a - relu(u))² + (u - w)²`` over u (eq. 6).

    Candidates: the best u ≤ 0 is ``min(w, 0)`` (cost ``a² + max(w, 0)²``), the best u ≥ 0 is
    ``max((a + w)/2, 0)``; the smaller cost wins, ties to u ≤ 0 (the first case of eq. 6).
    """
    u1 = jnp.minimum(w, 0.0)
    u2 = jnp.maximum(0.5 * (a + w), 0.0)

    def cost(u):
        return (a - jax.nn.relu(u)) ** 2 + (u - w) ** 2

    return jnp.where(cost(u1) <= cost(u2), u1, u2)


def activation_update(relu_prev, u_next, w, *, y=None, penalty=1.0):
    """Closed-form minimiser of the x-block (eq. 5); with ``y`` the last block's squared-loss prox.

    Hidden layer: ``argmin_x ‖x - relu_prev‖² + ‖u_next - x W‖²``;
    last layer: ``argmin_x ½‖x W - y‖² + (γ/2)‖x - relu_prev‖²``.
    """
    k = w.shape[0]
    gram = w @ w.T
    if y is None:
        lhs = jnp.eye(k, dtype=w.dtype) + gram
        rhs = relu_prev + u_next @ w.T
    else:
        lhs = penalty * jnp.eye(k, dtype=w.dtype) + gram
        rhs = penalty * relu_prev + y @ w.T
    # lhs is symmetric positive definite (≥ I or ≥ γI): solve xᵀ = lhs⁻¹ rhsᵀ.
    return jax.scipy.linalg.solve(lhs, rhs.T, assume_a="pos").T


def _clipped_mean_grad(x, r, clip_norm, sign):
    """Mean over rows of the clipped per-record gradients ``sign · x_iᵀ r_i`` (rank one each)."""
    norms = jnp.linalg.norm(x, axis=1) * jnp.linalg.norm(r, axis=1)
    scale = jnp.minimum(1.0, clip_norm / jnp.maximum(norms, jnp.finfo(x.dtype).tiny))
    return sign * (x.T @ (r * scale[:, None])) / x.shape[0]


def _power_rescale(w, u, rho, iterations):
    """Eq. 2 rescale W·min(ρ/λ̃, 1), λ̃ from the layers' own power iteration (carried u)."""
    from ..models._lipschitz import _power_iteration

    tiny = jnp.finfo(w.dtype).tiny
    lam, u = _power_iteration(w, u, int(iterations))
    return w * jnp.minimum(rho / jnp.maximum(lam, tiny), 1.0).astype(w.dtype), u


@functools.lru_cache(maxsize=16)
def _make_run(num_layers, batch_size, rhos, power_iterations):
    D = num_layers - 1

    @jax.jit
    def run(kernels, vectors, xs, us, x0, y, batches, temps, key, learning_rate, penalty, clip_norm,
            weight_decay):
        # xs[d] for d = 1..D (index d-1), us[d] for d = 0..D-1; batches (T, b) record indices.
        def step(carry, inp):
            kernels, vectors, xs, us, key = carry
            idx, temp = inp
            kernels, vectors, xs, us = list(kernels), list(vectors), list(xs), list(us)
            key, sub = jax.random.split(key)
            noise_keys = jax.random.split(sub, num_layers)
            xb = [x0[idx]] + [x[idx] for x in xs]
            ub = [u[idx] for u in us]
            yb = y[idx]
            for d in range(num_layers):
                w = kernels[d]
                if d >= 1:  # x-block (x_0 is the data)
                    relu_prev = jax.nn.relu(ub[d - 1])
                    if d < D:
                        xb[d] = activation_update(relu_prev, ub[d], w)
                    else:
                        xb[d] = activation_update(relu_prev, None, w, y=yb, penalty=penalty)
                if d < D:  # U-block
                    ub[d] = preactivation_update(xb[d + 1], xb[d] @ w)
                w, vectors[d] = _power_rescale(w, vectors[d], rhos[d], power_iterations)  # eq. 2
                if d < D:
                    grad = _clipped_mean_grad(xb[d], ub[d] - xb[d] @ w, clip_norm, -penalty)
                else:
                    grad = _clipped_mean_grad(xb[d], xb[d] @ w - yb, clip_norm, 1.0)
                noise = jax.random.normal(noise_keys[d], w.shape, w.dtype)
                w = w - learning_rate * grad + jnp.sqrt(2.0 * learning_rate * temp).astype(w.dtype) * noise
                kernels[d] = weight_decay_prox(w, learning_rate, weight_decay)
            xs = [x.at[idx].set(v) for x, v in zip(xs, xb[1:])]
            us = [u.at[idx].set(v) for u, v in zip(us, ub)]
            return (tuple(kernels), tuple(vectors), tuple(xs), tuple(us), key), None

        carry = (tuple(kernels), tuple(vectors), tuple(xs), tuple(us), key)
        (kernels, vectors, _, _, _), _ = jax.lax.scan(step, carry, (batches, temps))
        # The lifted state is dropped here: only the weights (and the public power vectors) leave.
        return kernels, vectors

    return run


def _int(name, v, lo=1):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ValueError(f"{name} must be a Python int >= {lo}; got {v!r}.")
    return int(v)


def train_dpsbcd(model: LipschitzMLP, data, *, learning_rate: float, noise_temperature, clip_norm: float,
                 contraction, batch_size: int, delta: float, weight_decay: float = 0.0, penalty: float = 1.0,
                 order_seed: int = 0, noise_seed: int | None = None) -> DPSBCDResult:
    r"""Train a :class:`~jaxdp.models.LipschitzMLP` by DP-SBCD and account for the released weights.

    See the module docstring for the updates. The guarantee is
    :func:`~jaxdp.accounting.dpsbcd_epsilon` with :math:`S_g = 2C` (replace-one; the clipped
    per-record gradients differ by at most 2C), :math:`L_T = 1/(1 + ηλ)` (exact for the
    weight-decay prox), ``contraction`` :math:`L_F` **as you state it** (Lemma 4.1:
    :math:`L_F = \max(|1-ηω|, |1-ηβ|)` for a convex β-smooth block, so 1 when
    :math:`η ≤ 2/β`; clipping and the unbounded lifted activations are outside that lemma),
    ``num_records`` :math:`m b` and the same schedule for every layer, summed over the
    layers **as Chen & Liu claim without proof** (see
    :func:`~jaxdp.accounting.dpsbcd_rdp`).

    This is a standalone driver, not ``train(algorithm=...)``: the update is not an optax
    transformation of a model-loss gradient; it needs per-record lifted state for all n
    records, closed-form block updates and the network's layer structure.

    Args:
      model: a :class:`~jaxdp.models.LipschitzMLP` (its kernels are the start; its ρ per layer
        and power iterations are used). Start weights must not depend on the data.
      data: a :class:`jaxdp.data.Dataset` or ``(x, y)`` with integer labels in [0, K).
      learning_rate: η > 0.
      noise_temperature: o > 0 per pass ``(passes,)`` or per step ``(passes, n // b)``; the
        weight noise is :math:`N(0, 2η\,o\,I)`. Fixed in advance (never data-dependent).
      clip_norm: C > 0, per-record gradient clip of every block.
      contraction: :math:`L_F > 0` of every block's gradient map (required; one value or one
        per layer).
      batch_size: b ≥ 1, at most n.
      delta: δ in (0, 1) of the reported ε.
      weight_decay: λ ≥ 0 of the proximal term (0: plain step, :math:`L_T = 1`).
      penalty: γ > 0 of the lifted objective (the paper uses 1).
      order_seed: public seed of the one permutation.
      noise_seed: a fixed noise key (the run is then NOT private); default OS entropy.

    Returns:
      :class:`DPSBCDResult`.

    References:
      C. Chen, D. Liu, arXiv:2407.08233v1 (2024), Algorithms 1-2, eqs. 2, 4-8, Theorem 4.6;
      J. Zeng et al., "Global convergence of block coordinate descent in deep learning",
      ICML 2019 (the lifted objective and the ReLU update).

    Examples:
      >>> import numpy as np
      >>> from flax import nnx
      >>> from jaxdp.models import LipschitzMLP
      >>> rng = np.random.default_rng(0)
      >>> x = rng.normal(size=(40, 3)).astype(np.float32); y = (x[:, 0] > 0).astype(int)
      >>> model = LipschitzMLP((3, 8, 2), rngs=nnx.Rngs(0), max_spectral_norm=2.0)
      >>> res = train_dpsbcd(model, (x, y), learning_rate=0.05, noise_temperature=[1e-3] * 2,
      ...                    clip_norm=1.0, contraction=1.0, batch_size=10, delta=1e-5, noise_seed=0)
      >>> bool(np.isfinite(res.epsilon))
      True
    """
    if not isinstance(model, LipschitzMLP):
        raise ValueError(f"model must be a jaxdp.models.LipschitzMLP (bias-free ReLU network); "
                         f"got {type(model).__name__}.")
    x, y, x_test, y_test, _, _ = _unpack_data(data)
    x = np.asarray(x, dtype=np.float32)
    y = np.asarray(y)
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise ValueError(f"data must be x of shape (n, features) and integer labels y of shape (n,); got "
                         f"{x.shape} and {y.shape}.")
    n = x.shape[0]
    batch_size = _int("batch_size", batch_size)
    if batch_size > n:
        raise ValueError(f"batch_size must be <= the number of records {n}; got {batch_size}.")
    for name, v, lo_open in (("learning_rate", learning_rate, True), ("clip_norm", clip_norm, True),
                             ("penalty", penalty, True), ("weight_decay", weight_decay, False)):
        fv = float(v)
        if not math.isfinite(fv) or fv < 0 or (lo_open and fv == 0):
            raise ValueError(f"{name} must be finite and {'> 0' if lo_open else '>= 0'}; got {v!r}.")
    layers = list(model.layers)
    num_layers = len(layers)
    k_out = layers[-1].kernel[...].shape[1]
    if y.size and (y.min() < 0 or y.max() >= k_out or not np.issubdtype(y.dtype, np.integer)):
        raise ValueError(f"y must hold integer labels in [0, {k_out}); got range [{y.min()}, {y.max()}].")
    m = n // batch_size
    temps = np.asarray(noise_temperature, dtype=np.float64)
    if temps.ndim == 1:
        temps = np.repeat(temps[:, None], m, axis=1)
    # The accountant validates the schedule (shape, > 0) and the constants, naming them.
    event = accounting.DPSBCD(np.asarray(noise_temperature, dtype=np.float64), float(learning_rate),
                              np.full(num_layers, 2.0 * float(clip_norm)),
                              np.broadcast_to(np.asarray(contraction, dtype=np.float64), (num_layers,)).copy(),
                              np.full(num_layers, 1.0 / (1.0 + float(learning_rate) * float(weight_decay))),
                              num_records=m * batch_size, batch_size=batch_size)
    eps = float(accounting.epsilon(event, delta))
    passes = temps.shape[0]

    start = time.perf_counter()
    perm = np.random.default_rng(order_seed).permutation(n)[: m * batch_size].reshape(m, batch_size)
    batches = np.tile(perm, (passes, 1))
    onehot = np.eye(k_out, dtype=np.float32)[y]
    kernels = tuple(layer.kernel[...] for layer in layers)
    vectors = tuple(layer.power_vector[...] for layer in layers)
    # Lifted variables start at a forward pass of the start weights (the paper leaves it open).
    xs, us, h = [], [], jnp.asarray(x)
    for d, w in enumerate(kernels):
        u = h @ w
        if d < num_layers - 1:
            us.append(u)
            h = jax.nn.relu(u)
            xs.append(h)
    run = _make_run(num_layers, batch_size, tuple(layer.max_spectral_norm for layer in layers),
                    layers[0].power_iterations)
    key = _secret_key(noise_seed)
    kernels, vectors = run(kernels, vectors, tuple(xs), tuple(us), jnp.asarray(x), jnp.asarray(onehot),
                           jnp.asarray(batches), jnp.asarray(temps.reshape(-1), jnp.float32), key,
                           jnp.float32(learning_rate), jnp.float32(penalty), jnp.float32(clip_norm),
                           jnp.float32(weight_decay))
    del key
    for layer, w, u in zip(layers, kernels, vectors):
        layer.kernel[...] = w
        layer.power_vector[...] = u
    model.rescale()  # eq. 2 once more on the released weights (post-processing)
    jax.block_until_ready(layers[-1].kernel[...])
    seconds = time.perf_counter() - start
    test_acc = None if x_test is None else accuracy(model, np.asarray(x_test, np.float32), np.asarray(y_test))
    return DPSBCDResult(model, eps, float(delta), event, test_acc, seconds)

