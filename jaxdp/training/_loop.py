r"""Train a Flax NNX model with projected noisy SGD and report ε per record position.

The loop runs the update the hidden-state accountants analyse,

.. math::

    Y_{t+1} = \Pi_K\Bigl(Y_t - \eta\Bigl(\frac1{b_t}\sum_{i\in B_t}\bar g_i(Y_t) + Z_t\Bigr)\Bigr),
    \qquad Z_t \sim \mathcal N(0, \sigma^2 I),\quad \sigma = \nu\,\frac{2C}{b},

(:func:`jaxdp.training.pnsgd`, per-example clipping by :func:`jaxdp.training.clipped_grad_sum`)
over consecutive batches :math:`B_t` of a fixed order of the records, shuffled once from a
recorded public seed, for one or several passes in the same order, or one pass stopped after a
uniformly drawn number of steps. A :class:`~jaxdp.training.PrivacyLedger` in the
:class:`TrainState` records what was spent; ε per position comes from
:func:`jaxdp.training.privacy_report`.

Execution: each jitted call runs up to ``steps_per_call`` steps under ``jax.lax.scan``
(default: one pass per call), with the data on the device and each batch gathered from
the order inside the step. Measured on the shared 2-core development CPU, compilation
(~1 s) included: digits, softmax regression, b = 64, 2,200 steps: 1.46 s scanning one pass
per call vs 1.64 s with one jitted call per step (``steps_per_call=1``); MLP 784-256-10,
b = 256, 160 steps: 2.35 s vs 2.17 s (compute-bound: equal within the machine's noise).
Scanning is never slower by more than the noise and saves the per-step dispatch on small
models, so it is the default.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from .. import _validate
from ._checkpoint import Checkpointer, _index_dirs
from ._clipping import clipped_grad_sum
from ._ledger import NOT_PRIVATE, PrivacyLedger, PrivacyReport, demote, privacy_report
from ._plan import _is_schedule, _plan_privacy, declared_loss_fn, rate_config
from ._transforms import _check_batch_size, _learning_rate_fn, pnsgd, pnsgd_noise_std

__all__ = ["TrainResult", "TrainState", "TrainingDivergedError", "accuracy", "train"]

_SCHEDULES = ("fixed", "random_stop")
_ALGORITHMS = ("pnsgd", "dpsgd", "dpsbcd")
_FORMAT = 2  # 2: order_seed and a secret noise key replace the single seed


class TrainState(NamedTuple):
    """Everything needed to continue a run bit-identically (all checkpointed).

    Attributes:
      params: the model's ``nnx.Param`` state (the current iterate :math:`Y_t`).
      opt_state: the :func:`~jaxdp.training.pnsgd` chain state, including the noise PRNG
        key (split every step) and the step count.
      step: steps done, ``int32`` scalar.
      order: the processing order, ``int32`` of shape ``(n_total,)``: position ``p``
        (1-based) is record ``order[p - 1]``; records past ``ledger.records`` are unused.
        DP-SGD has no order (a placeholder of shape ``(1,)``).
      total_steps: steps the run does (``passes·m``, or the secret stopping time).
      max_grad_norm: largest unclipped per-example gradient norm seen, float32 scalar.
      clipped: number of per-example gradients with norm above :math:`C`, ``int32``.
      ledger: the :class:`~jaxdp.training.PrivacyLedger` (host-side Python values), or a
        :class:`~jaxdp.training.DPSGDLedger` for DP-SGD.
      sample_key: DP-SGD's secret key of the Poisson sampling (split every step);
        ``None`` for PNSGD, whose order is public.
    """

    params: Any
    opt_state: Any
    step: jax.Array
    order: jax.Array
    total_steps: jax.Array
    max_grad_norm: jax.Array
    clipped: jax.Array
    ledger: Any
    sample_key: Any = None


class TrainResult(NamedTuple):
    """Result of :func:`train`.

    Attributes:
      model: the trained model (final iterate only, a new module; the input is untouched).
      state: the final :class:`TrainState`.
      privacy: the final :class:`~jaxdp.training.PrivacyReport`, or ``None`` with
        ``account=False`` (call ``privacy_report(state.ledger)`` later).
      test_accuracy: accuracy on the data set's test part, or ``None`` when it has none.
      intermediates: with ``return_intermediates=True``, the parameters after every step
        done in this call (leaves with a leading step axis); otherwise ``None``.
      history: ``(steps_done, {"best", "median", "worst"})`` after each reported segment.
      seconds: wall time of the training steps (compilation included, accounting excluded).
    """

    model: nnx.Module
    state: TrainState
    privacy: PrivacyReport | None
    test_accuracy: float | None
    intermediates: Any
    history: list
    seconds: float


def accuracy(model: nnx.Module, x, y, *, batch_size: int = 4096) -> float:
    """Classification accuracy: ``argmax`` of the logits, or ``logit > 0`` for one output.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jaxdp.models import SoftmaxRegression
      >>> accuracy(SoftmaxRegression(2, 3, rngs=nnx.Rngs(0)), jnp.ones((4, 2)), jnp.zeros(4, int))
      1.0
    """
    x = np.asarray(x)
    y = np.asarray(y)
    if x.shape[0] == 0:
        return float("nan")
    graphdef, state = nnx.split(model)

    @jax.jit
    def predict(state, xb):
        out = nnx.merge(graphdef, state)(xb)
        return (out > 0).astype(jnp.int32) if out.ndim == 1 else jnp.argmax(out, axis=-1)

    correct = 0
    for s in range(0, x.shape[0], batch_size):
        correct += int(np.sum(np.asarray(predict(state, x[s:s + batch_size])) == y[s:s + batch_size]))
    return correct / x.shape[0]


# ----------------------------------------------------------------------------------------
# Set-up: data, model constants, validation
# ----------------------------------------------------------------------------------------


def _unpack_data(data):
    from ..data import Dataset

    if isinstance(data, Dataset):
        return data.x_train, data.y_train, data.x_test, data.y_test, data.feature_norm_bound, data.name
    try:
        x, y = data
    except (TypeError, ValueError):
        raise ValueError("data must be a jaxdp.data.Dataset or a pair (x, y) of arrays.") from None
    return x, y, None, None, None, "arrays"


def _check_features(x: np.ndarray) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must have shape (n, features); got {x.shape}.")
    if np.issubdtype(x.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(x).all(axis=1))
        if bad.size:
            kind = "NaN" if np.isnan(x[bad[0]]).any() else "infinite"
            raise ValueError(
                f"x contains {kind} features in {bad.size} row(s) (first: row {bad[0]}); every batch "
                "must be finite: remove or impute those rows before training."
            )


def _check_labels(y: np.ndarray, model: nnx.Module, x: np.ndarray, loss_fn, num_classes: int | None) -> None:
    """Labels that the model's own classification loss can use: integers in ``[0, classes)``.

    ``classes`` is the data set's ``num_classes`` or, for ``(x, y)`` pairs, the model's
    number of outputs (2 for one logit). A user's ``loss_fn`` may use any finite labels.
    """
    if x.shape[0] == 0:
        raise ValueError("data holds no training record: x must have at least one row.")
    if loss_fn is not None and num_classes is None:
        if np.issubdtype(y.dtype, np.number) and not np.all(np.isfinite(y)):
            raise ValueError("y contains NaN or infinite labels.")
        return
    if not (np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_):
        raise ValueError(f"y must hold integer class labels for the model's classification loss; got dtype {y.dtype}.")
    if num_classes is None and getattr(model, "loss", None) is not None:
        try:
            out = jax.eval_shape(model, jax.ShapeDtypeStruct((1, *x.shape[1:]), jnp.float32))
            num_classes = max(2, int(out.shape[-1])) if out.ndim else 2
        except Exception:  # a model that cannot be shaped here: its own loss will say what it needs
            num_classes = None
    lo, hi = int(y.min()), int(y.max())
    if lo < 0 or (num_classes is not None and hi >= num_classes):
        bad = lo if lo < 0 else hi
        raise ValueError(f"y holds the label {bad}, outside [0, {num_classes if num_classes is not None else 'classes'})"
                         f" for this model/data set.")


def _fingerprint(x: np.ndarray, y: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in (x, y):
        a = np.ascontiguousarray(a)
        h.update(str((a.shape, a.dtype.str)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


class _Plan(NamedTuple):
    n_total: int
    records: int
    full_batches: int
    last_batch: int  # size of the partial batch, 0 if none
    steps_per_pass: int


def _plan(n_total: int, batch_size: int, drop_remainder: bool) -> _Plan:
    full, rem = divmod(n_total, batch_size)
    if full == 0:
        raise ValueError(f"batch_size must be <= the number of training examples ({n_total}); got {batch_size}.")
    if drop_remainder or rem == 0:
        return _Plan(n_total, full * batch_size, full, 0, full)
    return _Plan(n_total, n_total, full, rem, full + 1)


def _segments(start: int, stop: int, plan: _Plan, steps_per_call: int):
    """Deterministic segments ``(first_step, length, partial)`` covering ``[start, stop)``.

    Boundaries are absolute (chunks of ``steps_per_call`` from each pass's start, the
    partial batch alone), so a resumed run executes exactly the same jitted calls.
    """
    out = []
    m = plan.steps_per_pass
    s = start
    while s < stop:
        j = s % m
        if j < plan.full_batches:
            chunk_end = min((j // steps_per_call + 1) * steps_per_call, plan.full_batches)
            length = min(chunk_end - j, stop - s)
            out.append((s, length, False))
        else:
            length = 1
            out.append((s, 1, True))
        s += length
    return out


# ----------------------------------------------------------------------------------------
# State <-> checkpoint arrays
# ----------------------------------------------------------------------------------------


def _secret_key(noise_seed: int | None) -> jax.Array:
    """The key of the noise and the stopping time: OS entropy, or ``noise_seed`` (not private).

    The entropy fills the whole key (64 bits for the default threefry key), so it cannot be
    derived from anything the run prints or records.
    """
    if noise_seed is not None:
        return jax.random.key(int(noise_seed))
    like = jax.random.key_data(jax.random.key(0))
    words = np.frombuffer(secrets.token_bytes(like.size * like.dtype.itemsize), dtype=like.dtype)
    return jax.random.wrap_key_data(jnp.asarray(words.reshape(like.shape)))


def _arrays_part(state: TrainState):
    return (state.params, state.opt_state, state.step, state.order, state.total_steps,
            state.max_grad_norm, state.clipped, state.sample_key)


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_arrays(state: TrainState) -> dict[str, np.ndarray]:
    leaves = jax.tree.leaves(_arrays_part(state))
    return {f"leaf_{i:04d}": np.asarray(jax.random.key_data(v) if _is_key(v) else v)
            for i, v in enumerate(leaves)}


def _from_arrays(arrays: dict[str, np.ndarray], like: TrainState, ledger: PrivacyLedger) -> TrainState:
    leaves, treedef = jax.tree.flatten(_arrays_part(like))
    new = []
    for i, ref in enumerate(leaves):
        a = arrays[f"leaf_{i:04d}"]
        if _is_key(ref):
            new.append(jax.random.wrap_key_data(jnp.asarray(a), impl=jax.random.key_impl(ref)))
        else:
            new.append(jnp.asarray(a, dtype=ref.dtype))
    *parts, sample_key = jax.tree.unflatten(treedef, new)
    return TrainState(*parts, ledger=ledger, sample_key=sample_key)


def _like_arrays(state: TrainState) -> dict[str, np.ndarray]:
    leaves = jax.tree.leaves(_arrays_part(state))
    out = {}
    for i, v in enumerate(leaves):
        if _is_key(v):
            v = jax.random.key_data(v)
        out[f"leaf_{i:04d}"] = np.zeros(np.shape(v), np.asarray(v).dtype)
    return out


# ----------------------------------------------------------------------------------------
# The training loop
# ----------------------------------------------------------------------------------------


class TrainingDivergedError(FloatingPointError):
    """Training stopped because the model or a per-example gradient norm became NaN or infinite.

    No privacy report is produced for such a run: its ε would describe a broken model.
    """


@jax.jit
def _all_finite(params, max_grad_norm):
    leaves = [jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(params) if jnp.issubdtype(a.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True), jnp.isfinite(max_grad_norm)


def _check_finite(params, max_grad_norm, algorithm: str) -> None:
    """Raise :class:`TrainingDivergedError` (one line) if the parameters or the largest norm are not finite."""
    params_ok, norm_ok = (bool(v) for v in _all_finite(params, max_grad_norm))
    if not params_ok:
        raise TrainingDivergedError(
            f"{algorithm} training stopped: the model's parameters became NaN or infinite (a learning_rate too "
            "large for the parameters' dtype, a loss_fn whose gradient is NaN or inf, or features too large); no "
            "privacy report is given for a broken model.")
    if not norm_ok:
        raise TrainingDivergedError(
            f"{algorithm} training stopped: a per-example gradient norm was NaN or infinite (a loss_fn whose "
            "gradient is NaN or inf, or features too large for the parameters' dtype); no privacy report is given "
            "for a broken model.")


def _make_step(graphdef, rest, loss_fn, tx, clip_norm, use_fast_path=None, mesh=None):
    """The PNSGD step ``(carry, xb, yb, count) -> carry`` that :func:`train` scans.

    ``carry = (params, opt_state, step, max_grad_norm, clipped)``; ``count`` is the number
    of examples averaged (the batch size, or the last batch's). Traceable; jit it. With a
    ``mesh``, the batch rows are split over its ``"data"`` axis
    (:func:`~jaxdp.training.parallel_clipped_grad_sum`); ``tx`` adds the noise once to the sum.
    """

    def one_step(carry, xb, yb, count):
        params, opt_state, step, maxn, clipped = carry
        m = nnx.merge(graphdef, params, rest)
        if mesh is None:
            cg = clipped_grad_sum(loss_fn, m, (xb, yb), clip_norm, use_fast_path=use_fast_path)
        else:
            from ._parallel import parallel_clipped_grad_sum

            cg = parallel_clipped_grad_sum(loss_fn, m, (xb, yb), clip_norm, mesh, use_fast_path=use_fast_path)
        g = jax.tree.map(lambda s: s / jnp.asarray(count, s.dtype), cg.grad_sum)
        updates, opt_state = tx.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        maxn = jnp.maximum(maxn, jnp.max(cg.norms).astype(maxn.dtype))
        # NaN norms count as above C: the run-time check "no gradient exceeded C" must fail on them.
        clipped = clipped + jnp.sum(~(cg.norms <= jnp.asarray(clip_norm, cg.norms.dtype))).astype(clipped.dtype)
        return (params, opt_state, step + 1, maxn, clipped)

    return one_step


def train(
    model: nnx.Module,
    data,
    *,
    algorithm: str = "pnsgd",
    learning_rate: float | None = None,
    noise_multiplier: float | None = None,
    radius: float | None = None,
    optimizer: optax.GradientTransformation | None = None,
    batch_size: int = 64,
    passes: int = 1,
    schedule: str = "fixed",
    delta: float = 1e-5,
    order_seed: int = 0,
    noise_seed: int | None = None,
    loss_fn: Callable | None = None,
    clip_norm: float | None = None,
    lipschitz: float | None = None,
    smoothness: float | None = None,
    strong_convexity: float | None = None,
    convex: bool | None = None,
    drop_remainder: bool = True,
    return_intermediates: bool = False,
    steps_per_call: int | None = None,
    checkpoint_dir=None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    checkpoint_key: str | bytes | None = None,
    progress: bool = True,
    account: bool = True,
    callback: Callable[[TrainState], None] | None = None,
    use_fast_path: bool | None = None,
    devices=None,
    noise_temperature=None,
    contraction=None,
    weight_decay: float = 0.0,
    penalty: float = 1.0,
) -> TrainResult:
    r"""Train ``model`` privately, by PNSGD (hidden-state, per-record ε), DP-SGD or DP-SBCD, and account ε.

    ``algorithm="dpsgd"``: DP-SGD with true Poisson sampling (rate :math:`q = b/N`, with
    ``batch_size`` the expected batch size :math:`b`), per-example clipping at ``clip_norm``,
    noise :math:`\mathcal N(0, \nu^2C^2)` on the clipped sum (``noise_multiplier`` relative to
    :math:`C`, as in Opacus) and ``optimizer`` (default ``optax.sgd(learning_rate)``), for
    ``passes``·:math:`\lceil N/b\rceil` steps; any model; ε is
    ``dpsgd_epsilon(q, ν, steps, δ)`` for every record (:class:`~jaxdp.training.DPSGDLedger`).
    ``algorithm="dpsbcd"``: DP-SBCD (Chen & Liu 2024) of a :class:`~jaxdp.models.LipschitzMLP`:
    closed-form activation blocks and noisy proximal weight steps
    :math:`W ← (W − η\bar g + N(0, 2η\,o_t I))/(1 + ηλ)` over permute-once cyclic batches,
    ``noise_temperature`` :math:`o` per pass or per step, per-record block gradients clipped at
    ``clip_norm``, final weights released; ε per record position is the paper's hidden-state
    bound for the record's batch (:class:`~jaxdp.training.DPSBCDLedger`), which **sums the
    layers without proof** and needs ``contraction`` :math:`L_F` as you state it (details in
    :mod:`jaxdp.training._dpsbcd` and ``docs/dpsbcd.md``).
    The rest of this docstring describes ``algorithm="pnsgd"`` (the default).

    **Update.** For :math:`t = 0, 1, \dots`, with batch :math:`B_t` (consecutive blocks of
    :math:`b` positions of a fixed order), per-example gradients clipped at :math:`C`,
    :math:`\sigma = \nu\cdot 2C/b` (:func:`~jaxdp.training.pnsgd_noise_std`) and
    :math:`K = \{\lVert\theta\rVert_2 \le R\}`:

    .. math::

        Y_{t+1} = \Pi_K\Bigl(Y_t - \eta\bigl(\tfrac1{|B_t|}\textstyle\sum_{i\in B_t}
        \min(1, C/\lVert g_i\rVert)\,g_i + Z_t\bigr)\Bigr).

    The start :math:`Y_0` is the model's initial parameters (zero for the convex models of
    :mod:`jaxdp.models`: data-independent and inside :math:`K`; other starts are projected
    onto :math:`K` first).

    **Order and secret randomness.** The records are shuffled once,
    ``order = jax.random.permutation(jax.random.key(order_seed), n)``: the order is public
    (it may be printed) and does not depend on the data. The noise and the stopping time
    come from a **separate, secret** key, ``k_noise, k_stop = jax.random.split(secret)``,
    drawn from the operating system's entropy (:func:`secrets.token_bytes`) unless
    ``noise_seed`` is given. The secret key is never printed, logged or written to the
    ledger or the report; it lives in the train state and so in checkpoints, which must be
    kept as private as the data. ``schedule="fixed"`` runs ``passes`` passes in that
    same order; ``schedule="random_stop"`` runs one pass and stops after
    :math:`T \sim \mathrm{Uniform}\{1, \dots, m\}` steps (drawn from ``k_stop``), as
    Theorem 5 of Asoodeh et al. and Theorem 26 of Feldman et al. assume; :math:`T` must
    stay secret. With
    ``drop_remainder=True`` the last :math:`n \bmod b` positions are never used (ε = 0);
    otherwise they form a smaller last batch (larger sensitivity :math:`2C/b_{last}`, which
    the accountant takes into account).

    **Which guarantee.** Reported per position, best / median / worst over positions:

    * convex model with known constants: a model declaring ``loss(x, y)`` and
      ``loss_constants(feature_norm_bound)`` (:class:`~jaxdp.models.HiddenStateModel`, e.g.
      :class:`~jaxdp.models.LogisticRegression`, :class:`~jaxdp.models.SoftmaxRegression`
      or a user's module) trained on a :class:`~jaxdp.data.Dataset` with its own loss, or
      ``convex=True`` with ``lipschitz`` and ``smoothness``: :math:`C` defaults to the
      Lipschitz bound :math:`L`, so clipping cannot act on any admissible example; the loop
      **verifies at run time** (from the unclipped per-example norms) that no gradient
      exceeded :math:`C`, and requires :math:`\eta_t \le 2/(\beta+\rho)` at every step.
      Then the hidden-state (or random-stop) bound is reported.
    * otherwise (a model that declares no constants or is not convex, such as
      :class:`~jaxdp.models.MLP`, a clip norm below :math:`L`, constants stated for a
      smaller parameter ball than ``radius``, any clipped update, or
      ``return_intermediates=True``): the composition bound, with the reason in
      ``result.privacy.reason``; never the amplified one.

    The decision is :func:`~jaxdp.training.plan_privacy` (callable alone, before training).
    The step is a pure function scanned over steps: :func:`~jaxdp.training.pnsgd` applied
    to ``clipped_grad_sum(loss_fn, model, (x, y), C).grad_sum / b`` (DP-SGD:
    :func:`~jaxdp.training.dpsgd_step`); this function is the driver around them (order,
    secret keys, checkpoints, progress, ledger, report).

    **Learning-rate schedules.** ``learning_rate`` may be an optax schedule
    ``count -> η`` or a 1-D array of per-step rates. PNSGD checks every step's rate against
    :math:`2/(\beta+\rho)` and tells the accountant the schedule through its bounding
    constants: the run is accounted as the constant step :math:`\eta_\star = \min_t\eta_t`
    with Lipschitz constant :math:`L\max_t\eta_t/\min_t\eta_t` (worst contraction, largest
    shift-to-noise ratio; derivation in :func:`~jaxdp.training.plan_privacy`), so a schedule never reports
    less than the constant rate would. DP-SGD's guarantee does not depend on the learning
    rate: any schedule is accepted as is.

    Args:
      model: Flax NNX module whose ``nnx.Param`` variables are trained (not modified).
      algorithm: ``"pnsgd"`` (default), ``"dpsgd"`` or ``"dpsbcd"``.
      optimizer: DP-SGD only: any optax optimizer applied to the noisy averaged gradient
        (post-processing); default ``optax.sgd(learning_rate)``.
      data: :class:`jaxdp.data.Dataset` (its ``feature_norm_bound`` gives the convex
        models' constants; its test part gives ``test_accuracy``) or a pair ``(x, y)``
        (then pass ``lipschitz``/``smoothness`` for a convex guarantee).
      learning_rate: :math:`\eta > 0`, a 1-D array of per-step rates, or an optax schedule
        (see above); for convex models the library's step-size rule
        :math:`\eta_t \le 2/(\beta + \rho)` at every step.
      noise_multiplier: :math:`\nu > 0` (noise std over the sensitivity :math:`2C/b`); required
        except with ``algorithm="dpsbcd"`` (whose noise is ``noise_temperature``).
      radius: :math:`R > 0` of the parameter ball; the accountant's :math:`D = 2R`.
      batch_size: :math:`b`, 1 to the number of training examples.
      passes: :math:`k \ge 1` (``schedule="fixed"``; must be 1 for random stopping).
      schedule: ``"fixed"`` or ``"random_stop"``.
      delta: target :math:`\delta \in (0, 1)`.
      order_seed: the public seed of the processing order (recorded in the ledger).
      noise_seed: ``None`` (default): the noise and stopping-time key comes from the
        operating system's entropy and stays secret. An integer fixes it for tests and
        reproductions: the run is then **not private** (anyone who knows the seed can
        regenerate the noise), a ``UserWarning`` says so, and the ledger and report
        carry ``fixed_noise_seed`` / ``not_private``.
      loss_fn: ``loss_fn(model, x, y) -> (b,)`` per-example losses; default the model's own
        ``loss(x, y)`` method (required when the model declares none).
      clip_norm: :math:`C`; default :math:`L` for convex models, required otherwise.
      lipschitz, smoothness: :math:`L` and :math:`\beta` of a user-declared convex loss.
      strong_convexity: :math:`\rho \ge 0` of the loss (default: the model's declared
        :math:`\rho`, else 0).
      convex: override the model's ``is_convex`` declaration.
      drop_remainder: skip the last :math:`n \bmod b` positions (see above).
      return_intermediates: also return every iterate; the report switches to composition
        and a ``UserWarning`` is issued.
      steps_per_call: steps per jitted ``lax.scan`` call (default: one pass).
      checkpoint_dir: if given, save an atomic orbax checkpoint every ``checkpoint_every``
        steps (default: every pass) and at the end.
      checkpoint_every: steps between checkpoints (rounded up to a call boundary).
      resume: continue from the newest intact checkpoint in ``checkpoint_dir`` (which must
        come from the same configuration and data; newer folders that are not intact
        checkpoints are skipped with a warning). The checkpoint's integrity record is
        checked and its privacy ledger is recomputed from the configuration and the restored
        step counter: an edited or corrupted checkpoint is refused in one line. Without
        ``resume``, a non-empty ``checkpoint_dir`` is an error, so no run silently restarts
        and spends its budget twice. Checkpoint folders are named by a save counter, never
        by the step; with ``schedule="random_stop"`` the loop runs the whole pass (steps
        after the secret stopping time are masked no-ops, so no compiled program, progress
        line, running time or checkpoint listing depends on it) and saves at the same
        public positions whatever the stopping step. The folder is locked while the run
        holds it: a second run on it fails at once.
      checkpoint_key: a secret (str or bytes, >= 16 characters; default
        ``$JAXDP_CHECKPOINT_KEY``) that signs every checkpoint with HMAC-SHA-256; a resumed
        run then refuses checkpoints without a valid signature (edited configuration,
        ledger or step counter). Without a key, checkpoints are unauthenticated: the
        SHA-256 record catches corruption, not deliberate edits.
      progress: show a tqdm progress bar with ε (best/median/worst) as training goes,
        and print the final table (:meth:`~jaxdp.training.PrivacyReport.table`).
      account: compute the final :class:`~jaxdp.training.PrivacyReport`.
      callback: called with the :class:`TrainState` after every jitted call (and
        checkpoint).
      use_fast_path: passed to :func:`~jaxdp.training.clipped_grad_sum`.
      devices: ``None`` (default): one device, as JAX places it. Otherwise data parallelism
        (:func:`~jaxdp.training.data_parallel_mesh`: an integer :math:`k` for the first
        :math:`k` devices, a sequence of devices, or a ``Mesh`` with a ``"data"`` axis):
        parameters, optimizer state, keys and the training set are replicated, each
        batch's rows are split over the devices for the per-example clipped gradients,
        whose sums are added by a ``psum``; the noise is drawn **once** for the global batch
        from the one replicated key (the same draw as on one device), so the guarantee and
        the ledger are unchanged and the result equals the one-device run up to float
        rounding. Multi-host: README, "Multiple devices and hosts".
      noise_temperature: DP-SBCD only (required): :math:`o > 0`, shape ``(passes,)`` or
        ``(passes, n // b)``; the weight noise is :math:`N(0, 2η\,o\,I)`.
      contraction: DP-SBCD only (required): :math:`L_F > 0` of every block's gradient map,
        one value or one per layer (no default: the paper states none).
      weight_decay: DP-SBCD only: λ ≥ 0 of the proximal step (:math:`L_T = 1/(1+ηλ)`).
      penalty: DP-SBCD only: γ > 0 of the lifted objective (the paper uses 1).

    Returns:
      :class:`TrainResult`.

    Raises:
      ValueError: naming the parameter, for non-positive ``learning_rate``,
        ``noise_multiplier``, ``radius`` or ``clip_norm``, a step :math:`\eta > 2/(\beta+\rho)` for a
        convex model, NaN or infinite features, rows above the feature norm bound, a bad
        ``batch_size``/``passes``/``schedule``/``delta``, a non-empty ``checkpoint_dir``
        without ``resume``, or a checkpoint from another configuration. Nothing is written
        before validation passes.

    References:
      Feldman, Mironov, Talwar, Thakurta, "Privacy amplification by iteration", FOCS 2018
      (Algorithm 1, Thm 23); Asoodeh, Diaz, Calmon, "Privacy amplification of iterative
      algorithms via contraction coefficients", ISIT 2020 (Thms 4, 5).

    Examples:
      >>> from flax import nnx
      >>> from jaxdp.data import load_digits
      >>> from jaxdp.models import SoftmaxRegression
      >>> ds = load_digits()
      >>> res = train(SoftmaxRegression(64, 10, rngs=nnx.Rngs(0)), ds, learning_rate=1.0,
      ...             noise_multiplier=1.0, radius=30.0, batch_size=64, passes=2, progress=False)
      >>> res.privacy.analysis, int(res.state.step)
      ('hidden-state', 44)
    """
    # ---------------- validation (nothing is written before it passes) ----------------
    if not isinstance(model, nnx.Module):
        raise ValueError(f"model must be a Flax NNX module; got {type(model).__name__}.")
    _validate.check_static_choice("algorithm", algorithm, _ALGORITHMS)
    if algorithm == "dpsbcd" and devices is not None:
        raise ValueError("devices is not supported with algorithm='dpsbcd' (its per-record block updates run "
                         "on one device); leave devices=None.")
    if algorithm == "dpsbcd":
        from ._dpsbcd import _check_dpsbcd_arguments

        _check_dpsbcd_arguments(noise_multiplier=noise_multiplier, radius=radius, optimizer=optimizer,
                                schedule=schedule, loss_fn=loss_fn, lipschitz=lipschitz, smoothness=smoothness,
                                strong_convexity=strong_convexity, convex=convex, drop_remainder=drop_remainder,
                                return_intermediates=return_intermediates, use_fast_path=use_fast_path)
    else:
        if noise_multiplier is None:
            raise ValueError(f"noise_multiplier is required with algorithm={algorithm!r}.")
        for name, value in (("noise_temperature", noise_temperature), ("contraction", contraction)):
            if value is not None:
                raise ValueError(f"{name} is for algorithm='dpsbcd'; got algorithm={algorithm!r}.")
    if algorithm == "pnsgd":
        if learning_rate is None or radius is None:
            raise ValueError("learning_rate and radius are required with algorithm='pnsgd'.")
        if optimizer is not None:
            raise ValueError("optimizer is for algorithm='dpsgd'; PNSGD's update is the analysed plain step.")
        if not _is_schedule(learning_rate):  # a schedule is checked step by step by the plan
            _validate.check_in_range("learning_rate", learning_rate, 0.0, math.inf, lo_open=True)
        _validate.check_in_range("radius", radius, 0.0, math.inf, lo_open=True)
    if algorithm != "dpsbcd":
        _validate.check_in_range("noise_multiplier", noise_multiplier, 0.0, math.inf, lo_open=True)
    _validate.check_delta(delta)
    if strong_convexity is not None:
        _validate.check_in_range("strong_convexity", strong_convexity, 0.0, math.inf)
    _check_batch_size(batch_size)
    batch_size = int(batch_size)
    if isinstance(passes, bool) or not isinstance(passes, (int, np.integer)) or passes < 1:
        raise ValueError(f"passes must be a positive integer; got {passes!r}.")
    passes = int(passes)
    _validate.check_static_choice("schedule", schedule, _SCHEDULES)
    if schedule == "random_stop" and passes != 1:
        raise ValueError(f"passes must be 1 with schedule='random_stop' (the random-stopping analyses are for one pass); got {passes}.")
    if schedule == "random_stop" and return_intermediates:
        raise ValueError("return_intermediates=True is not available with schedule='random_stop': the number of "
                         "iterates would reveal the secret stopping time.")
    if isinstance(order_seed, bool) or not isinstance(order_seed, (int, np.integer)):
        raise ValueError(f"order_seed must be an integer; got {order_seed!r}.")
    if noise_seed is not None and (isinstance(noise_seed, bool) or not isinstance(noise_seed, (int, np.integer))):
        raise ValueError(f"noise_seed must be None (secret key from the OS entropy) or an integer; got {noise_seed!r}.")
    if clip_norm is not None:
        _validate.check_in_range("clip_norm", clip_norm, 0.0, math.inf, lo_open=True)
    for name, value in (("lipschitz", lipschitz), ("smoothness", smoothness)):
        if value is not None:
            _validate.check_in_range(name, value, 0.0, math.inf, lo_open=True)

    mesh = None
    if devices is not None:
        from ._parallel import _check_same_data, data_parallel_mesh

        mesh = data_parallel_mesh(devices)
        if checkpoint_dir is not None and jax.process_count() > 1:
            raise ValueError("checkpoint_dir is not supported with several processes (jax.distributed): "
                             "checkpoint from one-process runs.")
    x, y, x_test, y_test, x_bound, _ = _unpack_data(data)
    x = np.asarray(x)
    y = np.asarray(y)
    _check_features(x)
    if y.shape != (x.shape[0],):
        raise ValueError(f"y must have shape ({x.shape[0]},), one label per example; got {y.shape}.")
    _check_labels(y, model, x, loss_fn, getattr(data, "num_classes", None))
    if mesh is not None:
        _check_same_data(_fingerprint(x, y))

    if algorithm == "dpsbcd":
        from ._dpsbcd import run_dpsbcd

        return run_dpsbcd(
            model, x, y, x_test, y_test, learning_rate=learning_rate, noise_temperature=noise_temperature,
            clip_norm=clip_norm, contraction=contraction, weight_decay=weight_decay, penalty=penalty,
            batch_size=batch_size, passes=passes, delta=delta, order_seed=order_seed, noise_seed=noise_seed,
            steps_per_call=steps_per_call, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
            resume=resume, checkpoint_key=checkpoint_key, progress=progress, account=account, callback=callback, fingerprint=_fingerprint(x, y))
    if algorithm == "dpsgd":
        from ._dpsgd_loop import train_dpsgd

        if schedule != "fixed" or return_intermediates:
            raise ValueError("algorithm='dpsgd' samples every step (no schedule) and its guarantee already covers "
                             "every iterate: leave schedule and return_intermediates at their defaults.")
        if learning_rate is not None and _is_schedule(learning_rate):
            # DP-SGD's guarantee does not depend on the learning rate: any schedule is free.
            if optimizer is not None:
                raise ValueError("pass a learning-rate schedule or an optimizer with algorithm='dpsgd', not both.")
            fn, _ = _learning_rate_fn(learning_rate)
            optimizer, learning_rate = optax.sgd(fn), None
        return train_dpsgd(
            model, x, y, x_test, y_test, loss_fn=declared_loss_fn(model, loss_fn), learning_rate=learning_rate,
            optimizer=optimizer, noise_multiplier=noise_multiplier, clip_norm=clip_norm, batch_size=batch_size,
            passes=passes, delta=delta, order_seed=order_seed, noise_seed=noise_seed, steps_per_call=steps_per_call,
            checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume,
            checkpoint_key=checkpoint_key, progress=progress, account=account, callback=callback, use_fast_path=use_fast_path, fingerprint=_fingerprint(x, y),
            mesh=mesh)
    # ---------------- planning: which analysis, and why (jaxdp.training.plan_privacy) ----------------
    pp = _plan_privacy(model, x, x_bound, learning_rate=learning_rate, radius=radius, batch_size=batch_size,
                       passes=passes, schedule=schedule, drop_remainder=drop_remainder, loss_fn=loss_fn,
                       clip_norm=clip_norm, lipschitz=lipschitz, smoothness=smoothness,
                       strong_convexity=strong_convexity, convex=convex, return_intermediates=return_intermediates)
    loss_fn, is_convex, clip_norm, lip_bound, beta = pp.loss_fn, pp.convex, pp.clip_norm, pp.lipschitz_bound, pp.smoothness
    strong_convexity, analysis, reason, acct_lip = pp.strong_convexity, pp.analysis, pp.reason, pp.lipschitz
    plan = _plan(x.shape[0], batch_size, drop_remainder)
    if steps_per_call is None:
        steps_per_call = plan.full_batches
    if isinstance(steps_per_call, bool) or not isinstance(steps_per_call, (int, np.integer)) or steps_per_call < 1:
        raise ValueError(f"steps_per_call must be a positive integer; got {steps_per_call!r}.")
    steps_per_call = int(steps_per_call)
    if checkpoint_every is None:
        checkpoint_every = plan.steps_per_pass
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, (int, np.integer)) or checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be a positive integer; got {checkpoint_every!r}.")

    # ---------------- ledger ----------------
    noise_std = pnsgd_noise_std(noise_multiplier, clip_norm, batch_size)
    if return_intermediates:
        warnings.warn(
            "return_intermediates=True: releasing intermediate iterates voids the hidden-state "
            "guarantees; the reported epsilon is the composition bound.", UserWarning, stacklevel=2)

    params0 = nnx.split(model, nnx.Param, ...)[1]
    leaves0 = jax.tree.leaves(params0)
    if not leaves0:
        raise ValueError("model has no nnx.Param to train.")
    pdtype = jnp.result_type(*leaves0)
    if not jnp.issubdtype(pdtype, jnp.floating):
        raise ValueError(f"model parameters must be floating point; got {pdtype}.")
    top = math.sqrt(float(jnp.finfo(pdtype).max))
    if float(radius) >= top:  # the projection squares R and the norm in the parameters' dtype
        raise ValueError(f"radius must be below {top:.3g} for {pdtype} parameters (its square must be finite); "
                         f"got {float(radius):g}.")

    config = {
        "format": _FORMAT, "model": type(model).__qualname__, "loss_fn": getattr(loss_fn, "__qualname__", repr(loss_fn)),
        "params": str(jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), params0)),
        "data": _fingerprint(x, y), "learning_rate": rate_config(learning_rate, pp.learning_rates),
        "noise_multiplier": float(noise_multiplier), "radius": float(radius), "batch_size": batch_size,
        "passes": passes, "schedule": schedule, "delta": float(delta), "order_seed": int(order_seed), "clip_norm": clip_norm,
        "lipschitz": lip_bound, "smoothness": beta, "strong_convexity": float(strong_convexity),
        "convex": is_convex, "drop_remainder": bool(drop_remainder), "steps_per_call": steps_per_call,
        "return_intermediates": bool(return_intermediates),
    }

    ckpt = _open_checkpoints(checkpoint_dir, resume, checkpoint_key)

    # ---------------- initial state ----------------
    order = jax.random.permutation(jax.random.key(int(order_seed)), plan.n_total).astype(jnp.int32)
    if noise_seed is not None:
        warnings.warn(f"noise_seed is fixed: {NOT_PRIVATE}.", UserWarning, stacklevel=2)
    secret = _secret_key(noise_seed)
    if mesh is not None:
        from ._parallel import _same_secret_on_all_processes

        secret = _same_secret_on_all_processes(secret)
    k_noise, k_stop = jax.random.split(secret)
    if schedule == "random_stop":
        total = int(jax.random.randint(k_stop, (), 1, plan.steps_per_pass + 1))
    else:
        total = passes * plan.steps_per_pass
    tx = pnsgd(learning_rate if _is_schedule(learning_rate) else float(learning_rate), float(noise_multiplier),
               clip_norm, float(radius), k_noise, batch_size=batch_size)
    from ._transforms import project_onto_l2_ball

    params0 = project_onto_l2_ball(params0, float(radius))  # a start inside K
    ledger = PrivacyLedger(
        analysis=analysis, reason=reason, convex=is_convex, lipschitz=float(acct_lip), smoothness=beta,
        strong_convexity=float(strong_convexity), learning_rate=float(pp.learning_rate),
        noise_multiplier=float(noise_multiplier), noise_std=float(noise_std), clip_norm=clip_norm,
        lipschitz_bound=lip_bound, diameter=2.0 * float(radius), records=plan.records,
        unused=plan.n_total - plan.records, batch_size=batch_size, passes=passes,
        steps_per_pass=plan.steps_per_pass, schedule=schedule, order_seed=int(order_seed),
        fixed_noise_seed=noise_seed is not None, total_steps=total,
        steps_done=0, delta=float(delta), clipped=0, max_grad_norm=0.0,
        intermediates_released=bool(return_intermediates),
    )
    state = TrainState(
        params=params0, opt_state=tx.init(params0), step=jnp.zeros((), jnp.int32), order=order,
        total_steps=jnp.asarray(total, jnp.int32), max_grad_norm=jnp.zeros((), jnp.float32),
        clipped=jnp.zeros((), jnp.int32), ledger=ledger,
    )
    state, position = _resume(ckpt, state, config, checkpoint_dir, PrivacyLedger)

    # ---------------- compiled steps ----------------
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    X = jnp.asarray(x, dtype=pdtype)
    Y = jnp.asarray(y)
    b = batch_size
    if mesh is not None:  # data parallel: all replicated; the step splits each batch's rows
        from ._parallel import _replicate_state, replicate

        state, (X, Y), rest = _replicate_state(state, mesh), replicate((X, Y), mesh), replicate(rest, mesh)

    one_step = _make_step(graphdef, rest, loss_fn, tx, clip_norm, use_fast_path, mesh)

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
            return c, (c[0] if return_intermediates else None)

        return jax.lax.scan(body, carry, first_batch + jnp.arange(length, dtype=jnp.int32))

    def run_partial(carry, order, stop):
        idx = order[plan.full_batches * b: plan.full_batches * b + plan.last_batch]
        c = masked_step(carry, X[idx], Y[idx], plan.last_batch, stop)
        return c, (jax.tree.map(lambda a: a[None], c[0]) if return_intermediates else None)

    run_full_jit = jax.jit(run_full, static_argnames=("length",))
    run_partial_jit = jax.jit(run_partial)

    # ---------------- run ----------------
    # Positions are public: with random stopping the loop runs the whole pass (the steps
    # after the secret stopping time are masked), so segments, progress, history and
    # checkpoint times are the same whatever the stopping time.
    start = position
    total = int(state.total_steps)
    public_total = plan.steps_per_pass if schedule == "random_stop" else total
    stop = state.total_steps
    segments = _segments(start, public_total, plan, steps_per_call)
    pbar = None
    if progress:
        from tqdm.auto import tqdm

        pbar = tqdm(total=public_total, initial=start, desc="PNSGD", unit="step", leave=True)
    history: list = []
    inter: list = []
    carry = (state.params, state.opt_state, state.step, state.max_grad_norm, state.clipped)
    last_saved = start
    last_report = -math.inf
    t0 = time.perf_counter()
    t_acct = 0.0
    try:
        for first, length, partial in segments:
            if partial:
                carry, ys = run_partial_jit(carry, state.order, stop)
            else:
                j0 = first % plan.steps_per_pass
                carry, ys = run_full_jit(carry, state.order, jnp.asarray(j0, jnp.int32), stop, length=length)
            if return_intermediates:
                inter.append(jax.device_get(ys))
            position = first + length
            _check_finite(carry[0], carry[3], "PNSGD")
            steps_done = int(carry[2])
            clipped = int(carry[4])
            led = state.ledger._replace(steps_done=steps_done, clipped=clipped,
                                        max_grad_norm=float(carry[3]))
            if clipped > 0:
                from ._ledger import _clipping_reason

                led = demote(led, _clipping_reason(led))
            state = TrainState(carry[0], carry[1], carry[2], state.order, state.total_steps, carry[3],
                               carry[4], led)
            done = position >= public_total
            if ckpt is not None and (done or position - last_saved >= checkpoint_every):
                # The public position goes into the (secret-holding) checkpoint: a resumed
                # random-stop run continues the pass from there.
                meta = {"ledger": led.to_json(), "config": config, "position": position}
                ckpt.save_train(steps_done, _to_arrays(state), meta)
                last_saved = position
            if pbar is not None:
                pbar.update(length)
                now = time.perf_counter()
                p, t = divmod(position, plan.steps_per_pass)
                if account and (done or now - last_report > 0.5) and (p == 0 or t == 0 or schedule == "random_stop"):
                    ta = time.perf_counter()
                    summ = privacy_report(led).summary()
                    t_acct += time.perf_counter() - ta
                    history.append((position, summ))
                    pbar.set_postfix_str(
                        f"eps[{_short(led.analysis)}] best {summ['best']:.3g} med {summ['median']:.3g} "
                        f"worst {summ['worst']:.3g}")
                    last_report = time.perf_counter()
            if callback is not None:
                callback(state)
            carry = (state.params, state.opt_state, state.step, state.max_grad_norm, state.clipped)
    finally:
        if pbar is not None:
            pbar.close()
        if ckpt is not None:
            ckpt.close()
    seconds = time.perf_counter() - t0 - t_acct

    intermediates = None
    if return_intermediates and inter:
        intermediates = jax.tree.map(lambda *a: np.concatenate(a, axis=0), *inter)
    return _finish(graphdef, rest, state, account, progress, x_test, y_test, pdtype, intermediates, history,
                   seconds)


def _open_checkpoints(checkpoint_dir, resume: bool, checkpoint_key=None):
    """A locked Checkpointer for ``checkpoint_dir`` (or None); a non-empty one needs ``resume``."""
    if checkpoint_dir is None:
        return None
    ck = Checkpointer(checkpoint_dir, key=checkpoint_key)
    ck.acquire()  # before the emptiness check: a second run on the folder fails here, at once
    if not resume and _index_dirs(ck.directory):
        ck.close()
        # No step in the message: with random stopping it is secret.
        raise ValueError(
            f"checkpoint_dir {str(checkpoint_dir)!r} already holds a checkpoint: pass "
            "resume=True to continue that run, or use an empty directory."
        )
    return ck


def _refuse(ckpt, checkpoint_dir, what: str):
    ckpt.close()
    return ValueError(f"the checkpoint in {str(checkpoint_dir)!r} {what}; refusing to resume from it.")


def _resume(ckpt, state: TrainState, config: dict, checkpoint_dir, ledger_cls) -> tuple[TrainState, int]:
    """``(state, position)`` from the newest intact checkpoint, if any, with its ledger recomputed.

    ``position`` is the public position the run continues from: the step counter, except
    for random stopping, where steps past the secret stopping time are masked and the
    position runs on to the end of the pass.

    A checkpoint of another configuration is refused. The stored ledger is not trusted:
    the ledger is recomputed from this run's configuration (``state.ledger``, built from the
    same arguments) and the restored step counter, stopping time and clipping counters, and
    any disagreement with the stored one (e.g. an edited ``steps_done`` or noise multiplier)
    is refused in one line. Newer directories that are not intact checkpoints are skipped
    with a warning (:meth:`Checkpointer.restore`).
    """
    if ckpt is None or not _index_dirs(ckpt.directory):
        return state, int(state.step)
    try:
        arrays, meta = ckpt.restore(_like_arrays(state))
    except FileNotFoundError as err:
        ckpt.close()
        raise ValueError(f"checkpoint_dir {str(checkpoint_dir)!r} holds no intact checkpoint to resume "
                         f"({str(err).splitlines()[0]}).") from None
    except ValueError as err:
        ckpt.close()
        raise ValueError(str(err).splitlines()[0]) from None
    if meta.get("config") != config:
        old = meta.get("config") or {}
        diff = next((k for k in sorted(set(old) | set(config)) if old.get(k) != config.get(k)), "?")
        ckpt.close()
        raise ValueError(
            f"the checkpoint in {str(checkpoint_dir)!r} comes from a different run configuration "
            f"({diff}: checkpoint {old.get(diff)!r}, now {config.get(diff)!r}); resume it with the same "
            "settings and data, or use another directory."
        )
    restored = _from_arrays(arrays, state, state.ledger)
    try:
        stored = ledger_cls.from_json(meta["ledger"])
    except (KeyError, TypeError):
        raise _refuse(ckpt, checkpoint_dir, "has no readable privacy ledger") from None
    expected = _expected_ledger(state.ledger, restored, stored)
    if expected is None or meta.get("_step") != int(restored.step):
        raise _refuse(ckpt, checkpoint_dir, "has an impossible step counter or stopping time")
    # A checkpoint of a fixed-seed (not private) run stays not private; a private run resumed
    # with a fixed seed becomes not private: the flag may only go up.
    if stored != expected._replace(fixed_noise_seed=stored.fixed_noise_seed):
        field = next(f for f in stored._fields if getattr(stored, f) != getattr(expected, f))
        # The values are not printed: steps_done and total_steps are secret with random stopping.
        raise _refuse(ckpt, checkpoint_dir, f"has a privacy ledger that disagrees with its configuration and step "
                                            f"counter (field {field})")
    step = int(restored.step)
    position = meta.get("position", step)
    last = getattr(state.ledger, "steps_per_pass", 0) if getattr(state.ledger, "schedule", "fixed") == "random_stop" \
        else step
    if isinstance(position, bool) or not isinstance(position, int) or not step <= position <= max(last, step) \
            or (position > step and step != int(restored.total_steps)):
        raise _refuse(ckpt, checkpoint_dir, "has an impossible position in the pass")
    return restored._replace(ledger=expected), position


def _expected_ledger(initial, restored: TrainState, stored):
    """The ledger a run of this configuration has after ``restored.step`` steps, or None if impossible."""
    step, total = int(restored.step), int(restored.total_steps)
    schedule = getattr(initial, "schedule", "fixed")
    if schedule == "random_stop":
        if not 1 <= total <= initial.steps_per_pass:
            return None
    elif total != initial.total_steps:
        return None
    if not 0 <= step <= total:
        return None
    led = initial._replace(steps_done=step, total_steps=total, max_grad_norm=float(restored.max_grad_norm),
                           fixed_noise_seed=bool(initial.fixed_noise_seed or stored.fixed_noise_seed))
    if isinstance(initial, PrivacyLedger):
        led = led._replace(clipped=int(restored.clipped))
        if led.clipped > 0:
            from ._ledger import _clipping_reason

            # demote keeps the reason of the first clipping, whose counts are not recorded.
            led = demote(led, stored.reason if stored.analysis == "composition" else _clipping_reason(led))
    return led


def _finish(graphdef, rest, state, account, progress, x_test, y_test, pdtype, intermediates, history,
            seconds) -> TrainResult:
    """The trained model, the final report (printed with ``progress``) and the test accuracy."""
    trained = nnx.merge(graphdef, state.params, rest)
    report = privacy_report(state.ledger) if account else None
    if progress and report is not None:
        print(report.table())
    test_acc = None
    if x_test is not None and len(x_test):
        test_acc = accuracy(trained, np.asarray(x_test, dtype=np.dtype(pdtype)), y_test)
    return TrainResult(trained, state, report, test_acc, intermediates, history, seconds)


def _short(analysis: str) -> str:
    return {"hidden-state": "hidden", "random-stop": "stop", "composition": "comp"}.get(analysis, analysis)
