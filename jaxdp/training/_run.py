"""Pieces the driver and the mechanisms share: data, batches, the secret key, checkpoints and resume.

Nothing here knows a mechanism: the mechanisms (``_pnsgd``, ``_dpsgd_mechanism``,
``_dpsbcd``) build their :class:`Run` from these, the driver (``_driver``) runs it, and no
module imports one above it, so the package's imports form a tree
(``tests/training/test_imports.py``).
"""

from __future__ import annotations

import hashlib
import math
import secrets
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..data import Dataset
from ._checkpoint import Checkpointer, _index_dirs
from ._ledger import PrivacyLedger, PrivacyReport, _clipping_reason, demote

__all__ = ["TrainResult", "TrainingDivergedError", "accuracy"]

FORMAT = 3  # checkpoint format; 3: one driver for every mechanism (the mechanism named in the configuration)


class TrainResult(NamedTuple):
    """Result of :func:`~jaxdp.training.train`.

    Attributes:
      model: the trained model (final iterate only, a new module; the input is untouched).
      state: the mechanism's final state (:class:`~jaxdp.training.PNSGDState`,
        :class:`~jaxdp.training.DPSGDState` or :class:`~jaxdp.training.DPSBCDState`; it holds
        the secret noise key: never log it). Through the deprecated keyword door, the
        deprecated :class:`TrainState` with the ledger inside.
      privacy: the final :class:`~jaxdp.training.PrivacyReport`, or ``None`` with
        ``account=False`` (call ``privacy_report(result.ledger)`` later).
      test_accuracy: accuracy on the data set's test part, or ``None`` when it has none.
      intermediates: with ``return_intermediates=True``, the parameters after every step
        done in this call (leaves with a leading step axis); otherwise ``None``.
      history: ``(steps_done, {"best", "median", "worst"})`` where the progress bar showed ε,
        and at the end (never a secret stopping step).
      seconds: wall time of the training steps (compilation included, accounting excluded).
      ledger: the final ledger (:class:`~jaxdp.training.PrivacyLedger`,
        :class:`~jaxdp.training.DPSGDLedger` or :class:`~jaxdp.training.DPSBCDLedger`); its
        ``public()`` is what a report, log or JSON may show.
      mechanism: the mechanism as run: with ``target_epsilon``, the calibrated noise filled in.
    """

    model: nnx.Module
    state: Any
    privacy: PrivacyReport | None
    test_accuracy: float | None
    intermediates: Any
    history: list
    seconds: float
    ledger: Any = None
    mechanism: Any = None


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


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_arrays(state) -> dict[str, np.ndarray]:
    """A mechanism's state as the flat dict of arrays a checkpoint holds (keys as raw key data)."""
    leaves = jax.tree.leaves(state)
    return {f"leaf_{i:04d}": np.asarray(jax.random.key_data(v) if _is_key(v) else v)
            for i, v in enumerate(leaves)}


def _from_arrays(arrays: dict[str, np.ndarray], like):
    leaves, treedef = jax.tree.flatten(like)
    new = []
    for i, ref in enumerate(leaves):
        a = arrays[f"leaf_{i:04d}"]
        if _is_key(ref):
            new.append(jax.random.wrap_key_data(jnp.asarray(a), impl=jax.random.key_impl(ref)))
        else:
            new.append(jnp.asarray(a, dtype=ref.dtype))
    return jax.tree.unflatten(treedef, new)


def _like_arrays(state) -> dict[str, np.ndarray]:
    out = {}
    for i, v in enumerate(jax.tree.leaves(state)):
        if _is_key(v):
            v = jax.random.key_data(v)
        out[f"leaf_{i:04d}"] = np.zeros(np.shape(v), np.asarray(v).dtype)
    return out


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


def _check_format(ckpt, checkpoint_dir) -> None:
    """Refuse, in one line, a checkpoint written in another format (before its arrays are read)."""
    try:
        old = (ckpt.metadata().get("config") or {}).get("format")
    except FileNotFoundError:
        return  # restore() says what is wrong
    if old != FORMAT:
        ckpt.close()
        raise ValueError(
            f"the checkpoint in {str(checkpoint_dir)!r} was written by an older jaxdp trainer (checkpoint format "
            f"{old}, this version reads {FORMAT}); finish that run with the jaxdp release that started it, or "
            "start again in an empty directory.")


def _resume(ckpt, state, ledger, config: dict, checkpoint_dir):
    """``(state, ledger, position)`` from the newest intact checkpoint, if any, the ledger recomputed.

    ``position`` is the public position the run continues from: the step counter, except
    for random stopping, where steps past the secret stopping time are masked and the
    position runs on to the end of the pass.

    A checkpoint of another format or configuration is refused. The stored ledger is not
    trusted: the ledger is recomputed from this run's configuration (``ledger``, built from
    the same arguments) and the restored step counter, stopping time and clipping counters,
    and any disagreement with the stored one (e.g. an edited ``steps_done`` or noise
    multiplier) is refused in one line. Newer directories that are not intact checkpoints
    are skipped with a warning (:meth:`Checkpointer.restore`).
    """
    if ckpt is None or not _index_dirs(ckpt.directory):
        return state, ledger, int(state.step)
    _check_format(ckpt, checkpoint_dir)
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
    restored = _from_arrays(arrays, state)
    try:
        stored = type(ledger).from_json(meta["ledger"])
    except (KeyError, TypeError):
        raise _refuse(ckpt, checkpoint_dir, "has no readable privacy ledger") from None
    expected = _expected_ledger(ledger, restored, stored)
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
    last = ledger.steps_per_pass if getattr(ledger, "schedule", "fixed") == "random_stop" else step
    if isinstance(position, bool) or not isinstance(position, int) or not step <= position <= max(last, step) \
            or (position > step and step != int(expected.total_steps)):
        raise _refuse(ckpt, checkpoint_dir, "has an impossible position in the pass")
    return restored, expected, position


def _expected_ledger(initial, restored, stored):
    """The ledger a run of this configuration has after ``restored.step`` steps, or None if impossible."""
    step = int(restored.step)
    total = int(getattr(restored, "total_steps", initial.total_steps))
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
            # demote keeps the reason of the first clipping, whose counts are not recorded.
            led = demote(led, stored.reason if stored.analysis == "composition" else _clipping_reason(led))
    return led


def _short(analysis: str) -> str:
    return {"hidden-state": "hidden", "random-stop": "stop", "composition": "comp"}.get(analysis, analysis)


class Run(NamedTuple):
    """A mechanism set up on a model and data: everything the driver needs, and nothing it must know.

    Attributes:
      name: the progress bar's label.
      mechanism: the mechanism actually run (the calibrated noise filled in).
      state: the mechanism's initial state (a NamedTuple of arrays; all of it is checkpointed).
      ledger: the initial ledger (host-side facts; checkpointed in the metadata, recomputed on resume).
      config: the JSON configuration a resumed checkpoint must match.
      steps_per_pass: steps of one pass.
      public_total: the public positions the loop runs (random stopping: the whole pass, the
        steps after the secret stopping time masked); progress, history and checkpoints count these.
      segments: ``segments(start, stop) -> [(first, length, partial)]``, the jitted calls over
        positions ``[start, stop)`` (the same calls whatever the resume point).
      run: ``run(state, first, length, partial) -> (state, intermediates or None)``.
      after: ``after(ledger, state) -> ledger`` once a segment is done.
      model: ``model(state) -> nnx.Module`` the released model.
      pdtype: the parameters' dtype (the test set is cast to it).
      report_at: ``report_at(position) -> bool``: whether the progress bar shows ε there.
      keep_every_checkpoint: keep every checkpoint and the initial model (DP-SGD's per-instance
        accounting reads them all); otherwise the newest two.
    """

    name: str
    mechanism: Any
    state: Any
    ledger: Any
    config: dict
    steps_per_pass: int
    public_total: int
    segments: Any
    run: Any
    after: Any
    model: Any
    pdtype: Any
    report_at: Any
    keep_every_checkpoint: bool = False


def certify_noise(worst, target: float, guess: float, name: str) -> float:
    """``guess`` (an accountant's calibration) checked on the run's own report, else the bisection below.

    The report may recompute ε in another program and differ in the last bits: the guess is
    nudged up by at most about 1e-6 (relative) until the reported ε is at most ``target``;
    if it is then below ``0.98 * target`` (the calibration used a looser analysis than the
    report), or was never accepted, :func:`calibrate_to_target` searches from it.
    """
    if math.isfinite(guess) and guess > 0:
        nu = guess
        for k in range(10):
            eps = worst(nu)
            if eps <= target:
                if eps >= 0.98 * target:
                    return nu
                break
            nu *= 1.0 + 1e-12 * 4.0**k
    else:
        guess = 1.0
    return calibrate_to_target(worst, target, guess, name)


def calibrate_to_target(worst, target: float, start: float, name: str) -> float:
    """The smallest noise level (to 0.2%) whose reported worst-record ε is at most ``target``.

    ``worst(noise) -> float`` is the run's reported ε at the end, non-increasing in the
    noise (every analysis used falls as the noise grows). Bisection on the log of the noise;
    the returned level is always one whose ε was computed and found ``<= target`` (the
    upper end of the bracket), so the run reports at most the target, and at least
    ``0.98 * target`` wherever ε is continuous in the noise.
    """
    lo, hi = start, start
    while worst(hi) > target:
        lo, hi = hi, hi * 4.0
        if hi > 1e12:
            raise ValueError(f"target_epsilon={target:g} is not reachable with {name} up to 1e12.")
    if lo == hi:
        while worst(lo) <= target:
            lo, hi = lo / 4.0, lo
            if lo < 1e-12:
                return hi
    while hi / lo > 1.002:
        mid = math.sqrt(lo * hi)
        if worst(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi


def param_dtype(params):
    """The one floating dtype of a model's parameters (training keeps it)."""
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise ValueError("model has no nnx.Param to train.")
    pdtype = jnp.result_type(*leaves)
    if not jnp.issubdtype(pdtype, jnp.floating):
        raise ValueError(f"model parameters must be floating point; got {pdtype}.")
    return pdtype
