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
from ._loop import _secret_key, accuracy

__all__ = ["DPSBCDResult", "train_dpsbcd"]


class DPSBCDResult(NamedTuple):
    """What :func:`train_dpsbcd` returns.

    Attributes:
      model: the trained :class:`~jaxdp.models.LipschitzMLP` (final weights only; a new module).
      epsilon: ε at ``delta`` of the worst record position (:func:`~jaxdp.accounting.dpsbcd_rdp`
        per batch position of the public order, as claimed by Chen & Liu 2024; see its
        assumptions). At least :func:`~jaxdp.accounting.dpsbcd_epsilon`, the paper's mixture
        over a secret random position.
      delta: δ.
      event: the :class:`~jaxdp.accounting.DPSBCD` event of the run (its ``epsilon`` is the mixture).
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
    """Mean over rows of the clipped per-record gradients ``sign · x_iᵀ r_i`` (rank one each), and their norms."""
    norms = jnp.abs(sign) * jnp.linalg.norm(x, axis=1) * jnp.linalg.norm(r, axis=1)
    scale = jnp.minimum(1.0, clip_norm / jnp.maximum(norms, jnp.finfo(x.dtype).tiny))
    return sign * (x.T @ (r * scale[:, None])) / x.shape[0], norms


def _power_rescale(w, u, rho, iterations):
    """Eq. 2 rescale W·min(ρ/λ̃, 1), λ̃ from the layers' own power iteration (carried u)."""
    from ..models._lipschitz import _power_iteration

    tiny = jnp.finfo(w.dtype).tiny
    lam, u = _power_iteration(w, u, int(iterations))
    return w * jnp.minimum(rho / jnp.maximum(lam, tiny), 1.0).astype(w.dtype), u


@functools.lru_cache(maxsize=16)
def _make_segment(num_layers, batch_size, steps_per_pass, rhos, power_iterations):
    """The jitted DP-SBCD segment: ``length`` steps from absolute step ``first`` under one ``lax.scan``.

    ``carry = (kernels, vectors, xs, us, key, step, max_grad_norm, clipped)``; ``xs[d-1]`` is
    :math:`x_d` (d = 1..D) and ``us[d]`` is :math:`U_d` (d = 0..D-1) for all records. Cached
    on the shapes and choices only, so repeated runs reuse the compiled function.
    """
    D = num_layers - 1
    b, m = batch_size, steps_per_pass

    def step(carry, s, x0, y, order, temps, learning_rate, penalty, clip_norm, weight_decay):
        kernels, vectors, xs, us, key, count, maxn, clipped = carry
        kernels, vectors = list(kernels), list(vectors)
        idx = jax.lax.dynamic_slice(order, ((s % m) * b,), (b,))
        temp = temps[s]
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
                grad, norms = _clipped_mean_grad(xb[d], ub[d] - xb[d] @ w, clip_norm, -penalty)
            else:
                grad, norms = _clipped_mean_grad(xb[d], xb[d] @ w - yb, clip_norm, 1.0)
            maxn = jnp.maximum(maxn, jnp.max(norms).astype(maxn.dtype))
            clipped = clipped + jnp.sum(~(norms <= clip_norm)).astype(clipped.dtype)  # NaN counts as above C
            noise = jax.random.normal(noise_keys[d], w.shape, w.dtype)
            w = w - learning_rate * grad + jnp.sqrt(2.0 * learning_rate * temp).astype(w.dtype) * noise
            kernels[d] = weight_decay_prox(w, learning_rate, weight_decay)
        xs = tuple(x.at[idx].set(v) for x, v in zip(xs, xb[1:]))
        us = tuple(u.at[idx].set(v) for u, v in zip(us, ub))
        return (tuple(kernels), tuple(vectors), xs, us, key, count + 1, maxn, clipped), None

    def segment(carry, x0, y, order, temps, first, learning_rate, penalty, clip_norm, weight_decay, *, length):
        def body(c, s):
            return step(c, s, x0, y, order, temps, learning_rate, penalty, clip_norm, weight_decay)

        return jax.lax.scan(body, carry, first + jnp.arange(length, dtype=jnp.int32))[0]

    return jax.jit(segment, static_argnames=("length",))


def _check_dpsbcd_arguments(**given) -> None:
    """Refuse ``train`` options that DP-SBCD does not use (never silently ignored)."""
    defaults = {"schedule": "fixed", "drop_remainder": True, "return_intermediates": False}
    for name, value in given.items():
        if value is not None and value != defaults.get(name, None):
            hint = " (its noise is noise_temperature)" if name == "noise_multiplier" else ""
            raise ValueError(f"{name} is not used by algorithm='dpsbcd'{hint}; leave it at its default.")


def _reason(ledger_kw, num_layers) -> str:
    lt = ledger_kw["prox_lipschitz"][0]
    lf = ledger_kw["contraction"]
    lf = f"{lf[0]:g}" if len(set(lf)) == 1 else "[" + ", ".join(f"{v:g}" for v in lf) + "]"
    return (f"DP-SBCD (Chen & Liu 2024, Thm 4.6), final weights only, per batch position of the public order; "
            f"summed over the {num_layers} layers as the paper claims WITHOUT PROOF (Section 4.2), and assuming "
            f"the paper's LSI for every iterate (the spectral rescaling is left out of its analysis); "
            f"S_g = 2C = {ledger_kw['sensitivity'][0]:g} (per-record block gradients clipped at C), "
            f"L_T = 1/(1 + eta*weight_decay) = {lt:.6g} (exact), L_F = {lf} AS STATED by the user (Lemma 4.1 needs "
            f"a convex beta-smooth block and eta <= 2/beta; not checked). The composition bound (every iterate "
            f"released) needs none of these assumptions")


def run_dpsbcd(model, x, y, x_test, y_test, *, learning_rate, noise_temperature, clip_norm, contraction,
               weight_decay, penalty, batch_size, passes, delta, order_seed, noise_seed, steps_per_call,
               checkpoint_dir, checkpoint_every, resume, progress, account, callback, fingerprint,
               checkpoint_key=None):
    """Run DP-SBCD; the driver behind ``train(..., algorithm="dpsbcd")`` (arguments validated there or here)."""
    import warnings

    from flax import nnx

    from .. import _validate
    from ._ledger import NOT_PRIVATE, DPSBCDLedger, privacy_report
    from ._loop import TrainResult, TrainState, _check_finite, _open_checkpoints, _plan, _resume, _segments, _to_arrays

    if not isinstance(model, LipschitzMLP):
        raise ValueError(f"model must be a jaxdp.models.LipschitzMLP (bias-free ReLU network) with "
                         f"algorithm='dpsbcd'; got {type(model).__name__}.")
    for name, v in (("learning_rate", learning_rate), ("noise_temperature", noise_temperature),
                    ("clip_norm", clip_norm), ("contraction", contraction)):
        if v is None:
            raise ValueError(f"{name} is required with algorithm='dpsbcd' (no default: the bound depends on it).")
    _validate.check_in_range("learning_rate", learning_rate, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("clip_norm", clip_norm, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("weight_decay", weight_decay, 0.0, math.inf)
    _validate.check_in_range("penalty", penalty, 0.0, math.inf, lo_open=True)
    layers = list(model.layers)
    num_layers = len(layers)
    k_in, k_out = layers[0].kernel[...].shape[0], layers[-1].kernel[...].shape[1]
    if x.shape[1] != k_in:
        raise ValueError(f"x must have {k_in} features (the model's input width); got {x.shape[1]}.")
    if y.size and (not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= k_out):
        raise ValueError(f"y must hold integer labels in [0, {k_out}); got {y.dtype} in [{y.min()}, {y.max()}].")
    plan = _plan(x.shape[0], batch_size, True)  # permute-once cyclic batches of equal size (Theorem 4.6)
    m = plan.steps_per_pass
    temps = np.asarray(noise_temperature, dtype=np.float64)
    if temps.ndim == 0:
        temps = np.full(passes, float(temps))
    elif passes not in (1, temps.shape[0]):
        raise ValueError(f"passes must equal the length of noise_temperature ({temps.shape[0]}, one entry per "
                         f"pass) or be left at 1; got {passes}.")
    passes = int(temps.shape[0]) if temps.ndim else passes
    contraction = np.asarray(contraction, dtype=np.float64)
    if contraction.ndim > 1 or contraction.size not in (1, num_layers):
        raise ValueError(f"contraction must be one value or one per layer ({num_layers}); got shape "
                         f"{contraction.shape}.")
    lt = 1.0 / (1.0 + float(learning_rate) * float(weight_decay))
    ledger_kw = dict(learning_rate=float(learning_rate), noise_temperature=temps.tolist(),
                     sensitivity=[2.0 * float(clip_norm)] * num_layers,
                     contraction=np.broadcast_to(contraction, (num_layers,)).tolist(),
                     prox_lipschitz=[lt] * num_layers)
    # The accountant's checks, in NumPy (its eager computation would cost seconds of compilation).
    bad = ~(np.isfinite(temps) & (temps > 0))
    if np.any(bad):
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"noise_temperature must be > 0 and finite at every step (a schedule that goes negative or "
                         f"to zero has no privacy); got {temps[idx]:g} at index {idx}.")
    if temps.ndim not in (1, 2) or (temps.ndim == 2 and temps.shape[1] != m):
        raise ValueError(f"noise_temperature must have shape (passes,) or (passes, {m}) (one per step of each pass, "
                         f"{m} = number of records // batch_size); got shape {temps.shape}.")
    _validate.check_in_range("contraction", contraction, 0.0, math.inf, lo_open=True)
    if steps_per_call is None:
        steps_per_call = m
    if isinstance(steps_per_call, bool) or not isinstance(steps_per_call, (int, np.integer)) or steps_per_call < 1:
        raise ValueError(f"steps_per_call must be a positive integer; got {steps_per_call!r}.")
    if checkpoint_every is None:
        checkpoint_every = m
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, (int, np.integer)) or checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be a positive integer; got {checkpoint_every!r}.")
    total = passes * m

    graphdef, params0, rest = nnx.split(model, nnx.Param, ...)
    pdtype = layers[0].kernel[...].dtype
    config = {
        "format": 1, "algorithm": "dpsbcd", "model": type(model).__qualname__,
        "params": str(jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), params0)), "data": fingerprint,
        "rhos": [float(layer.max_spectral_norm) for layer in layers],
        "power_iterations": int(layers[0].power_iterations), "clip_norm": float(clip_norm),
        "weight_decay": float(weight_decay), "penalty": float(penalty), "batch_size": int(batch_size),
        "delta": float(delta), "order_seed": int(order_seed), "steps_per_call": int(steps_per_call), **ledger_kw,
    }
    ckpt = _open_checkpoints(checkpoint_dir, resume, checkpoint_key)
    if noise_seed is not None:
        warnings.warn(f"noise_seed is fixed: {NOT_PRIVATE}.", UserWarning, stacklevel=3)
    ledger = DPSBCDLedger(
        analysis="dpsbcd", reason=_reason(ledger_kw, num_layers), **ledger_kw, clip_norm=float(clip_norm),
        weight_decay=float(weight_decay), penalty=float(penalty), records=plan.records,
        unused=plan.n_total - plan.records, batch_size=int(batch_size), passes=passes, steps_per_pass=m,
        total_steps=total, steps_done=0, delta=float(delta), order_seed=int(order_seed),
        fixed_noise_seed=noise_seed is not None, max_grad_norm=0.0)

    X = jnp.asarray(x, dtype=pdtype)
    Y = jnp.asarray(np.eye(k_out, dtype=np.dtype(pdtype))[y])
    kernels = tuple(layer.kernel[...] for layer in layers)
    vectors = tuple(layer.power_vector[...] for layer in layers)
    # Lifted variables start at a forward pass of the start weights (the paper leaves it open).
    xs, us, h = [], [], X
    for w in kernels[:-1]:
        us.append(h @ w)
        h = jax.nn.relu(us[-1])
        xs.append(h)
    order = jax.random.permutation(jax.random.key(int(order_seed)), plan.n_total).astype(jnp.int32)
    state = TrainState(params=kernels, opt_state=(vectors, tuple(xs), tuple(us), _secret_key(noise_seed)),
                       step=jnp.zeros((), jnp.int32), order=order, total_steps=jnp.asarray(total, jnp.int32),
                       max_grad_norm=jnp.zeros((), jnp.float32), clipped=jnp.zeros((), jnp.int32), ledger=ledger)
    state, _ = _resume(ckpt, state, config, checkpoint_dir, DPSBCDLedger)

    segment = _make_segment(num_layers, int(batch_size), m, tuple(float(layer.max_spectral_norm) for layer in layers),
                            int(layers[0].power_iterations))
    step_temps = jnp.asarray((np.repeat(temps[:, None], m, axis=1) if temps.ndim == 1 else temps).reshape(-1),
                             pdtype)
    scalars = tuple(jnp.asarray(v, pdtype) for v in (learning_rate, penalty, clip_norm, weight_decay))

    start = int(state.step)
    pbar = None
    if progress:
        from tqdm.auto import tqdm

        pbar = tqdm(total=total, initial=start, desc="DP-SBCD", unit="step", leave=True)
        if account:  # the release's guarantee is fixed in advance: shown once (the same compiled shape as the end)
            planned = privacy_report(state.ledger._replace(steps_done=total)).summary()["worst"]
            pbar.set_postfix_str(f"eps at the end {planned:.3g} (worst position)")
    history: list = []
    last_saved = start
    t0 = time.perf_counter()
    try:
        for first, length, _ in _segments(start, total, plan, int(steps_per_call)):
            vecs, xs, us, key = state.opt_state
            carry = (state.params, vecs, xs, us, key, state.step, state.max_grad_norm, state.clipped)
            carry = segment(carry, X, Y, state.order, step_temps, jnp.asarray(first, jnp.int32), *scalars,
                            length=length)
            _check_finite(carry[0], carry[6], "DP-SBCD")
            steps_done = int(carry[5])
            led = state.ledger._replace(steps_done=steps_done, max_grad_norm=float(carry[6]))
            state = state._replace(params=carry[0], opt_state=carry[1:5], step=carry[5], max_grad_norm=carry[6],
                                   clipped=carry[7], ledger=led)
            done = steps_done >= total
            if ckpt is not None and (done or steps_done - last_saved >= checkpoint_every):
                ckpt.save_train(steps_done, _to_arrays(state), {"ledger": led.to_json(), "config": config})
                last_saved = steps_done
            if pbar is not None:
                pbar.update(length)
            if callback is not None:
                callback(state)
    finally:
        if pbar is not None:
            pbar.close()
        if ckpt is not None:
            ckpt.close()
    seconds = time.perf_counter() - t0

    trained = nnx.merge(graphdef, params0, rest)  # a new module: the input is untouched
    for layer, w, u in zip(trained.layers, state.params, state.opt_state[0]):
        layer.kernel[...] = w
        layer.power_vector[...] = u
    trained.rescale()  # eq. 2 once more on the released weights (post-processing)
    report = privacy_report(state.ledger) if account else None
    if report is not None:
        history.append((int(state.step), report.summary()))
    if progress and report is not None:
        worst = report.summary()["worst"]
        head = f"{NOT_PRIVATE}\n" if report.not_private else ""
        print(f"{head}guarantee of the released model: epsilon = {worst:.4g} at delta = {report.delta:g} for every "
              f"record (worst batch position), by {report.analysis}\n  assumptions: {report.reason}")
        print(report.table())
    test_acc = None
    if x_test is not None and len(x_test):
        test_acc = accuracy(trained, np.asarray(x_test, dtype=np.dtype(pdtype)), np.asarray(y_test))
    return TrainResult(trained, state, report, test_acc, None, history, seconds)


def train_dpsbcd(model: LipschitzMLP, data, *, learning_rate: float, noise_temperature, clip_norm: float,
                 contraction, batch_size: int, delta: float, weight_decay: float = 0.0, penalty: float = 1.0,
                 order_seed: int = 0, noise_seed: int | None = None) -> DPSBCDResult:
    r"""Shortcut: ``train(model, data, algorithm="dpsbcd", ...)`` without progress output, as a :class:`DPSBCDResult`.

    The same run as :func:`~jaxdp.training.train` with ``algorithm="dpsbcd"`` (one loop:
    this function only forwards its arguments and repackages the result; use ``train`` for
    checkpoints, resume, progress and the full :class:`~jaxdp.training.PrivacyReport`). See
    the module docstring for the updates and ``train`` for the guarantee.

    Args:
      model: a :class:`~jaxdp.models.LipschitzMLP` (its kernels are the start, not modified).
      data: a :class:`jaxdp.data.Dataset` or ``(x, y)`` with integer labels in [0, K).
      learning_rate: η > 0.
      noise_temperature: o > 0 per pass ``(passes,)`` or per step ``(passes, n // b)``.
      clip_norm: C > 0.
      contraction: :math:`L_F > 0` (required; one value or one per layer).
      batch_size: b ≥ 1, at most n.
      delta: δ in (0, 1).
      weight_decay: λ ≥ 0. penalty: γ > 0. order_seed: public seed of the permutation.
      noise_seed: a fixed noise key (the run is then NOT private); default OS entropy.

    Returns:
      :class:`DPSBCDResult` (``epsilon`` is the worst record position's, the release's guarantee).

    References:
      C. Chen, D. Liu, arXiv:2407.08233v1 (2024), Algorithms 1-2, eqs. 2, 4-8, Theorem 4.6.

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
    from ._loop import train

    res = train(model, data, algorithm="dpsbcd", learning_rate=learning_rate, noise_temperature=noise_temperature,
                clip_norm=clip_norm, contraction=contraction, batch_size=batch_size, delta=delta,
                weight_decay=weight_decay, penalty=penalty, order_seed=order_seed, noise_seed=noise_seed,
                progress=False)
    rep = res.privacy
    return DPSBCDResult(res.model, rep.summary()["worst"], float(delta), res.state.ledger.event(), res.test_accuracy,
                        res.seconds)
