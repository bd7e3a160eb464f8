r"""One driver for every mechanism: ``train(model, data, mechanism, ...)``.

The loop is written once: validation at the boundary, the secret key (OS entropy, the same
on every host), the mechanism's set-up, checkpoints with integrity and resume, the jitted
segments, progress, callback, the ledger after every segment, the report and the released
model. A mechanism (:class:`~jaxdp.training.PNSGDMechanism`,
:class:`~jaxdp.training.DPSGDMechanism`, :class:`~jaxdp.training.DPSBCDMechanism`) owns its
state, its step, its plan and its ledger (``setup`` in its module returns a
:class:`~jaxdp.training._run.Run`); the driver knows none of them.
"""

from __future__ import annotations

import math
import time
import warnings

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from .. import _validate
from . import _dpsbcd, _dpsgd_mechanism, _pnsgd
from ._config import RunOptions
from ._dpsbcd import DPSBCDMechanism, DPSBCDResult
from ._dpsgd_mechanism import DPSGDMechanism
from ._legacy import legacy_result, translate
from ._ledger import NOT_PRIVATE, privacy_report
from ._parallel import _check_same_data, _same_secret_on_all_processes, data_parallel_mesh, replicate
from ._pnsgd import PNSGDMechanism
from ._run import (
    TrainResult,
    _check_features,
    _check_finite,
    _check_labels,
    _fingerprint,
    _open_checkpoints,
    _resume,
    _secret_key,
    _short,
    _to_arrays,
    _unpack_data,
    accuracy,
)

__all__ = ["train", "train_dpsbcd"]

_SETUPS = {PNSGDMechanism: _pnsgd.setup, DPSGDMechanism: _dpsgd_mechanism.setup, DPSBCDMechanism: _dpsbcd.setup}


def train(model: nnx.Module, data, mechanism=None, *, delta: float = 1e-5, order_seed: int = 0,
          noise_seed: int | None = None, options: RunOptions | None = None, **deprecated) -> TrainResult:
    r"""Train ``model`` on ``data`` with a private ``mechanism`` and account its ε.

    The mechanism says what runs and which guarantee holds (its docstring gives the update,
    the analysis and its assumptions); ``options`` say how it runs (none of them changes the
    guarantee). The report (``result.privacy``, printed with ``options.progress``) leads with
    the release's ε at ``delta``.

    **Order and secret randomness.** The records are shuffled once,
    ``order = jax.random.permutation(jax.random.key(order_seed), n)``: the order is public
    and does not depend on the data. The noise (and DP-SGD's sampling, and the random
    stopping time) come from a **separate, secret** key drawn from the operating system's
    entropy (:func:`secrets.token_bytes`) unless ``noise_seed`` is given; with several JAX
    processes, process 0's key is broadcast to all through JAX's collectives. The key is
    never printed, logged or written to the ledger or the report; it lives in the state and
    so in checkpoints, which must be kept as private as the data.

    **Checkpoints** (``options.checkpoint_dir``): atomic orbax checkpoints every
    ``options.checkpoint_every`` steps and at the end, named by a save counter (never the
    step), each with an integrity record; ``options.resume`` continues bit-identically from
    the newest intact one after the mechanism, model and data are checked to be the same
    and the stored ledger is recomputed from the configuration and the restored counters.
    A checkpoint of an older format is refused in one line.

    Args:
      model: a Flax NNX module whose ``nnx.Param`` variables are trained (not modified).
      data: a :class:`jaxdp.data.Dataset` (its ``feature_norm_bound`` gives the convex
        models' constants; its test part gives ``test_accuracy``) or a pair ``(x, y)``.
      mechanism: a :class:`~jaxdp.training.PNSGDMechanism`,
        :class:`~jaxdp.training.DPSGDMechanism` or :class:`~jaxdp.training.DPSBCDMechanism`.
      delta: target :math:`\delta \in (0, 1)`.
      order_seed: the public seed of the processing order (recorded in the ledger).
      noise_seed: ``None`` (default): the secret key comes from the OS entropy. An integer
        fixes it for tests and reproductions: the run is then **not private**, a
        ``UserWarning`` says so, and the ledger and report carry it.
      options: a :class:`~jaxdp.training.RunOptions` (default ``RunOptions()``).
      **deprecated: the keyword door of earlier releases (``algorithm=``, the mechanisms'
        fields and the run options as keywords), translated by :data:`DEPRECATIONS
        <jaxdp.training._legacy.DEPRECATIONS>` with a ``DeprecationWarning``; removed in the
        next release.

    Returns:
      :class:`~jaxdp.training.TrainResult`.

    Raises:
      ValueError: one line naming the parameter, before anything is written: a mechanism that
        does not fit the model or data (e.g. a step above :math:`2/(\beta+\rho)`, rows above the
        feature norm bound, ``batch_size`` above the number of records), NaN or infinite
        features, a bad ``delta``/``order_seed``/``noise_seed``, a non-empty checkpoint
        directory without ``resume``, or a checkpoint of another run or format.

    Examples:
      >>> from flax import nnx
      >>> from jaxdp.data import load_digits
      >>> from jaxdp.models import SoftmaxRegression
      >>> from jaxdp.training import PNSGDMechanism, RunOptions
      >>> mech = PNSGDMechanism(learning_rate=1.0, noise_multiplier=1.0, radius=30.0, batch_size=64, passes=2)
      >>> res = train(SoftmaxRegression(64, 10, rngs=nnx.Rngs(0)), load_digits(), mech,
      ...             options=RunOptions(progress=False))
      >>> res.privacy.analysis, int(res.state.step)
      ('hidden-state', 44)
    """
    if mechanism is None or deprecated:
        if mechanism is not None:
            raise ValueError("pass a mechanism or the deprecated keywords (algorithm=..., learning_rate=..., ...), "
                             f"not both; got {sorted(deprecated)[0]}=... with a mechanism.")
        mechanism, options = translate(deprecated, options, stacklevel=3)
        return legacy_result(_train(model, data, mechanism, delta, order_seed, noise_seed, options))
    return _train(model, data, mechanism, delta, order_seed, noise_seed, RunOptions() if options is None else options)


def _train(model, data, mechanism, delta, order_seed, noise_seed, options: RunOptions) -> TrainResult:
    # ---------------- validation (nothing is written before it passes) ----------------
    if not isinstance(model, nnx.Module):
        raise ValueError(f"model must be a Flax NNX module; got {type(model).__name__}.")
    setup = _SETUPS.get(type(mechanism))
    if setup is None:
        raise ValueError("mechanism must be a PNSGDMechanism, DPSGDMechanism or DPSBCDMechanism; got "
                         f"{type(mechanism).__name__}.")
    if not isinstance(options, RunOptions):
        raise ValueError(f"options must be a jaxdp.training.RunOptions; got {type(options).__name__}.")
    _validate.check_delta(delta)
    # jax.random.key takes a 64-bit seed: larger ones raised a bare OverflowError.
    if isinstance(order_seed, bool) or not isinstance(order_seed, (int, np.integer)) \
            or not -2**63 <= int(order_seed) < 2**63:
        raise ValueError(f"order_seed must be an integer in [-2**63, 2**63); got {order_seed!r}.")
    if noise_seed is not None and (isinstance(noise_seed, bool) or not isinstance(noise_seed, (int, np.integer))
                                   or not -2**63 <= int(noise_seed) < 2**63):
        raise ValueError(f"noise_seed must be None (secret key from the OS entropy) or an integer in "
                         f"[-2**63, 2**63); got {noise_seed!r}.")
    mesh = None
    if options.devices is not None:
        mesh = data_parallel_mesh(options.devices)
        if options.checkpoint_dir is not None and jax.process_count() > 1:
            raise ValueError("checkpoint_dir is not supported with several processes (jax.distributed): "
                             "checkpoint from one-process runs.")
    x, y, x_test, y_test, x_bound, _ = _unpack_data(data)
    x, y = np.asarray(x), np.asarray(y)
    _check_features(x)
    if y.shape != (x.shape[0],):
        raise ValueError(f"y must have shape ({x.shape[0]},), one label per example; got {y.shape}.")
    _check_labels(y, model, x, getattr(mechanism, "loss_fn", None), getattr(data, "num_classes", None))
    fingerprint = _fingerprint(x, y)
    if mesh is not None:
        _check_same_data(fingerprint)

    # ---------------- the secret key and the mechanism ----------------
    if noise_seed is not None:
        warnings.warn(f"noise_seed is fixed: {NOT_PRIVATE}.", UserWarning, stacklevel=3)
    secret = _secret_key(noise_seed)
    if mesh is not None:
        secret = _same_secret_on_all_processes(secret)
    run = setup(mechanism, model, x, y, x_bound, delta=delta, order_seed=order_seed, secret=secret,
                fixed_seed=noise_seed is not None, mesh=mesh, options=options)
    config = {**run.config, "data": fingerprint}
    ckpt = _open_checkpoints(options.checkpoint_dir, options.resume, options.checkpoint_key)
    if ckpt is not None and run.keep_every_checkpoint:
        ckpt.max_to_keep = None  # every checkpoint stays: per-instance accounting reads them all
    state, ledger, start = _resume(ckpt, run.state, run.ledger, config, options.checkpoint_dir)
    if mesh is not None:  # data parallel: the state replicated (the mechanism replicated the data)
        state = replicate(state, mesh)

    # ---------------- run ----------------
    # Positions are public: with random stopping the loop runs the whole pass (the steps after
    # the secret stopping time are masked), so segments, progress, history and checkpoint
    # times are the same whatever the stopping time.
    total = run.public_total
    every = options.checkpoint_every or run.steps_per_pass
    pbar = None
    if options.progress:
        pbar = tqdm(total=total, initial=start, desc=run.name, unit="step", leave=True)
    history: list = []
    inter: list = []
    last_saved, last_report = start, -math.inf
    if ckpt is not None and run.keep_every_checkpoint and start == 0 and ckpt.latest_step() is None:
        # The initial model too: the first steps' per-point norms are measured on it.
        ckpt.save_train(0, _to_arrays(state), {"ledger": ledger._asdict(), "config": config})
    t0 = time.perf_counter()
    t_acct = 0.0
    try:
        for first, length, partial in run.segments(start, total):
            state, ys = run.run(state, first, length, partial)
            if ys is not None:
                inter.append(jax.device_get(ys))
            position = first + length
            _check_finite(state[0], state.max_grad_norm, run.name)  # the parameters are every state's first field
            ledger = run.after(ledger, state)
            done = position >= total
            if ckpt is not None and (done or position - last_saved >= every):
                # The public position goes into the (secret-holding) checkpoint: a resumed
                # random-stop run continues the pass from there.
                meta = {"ledger": ledger._asdict(), "config": config, "position": position}
                ckpt.save_train(ledger.steps_done, _to_arrays(state), meta)
                last_saved = position
            if pbar is not None:
                pbar.update(length)
                if options.account and run.report_at(position) and (done or time.perf_counter() - last_report > 0.5):
                    ta = time.perf_counter()
                    summ = privacy_report(ledger).summary()
                    t_acct += time.perf_counter() - ta
                    history.append((position, summ))
                    pbar.set_postfix_str(f"eps[{_short(ledger.analysis)}] best {summ['best']:.3g} med "
                                         f"{summ['median']:.3g} worst {summ['worst']:.3g}")
                    last_report = time.perf_counter()
            if options.callback is not None:
                options.callback(state, ledger)
    finally:
        if pbar is not None:
            pbar.close()
        if ckpt is not None:
            ckpt.close()
    seconds = time.perf_counter() - t0 - t_acct

    # ---------------- the release ----------------
    intermediates = jax.tree.map(lambda *a: np.concatenate(a, axis=0), *inter) if inter else None
    trained = run.model(state)
    report = privacy_report(ledger) if options.account else None
    if report is not None and (not history or history[-1][0] != total):
        history.append((total, report.summary()))  # the public position: the end of the run
    if options.progress and report is not None:
        print(report.table())
    test_acc = None
    if x_test is not None and len(x_test):
        test_acc = accuracy(trained, np.asarray(x_test, dtype=np.dtype(run.pdtype)), np.asarray(y_test))
    return TrainResult(trained, state, report, test_acc, intermediates, history, seconds, ledger, run.mechanism)


def train_dpsbcd(model, data, *, learning_rate: float, noise_temperature, clip_norm: float, contraction,
                 batch_size: int, delta: float, weight_decay: float = 0.0, penalty: float = 1.0, order_seed: int = 0,
                 noise_seed: int | None = None) -> DPSBCDResult:
    r"""Deprecated shortcut: ``train(model, data, DPSBCDMechanism(...), options=RunOptions(progress=False))``.

    Kept for one release (``DeprecationWarning``); returns a :class:`DPSBCDResult` (``epsilon``
    is the worst record position's, the release's guarantee).

    References:
      C. Chen, D. Liu, arXiv:2407.08233v1 (2024), Algorithms 1-2, eqs. 2, 4-8, Theorem 4.6.

    Examples:
      >>> import warnings
      >>> import numpy as np
      >>> from flax import nnx
      >>> from jaxdp.models import LipschitzMLP
      >>> rng = np.random.default_rng(0)
      >>> x = rng.normal(size=(40, 3)).astype(np.float32); y = (x[:, 0] > 0).astype(int)
      >>> model = LipschitzMLP((3, 8, 2), rngs=nnx.Rngs(0), max_spectral_norm=2.0)
      >>> with warnings.catch_warnings():
      ...     warnings.simplefilter("ignore")
      ...     res = train_dpsbcd(model, (x, y), learning_rate=0.05, noise_temperature=[1e-3] * 2,
      ...                        clip_norm=1.0, contraction=1.0, batch_size=10, delta=1e-5, noise_seed=0)
      >>> bool(np.isfinite(res.epsilon))
      True
    """
    warnings.warn("train_dpsbcd is deprecated and will be removed in the next release: use "
                  "train(model, data, DPSBCDMechanism(...), options=RunOptions(progress=False)).",
                  DeprecationWarning, stacklevel=2)
    mech = DPSBCDMechanism(learning_rate=learning_rate, noise_temperature=noise_temperature, clip_norm=clip_norm,
                           contraction=contraction, batch_size=batch_size, weight_decay=weight_decay, penalty=penalty)
    res = _train(model, data, mech, delta, order_seed, noise_seed, RunOptions(progress=False))
    return DPSBCDResult(res.model, res.privacy.summary()["worst"], float(delta), res.ledger.event(), res.test_accuracy,
                        res.seconds)

