r"""PNSGD as a mechanism: its configuration, state, step, plan and ledger.

The update the hidden-state accountants analyse,

.. math::

    Y_{t+1} = \Pi_K\Bigl(Y_t - \eta\Bigl(\frac1{b_t}\sum_{i\in B_t}\bar g_i(Y_t) + Z_t\Bigr)\Bigr),
    \qquad Z_t \sim \mathcal N(0, \sigma^2 I),\quad \sigma = \nu\,\frac{2C}{b},

(:func:`jaxdp.training.pnsgd`, per-example clipping by :func:`jaxdp.training.clipped_grad_sum`)
over consecutive batches :math:`B_t` of a fixed order of the records, shuffled once from the
public ``order_seed``, for one or several passes in the same order, or one pass stopped
after a secret, uniformly drawn number of steps.

Execution: each jitted call runs up to ``steps_per_call`` steps under ``jax.lax.scan``
(default: one pass per call), with the data on the device and each batch gathered from the
order inside the step. Measured on the shared 2-core development CPU, compilation (~1 s)
included: digits, softmax regression, b = 64, 2,200 steps: 1.46 s scanning one pass per
call vs 1.64 s with one jitted call per step; MLP 784-256-10, b = 256, 160 steps: 2.35 s
vs 2.17 s (compute-bound: equal within the machine's noise).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from .. import _validate
from ..accounting import calibrate_pnsgd_noise_std
from ._clipping import clipped_grad_sum
from ._config import (
    check_callable,
    check_count,
    check_flag,
    check_noise_or_target,
    check_optional_positive,
    check_positive,
    frozen_config,
    replace,
)
from ._ledger import PrivacyLedger, _clipping_reason, demote, worst_epsilon
from ._parallel import parallel_clipped_grad_sum, replicate
from ._plan import _is_schedule, _plan_privacy, rate_config
from ._pnsgd_poisson import bind_sampler, check_contraction, plan_poisson, poisson_steps
from ._run import FORMAT, Run, _plan, _segments, certify_noise, param_dtype
from ._transforms import pnsgd, pnsgd_noise_std, project_onto_l2_ball

__all__ = ["PNSGDMechanism", "PNSGDState"]

_SCHEDULES = ("fixed", "random_stop")
_SAMPLINGS = ("sequential", "poisson", "shuffle")


@frozen_config
class PNSGDMechanism:
    r"""Projected noisy SGD with per-record ε: hidden-state, random-stop or composition analysis.

    **Update.** For :math:`t = 0, 1, \dots`, with batch :math:`B_t` (consecutive blocks of
    :math:`b` positions of the public order), per-example gradients clipped at :math:`C`,
    :math:`\sigma = \nu\cdot 2C/b` (:func:`~jaxdp.training.pnsgd_noise_std`) and
    :math:`K = \{\lVert\theta\rVert_2 \le R\}`:
    :math:`Y_{t+1} = \Pi_K(Y_t - \eta(\frac1{|B_t|}\sum_{i\in B_t}\min(1, C/\lVert g_i\rVert)g_i + Z_t))`.
    The start is the model's parameters projected onto :math:`K`.

    **Which guarantee** (:func:`~jaxdp.training.plan_privacy`, callable alone): a convex model
    with known constants (a :class:`~jaxdp.models.HiddenStateModel` on a
    :class:`~jaxdp.data.Dataset`, or ``convex=True`` with ``lipschitz`` and ``smoothness``),
    :math:`C \ge L` (default :math:`C = L`; the driver verifies at run time that no gradient
    was clipped) and :math:`\eta_t \le 2/(\beta+\rho)` get the hidden-state bound (or the
    random-stop bound with ``schedule="random_stop"``: one pass stopped after a secret
    :math:`T \sim \mathrm{Uniform}\{1..m\}` steps); anything else gets composition, with the
    reason in the report. A learning-rate schedule is accounted at its bounding constants
    (see :func:`~jaxdp.training.plan_privacy`).

    **Noise.** Give ``noise_multiplier`` :math:`\nu > 0` (the noise std over the sensitivity
    :math:`2C/b` of the averaged clipped gradient), or ``target_epsilon``: the smallest
    :math:`\nu` whose reported worst-record ε at the run's δ is at most the target, for
    this run's analysis, steps and the records actually used (after ``drop_remainder``);
    :attr:`TrainResult.mechanism <jaxdp.training.TrainResult>` holds the :math:`\nu` used.

    Attributes:
      learning_rate: :math:`\eta > 0`, a 1-D array of per-step rates, or an optax schedule.
      radius: :math:`R > 0` of the parameter ball (the accountant's :math:`D = 2R`).
      noise_multiplier: :math:`\nu > 0`; or
      target_epsilon: the worst-record ε to calibrate :math:`\nu` for.
      batch_size: :math:`b \ge 1`.
      passes: :math:`k \ge 1` in the same order (1 for random stopping).
      schedule: ``"fixed"`` or ``"random_stop"``.
      clip_norm: :math:`C > 0`; default the model's Lipschitz bound (required for other models).
      loss_fn: ``loss_fn(model, x, y) -> (b,)``; default the model's own ``loss(x, y)``.
      lipschitz, smoothness: :math:`L, \beta > 0` of a convex loss you declare.
      strong_convexity: :math:`\rho \ge 0` (default: the model's, else 0).
      convex: override the model's ``is_convex`` declaration.
      drop_remainder: skip the last :math:`n \bmod b` positions of the order (ε = 0 for them);
        otherwise they form a smaller last batch.
      return_intermediates: also return every iterate (the report becomes composition).
      use_fast_path: passed to :func:`~jaxdp.training.clipped_grad_sum`.
      sampling: ``"sequential"`` (default: the consecutive batches above) or ``"poisson"``:
        every step samples each record independently with probability :math:`q = b/N`
        (secret), cut to a uniformly random ``max_batch_size`` :math:`B` records when more
        are drawn, and divides the clipped sum by the fixed :math:`b`, for
        ``passes``·:math:`\lceil N/b\rceil` steps. A convex model then gets the hidden-state
        bound of :func:`~jaxdp.accounting.poisson_pnsgd_rdp` (add/remove neighbours, every
        record alike, flat in the steps after a burn-in; the event
        ``PNSGD(..., sampling="poisson")``), which needs :math:`\eta\beta B/b \le 2`
        (checked here when ``smoothness`` and ``max_batch_size`` are given, else when training
        starts). ``"shuffle"``: every pass cuts a fresh **secret** uniformly random permutation
        of the N records into consecutive batches (the last one smaller: ``drop_remainder``
        does not apply), each averaged over its size; a convex model gets the hidden-state
        bound of :func:`~jaxdp.accounting.shuffle_pnsgd_rdp` (replace-one neighbours, every
        record alike, flat in the passes; the event ``PNSGD(..., sampling="shuffle")``;
        ``docs/hidden_state_poisson.md`` §8).
      max_batch_size: :math:`B \ge 1` of ``sampling="poisson"``; ``None`` keeps every drawn
        record (then :math:`B = N + 1`, the neighbour's size, which only a tiny
        :math:`\eta\beta` allows).

    References:
      Feldman, Mironov, Talwar, Thakurta, "Privacy amplification by iteration", FOCS 2018
      (Algorithm 1, Thm 23); Asoodeh, Diaz, Calmon, "Privacy amplification of iterative
      algorithms via contraction coefficients", ISIT 2020 (Thms 4, 5).

    Examples:
      >>> PNSGDMechanism(learning_rate=1.0, radius=30.0, noise_multiplier=1.0).batch_size
      64
      >>> PNSGDMechanism(learning_rate=1.0, radius=30.0, noise_multiplier=1.0, optimizer=None)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: optimizer is not a field of PNSGDMechanism (it belongs to DPSGDMechanism); its fields are ...
    """

    learning_rate: Any
    radius: float
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    batch_size: int = 64
    passes: int = 1
    schedule: str = "fixed"
    clip_norm: float | None = None
    loss_fn: Callable | None = None
    lipschitz: float | None = None
    smoothness: float | None = None
    strong_convexity: float | None = None
    convex: bool | None = None
    drop_remainder: bool = True
    return_intermediates: bool = False
    use_fast_path: bool | None = None
    sampling: str = "sequential"
    max_batch_size: int | None = None

    def __post_init__(self):
        check_noise_or_target("PNSGDMechanism", "noise_multiplier", self.noise_multiplier, self.target_epsilon)
        check_optional_positive(noise_multiplier=self.noise_multiplier, clip_norm=self.clip_norm,
                                lipschitz=self.lipschitz, smoothness=self.smoothness)
        if not _is_schedule(self.learning_rate):  # a schedule is checked step by step by the plan
            check_positive("learning_rate", self.learning_rate)
        check_positive("radius", self.radius)
        check_count("batch_size", self.batch_size)
        check_count("passes", self.passes)
        _validate.check_static_choice("schedule", self.schedule, _SCHEDULES)
        if self.schedule == "random_stop" and self.passes != 1:
            raise ValueError(f"passes must be 1 with schedule='random_stop' (the random-stopping analyses are for "
                             f"one pass); got {self.passes}.")
        if self.schedule == "random_stop" and self.return_intermediates:
            raise ValueError("return_intermediates=True is not available with schedule='random_stop': the number of "
                             "iterates would reveal the secret stopping time.")
        if self.strong_convexity is not None:
            _validate.check_in_range("strong_convexity", self.strong_convexity, 0.0, math.inf)
        check_callable("loss_fn", self.loss_fn, "loss_fn(model, x, y) -> per-example losses (b,)")
        check_flag("convex", self.convex, allow_none=True)
        check_flag("drop_remainder", self.drop_remainder)
        check_flag("return_intermediates", self.return_intermediates)
        check_flag("use_fast_path", self.use_fast_path, allow_none=True)
        _check_sampling(self)


def _check_sampling(mech: PNSGDMechanism) -> None:
    """The batch scheme's fields (see :class:`PNSGDMechanism`), with the contraction ηβB/b ≤ 2 when β is given."""
    _validate.check_static_choice("sampling", mech.sampling, _SAMPLINGS)
    if mech.sampling != "poisson":
        if mech.max_batch_size is not None:
            raise ValueError(f"max_batch_size is a field of sampling='poisson' only; got sampling={mech.sampling!r}.")
        if mech.sampling == "shuffle" and mech.schedule != "fixed":
            raise ValueError("schedule='random_stop' is not available with sampling='shuffle' (the shuffled-batch "
                             "analysis is for whole passes); use schedule='fixed'.")
        return
    if mech.schedule != "fixed":
        raise ValueError("schedule='random_stop' is not available with sampling='poisson' (the Poisson analysis is "
                         "for a public number of steps); use schedule='fixed'.")
    if mech.max_batch_size is not None:
        check_count("max_batch_size", mech.max_batch_size)
        if mech.smoothness is not None and not _is_schedule(mech.learning_rate):
            check_contraction(float(mech.learning_rate), float(mech.smoothness), mech.max_batch_size, mech.batch_size)


class PNSGDState(NamedTuple):
    """Everything needed to continue a PNSGD run bit-identically (all checkpointed).

    Attributes:
      params: the model's ``nnx.Param`` state (the iterate :math:`Y_t`).
      opt_state: the :func:`~jaxdp.training.pnsgd` chain state, with the secret noise key.
      step: steps done, ``int32``.
      order: the public processing order, ``int32`` ``(n,)``: position ``p`` (1-based) is
        record ``order[p - 1]``.
      total_steps: steps the run does (``passes·m``, or the **secret** stopping time).
      max_grad_norm: largest unclipped per-example gradient norm seen, float32.
      clipped: number of per-example gradients with norm above :math:`C`, ``int32``.
      sample_key: ``sampling="poisson"``: the secret key of the batches (split every step);
        ``None`` for the fixed order. With Poisson batches ``order`` is the identity (no order is used).
    """

    params: Any
    opt_state: Any
    step: jax.Array
    order: jax.Array
    total_steps: jax.Array
    max_grad_norm: jax.Array
    clipped: jax.Array
    sample_key: Any = None


def _make_step(graphdef, rest, loss_fn, tx, clip_norm, use_fast_path=None, mesh=None):
    """The PNSGD step ``(carry, xb, yb, count) -> carry``, ``carry = (params, opt_state, step, maxn, clipped)``.

    ``count`` is the number of examples averaged (the batch size, or the last batch's).
    With a ``mesh`` the batch rows are split over its ``"data"`` axis; ``tx`` adds the noise
    once to the sum.
    """

    def one_step(carry, xb, yb, count):
        params, opt_state, step, maxn, clipped = carry
        m = nnx.merge(graphdef, params, rest)
        if mesh is None:
            cg = clipped_grad_sum(loss_fn, m, (xb, yb), clip_norm, use_fast_path=use_fast_path)
        else:
            cg = parallel_clipped_grad_sum(loss_fn, m, (xb, yb), clip_norm, mesh, use_fast_path=use_fast_path)
        g = jax.tree.map(lambda s: s / jnp.asarray(count, s.dtype), cg.grad_sum)
        updates, opt_state = tx.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        maxn = jnp.maximum(maxn, jnp.max(cg.norms).astype(maxn.dtype))
        # NaN norms count as above C: the run-time check "no gradient exceeded C" must fail on them.
        clipped = clipped + jnp.sum(~(cg.norms <= jnp.asarray(clip_norm, cg.norms.dtype))).astype(clipped.dtype)
        return (params, opt_state, step + 1, maxn, clipped)

    return one_step


def _noise_for_target(mech: PNSGDMechanism, ledger: PrivacyLedger, planned_steps: int) -> float:
    """ν whose reported worst-record ε at the end is at most ``mech.target_epsilon`` (≥ 98% of it)."""
    target, b, c = float(mech.target_epsilon), ledger.batch_size, ledger.clip_norm

    def worst(nu):
        led = ledger._replace(noise_multiplier=float(nu), noise_std=float(pnsgd_noise_std(nu, c, b)),
                              steps_done=planned_steps)
        return worst_epsilon(led)

    start = 1.0
    if ledger.schedule == "fixed":
        # The run's record (its noise_std is what is solved for); composition when demoted.
        sigma = calibrate_pnsgd_noise_std(target, ledger.delta, ledger.event())
        start = float(sigma) * b / (2.0 * c)  # the accountant's σ as the ν the report recomputes σ from
    return certify_noise(worst, target, start, "noise_multiplier")


def setup(mech: PNSGDMechanism, model, x, y, x_bound, *, delta, order_seed, secret, fixed_seed, mesh,
          options) -> Run:
    """PNSGD on ``model`` and ``(x, y)``: plan, ledger, initial state and the compiled segments."""
    poisson, shuffle = mech.sampling == "poisson", mech.sampling == "shuffle"
    drop = mech.drop_remainder and not (poisson or shuffle)  # random batches use every record
    pp = _plan_privacy(model, x, x_bound, learning_rate=mech.learning_rate, radius=mech.radius,
                       batch_size=mech.batch_size, passes=mech.passes, schedule=mech.schedule,
                       drop_remainder=drop, loss_fn=mech.loss_fn, clip_norm=mech.clip_norm,
                       lipschitz=mech.lipschitz, smoothness=mech.smoothness, strong_convexity=mech.strong_convexity,
                       convex=mech.convex, return_intermediates=mech.return_intermediates)
    plan = _plan(x.shape[0], mech.batch_size, drop)
    reason, extra = pp.reason, {}
    if poisson:
        sampler = bind_sampler(int(x.shape[0]), mech.batch_size, mech.max_batch_size)
        eta_max = float(pp.learning_rate if pp.learning_rates is None else pp.learning_rates.max())
        reason, extra = plan_poisson(pp, sampler, mech.batch_size, eta_max)
        plan = plan._replace(steps_per_pass=sampler.steps_per_pass)
    elif shuffle:
        reason, extra = f"{pp.reason}; secret batches reshuffled every pass, replace-one neighbours", {
            "sampling": "shuffle"}
    batch_size, passes, schedule, radius = mech.batch_size, mech.passes, mech.schedule, float(mech.radius)
    steps_per_call = plan.full_batches if options.steps_per_call is None else options.steps_per_call
    if mech.return_intermediates:
        warnings.warn(
            "return_intermediates=True: releasing intermediate iterates voids the hidden-state "
            "guarantees; the reported epsilon is the composition bound.", UserWarning, stacklevel=4)
    params0 = nnx.split(model, nnx.Param, ...)[1]
    pdtype = param_dtype(params0)
    top = math.sqrt(float(jnp.finfo(pdtype).max))
    if radius >= top:  # the projection squares R and the norm in the parameters' dtype
        raise ValueError(f"radius must be below {top:.3g} for {pdtype} parameters (its square must be finite); "
                         f"got {radius:g}.")
    ledger = PrivacyLedger(
        analysis=pp.analysis, reason=reason, convex=pp.convex, lipschitz=float(pp.lipschitz),
        smoothness=pp.smoothness, strong_convexity=float(pp.strong_convexity), learning_rate=float(pp.learning_rate),
        noise_multiplier=float("nan"), noise_std=float("nan"), clip_norm=pp.clip_norm,
        lipschitz_bound=pp.lipschitz_bound, diameter=2.0 * radius, records=plan.records,
        unused=plan.n_total - plan.records, batch_size=batch_size, passes=passes,
        steps_per_pass=plan.steps_per_pass, schedule=schedule, order_seed=int(order_seed),
        fixed_noise_seed=fixed_seed, total_steps=0, steps_done=0, delta=float(delta), clipped=0,
        max_grad_norm=0.0, intermediates_released=bool(mech.return_intermediates), **extra)
    nu = mech.noise_multiplier
    if nu is None:
        nu = _noise_for_target(mech, ledger, passes * plan.steps_per_pass)
    mech = replace(mech, noise_multiplier=float(nu), target_epsilon=None) if mech.target_epsilon is not None else mech
    nu = float(nu)
    ledger = ledger._replace(noise_multiplier=nu, noise_std=float(pnsgd_noise_std(nu, pp.clip_norm, batch_size)))
    config = {
        "format": FORMAT, "mechanism": "pnsgd", "model": type(model).__qualname__,
        "loss_fn": getattr(pp.loss_fn, "__qualname__", repr(pp.loss_fn)),
        "params": str(jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), params0)),
        "learning_rate": rate_config(mech.learning_rate, pp.learning_rates), "noise_multiplier": nu,
        "radius": radius, "batch_size": batch_size, "passes": passes, "schedule": schedule, "delta": float(delta),
        "order_seed": int(order_seed), "clip_norm": pp.clip_norm, "lipschitz": pp.lipschitz_bound,
        "smoothness": pp.smoothness, "strong_convexity": float(pp.strong_convexity), "convex": pp.convex,
        "drop_remainder": bool(mech.drop_remainder), "steps_per_call": steps_per_call,
        "return_intermediates": bool(mech.return_intermediates), **extra,
    }

    # ---------------- initial state ----------------
    order = jax.random.permutation(jax.random.key(int(order_seed)), plan.n_total).astype(jnp.int32)
    if poisson or shuffle:  # no public order: every record is sampled alike
        order = jnp.arange(plan.n_total, dtype=jnp.int32)
    k_noise, k_stop = jax.random.split(secret)  # Poisson or shuffled batches: k_stop is the sampling key
    if schedule == "random_stop":
        total = int(jax.random.randint(k_stop, (), 1, plan.steps_per_pass + 1))
    else:
        total = passes * plan.steps_per_pass
    lr = mech.learning_rate
    lr = lr if _is_schedule(lr) else float(lr)
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    X, Y, b = jnp.asarray(x, dtype=pdtype), jnp.asarray(y), batch_size
    if mesh is not None:  # data parallel: all replicated; the step splits each batch's rows
        (X, Y), rest = replicate((X, Y), mesh), replicate(rest, mesh)
    if poisson:
        tx, poisson_run, poisson_segments, poisson_report_at = poisson_steps(
            sampler, graphdef, rest, pp.loss_fn, X, Y, learning_rate=lr, noise_multiplier=nu, clip_norm=pp.clip_norm,
            radius=radius, key=k_noise, batch_size=batch_size, steps_per_call=steps_per_call,
            use_fast_path=mech.use_fast_path, mesh=mesh, keep=bool(mech.return_intermediates))
    else:
        tx = pnsgd(lr, nu, pp.clip_norm, radius, k_noise, batch_size=batch_size)
    params0 = project_onto_l2_ball(params0, radius)  # a start inside K
    ledger = ledger._replace(total_steps=total)
    state = PNSGDState(params=params0, opt_state=tx.init(params0), step=jnp.zeros((), jnp.int32), order=order,
                       total_steps=jnp.asarray(total, jnp.int32), max_grad_norm=jnp.zeros((), jnp.float32),
                       clipped=jnp.zeros((), jnp.int32),
                       sample_key=sampler.init_key(k_stop) if poisson else (k_stop if shuffle else None))

    # ---------------- compiled segments ----------------
    one_step = _make_step(graphdef, rest, pp.loss_fn, tx, pp.clip_norm, mech.use_fast_path, mesh)
    keep = bool(mech.return_intermediates)

    def masked_step(c, xb, yb, count, stop):
        # Every public position runs a step; those after the (traced, secret) stopping time
        # keep the carry unchanged. So no compiled program, trip count, progress line or
        # running time depends on the stopping time. A fixed schedule passes stop = total.
        new = one_step(c, xb, yb, count)
        if schedule != "random_stop":
            return new
        active = c[2] < stop
        return jax.tree.map(lambda n, o: jnp.where(active, n, o), new, c)

    def run_full(carry, order, first_batch, stop, length):
        def body(c, j):
            idx = jax.lax.dynamic_slice(order, (j * b,), (b,))
            c = masked_step(c, X[idx], Y[idx], b, stop)
            return c, (c[0] if keep else None)

        return jax.lax.scan(body, carry, first_batch + jnp.arange(length, dtype=jnp.int32))

    def run_partial(carry, order, stop):
        idx = order[plan.full_batches * b: plan.full_batches * b + plan.last_batch]
        c = masked_step(carry, X[idx], Y[idx], plan.last_batch, stop)
        return c, (jax.tree.map(lambda a: a[None], c[0]) if keep else None)

    run_full_jit = jax.jit(run_full, static_argnames=("length",))
    pass_order = jax.jit(lambda k, p: jax.random.permutation(jax.random.fold_in(k, p), plan.n_total).astype(jnp.int32))
    run_partial_jit = jax.jit(run_partial)

    def run(st: PNSGDState, first, length, partial):
        carry = (st.params, st.opt_state, st.step, st.max_grad_norm, st.clipped)
        # Shuffled batches: this pass's secret permutation, from the sampling key and the pass index
        # (segments never cross a pass, and a resumed run draws the same permutation).
        order = pass_order(st.sample_key, jnp.asarray(first // plan.steps_per_pass, jnp.int32)) if shuffle \
            else st.order
        if partial:
            carry, ys = run_partial_jit(carry, order, st.total_steps)
        else:
            j0 = first % plan.steps_per_pass
            carry, ys = run_full_jit(carry, order, jnp.asarray(j0, jnp.int32), st.total_steps, length=length)
        return PNSGDState(carry[0], carry[1], carry[2], st.order, st.total_steps, carry[3], carry[4],
                          st.sample_key), ys

    def after(led: PrivacyLedger, st: PNSGDState) -> PrivacyLedger:
        led = led._replace(steps_done=int(st.step), clipped=int(st.clipped), max_grad_norm=float(st.max_grad_norm))
        return demote(led, _clipping_reason(led)) if led.clipped > 0 else led

    def segments(start, stop):
        return _segments(start, stop, plan, steps_per_call)

    def report_at(position):
        p, t = divmod(position, plan.steps_per_pass)
        return p == 0 or t == 0 or schedule == "random_stop"

    def released(st: PNSGDState):
        return nnx.merge(graphdef, st.params, rest)

    if poisson:  # the sampled steps (the fixed-order ones above are never compiled)
        run, segments, report_at = poisson_run, poisson_segments, poisson_report_at
    return Run(name="PNSGD", mechanism=mech, state=state, ledger=ledger, config=config,
               steps_per_pass=plan.steps_per_pass,
               public_total=plan.steps_per_pass if schedule == "random_stop" else total, segments=segments,
               run=run, after=after, model=released, pdtype=pdtype, report_at=report_at)

