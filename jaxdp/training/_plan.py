r"""Privacy planning: which analysis applies to a PNSGD run, and why, before any step runs.

:func:`plan_privacy` is the first of the three pieces of :func:`~jaxdp.training.train`:

1. **planning** (this module): from the model's declared loss and constants
   (:class:`~jaxdp.models.HiddenStateModel`), the data's feature bound and the
   hyper-parameters, the analysis the accountant may use (hidden-state, random-stop or
   composition), the reason, and the constants it is told;
2. **the step**: a pure function scanned over steps (:func:`~jaxdp.training.pnsgd` on the
   averaged output of :func:`~jaxdp.training.clipped_grad_sum`, or
   :func:`~jaxdp.training.dpsgd_step`);
3. **the driver** (:func:`~jaxdp.training.train`): order, secret keys, checkpoints,
   progress, the ledger and the report (:func:`~jaxdp.training.privacy_report`).

**Learning-rate schedules.** The hidden-state analyses hold for steps
:math:`\eta_t \le 2/(\beta+\rho)` at every step; they are checked one by one. A schedule is
accounted as the constant-step run at the **bounding constants**

.. math::

    \eta_\star = \min_t \eta_t,\qquad L_\star = L\,\frac{\max_t \eta_t}{\min_t \eta_t},

which is conservative for every analysis: in parameter space the noise of step :math:`t`
has std :math:`\eta_t\sigma \ge \eta_\star\sigma`, the step that uses a record moves the two
runs apart by :math:`\eta_j\cdot 2L/b \le \eta_\star\cdot 2L_\star/b`, and the step's
contraction :math:`M(\eta_t) = \sqrt{1 - 2\eta_t\beta\rho/(\beta+\rho)} \le M(\eta_\star)`
(and :math:`M(\eta)D/(\eta\sigma)` decreases in :math:`\eta`). Every bound used
(contraction coefficients, shifted Rényi divergences, composition) grows with the shift
and the contraction and falls with the noise, so the constant run at
:math:`(\eta_\star, L_\star)` bounds the scheduled one. The ledger records
:math:`\eta_\star` and :math:`L_\star` and the reason says so. A constant rate is accounted
exactly as before (:math:`L_\star = L`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from .. import _validate
from ..models import HiddenStateModel, LossConstants
from ._run import _check_features, _unpack_data
from ._transforms import _schedule_rates

__all__ = ["PrivacyPlan", "plan_privacy"]

_HIDDEN = "hidden-state"
_STOP = "random-stop"
_COMPOSITION = "composition"


class PrivacyPlan(NamedTuple):
    """What :func:`plan_privacy` decided (host-side Python values).

    Attributes:
      analysis: ``"hidden-state"``, ``"random-stop"`` or ``"composition"``.
      reason: why (one sentence, for the report).
      convex: whether the loss is treated as convex with known constants.
      loss_fn: the per-example loss ``loss_fn(model, x, y) -> (b,)`` training uses.
      clip_norm: :math:`C` (default the Lipschitz bound).
      lipschitz: :math:`L` the accountant is told (``min(C, L)``, times
        :math:`\\max\\eta_t/\\min\\eta_t` for a schedule under an amplified analysis).
      lipschitz_bound: the loss's Lipschitz bound, or ``None``.
      smoothness: :math:`\\beta`, or ``None``.
      strong_convexity: :math:`\\rho`.
      learning_rate: the constant step the accountant is told (:math:`\\min_t\\eta_t`).
      learning_rates: per-step rates of a schedule (float64, one per planned step), or
        ``None`` for a constant rate.
      num_steps: planned steps (for random stopping, the most the run can do).
    """

    analysis: str
    reason: str
    convex: bool
    loss_fn: Callable
    clip_norm: float
    lipschitz: float
    lipschitz_bound: float | None
    smoothness: float | None
    strong_convexity: float
    learning_rate: float
    learning_rates: np.ndarray | None
    num_steps: int


def declared_loss_fn(model, loss_fn):
    """``loss_fn``, or the model's own ``loss(x, y)`` as ``loss_fn(model, x, y)``."""
    if loss_fn is not None:
        if not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable as loss_fn(model, x, y); got {loss_fn!r}.")
        return loss_fn
    if callable(getattr(model, "loss", None)):
        def loss(m, x, y):
            return m.loss(x, y)

        loss.__qualname__ = f"{type(model).__qualname__}.loss"
        return loss
    raise ValueError(
        f"loss_fn is required: {type(model).__name__} declares no loss(x, y) method (see "
        "jaxdp.models.HiddenStateModel); pass loss_fn(model, x, y) -> per-example losses (b,)."
    )


def _declared_constants(model, loss_fn_given: bool, x_bound):
    """The model's :class:`~jaxdp.models.LossConstants` for its own loss, or ``None``."""
    method = getattr(model, "loss_constants", None)
    if loss_fn_given or x_bound is None or not callable(method):
        return None
    c = method(x_bound)
    if not isinstance(c, LossConstants):
        c = LossConstants(*c)
    return c


def _is_schedule(learning_rate) -> bool:
    return callable(learning_rate) or np.ndim(learning_rate) != 0


def rate_config(learning_rate, rates: np.ndarray | None):
    """A JSON value identifying the learning rate (checkpoints refuse another one)."""
    if rates is None:
        return float(learning_rate)
    return {"min": float(rates.min()), "max": float(rates.max()), "steps": int(rates.size),
            "sha256": hashlib.sha256(np.ascontiguousarray(rates, np.float64).tobytes()).hexdigest()}


def plan_privacy(
    model,
    data,
    *,
    learning_rate,
    radius: float,
    batch_size: int = 64,
    passes: int = 1,
    schedule: str = "fixed",
    drop_remainder: bool = True,
    loss_fn: Callable | None = None,
    clip_norm: float | None = None,
    lipschitz: float | None = None,
    smoothness: float | None = None,
    strong_convexity: float | None = None,
    convex: bool | None = None,
    return_intermediates: bool = False,
) -> PrivacyPlan:
    r"""Which privacy analysis a PNSGD run of ``model`` on ``data`` gets, and why.

    Reads the model's declaration (:class:`~jaxdp.models.HiddenStateModel`: ``loss(x, y)``
    and ``loss_constants(feature_norm_bound)``), or the explicit ``lipschitz``,
    ``smoothness``, ``strong_convexity`` and ``convex``, and decides:

    * **hidden-state** (or **random-stop** with ``schedule="random_stop"``): the loss is
      convex with constants :math:`L, \beta, \rho` valid on the ball of radius :math:`R`,
      :math:`C \ge L` (clipping inactive; the driver verifies it at run time), every step
      :math:`\eta_t \le 2/(\beta+\rho)`, only the final iterate released;
    * **composition** otherwise (no constants, non-convex, :math:`C < L`, constants stated
      for a smaller parameter ball, intermediate iterates released), valid for any model.

    **Schedules.** A schedule (every rate checked against :math:`2/(\beta+\rho)`) is
    accounted as the constant-step run at the bounding constants

    .. math::

        \eta_\star = \min_t \eta_t,\qquad L_\star = L\,\frac{\max_t \eta_t}{\min_t \eta_t}.

    This is conservative for every analysis: in parameter space the noise of step :math:`t`
    has std :math:`\eta_t\sigma \ge \eta_\star\sigma`, the step that uses a record moves
    the two runs apart by :math:`\eta_j\cdot 2L/b \le \eta_\star\cdot 2L_\star/b`, and the
    step's contraction :math:`M(\eta_t) = \sqrt{1 - 2\eta_t\beta\rho/(\beta+\rho)} \le
    M(\eta_\star)` (also :math:`M(\eta)D/(\eta\sigma)` decreases in :math:`\eta`). The
    contraction-coefficient (Asoodeh et al. Thm 4), shifted-Rényi (Feldman et al. Thm 23)
    and composition bounds all grow with the shift and the contraction and fall with the
    noise, step by step, so the constant run at :math:`(\eta_\star, L_\star)` bounds the
    scheduled one. The composition column is then conservative too (it does not depend on
    :math:`\eta` but is computed with :math:`L_\star`). A constant rate has
    :math:`L_\star = L` and is accounted exactly as before.

    Args:
      model: a Flax NNX module, ideally a :class:`~jaxdp.models.HiddenStateModel`.
      data: :class:`jaxdp.data.Dataset` (its ``feature_norm_bound`` gives the constants)
        or a pair ``(x, y)`` (then pass ``lipschitz`` and ``smoothness``).
      learning_rate: :math:`\eta > 0`, a 1-D array of per-step rates, or an optax schedule.
      radius: :math:`R > 0` of the parameter ball.
      batch_size, passes, schedule, drop_remainder: as in :func:`~jaxdp.training.train`.
      loss_fn: ``loss_fn(model, x, y) -> (b,)``; default the model's ``loss``. A loss other
        than the model's own gets the model's constants only when passed explicitly.
      clip_norm: :math:`C`; default :math:`L`.
      lipschitz, smoothness: :math:`L, \beta` of a convex loss (override the model's).
      strong_convexity: :math:`\rho \ge 0` (default: the model's, else 0).
      convex: override the model's declaration.
      return_intermediates: every iterate released (composition).

    Returns:
      :class:`PrivacyPlan`.

    References:
      Feldman, Mironov, Talwar, Thakurta, "Privacy amplification by iteration", FOCS 2018
      (Thm 23); Asoodeh, Diaz, Calmon, "Privacy amplification of iterative algorithms via
      contraction coefficients", ISIT 2020 (Thms 4, 5).

    Raises:
      ValueError: naming the parameter, as :func:`~jaxdp.training.train` does (a step
        above :math:`2/(\beta+\rho)` at some step of a convex run, rows above the feature
        bound, a convex model without constants, ...).

    Examples:
      >>> from flax import nnx
      >>> from jaxdp.data import load_digits
      >>> from jaxdp.models import MLP, SoftmaxRegression
      >>> ds = load_digits()
      >>> plan_privacy(SoftmaxRegression(64, 10, rngs=nnx.Rngs(0)), ds, learning_rate=1.0, radius=30.0).analysis
      'hidden-state'
      >>> plan = plan_privacy(MLP((64, 16, 10), rngs=nnx.Rngs(0)), ds, learning_rate=0.1, radius=30.0, clip_norm=1.0)
      >>> plan.analysis, plan.reason.split(":")[0]
      ('composition', 'MLP is not convex')
    """
    x, y, _, _, x_bound, _ = _unpack_data(data)
    x = np.asarray(x)
    _check_features(x)
    return _plan_privacy(model, x, x_bound, learning_rate=learning_rate, radius=radius, batch_size=batch_size,
                         passes=passes, schedule=schedule, drop_remainder=drop_remainder, loss_fn=loss_fn,
                         clip_norm=clip_norm, lipschitz=lipschitz, smoothness=smoothness,
                         strong_convexity=strong_convexity, convex=convex,
                         return_intermediates=return_intermediates)


def _num_steps(n_total: int, batch_size: int, passes: int, schedule: str, drop_remainder: bool) -> int:
    full, rem = divmod(int(n_total), int(batch_size))
    if full == 0:
        raise ValueError(f"batch_size must be <= the number of training examples ({n_total}); got {batch_size}.")
    per_pass = full + (1 if rem and not drop_remainder else 0)
    return per_pass if schedule == "random_stop" else int(passes) * per_pass


def _plan_privacy(model, x: np.ndarray, x_bound, *, learning_rate, radius, batch_size, passes, schedule,
                  drop_remainder, loss_fn, clip_norm, lipschitz, smoothness, strong_convexity, convex,
                  return_intermediates) -> PrivacyPlan:
    _validate.check_in_range("radius", radius, 0.0, math.inf, lo_open=True)
    if clip_norm is not None:
        _validate.check_in_range("clip_norm", clip_norm, 0.0, math.inf, lo_open=True)
    for name, value in (("lipschitz", lipschitz), ("smoothness", smoothness)):
        if value is not None:
            _validate.check_in_range(name, value, 0.0, math.inf, lo_open=True)
    if strong_convexity is not None:
        _validate.check_in_range("strong_convexity", strong_convexity, 0.0, math.inf)
    num_steps = _num_steps(x.shape[0], batch_size, passes, schedule, drop_remainder)

    # ---- learning rate(s): every planned step's rate, concrete ----
    rates = None
    if _is_schedule(learning_rate):
        rates = _schedule_rates(learning_rate, num_steps)
        if not np.all(np.isfinite(rates) & (rates > 0)):
            bad = int(np.flatnonzero(~(np.isfinite(rates) & (rates > 0)))[0])
            raise ValueError(f"learning_rate must be in (0, inf) at every step; step {bad} has {rates[bad]!r}.")
        eta_min, eta_max = float(rates.min()), float(rates.max())
    else:
        _validate.check_in_range("learning_rate", learning_rate, 0.0, math.inf, lo_open=True)
        eta_min = eta_max = float(learning_rate)

    # ---- the model's declaration ----
    loss_given = loss_fn is not None
    loss_fn = declared_loss_fn(model, loss_fn)
    declared = _declared_constants(model, loss_given, x_bound)
    if convex is not None:
        is_convex = bool(convex)
    elif declared is not None:
        is_convex = bool(declared.convex) and bool(getattr(model, "is_convex", True))
    else:
        is_convex = bool(getattr(model, "is_convex", isinstance(model, HiddenStateModel)))
    constants = declared
    if lipschitz is not None or smoothness is not None:
        if lipschitz is None or smoothness is None:
            raise ValueError("pass both lipschitz and smoothness (the constants of a convex loss), or neither.")
        constants = LossConstants(float(lipschitz), float(smoothness))
    if strong_convexity is None:
        strong_convexity = float(constants.strong_convexity) if constants is not None else 0.0
    strong_convexity = float(strong_convexity)
    if is_convex and constants is None:
        raise ValueError(
            "a convex guarantee needs the loss's constants: use a jaxdp.data.Dataset (its "
            "feature_norm_bound gives them for a model declaring loss_constants, e.g. "
            "LogisticRegression/SoftmaxRegression with their default loss) or pass lipschitz= and smoothness=."
        )
    lip_bound, beta = (float(constants.lipschitz), float(constants.smoothness)) if is_convex else (None, None)
    if is_convex:
        # The library's one step-size rule, 0 < eta_t <= 2/(beta + rho) at every step (also checks rho <= beta).
        _validate.check_learning_rate(eta_max, beta, strong_convexity)
        if x_bound is not None and constants is declared:
            norms = np.linalg.norm(x.astype(np.float64), axis=1)
            if norms.size and norms.max() > x_bound:
                raise ValueError(
                    f"a training row has L2 norm {norms.max():.9g} > feature_norm_bound = {x_bound:g}, "
                    "so the model's Lipschitz bound does not hold."
                )
    if clip_norm is None:
        if lip_bound is None:
            raise ValueError(
                "clip_norm is required for a model without a Lipschitz bound (e.g. an MLP): the "
                "clipped gradient's norm C sets the sensitivity."
            )
        clip_norm = lip_bound
    clip_norm = float(clip_norm)

    # ---- which analysis ----
    name = type(model).__name__
    if return_intermediates:
        analysis, reason = _COMPOSITION, (
            "return_intermediates=True releases every iterate, so amplification by iteration does "
            "not apply; composition over the released steps holds")
    elif not is_convex:
        what = ("is not convex" if declared is not None or getattr(model, "is_convex", None) is False
                else "declares no convex loss with constants")
        analysis, reason = _COMPOSITION, (
            f"{name} {what}: a gradient step is not known to be a contraction, so the convex "
            "analyses do not cover it; composition of the noisy steps (sensitivity 2C/b) holds")
    elif constants is declared and float(declared.radius) < float(radius):
        analysis, reason = _COMPOSITION, (
            f"{name}'s loss constants hold for parameters of norm <= {float(declared.radius):g}, but the "
            f"training ball has radius {float(radius):g}, so L and beta are not known to hold")
    elif clip_norm < lip_bound:
        analysis, reason = _COMPOSITION, (
            f"clip_norm C={clip_norm:g} is below the Lipschitz bound L={lip_bound:g}: clipping may act on "
            "a neighbouring data set, so the update is not known to be a contraction")
    else:
        analysis = _STOP if schedule == "random_stop" else _HIDDEN
        eta_text = f"eta={eta_min:g}" if rates is None else f"eta_t in [{eta_min:g}, {eta_max:g}]"
        reason = (
            f"convex loss, L={lip_bound:g}, beta={beta:g}, {eta_text} <= 2/(beta+rho), C={clip_norm:g} >= L "
            "(no per-example gradient clipped, verified at run time), only the final iterate released")
    acct_lip = min(clip_norm, lip_bound) if (lip_bound is not None and analysis != _COMPOSITION) else clip_norm
    if rates is not None and analysis != _COMPOSITION and eta_max > eta_min:
        acct_lip *= eta_max / eta_min
        reason += (f"; the learning-rate schedule is accounted as the constant step eta*={eta_min:g} with "
                   f"L*=L*max(eta)/min(eta)={acct_lip:g} (worst contraction, largest shift-to-noise ratio)")
    return PrivacyPlan(analysis=analysis, reason=reason, convex=is_convex, loss_fn=loss_fn, clip_norm=clip_norm,
                       lipschitz=float(acct_lip), lipschitz_bound=lip_bound, smoothness=beta,
                       strong_convexity=strong_convexity, learning_rate=eta_min, learning_rates=rates,
                       num_steps=num_steps)
