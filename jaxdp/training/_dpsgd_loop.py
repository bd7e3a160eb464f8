r"""The DP-SGD driver behind ``train(..., algorithm="dpsgd")``.

Each step draws a Poisson sample of the training set with rate :math:`q = b/N` (``b`` the
expected batch size), sums the per-example gradients clipped at :math:`C` over it, adds
:math:`\mathcal N(0, \nu^2C^2 I)`, divides by :math:`b` and applies the optimizer
(:func:`~jaxdp.training.dpsgd_step`, :func:`~jaxdp.training.dpsgd`). Steps are scanned one
pass (:math:`\lceil N/b\rceil` steps) per jitted call. The sampling and noise keys come from
the secret key (OS entropy unless ``noise_seed``); the guarantee is
``dpsgd_epsilon(q, ν, steps, δ)`` for every record, add/remove neighbours, every iterate
possibly released, whatever the model (no convexity needed).

With a ``checkpoint_dir`` the driver keeps **every** checkpoint, the initial model (step 0)
included, with the ledger ``(q, noise_multiplier, clip_norm, steps)``: per-instance
accounting (:func:`~jaxdp.training.clipped_norms_at_checkpoints`) measures each record's
clipped gradient norm on the models recorded there.
"""

from __future__ import annotations

import math
import time
import warnings

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from .. import _validate
from ._dpsgd import batch_capacity, dpsgd, dpsgd_step
from ._ledger import NOT_PRIVATE, DPSGDLedger, privacy_report

_FORMAT = 1
# The padded batch: a second chunk in about 1% of steps (the overflow never drops a sampled
# record, so this is speed only). Expected rows per step, c·(1 + P(S > c)), are within a
# few percent of their flat minimum from 1% to 5% overflow, against c ≈ mean + 4.9 sd for
# 1e-6 (256/10,000: 293 rows against 334, 11% fewer). The overflow chunk runs in a while
# loop, whose convolutions are as fast as straight-line ones since the clipping code writes
# them in XLA's canonical form (_clipping._canonical_conv).
_OVERFLOW = 1e-2


def train_dpsgd(model, x, y, x_test, y_test, *, loss_fn, learning_rate, optimizer, noise_multiplier, clip_norm,
                batch_size, passes, delta, order_seed, noise_seed, steps_per_call, checkpoint_dir,
                checkpoint_every, resume, progress, account, callback, use_fast_path, fingerprint, mesh=None,
                checkpoint_key=None):
    """Run DP-SGD; arguments as validated by :func:`jaxdp.training.train`."""
    from ._loop import TrainState, _check_finite, _finish, _open_checkpoints, _resume, _secret_key, _to_arrays

    _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True)
    if clip_norm is None:
        raise ValueError("clip_norm is required with algorithm='dpsgd': the clip norm C sets the sensitivity.")
    _validate.check_in_range("clip_norm", clip_norm, 0.0, math.inf, lo_open=True)
    if optimizer is None:
        if learning_rate is None:
            raise ValueError("pass learning_rate (plain SGD) or optimizer (any optax optimizer) with algorithm='dpsgd'.")
        _validate.check_in_range("learning_rate", learning_rate, 0.0, math.inf, lo_open=True)
        optimizer = optax.sgd(float(learning_rate))
    elif not isinstance(optimizer, optax.GradientTransformation):
        raise ValueError(f"optimizer must be an optax.GradientTransformation; got {type(optimizer).__name__}.")
    n = int(x.shape[0])
    if batch_size > n:
        raise ValueError(f"batch_size must be <= the number of training examples ({n}); got {batch_size}.")
    q = batch_size / n
    steps_per_pass = math.ceil(n / batch_size)
    total = passes * steps_per_pass
    capacity = batch_capacity(n, q, overflow=_OVERFLOW)
    if steps_per_call is None:
        steps_per_call = steps_per_pass
    if checkpoint_every is None:
        checkpoint_every = steps_per_pass

    params0 = nnx.split(model, nnx.Param, ...)[1]
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    config = {
        "format": _FORMAT, "algorithm": "dpsgd", "model": type(model).__qualname__,
        "loss_fn": getattr(loss_fn, "__qualname__", repr(loss_fn)),
        "params": str(jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), params0)), "data": fingerprint,
        "learning_rate": None if learning_rate is None else float(learning_rate),
        "noise_multiplier": float(noise_multiplier), "clip_norm": float(clip_norm), "batch_size": int(batch_size),
        "passes": int(passes), "delta": float(delta), "order_seed": int(order_seed), "steps_per_call": steps_per_call,
    }
    ckpt = _open_checkpoints(checkpoint_dir, resume, checkpoint_key)
    if ckpt is not None:
        ckpt.max_to_keep = None  # every checkpoint stays: per-instance accounting reads them all

    if noise_seed is not None:
        warnings.warn(f"noise_seed is fixed: {NOT_PRIVATE}.", UserWarning, stacklevel=3)
    secret = _secret_key(noise_seed)
    if mesh is not None:
        from ._parallel import _same_secret_on_all_processes

        secret = _same_secret_on_all_processes(secret)
    k_noise, k_sample = jax.random.split(secret)
    tx = dpsgd(optimizer, float(noise_multiplier), float(clip_norm), float(batch_size), k_noise)
    reason = (f"Poisson sampling q={q:.6g} (expected batch {batch_size} of {n}), per-example clipping at "
              f"C={float(clip_norm):g}, Gaussian noise nu*C on the sum (nu={float(noise_multiplier):g}), add/remove "
              "neighbours, every iterate may be released: sampled-Gaussian RDP composed over the steps, valid for "
              "any model")
    ledger = DPSGDLedger(
        analysis="dpsgd", reason=reason, q=q, noise_multiplier=float(noise_multiplier), clip_norm=float(clip_norm),
        learning_rate=None if learning_rate is None else float(learning_rate), batch_size=int(batch_size),
        records=n, passes=int(passes), steps_per_pass=steps_per_pass, total_steps=total, steps_done=0,
        capacity=capacity, delta=float(delta), order_seed=int(order_seed), fixed_noise_seed=noise_seed is not None,
        max_grad_norm=0.0)
    state = TrainState(params=params0, opt_state=tx.init(params0), step=jnp.zeros((), jnp.int32),
                       order=jnp.zeros((1,), jnp.int32), total_steps=jnp.asarray(total, jnp.int32),
                       max_grad_norm=jnp.zeros((), jnp.float32), clipped=jnp.zeros((), jnp.int32), ledger=ledger,
                       sample_key=k_sample)
    state, _ = _resume(ckpt, state, config, checkpoint_dir, DPSGDLedger)

    pdtype = jnp.result_type(*jax.tree.leaves(params0))
    X = jnp.asarray(x, dtype=pdtype)
    Y = jnp.asarray(y)
    if mesh is not None:  # data parallel: all replicated; the step splits each chunk's rows
        from ._parallel import _replicate_state, replicate

        state, (X, Y), rest = _replicate_state(state, mesh), replicate((X, Y), mesh), replicate(rest, mesh)

    def one(carry):
        params, opt_state, step, maxn, key = carry
        key, k_step = jax.random.split(key)
        params, opt_state, out = dpsgd_step(loss_fn, graphdef, rest, tx, params, opt_state, k_step, X, Y, q,
                                            float(clip_norm), capacity, use_fast_path=use_fast_path, mesh=mesh)
        return params, opt_state, step + 1, jnp.maximum(maxn, out.max_grad_norm), key

    run_one = jax.jit(one)
    run = jax.jit(lambda c: jax.lax.scan(lambda c, _: (one(c), None), c, None, length=steps_per_call)[0])

    start = int(state.step)
    pbar = None
    if progress:
        from tqdm.auto import tqdm

        pbar = tqdm(total=total, initial=start, desc="DP-SGD", unit="step", leave=True)
    history: list = []
    carry = (state.params, state.opt_state, state.step, state.max_grad_norm, state.sample_key)
    last_saved = start
    if ckpt is not None and start == 0 and ckpt.latest_step() is None:
        # The initial model too: the first steps' per-point norms are measured on it.
        ckpt.save_train(0, _to_arrays(state), {"ledger": state.ledger.to_json(), "config": config})
    t0 = time.perf_counter()
    t_acct = 0.0
    try:
        s = start
        while s < total:
            # Whole scanned calls where they fit, single steps for the rest: the same calls on resume.
            if s % steps_per_call == 0 and s + steps_per_call <= total:
                carry = run(carry)
                length = steps_per_call
            else:
                carry = run_one(carry)
                length = 1
            s += length
            _check_finite(carry[0], carry[3], "DP-SGD")
            led = state.ledger._replace(steps_done=s, max_grad_norm=float(carry[3]))
            state = state._replace(params=carry[0], opt_state=carry[1], step=carry[2], max_grad_norm=carry[3],
                                   sample_key=carry[4], ledger=led)
            done = s >= total
            if ckpt is not None and (done or s - last_saved >= checkpoint_every):
                ckpt.save_train(s, _to_arrays(state), {"ledger": led.to_json(), "config": config})
                last_saved = s
            if pbar is not None:
                pbar.update(length)
                if account and (done or s % steps_per_pass == 0):
                    ta = time.perf_counter()
                    summ = privacy_report(led).summary()
                    t_acct += time.perf_counter() - ta
                    history.append((s, summ))
                    pbar.set_postfix_str(f"eps {summ['worst']:.3g}")
            if callback is not None:
                callback(state)
    finally:
        if pbar is not None:
            pbar.close()
        if ckpt is not None:
            ckpt.close()
    seconds = time.perf_counter() - t0 - t_acct
    return _finish(graphdef, rest, state, account, progress, x_test, y_test, pdtype, None, history, seconds)
