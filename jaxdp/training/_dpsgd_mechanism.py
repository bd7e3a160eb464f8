r"""DP-SGD as a mechanism: its configuration, state, plan and ledger (the step is :func:`~jaxdp.training.dpsgd_step`).

Each step draws a Poisson sample of the training set with rate :math:`q = b/N` (``b`` the
expected batch size), sums the per-example gradients clipped at :math:`C` over it, adds
:math:`\mathcal N(0, \nu^2C^2 I)`, divides by :math:`b` and applies the optimizer. The
sampling and noise keys come from the secret key; the guarantee is
``dpsgd_epsilon(q, ν, steps, δ)`` for every record, add/remove neighbours, every iterate
possibly released, whatever the model (no convexity needed).

With ``sampler=`` another batch scheme of :mod:`jaxdp.training.samplers` picks the batches
(truncated Poisson, fixed size, balls-in-bins, shuffling), and the guarantee is that
scheme's event (:meth:`~jaxdp.training.samplers.Sampler.event`), never the Poisson one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ..accounting import calibrate_noise_multiplier
from . import _config
from ._config import frozen_config, replace
from ._dpsgd import batch_capacity, dpsgd, dpsgd_step
from ._ledger import DPSGDLedger, privacy_report
from ._parallel import replicate
from ._per_example import _up
from ._plan import _is_schedule, declared_loss_fn
from ._run import FORMAT, Run, calibrate_to_target, certify_noise, param_dtype
from ._transforms import _learning_rate_fn
from .samplers import Poisson, Sampler

__all__ = ["DPSGDMechanism", "DPSGDState"]

# The padded batch: a second chunk in about 1% of steps (the overflow never drops a sampled
# record, so this is speed only). Expected rows per step, c·(1 + P(S > c)), are within a
# few percent of their flat minimum from 1% to 5% overflow, against c ≈ mean + 4.9 sd for
# 1e-6 (256/10,000: 293 rows against 334, 11% fewer). The overflow chunk runs in a while
# loop, whose convolutions are as fast as straight-line ones since the clipping code writes
# them in XLA's canonical form (_clipping._canonical_conv).
_OVERFLOW = 1e-2


@frozen_config
class DPSGDMechanism:
    r"""DP-SGD with true Poisson sampling (or another ``sampler``), for any Flax NNX model (Abadi et al. 2016).

    Every step samples each record independently with probability :math:`q = b/N`
    (``batch_size`` is the expected batch size :math:`b`), clips the per-example gradients at
    :math:`C`, adds :math:`\mathcal N(0, \nu^2C^2 I)` to their sum (``noise_multiplier``
    relative to :math:`C`, as in Opacus and dp_accounting), divides by :math:`b` and applies
    ``optimizer`` (default ``optax.sgd(learning_rate)``; post-processing), for
    ``passes``·:math:`\lceil N/b\rceil` steps. Its ε is
    :func:`~jaxdp.accounting.dpsgd_epsilon` ``(q, ν, steps, δ)`` for every record
    (add/remove neighbours, every iterate possibly released).

    Attributes:
      clip_norm: :math:`C > 0`.
      noise_multiplier: :math:`\nu > 0`; or
      target_epsilon: the ε to calibrate :math:`\nu` for
        (:func:`~jaxdp.accounting.calibrate_noise_multiplier` at this run's :math:`q`, steps and δ).
      batch_size: the expected batch size :math:`b \ge 1` (at most :math:`N`).
      passes: :math:`\ge 1`; the run does ``passes``·:math:`\lceil N/b\rceil` steps.
      learning_rate: of plain SGD: a number, a 1-D array of per-step rates or an optax schedule; or
      optimizer: any optax optimizer (not both).
      loss_fn: ``loss_fn(model, x, y) -> (b,)``; default the model's own ``loss(x, y)``.
      use_fast_path: passed to :func:`~jaxdp.training.clipped_grad_sum`.
      micro_batch_size: gradient accumulation: each step's Poisson batch is processed in
        micro-batches of this many rows inside the one compiled step (memory of one
        micro-batch); the clipped sum is the same, the noise added once, the accounting
        unchanged (see :func:`~jaxdp.training.dpsgd_step`). Default: one padded batch.
      trainable: nnx filter of the trained parameters (default every ``nnx.Param``; e.g.
        ``nnx.LoRAParam``): only these are clipped, noised and updated; the others are
        public and stay as they are.
      sampler: the batch scheme, a :mod:`jaxdp.training.samplers` sampler (default
        Poisson sampling at rate ``batch_size``/:math:`N`, as without it). Its sizes left
        ``None`` come from ``batch_size``; a sampler that sets its own size takes
        ``batch_size`` off (leave it at its default). The run's ledger, reports and
        ``target_epsilon`` use the sampler's event
        (:meth:`~jaxdp.training.samplers.Sampler.event`): the ε is always the scheme's;
        a pass is the sampler's ``steps_per_pass``; the noisy sum is divided by its
        expected batch size.

    Examples:
      >>> DPSGDMechanism(clip_norm=1.0, noise_multiplier=1.1, learning_rate=0.5).passes
      1
      >>> DPSGDMechanism(clip_norm=1.0, noise_multiplier=1.1, learning_rate=0.5, radius=0.001)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: radius is not a field of DPSGDMechanism (it belongs to PNSGDMechanism); its fields are ...
    """

    clip_norm: float
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    batch_size: int = 64
    passes: int = 1
    learning_rate: Any = None
    optimizer: optax.GradientTransformation | None = None
    loss_fn: Callable | None = None
    use_fast_path: bool | None = None
    micro_batch_size: int | None = None
    trainable: Any = nnx.Param
    sampler: Sampler | None = None

    def __post_init__(self):
        _config.check_noise_or_target("DPSGDMechanism", "noise_multiplier", self.noise_multiplier, self.target_epsilon)
        _config.check_positive("clip_norm", self.clip_norm)
        _config.check_optional_positive(noise_multiplier=self.noise_multiplier)
        _config.check_count("batch_size", self.batch_size)
        _config.check_count("passes", self.passes)
        if self.optimizer is not None and not isinstance(self.optimizer, optax.GradientTransformation):
            raise ValueError(f"optimizer must be an optax.GradientTransformation; got {type(self.optimizer).__name__}.")
        if (self.learning_rate is None) == (self.optimizer is None):
            raise ValueError("DPSGDMechanism needs exactly one of learning_rate (plain SGD) and optimizer (any optax "
                             f"optimizer); got {'both' if self.optimizer is not None else 'neither'}.")
        if self.learning_rate is not None and not _is_schedule(self.learning_rate):
            _config.check_positive("learning_rate", self.learning_rate)
        _config.check_callable("loss_fn", self.loss_fn, "loss_fn(model, x, y) -> per-example losses (b,)")
        _config.check_flag("use_fast_path", self.use_fast_path, allow_none=True)
        if self.micro_batch_size is not None:
            _config.check_count("micro_batch_size", self.micro_batch_size)
        if self.sampler is not None:
            if not isinstance(self.sampler, Sampler) or type(self.sampler) is Sampler:
                raise ValueError("sampler must be a jaxdp.training.samplers sampler (Poisson, TruncatedPoisson, "
                                 f"FixedSize, BallsInBins, Shuffle); got {type(self.sampler).__name__}.")
            if self.sampler.num_records is not None:
                raise ValueError("sampler must not be bound to a data set (the run binds it); pass it without "
                                 "num_records.")
            if self.batch_size != 64 and _own_size(self.sampler) is not None:
                raise ValueError(f"batch_size={self.batch_size} and sampler={self.sampler!r} both set the batch; "
                                 "give the size to one of them.")


class DPSGDState(NamedTuple):
    """Everything needed to continue a DP-SGD run bit-identically (all checkpointed).

    Attributes:
      params: the model's ``nnx.Param`` state.
      opt_state: the :func:`~jaxdp.training.dpsgd` chain state, with the secret noise key.
      step: steps done, ``int32``.
      max_grad_norm: largest unclipped per-example gradient norm seen, float32.
      sample_key: the secret key of the Poisson sampling (split every step).
    """

    params: Any
    opt_state: Any
    step: jax.Array
    max_grad_norm: jax.Array
    sample_key: jax.Array


def _reason(q, batch_size, n, clip_norm, nu) -> str:
    return (f"Poisson sampling q={q:.6g} (expected batch {batch_size} of {n}), per-example clipping at "
            f"C={clip_norm:g}, Gaussian noise nu*C on the sum (nu={nu:g}), add/remove neighbours, every iterate "
            "may be released: sampled-Gaussian RDP composed over the steps, valid for any model")


def setup(mech: DPSGDMechanism, model, x, y, x_bound, *, delta, order_seed, secret, fixed_seed, mesh,
          options) -> Run:
    """DP-SGD on ``model`` and ``(x, y)``: ledger, initial state and the compiled calls."""
    n = int(x.shape[0])
    batch_size, passes, clip_norm = mech.batch_size, mech.passes, float(mech.clip_norm)
    default = mech.sampler is None or (isinstance(mech.sampler, Poisson) and mech.sampler.q is None)
    if default and batch_size > n:
        raise ValueError(f"batch_size must be <= the number of training examples ({n}); got {batch_size}.")
    loss_fn = declared_loss_fn(model, mech.loss_fn)
    learning_rate, optimizer = mech.learning_rate, mech.optimizer
    if learning_rate is not None and _is_schedule(learning_rate):
        # DP-SGD's guarantee does not depend on the learning rate: any schedule is free.
        optimizer, learning_rate = optax.sgd(_learning_rate_fn(learning_rate)[0]), None
    elif optimizer is None:
        optimizer = optax.sgd(float(learning_rate))
    sampler, q, steps_per_pass, capacity, norm = _bind_sampler(mech.sampler, n, batch_size)
    spec = None if isinstance(sampler, Poisson) else sampler.spec()  # Poisson: the ledger of old
    if not default:
        batch_size = max(1, round(sampler.expected_batch_size))
    total = passes * steps_per_pass
    steps_per_call = steps_per_pass if options.steps_per_call is None else options.steps_per_call
    nu = mech.noise_multiplier
    if nu is None:
        if spec is None:
            nu = _noise_for_target(float(mech.target_epsilon), q, total, float(delta))
        else:
            nu = _noise_for_sampler(float(mech.target_epsilon), sampler, total, float(delta))
        mech = replace(mech, noise_multiplier=nu, target_epsilon=None)
    nu = float(nu)

    graphdef, params0, rest = nnx.split(model, mech.trainable, ...)
    pdtype = param_dtype(params0)
    config = {
        "format": FORMAT, "mechanism": "dpsgd", "model": type(model).__qualname__,
        "loss_fn": getattr(loss_fn, "__qualname__", repr(loss_fn)),
        "params": str(jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), params0)),
        "learning_rate": None if learning_rate is None else float(learning_rate),
        "noise_multiplier": nu, "clip_norm": clip_norm, "batch_size": batch_size,
        "passes": passes, "delta": float(delta), "order_seed": int(order_seed), "steps_per_call": steps_per_call,
    }
    if mech.micro_batch_size is not None:  # the sums' order: part of a bit-identical resume
        config["micro_batch_size"] = int(mech.micro_batch_size)
    if mech.trainable is not nnx.Param:
        config["trainable"] = repr(mech.trainable)
    if not default:
        config["sampler"] = sampler.spec()
    k_noise, k_sample = jax.random.split(secret)
    tx = dpsgd(optimizer, nu, clip_norm, norm, k_noise)
    reason = _reason(q, batch_size, n, clip_norm, nu) if spec is None else _sampler_reason(sampler, clip_norm, nu)
    ledger = DPSGDLedger(
        analysis="dpsgd", reason=reason, q=q, noise_multiplier=nu,
        clip_norm=clip_norm, learning_rate=None if learning_rate is None else float(learning_rate),
        batch_size=batch_size, records=n, passes=passes, steps_per_pass=steps_per_pass, total_steps=total,
        steps_done=0, capacity=capacity, delta=float(delta), order_seed=int(order_seed), fixed_noise_seed=fixed_seed,
        max_grad_norm=0.0, sampler=spec)
    # The optimizer sees the float32 (at least) clipped sum: its state in that dtype too.
    state = DPSGDState(params=params0, opt_state=tx.init(jax.tree.map(_up, params0)), step=jnp.zeros((), jnp.int32),
                       max_grad_norm=jnp.zeros((), jnp.float32), sample_key=sampler.init_key(k_sample))

    X, Y = jnp.asarray(x, dtype=pdtype), jnp.asarray(y)
    if mesh is not None:  # data parallel: all replicated; the step splits each chunk's rows
        (X, Y), rest = replicate((X, Y), mesh), replicate(rest, mesh)

    def one(carry):
        params, opt_state, step, maxn, key = carry
        key, indices, size = sampler.sample(key, step)
        params, opt_state, out = dpsgd_step(loss_fn, graphdef, rest, tx, params, opt_state, None, X, Y, q,
                                            clip_norm, capacity, use_fast_path=mech.use_fast_path, mesh=mesh,
                                            micro_batch_size=mech.micro_batch_size, wrt=mech.trainable,
                                            batch=(indices, size))
        return params, opt_state, step + 1, jnp.maximum(maxn, out.max_grad_norm), key

    run_one = jax.jit(one)
    run_scan = jax.jit(lambda c: jax.lax.scan(lambda c, _: (one(c), None), c, None, length=steps_per_call)[0])

    def segments(start, stop):
        # Whole scanned calls where they fit, single steps for the rest: the same calls on resume.
        out, s = [], start
        while s < stop:
            whole = s % steps_per_call == 0 and s + steps_per_call <= stop
            out.append((s, steps_per_call, False) if whole else (s, 1, True))
            s += steps_per_call if whole else 1
        return out

    def run(st: DPSGDState, first, length, single):
        return DPSGDState(*(run_one if single else run_scan)(tuple(st))), None

    def after(led: DPSGDLedger, st: DPSGDState) -> DPSGDLedger:
        return led._replace(steps_done=int(st.step), max_grad_norm=float(st.max_grad_norm))

    return Run(name="DP-SGD", mechanism=mech, state=state, ledger=ledger, config=config,
               steps_per_pass=steps_per_pass, public_total=total, segments=segments, run=run, after=after,
               model=lambda st: nnx.merge(graphdef, st.params, rest), pdtype=pdtype,
               report_at=lambda s: s % steps_per_pass == 0, keep_every_checkpoint=True)


def _noise_for_target(target: float, q: float, num_steps: int, delta: float) -> float:
    """The calibrated ν (certified: the report's ε, the same accountant, is at most the target)."""
    nu = float(calibrate_noise_multiplier(target, q, num_steps, delta).noise_multiplier)
    if not math.isfinite(nu):
        raise ValueError(f"target_epsilon={target:g} is not reachable at delta={delta:g} with a noise multiplier up "
                         "to 1e4.")
    probe = DPSGDLedger("dpsgd", "", q, nu, 1.0, None, 1, 1, 1, num_steps, num_steps, num_steps, 1, delta, 0, False,
                        0.0)

    def worst(noise):
        return privacy_report(probe._replace(noise_multiplier=float(noise))).summary()["worst"]

    return certify_noise(worst, target, nu, "noise_multiplier")


def _own_size(sampler: Sampler):
    """The size a sampler sets itself (its rate, batch size or batches per epoch), or None."""
    own = {f.name for f in dataclasses.fields(sampler)} & {"q", "batch_size", "steps_per_pass"}
    return next((getattr(sampler, f) for f in sorted(own) if getattr(sampler, f) is not None), None)


def _bind_sampler(sampler: Sampler | None, n: int, batch_size: int):
    """``(bound sampler, q, steps per pass, capacity, divisor)``; Poisson from ``batch_size`` as before samplers."""
    if sampler is None or (isinstance(sampler, Poisson) and sampler.q is None):
        q = batch_size / n
        return (Poisson(q).bind(n), q, math.ceil(n / batch_size), batch_capacity(n, q, overflow=_OVERFLOW),
                float(batch_size))
    bound = sampler.bind(n, batch_size)
    return bound, bound.expected_batch_size / n, bound.steps_per_pass, bound.capacity, bound.expected_batch_size


def _sampler_reason(sampler: Sampler, clip_norm, nu) -> str:
    return (f"{sampler.describe()}; per-example clipping at C={clip_norm:g}, Gaussian noise nu*C on the sum "
            f"(nu={nu:g}), every iterate may be released, valid for any model")


def _noise_for_sampler(target: float, sampler: Sampler, num_steps: int, delta: float) -> float:
    """The smallest ν (to 0.2%) whose reported ε of the sampler's event after ``num_steps`` is at most ``target``."""
    n = sampler.num_records
    spec = sampler.spec()
    probe = DPSGDLedger("dpsgd", "", 0.0, 1.0, 1.0, None, 1, n, 1, num_steps, num_steps, num_steps, 1, delta, 0,
                        False, 0.0, spec)

    def worst(noise):
        return privacy_report(probe._replace(noise_multiplier=float(noise))).summary()["worst"]

    return calibrate_to_target(worst, target, 1.0, "noise_multiplier")
