r"""Projected noisy SGD (PNSGD) as optax gradient transformations.

The update that the hidden-state accountants analyse is

.. math::

    Y_{t+1} = \Pi_K\bigl(Y_t - \eta\,(g_t + Z_t)\bigr),\qquad
    Z_t \sim \mathcal N(0, \sigma_Z^2 I),

with :math:`K = \{\theta : \lVert\theta\rVert_2 \le R\}` (diameter :math:`D = 2R`) and
:math:`g_t` the averaged clipped gradient of the step's batch. :func:`pnsgd` builds it as
``chain(add_gaussian_noise, scale(-η), project_l2_ball)``; each piece is a factory
returning an ``optax.GradientTransformation`` with a NamedTuple state.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import _validate

__all__ = [
    "AddGaussianNoiseState",
    "ProjectL2BallState",
    "add_gaussian_noise",
    "project_l2_ball",
    "project_onto_l2_ball",
    "pnsgd",
    "pnsgd_noise_std",
]


class AddGaussianNoiseState(NamedTuple):
    """State of :func:`add_gaussian_noise`.

    Attributes:
      count: number of updates done so far, ``int32`` scalar.
      key: the PRNG key for the *next* update (split on every update, never reused).
    """

    count: jax.Array
    key: jax.Array


class ProjectL2BallState(NamedTuple):
    """State of :func:`project_l2_ball` (stateless)."""


def _as_key(key) -> jax.Array:
    if isinstance(key, int) and not isinstance(key, bool):
        return jax.random.key(key)
    dtype = getattr(key, "dtype", None)
    if dtype is not None and (
        jnp.issubdtype(dtype, jax.dtypes.prng_key)
        or (dtype == jnp.uint32 and getattr(key, "shape", ())[-1:] == (2,))
    ):
        return key
    raise TypeError(
        f"key must be a JAX PRNG key (jax.random.key(seed)) or an int seed; got {key!r}."
    )


def add_gaussian_noise(noise_std, key) -> optax.GradientTransformation:
    r"""Add isotropic Gaussian noise of *absolute* standard deviation ``noise_std``.

    .. math::

        u \mapsto u + Z,\qquad Z \sim \mathcal N(0, s^2 I),\ s = \texttt{noise\_std}.

    The key lives in the state. Each update does
    ``next_key, noise_key = jax.random.split(state.key)`` and draws leaf ``j`` (in
    ``jax.tree.leaves`` order) as ``s * jax.random.normal(k_j, leaf.shape, leaf.dtype)``
    with ``k_j = jax.random.split(noise_key, num_leaves)[j]``; ``next_key`` becomes the
    state's key. So no key is ever used twice, and the noise of step ``t`` can be
    reproduced from the initial key alone. Noise is drawn in each leaf's dtype (the
    user's dtype is kept).

    The caller sets the scale: for a Gaussian mechanism with L2 sensitivity
    :math:`\Delta` and noise multiplier :math:`\nu`, pass ``noise_std = ν·Δ``.

    Args:
      noise_std: :math:`s \ge 0` (0 adds nothing but still advances the key).
      key: a JAX PRNG key (``jax.random.key(seed)``), or an int seed turned into one.
        Dedicate it to the noise (split it off your root key; do not also use it for
        initialisation or data order), and never derive it from NumPy's global state.

    Returns:
      An ``optax.GradientTransformation`` with state :class:`AddGaussianNoiseState`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> tx = add_gaussian_noise(0.1, jax.random.key(0))
      >>> state = tx.init(jnp.zeros(3))
      >>> u, state = tx.update(jnp.zeros(3), state)
      >>> u.shape, int(state.count)
      ((3,), 1)
    """
    _validate.check_in_range("noise_std", noise_std, 0.0, math.inf)
    key = _as_key(key)

    def init_fn(params):
        del params
        return AddGaussianNoiseState(count=jnp.zeros([], jnp.int32), key=key)

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates)
        next_key, noise_key = jax.random.split(state.key)
        keys = list(jax.random.split(noise_key, len(leaves))) if leaves else []
        noisy = [
            leaf + jnp.asarray(noise_std, leaf.dtype) * jax.random.normal(k, leaf.shape, leaf.dtype)
            for leaf, k in zip(leaves, keys, strict=True)
        ]
        count = optax.safe_increment(state.count)
        return jax.tree.unflatten(treedef, noisy), AddGaussianNoiseState(count=count, key=next_key)

    return optax.GradientTransformation(init_fn, update_fn)


def project_onto_l2_ball(tree: Any, radius) -> Any:
    r"""Euclidean projection of a pytree onto :math:`\{\theta : \lVert\theta\rVert_2 \le R\}`.

    .. math::

        \Pi(\theta) = \theta\cdot\min\Bigl(1, \frac{R}{\lVert\theta\rVert}\Bigr)
                    = \theta\cdot\frac{R}{\max(\lVert\theta\rVert, R)},

    with the global norm over all leaves, computed as
    :math:`R/\sqrt{\max(\lVert\theta\rVert^2, R^2)}`: no division by zero and finite
    gradients at :math:`\theta = 0` (for :math:`R > 0`). Where :math:`\lVert\theta\rVert^2`
    or :math:`R^2` overflows the dtype (e.g. :math:`R \gtrsim 1.8\cdot10^{19}` in float32)
    the result is NaN, never a silently zeroed point: ``train`` refuses such a radius up
    front and stops with :class:`~jaxdp.training.TrainingDivergedError` on such parameters.

    Args:
      tree: pytree of arrays.
      radius: :math:`R > 0`.

    Returns:
      The projected pytree (same structure and dtypes).

    Examples:
      >>> import jax.numpy as jnp
      >>> project_onto_l2_ball({"a": jnp.array([3.0]), "b": jnp.array([4.0])}, 1.0)["b"].tolist()
      [0.800000011920929]
    """
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return tree
    dtype = jnp.result_type(*leaves)
    # Clamp the *squared* norm before the square root: sqrt'(0) is infinite, and JAX
    # differentiates through both sides of a max, so max(‖θ‖, R) has a NaN gradient at 0.
    sq = optax.tree.norm(tree, squared=True).astype(dtype)
    r = jnp.asarray(radius, dtype)
    scale = r / jnp.sqrt(jnp.maximum(sq, r * r))
    # An overflowed square would give a factor 0 (the point silently sent to the centre): NaN instead.
    scale = jnp.where((sq < jnp.inf) & (r * r < jnp.inf), scale, jnp.nan)
    return jax.tree.map(lambda x: x * scale.astype(x.dtype), tree)


def project_l2_ball(radius) -> optax.GradientTransformation:
    r"""Turn an update into one that lands in the L2 ball of radius ``radius``.

    .. math::

        u \mapsto \Pi_K(\theta + u) - \theta,\qquad K = \{\lVert\theta\rVert_2 \le R\},

    so that ``optax.apply_updates(params, new_u)`` equals :math:`\Pi_K(\theta + u)` (up
    to one floating-point rounding of the addition). The norm is global across leaves.
    This must be the **last** transformation of a chain.

    Args:
      radius: :math:`R > 0`; the set's diameter (the accountants' :math:`D`) is :math:`2R`.

    Returns:
      An ``optax.GradientTransformation`` with state :class:`ProjectL2BallState`. Its
      ``update`` requires ``params``.

    Raises:
      ValueError: if ``radius`` is not positive and finite, or ``update`` gets no params.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> tx = project_l2_ball(1.0)
      >>> params = jnp.array([0.0, 0.5])
      >>> u, _ = tx.update(jnp.array([2.0, 0.0]), tx.init(params), params)
      >>> float(optax.tree.norm(optax.apply_updates(params, u)))
      1.0
    """
    _validate.check_in_range("radius", radius, 0.0, math.inf, lo_open=True)

    def init_fn(params):
        del params
        return ProjectL2BallState()

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "project_l2_ball needs the current parameters: call update(updates, state, params)."
            )
        new = optax.apply_updates(params, updates)
        projected = project_onto_l2_ball(new, radius)
        return jax.tree.map(lambda p, q: q - p, params, projected), state

    return optax.GradientTransformation(init_fn, update_fn)


def pnsgd_noise_std(noise_multiplier, clip_norm, batch_size: int = 1):
    r"""Standard deviation of the gradient noise :math:`Z` that :func:`pnsgd` adds.

    .. math::

        \sigma_Z = \nu\cdot\Delta,\qquad \Delta = \frac{2C}{b},

    the replace-one L2 sensitivity of the averaged clipped gradient. This
    :math:`\sigma_Z` is the :math:`\sigma` of the hidden-state accountants (noise on the
    averaged gradient, with Lipschitz constant :math:`L = C`); see :func:`pnsgd`.

    Array-like inputs (as in optax): concrete scalars give a Python float and are
    validated; arrays or traced values (inside ``jit``/``vmap``/``grad``) give a JAX array
    and are not validated (invalid values propagate as NaN or inf).

    Examples:
      >>> pnsgd_noise_std(1.0, clip_norm=1.0, batch_size=4)
      0.5
    """
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf)
    _validate.check_in_range("clip_norm", clip_norm, 0.0, math.inf, lo_open=True)
    _check_batch_size(batch_size)
    values = (noise_multiplier, clip_norm, batch_size)
    if all(_validate.is_concrete(v) and np.ndim(v) == 0 for v in values):
        return float(noise_multiplier) * 2.0 * float(clip_norm) / int(batch_size)
    return jnp.asarray(noise_multiplier) * 2.0 * jnp.asarray(clip_norm) / jnp.asarray(batch_size)


def _check_batch_size(batch_size) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int,)) and not (
        hasattr(batch_size, "dtype") and jnp.issubdtype(batch_size.dtype, jnp.integer)
    ):
        raise ValueError(f"batch_size must be a positive integer; got {batch_size!r}.")
    if _validate.is_concrete(batch_size) and np.any(np.asarray(batch_size) < 1):
        raise ValueError(f"batch_size must be a positive integer; got {batch_size}.")


def _learning_rate_fn(learning_rate):
    r"""The step size of step ``count`` as a function, for a constant, an array or a schedule.

    * a scalar :math:`\eta` (float, or a traced array): the constant ``η``;
    * a 1-D array of per-step rates :math:`(\eta_0, \eta_1, \dots)`: step ``count`` uses
      ``rates[min(count, len - 1)]`` (the last rate repeats);
    * a callable (an optax schedule ``count -> η``): itself.

    Returns ``(fn, rates)``: ``fn(count)`` is traceable; ``rates`` is the concrete array of
    per-step rates for a 1-D array, else ``None``.

    Examples:
      >>> fn, rates = _learning_rate_fn([0.5, 0.25])
      >>> [float(fn(c)) for c in (0, 1, 5)], rates.tolist()
      ([0.5, 0.25, 0.25], [0.5, 0.25])
    """
    if callable(learning_rate):
        return learning_rate, None
    if np.ndim(learning_rate) == 0:
        return (lambda count: learning_rate), None
    if np.ndim(learning_rate) != 1 or np.shape(learning_rate)[0] == 0:
        raise ValueError(
            "learning_rate must be a scalar, a non-empty 1-D array of per-step rates or a schedule "
            f"(a callable count -> rate); got shape {np.shape(learning_rate)}.")
    rates = jnp.asarray(learning_rate)
    last = rates.shape[0] - 1
    concrete = np.asarray(learning_rate, np.float64) if _validate.is_concrete(learning_rate) else None

    def fn(count):
        return rates[jnp.minimum(count, last)]

    return fn, concrete


def _schedule_rates(learning_rate, num_steps: int) -> np.ndarray:
    r"""The concrete step sizes :math:`\eta_0, \dots, \eta_{T-1}` of ``num_steps`` steps, float64.

    For a schedule, its values at ``count = 0..T-1``; for a 1-D array, its first ``T``
    entries (the last repeated); for a scalar, ``T`` copies.

    Examples:
      >>> import optax
      >>> _schedule_rates(optax.linear_schedule(1.0, 0.5, 2), 3).tolist()
      [1.0, 0.75, 0.5]
    """
    num_steps = int(num_steps)
    if callable(learning_rate):
        counts = jnp.arange(num_steps, dtype=jnp.int32)
        return np.asarray(jax.vmap(lambda c: jnp.asarray(learning_rate(c)))(counts), np.float64).reshape(num_steps)
    rates = np.asarray(learning_rate, np.float64)  # the given values exactly, not their float32 rounding
    if rates.ndim == 0:
        return np.full(num_steps, float(rates))
    return rates[np.minimum(np.arange(num_steps), rates.shape[0] - 1)]


def pnsgd(learning_rate, noise_multiplier, clip_norm, radius, key, batch_size: int = 1,
          *, smoothness=None) -> optax.GradientTransformation:
    r"""Projected noisy SGD: the update analysed by the hidden-state accountants.

    Given the **averaged clipped gradient** :math:`g` of a batch of size :math:`b`
    (e.g. ``clipped_grad_sum(...).grad_sum / b``), the update is exactly

    .. math::

        Y \leftarrow \Pi_K\bigl(Y - \eta\,(g + Z)\bigr),\qquad
        Z\sim\mathcal N\bigl(0, \sigma_Z^2 I\bigr),\qquad
        \sigma_Z = \nu\cdot\frac{2C}{b},

    with :math:`K` the L2 ball of radius :math:`R` (diameter :math:`D = 2R`), built as
    ``chain(add_gaussian_noise(σ_Z, key), scale(-η), project_l2_ball(R))``.

    **Noise convention (derivation).** Clipping bounds every per-example gradient by
    :math:`C`, so the loss seen by the update is :math:`L`-Lipschitz with :math:`L = C`
    (or the model's own bound :math:`L \le C` when clipping is inactive). Neighbouring
    data sets differ by *replacing* one example, which changes one term of the average
    :math:`g = \frac1b\sum_{i\in B}\bar g_i` by at most
    :math:`\lVert\bar g_i - \bar g_i'\rVert/b \le 2C/b =: \Delta`. The
    ``noise_multiplier`` :math:`\nu` is the ratio of the noise standard deviation to
    this sensitivity, :math:`\nu = \sigma_Z/\Delta`, the same dimensionless ``sigma`` as
    ``jaxdp.accounting.gaussian_rdp`` (one step releasing :math:`g+Z` is
    :math:`(\alpha, \alpha/(2\nu^2))`-RDP).

    The hidden-state accountants (``jaxdp.accounting``; Feldman et al. Thm 23) are
    parametrised instead by the *absolute* standard deviation :math:`\sigma` of the noise
    on the averaged gradient (their argument ``noise_std``) and the Lipschitz constant
    :math:`L`, with sensitivity
    :math:`2L/b` (Feldman et al., Algorithm 1: :math:`\sigma` is the std of the noise added
    to the gradient, so the noise std in parameter space is :math:`\eta\sigma`). So call
    ``jaxdp.accounting.pnsgd_privacy(PNSGD(C, β, η, pnsgd_noise_std(ν, C, b), 2R,
    num_records=n, batch_size=b), delta)``; conversely a :math:`\sigma` from
    ``calibrate_pnsgd_noise_std`` gives :math:`\nu = \sigma b / (2C)`. At :math:`b = 1` the
    per-index bound of Theorem 23 becomes

    .. math::

        \frac{2\alpha L^2}{\sigma^2 (n - i + 1)}
        = \frac{2\alpha C^2}{(2C\nu)^2 (n-i+1)} = \frac{\alpha}{2\nu^2 (n-i+1)} ,

    and for batches it is :math:`\alpha\Delta^2 / (2\sigma_Z^2 m) = \alpha/(2\nu^2 m)`
    with :math:`m` the number of steps from the point's batch to the end. Note the
    factor 2 against optax's ``dpsgd``, whose ``noise_multiplier`` is relative to
    :math:`C` on the *sum* (add/remove neighbours): the same :math:`\nu` here adds twice
    the noise.

    Assumptions for the amplified guarantees (not checked here, except the step size when
    ``smoothness`` is given): the per-example loss is convex and :math:`\beta`-smooth on
    :math:`K` and clipping is inactive (clipped gradients of general models are not
    gradients of a convex function), :math:`\eta \le 2/\beta`, the start
    point is data-independent and in :math:`K`, and only the final iterate is released.

    Args:
      learning_rate: :math:`\eta > 0`: a scalar (array-like, may be traced), a 1-D array of
        per-step rates :math:`\eta_t` (the last repeats), or an optax schedule
        ``count -> η``. The hidden-state analyses need :math:`\eta_t \le 2/(\beta+\rho)` at
        every step and are told the schedule by :func:`~jaxdp.training.train` (see its
        docstring: the run is accounted at the bounding constant step).
      noise_multiplier: :math:`\nu \ge 0` (see above).
      clip_norm: :math:`C > 0`, the per-example clip norm used to compute :math:`g`.
      radius: :math:`R > 0`.
      key: JAX PRNG key (or int seed) for the noise; it is split every step.
      batch_size: :math:`b \ge 1`, the number of examples averaged into :math:`g`.
      smoothness: optional :math:`\beta > 0`; if given, a step outside the library's
        step-size rule :math:`0 < \eta \le 2/\beta` (``jaxdp._validate``, the one rule) raises
        ``ValueError``.

    Returns:
      ``optax.GradientTransformation`` whose state is the chain's tuple
      ``(AddGaussianNoiseState, EmptyState, ProjectL2BallState)``; ``update`` needs params.

    Raises:
      ValueError: naming the parameter, for a non-positive learning rate, clip norm or
        radius, a negative noise multiplier, a batch size below 1, or a step size that
        breaks :math:`\eta \le 2/\beta`.

    References:
      Feldman, Mironov, Talwar, Thakurta, "Privacy amplification by iteration", FOCS 2018
      (Algorithm 1, Thm 23); Asoodeh, Diaz, Calmon, "Privacy amplification of iterative
      algorithms via contraction coefficients", ISIT 2020.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> tx = pnsgd(0.5, noise_multiplier=0.0, clip_norm=1.0, radius=1.0, key=jax.random.key(0))
      >>> params = jnp.array([0.0, 0.0])
      >>> u, state = tx.update(jnp.array([-4.0, 0.0]), tx.init(params), params)
      >>> optax.apply_updates(params, u).tolist()  # Π(0 − 0.5·(−4, 0)) = Π((2, 0))
      [1.0, 0.0]
    """
    fn, _ = _learning_rate_fn(learning_rate)
    if not callable(learning_rate):
        _validate.check_in_range("learning_rate", learning_rate, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf)
    _validate.check_in_range("clip_norm", clip_norm, 0.0, math.inf, lo_open=True)
    _validate.check_in_range("radius", radius, 0.0, math.inf, lo_open=True)
    _check_batch_size(batch_size)
    if smoothness is not None and not callable(learning_rate):
        # the library's one step-size rule, at every step of a per-step array
        _validate.check_learning_rate(learning_rate, smoothness)
    noise_std = pnsgd_noise_std(noise_multiplier, clip_norm, batch_size)
    if np.ndim(learning_rate) == 0 and not callable(learning_rate):
        step = optax.scale(-jnp.asarray(learning_rate))
    else:
        step = optax.scale_by_schedule(lambda count: -fn(count))
    return optax.chain(add_gaussian_noise(noise_std, key), step, project_l2_ball(radius))
