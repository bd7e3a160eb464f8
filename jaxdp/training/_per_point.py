r"""Per-point clipped gradient norms at DP-SGD checkpoints, and the per-instance ε they give.

Per-instance accounting of DP-SGD (Thudi et al. 2024; Feldman and Zrnic 2021) needs, for
every record :math:`x_i` and every step, the ratio

.. math:: r_i = \frac{\min(\lVert\nabla_\theta \ell(\theta, x_i)\rVert_2,\ C)}{C} \in [0, 1]

at the model :math:`\theta` the step starts from. :func:`per_point_clipped_norms` computes it
for a whole data set in fixed-size jitted chunks (the dense-layer fast path of
:func:`~jaxdp.training.clipped_grad_sum` when it applies, ``vmap(grad)`` otherwise), so the
working set is set by ``chunk_size``, not by the number of records.
:func:`clipped_norms_at_checkpoints` does it for every checkpoint that
``train(..., DPSGDMechanism(...), options=RunOptions(checkpoint_dir=...))`` kept, and :func:`per_point_privacy`
turns the result into per-point ε, always next to the data-independent ε of the release.

Measured on the project's shared 2-core CPU (jax 0.10.2), 60,000 MNIST-shaped records
(784 features, float32), MLP 784-256-10, 1,024 records per chunk: peak resident memory
0.53 GiB on the fast path, 1.29 GiB on the ``vmap(grad)`` path (docs/reports.md); the working set beyond
the data is about ``chunk_size · (784 + 2·256 + 2·10) · 4`` bytes on the fast path and
``chunk_size · 203,530 · 4`` bytes (one gradient per record) on the ``vmap(grad)`` path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import _validate
from .. import accounting as acc
from ._checkpoint import Checkpointer
from ._clipping import clipped_grad_sum
from ._ledger import DPSGDLedger, privacy_report
from ._plan import declared_loss_fn
from ._run import _fingerprint, _unpack_data

__all__ = [
    "CheckpointNorms",
    "PerPointPrivacy",
    "clipped_norms_at_checkpoints",
    "per_point_clipped_norms",
    "per_point_privacy",
]


# ----------------------------------------------------------------------------------------
# Norms for a whole data set, chunk by chunk
# ----------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("loss_fn", "graphdef", "use_fast_path"))
def _chunk_norms(loss_fn, graphdef, params, rest, x, y, clip_norm, use_fast_path):
    # Only the norms leave this program: XLA drops the clipped sum that clipped_grad_sum
    # would also form.
    model = nnx.merge(graphdef, params, rest)
    norms = clipped_grad_sum(loss_fn, model, (x, y), clip_norm, use_fast_path=use_fast_path).norms
    # clipped_grad_sum reads a NaN squared norm as 0; a record whose loss is not finite is
    # reported instead (an r of 0 would charge it nothing).
    return jnp.where(jnp.isfinite(loss_fn(model, x, y)), norms, jnp.nan)


def _check_chunk_size(chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer; got {chunk_size!r}.")
    return int(chunk_size)


def _xy(data) -> tuple[np.ndarray, np.ndarray]:
    x, y, *_ = _unpack_data(data)
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim < 1 or y.shape[:1] != x.shape[:1] or x.shape[0] == 0:
        raise ValueError(f"data must hold at least one record, x and y sharing the leading axis; got shapes "
                         f"{x.shape} and {y.shape}.")
    return x, y


def per_point_clipped_norms(loss_fn: Callable, model: nnx.Module, data, clip_norm, *, chunk_size: int = 1024,
                            use_fast_path: bool | None = None) -> np.ndarray:
    r"""Clipped gradient norm over the clip norm, :math:`r_i = \min(\lVert g_i\rVert_2, C)/C`, for every record.

    :math:`g_i = \nabla_\theta \ell(\theta, x_i)` with respect to the model's ``nnx.Param``
    variables. The records are processed in chunks of ``chunk_size`` by one compiled
    program (the last chunk is padded with copies of its last record, whose values are
    dropped), so memory does not grow with the number of records beyond the data and the
    output: the working set is ``chunk_size`` rows of the layers' inputs and outputs on the
    dense-layer fast path, or ``chunk_size`` gradients on the ``vmap(grad)`` path (see
    :func:`~jaxdp.training.clipped_grad_sum`). The features are cast to the parameters'
    dtype, as in training.

    Args:
      loss_fn: ``loss_fn(model, x, y) -> (b,)`` per-example losses (row i depends on
        record i only).
      model: Flax NNX module at the parameters of interest.
      data: a :class:`jaxdp.data.Dataset` (its training part) or a pair ``(x, y)``.
      clip_norm: :math:`C > 0`.
      chunk_size: records per compiled call, ≥ 1.
      use_fast_path: as in :func:`~jaxdp.training.clipped_grad_sum`.

    Returns:
      float64 array of shape ``(n,)`` with values in [0, 1].

    Raises:
      ValueError: for a bad ``clip_norm`` or ``chunk_size``, non-finite features, or a
        non-finite loss or gradient norm (naming the first such record).

    Examples:
      >>> import numpy as np
      >>> from flax import nnx
      >>> from jaxdp.models import LogisticRegression, binary_logistic_loss
      >>> model = LogisticRegression(3, rngs=nnx.Rngs(0))
      >>> x, y = np.ones((5, 3), np.float32), np.array([0, 1, 0, 1, 0])
      >>> per_point_clipped_norms(binary_logistic_loss, model, (x, y), 4.0, chunk_size=2).tolist()
      [0.25, 0.25, 0.25, 0.25, 0.25]
    """
    _validate.check_in_range("clip_norm", clip_norm, 0.0, math.inf, lo_open=True)
    chunk_size = _check_chunk_size(chunk_size)
    if not isinstance(model, nnx.Module):
        raise ValueError(f"model must be a Flax NNX module; got {type(model).__name__}.")
    x, y = _xy(data)
    if np.issubdtype(x.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(x.reshape(x.shape[0], -1)).all(axis=1))
        if bad.size:
            raise ValueError(f"x has non-finite features in {bad.size} record(s) (first: record {bad[0]}).")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    pdtype = jnp.result_type(*jax.tree.leaves(params))
    n = x.shape[0]
    b = min(chunk_size, n)
    out = np.empty(n, np.float64)
    for s in range(0, n, b):
        xb, yb = x[s:s + b], y[s:s + b]
        m = xb.shape[0]
        if m < b:  # pad with the last record: the shape (hence the program) stays the same
            xb = np.concatenate([xb, np.repeat(xb[-1:], b - m, axis=0)])
            yb = np.concatenate([yb, np.repeat(yb[-1:], b - m, axis=0)])
        norms = _chunk_norms(loss_fn, graphdef, params, rest, jnp.asarray(xb, dtype=pdtype), jnp.asarray(yb),
                             clip_norm, use_fast_path)
        out[s:s + m] = np.asarray(norms, dtype=np.float64)[:m]  # blocks: one chunk in flight
    bad = np.flatnonzero(~np.isfinite(out))
    if bad.size:
        raise ValueError(f"the loss or gradient norm of {bad.size} record(s) is not finite (first: record {bad[0]}).")
    c = float(clip_norm)
    return np.minimum(out, c) / c


# ----------------------------------------------------------------------------------------
# Every checkpoint of a DP-SGD run
# ----------------------------------------------------------------------------------------


def _check_poisson(ledger: DPSGDLedger, where) -> None:
    """Per-instance accounting analyses Poisson sampling only: refuse another batch scheme in one line."""
    if ledger.sampler is not None:
        raise ValueError(f"{str(where)!r} holds a DP-SGD run with {ledger.sampler.get('name')} batches: per-instance "
                         "accounting covers Poisson sampling only (the run's own report gives its epsilon).")


class CheckpointNorms(NamedTuple):
    """Per-point clipped norms at the checkpoints of a DP-SGD run.

    Attributes:
      checkpoint_steps: int64 ``(c,)``, increasing: column ``j`` of ``r`` was measured on
        the model after ``checkpoint_steps[j]`` steps (0 is the initial model). Only
        models that start a step are kept (steps below ``ledger.steps_done``).
      r: float64 ``(n, c)``, :math:`\\min(\\lVert g_i\\rVert, C)/C` per record and checkpoint.
      ledger: the run's :class:`~jaxdp.training.DPSGDLedger` at its latest checkpoint
        (``q``, ``noise_multiplier``, ``clip_norm``, ``steps_done``, ``delta``).
    """

    checkpoint_steps: np.ndarray
    r: np.ndarray
    ledger: DPSGDLedger


def _param_signature(params) -> str:
    # The same string the DP-SGD driver records in its configuration.
    return str(jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), params))


def clipped_norms_at_checkpoints(model: nnx.Module, data, checkpoint_dir, *, loss_fn: Callable | None = None,
                                 chunk_size: int = 1024, use_fast_path: bool | None = None,
                                 progress: Callable[[int, int], None] | None = None) -> CheckpointNorms:
    r"""Per-point clipped norms :math:`r_i` on every model a DP-SGD run checkpointed.

    Reads the checkpoints that ``train(model, data, DPSGDMechanism(...), options=RunOptions(checkpoint_dir=...))``
    wrote (that driver keeps every one, the initial model included; ``checkpoint_every``
    and ``steps_per_call`` set how many), loads each one's parameters into ``model``'s
    structure and runs :func:`per_point_clipped_norms` on the training data. Before any
    work it checks that the run was DP-SGD, that ``model`` has the recorded parameter
    shapes, that ``loss_fn`` has the recorded name and that ``data`` has the recorded
    fingerprint, so the norms are those of the run's own records and loss.

    Args:
      model: a module with the trained model's structure (e.g. the model passed to
        ``train``; its parameter values are not used).
      data: the training data of the run: a :class:`jaxdp.data.Dataset` or ``(x, y)``.
      checkpoint_dir: the run's checkpoint folder.
      loss_fn: the run's loss; default as in ``train`` (by model type).
      chunk_size: records per compiled call (sets the memory, see
        :func:`per_point_clipped_norms`).
      use_fast_path: as in :func:`~jaxdp.training.clipped_grad_sum`.
      progress: optional ``progress(done, total)`` called after each checkpoint.

    Returns:
      :class:`CheckpointNorms` ``(checkpoint_steps, r, ledger)``.

    Raises:
      FileNotFoundError: if the folder holds no checkpoint.
      ValueError: if the run was not DP-SGD, or the model, loss or data differ from the
        run's, or a norm is not finite.

    Examples:
      >>> import tempfile, numpy as np
      >>> from flax import nnx
      >>> from jaxdp.data import from_arrays
      >>> from jaxdp.models import SoftmaxRegression
      >>> from jaxdp.training import DPSGDMechanism, RunOptions, train
      >>> rng = np.random.default_rng(0)
      >>> ds = from_arrays(rng.normal(size=(40, 4)), rng.integers(0, 3, 40), test_fraction=0.0)
      >>> folder = tempfile.mkdtemp()
      >>> mech = DPSGDMechanism(learning_rate=0.5, noise_multiplier=1.0, clip_norm=1.0, batch_size=10, passes=2)
      >>> _ = train(SoftmaxRegression(4, 3, rngs=nnx.Rngs(0)), ds, mech,
      ...           options=RunOptions(checkpoint_dir=folder, progress=False))
      >>> norms = clipped_norms_at_checkpoints(SoftmaxRegression(4, 3, rngs=nnx.Rngs(0)), ds, folder)
      >>> norms.checkpoint_steps.tolist(), norms.r.shape, norms.ledger.steps_done
      ([0, 4], (40, 2), 8)
    """

    chunk_size = _check_chunk_size(chunk_size)
    if not isinstance(model, nnx.Module):
        raise ValueError(f"model must be a Flax NNX module; got {type(model).__name__}.")
    x, y = _xy(data)
    folder = Path(checkpoint_dir).expanduser()
    ck = Checkpointer(folder, max_to_keep=None)
    try:
        steps = ck.steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {str(checkpoint_dir)!r}.")
        ck.check_one_run()
        meta = ck.metadata(steps[-1])
        config = meta.get("config") or {}
        if config.get("mechanism") != "dpsgd" or "ledger" not in meta:
            raise ValueError(f"checkpoint_dir {str(checkpoint_dir)!r} does not hold a DP-SGD run of this jaxdp "
                             "(train(..., DPSGDMechanism(...))): per-instance accounting needs its ledger.")
        ledger = DPSGDLedger.from_json(meta["ledger"])
        _check_poisson(ledger, checkpoint_dir)
        loss_fn = declared_loss_fn(model, loss_fn)
        graphdef, params0, rest = nnx.split(model, nnx.Param, ...)
        if _param_signature(params0) != config.get("params"):
            raise ValueError(f"model does not have the parameters of the checkpointed run ({config.get('model')}, "
                             f"{config.get('params')}).")
        name = getattr(loss_fn, "__qualname__", repr(loss_fn))
        if name != config.get("loss_fn"):
            raise ValueError(f"loss_fn is {name!r} but the run used {config.get('loss_fn')!r}.")
        if _fingerprint(x, y) != config.get("data"):
            raise ValueError("data is not the run's training data (its fingerprint differs from the checkpoint's).")
        leaves0, treedef = jax.tree.flatten(params0)
        used = [s for s in steps if s < ledger.steps_done]
        if not used:
            raise ValueError(f"checkpoint_dir {str(checkpoint_dir)!r} holds no model that starts a step "
                             f"(checkpoints {steps}, {ledger.steps_done} steps done).")
        r = np.empty((x.shape[0], len(used)), np.float64)
        for j, s in enumerate(used):
            stored = ck.metadata(s).get("_arrays")
            if stored is None:
                raise ValueError(f"checkpoint {s} in {str(checkpoint_dir)!r} lacks its array signature.")
            like = {k: np.zeros(shape, dtype) for k, (shape, dtype) in stored.items()}
            arrays, _ = ck.restore(like, s)
            # DPSGDState's leaves start with the parameters.
            leaves = [jnp.asarray(arrays[f"leaf_{i:04d}"], dtype=ref.dtype) for i, ref in enumerate(leaves0)]
            m = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves), rest)
            r[:, j] = per_point_clipped_norms(loss_fn, m, (x, y), ledger.clip_norm, chunk_size=chunk_size,
                                              use_fast_path=use_fast_path)
            if progress is not None:
                progress(j + 1, len(used))
    finally:
        ck.close()
    return CheckpointNorms(np.asarray(used, np.int64), r, ledger)


# ----------------------------------------------------------------------------------------
# Per-point ε, next to the guarantee of the release
# ----------------------------------------------------------------------------------------


class PerPointPrivacy(NamedTuple):
    """Per-point ε of a DP-SGD run, after the data-independent guarantee of its release.

    Attributes:
      epsilon: the **guarantee of the release**: the data-independent ε at ``delta`` for
        every record (:func:`jaxdp.accounting.dpsgd_epsilon`, the value ``train`` reports).
      delta: δ.
      analysis: the release guarantee's analysis.
      reason: its assumptions.
      estimate: :class:`jaxdp.accounting.PerInstancePrivacy` from Thudi et al. 2024,
        Theorem 3.3, with each step's r taken from the nearest checkpoint: an **estimate**
        per record (its ``assumptions`` say why), not a guarantee.
      ledger: :class:`jaxdp.accounting.PerInstancePrivacy` of the individual Rényi ledger
        (Feldman and Zrnic 2021): each record's realised individual RDP summed over the
        steps (r from the nearest checkpoint), converted at ``delta``. Informational, not a
        guarantee (its ``assumptions`` say why).
      checkpoint_steps: the checkpoints used; num_steps: the steps of the run.
    """

    epsilon: float
    delta: float
    analysis: str
    reason: str
    estimate: Any
    ledger: Any
    checkpoint_steps: np.ndarray
    num_steps: int

    def summary(self, values=None) -> dict[str, float]:
        """Median, quartiles and the share of records strictly below the release's ε.

        ``values`` defaults to ``estimate.epsilon``.
        """
        v = np.asarray(self.estimate.epsilon if values is None else values, np.float64)
        q1, med, q3 = np.quantile(v, [0.25, 0.5, 0.75])
        return {"median": float(med), "quartile_1": float(q1), "quartile_3": float(q3),
                "share_below": float(np.mean(v < self.epsilon))}


def _steps_per_checkpoint(checkpoint_steps: np.ndarray, num_steps: int) -> np.ndarray:
    """How many of the steps 1..n use each checkpoint: step t uses the one nearest t - 1 (ties: earlier)."""
    t = np.arange(num_steps)  # t - 1 for t = 1..n
    ck = np.asarray(checkpoint_steps)
    hi = np.clip(np.searchsorted(ck, t, side="left"), 0, ck.size - 1)
    lo = np.clip(hi - 1, 0, ck.size - 1)
    nearest = np.where(np.abs(ck[lo] - t) <= np.abs(ck[hi] - t), lo, hi)
    return np.bincount(nearest, minlength=ck.size)


def _realised_rdp(r, checkpoint_steps, num_steps, q, noise_multiplier, orders, block) -> np.ndarray:
    """Σ_t ε_step(α; r_{i,t}) per record, r_{i,t} from the checkpoint nearest t - 1: shape (n, k)."""
    counts = _steps_per_checkpoint(checkpoint_steps, num_steps).astype(np.float64)
    rdp = np.empty((r.shape[0], len(orders)), np.float64)
    for s in range(0, r.shape[0], block):
        rb = r[s:s + block]
        m = rb.shape[0]
        if m < block and r.shape[0] > block:  # a fixed shape: one compiled program
            rb = np.concatenate([rb, np.zeros((block - m, rb.shape[1]))])
        step_rdp = np.asarray(acc.per_instance_sampled_gaussian_rdp(orders, q, noise_multiplier, rb))  # (m, c, k)
        rdp[s:s + m] = np.einsum("c,mck->mk", counts, step_rdp)[:m]
    return rdp


def per_point_privacy(norms: CheckpointNorms, *, delta: float | None = None, orders=None, p: float | None = None,
                      chunk_size: int = 256, r_grid: int | None = None) -> PerPointPrivacy:
    r"""Per-point ε of a DP-SGD run from its checkpoint norms, after the guarantee of the release.

    Three numbers per run, in this order of authority:

    1. ``epsilon``: the data-independent guarantee,
       :math:`ε = \mathrm{dpsgd\_epsilon}(q, ν, n, δ)`, valid for every record. This is
       the guarantee of the released model; the per-point values below are not.
    2. ``estimate``: Thudi et al. 2024, Theorem 3.3 per record
       (:func:`jaxdp.accounting.per_instance_dpsgd_privacy` with ``checkpoint_steps``):
       step t uses the r of the checkpoint nearest to t − 1, and the expectation over
       training runs is replaced by the one recorded run. An **estimate**.
    3. ``ledger``: each record's realised individual RDP,
       :math:`\sum_t ε_{\mathrm{step}}(α; r_{i,t})` with the per-step bound of Thudi et
       al. Theorem 3.2 (:func:`jaxdp.accounting.per_instance_sampled_gaussian_rdp`),
       converted at δ. Feldman and Zrnic's Rényi filter turns such a sum into a guarantee
       only when training **enforced** a budget, dropping a record before it is exceeded,
       with r known at every step. Plain DP-SGD enforces none (with the data-independent
       budget no record is ever dropped, and that filter's guarantee is ε of item 1), and
       here r is known only at checkpoints: the values are informational.

    Args:
      norms: from :func:`clipped_norms_at_checkpoints`.
      delta: δ in (0, 1); default the run's.
      orders: Rényi orders of the per-point analyses; default
        :data:`jaxdp.accounting.PER_INSTANCE_ORDERS`.
      p: Hölder exponent of Theorem 3.3 (default 3n).
      chunk_size: points per chunk of the accountants (memory).
      r_grid: ``None`` (exact) or a power of two M: the Theorem 3.3 estimate rounds each r
        up to a multiple of 1/M and reads a table (an upper bound of the exact estimate,
        much faster for large data sets; see
        :func:`jaxdp.accounting.per_instance_dpsgd_privacy`).

    Returns:
      :class:`PerPointPrivacy`.

    References:
      A. Thudi, H. Jia, C. Meehan, I. Shumailov, N. Papernot, "Gradients Look Alike:
      Sensitivity is Often Overestimated in DP-SGD", USENIX Security 2024 (arXiv:2307.00310),
      Theorems 3.2 and 3.3. V. Feldman, T. Zrnic, "Individual Privacy Accounting via a
      Rényi Filter", NeurIPS 2021 (arXiv:2008.11193).

    Examples:
      >>> import numpy as np
      >>> from jaxdp.training import CheckpointNorms, DPSGDLedger, per_point_privacy
      >>> led = DPSGDLedger(analysis="dpsgd", reason="", q=0.1, noise_multiplier=1.0, clip_norm=1.0,
      ...     learning_rate=0.1, batch_size=10, records=100, passes=2, steps_per_pass=10, total_steps=20,
      ...     steps_done=20, capacity=30, delta=1e-5, order_seed=0, fixed_noise_seed=False, max_grad_norm=1.0)
      >>> norms = CheckpointNorms(np.array([0, 10]), np.array([[1.0, 1.0], [0.1, 0.05]]), led)
      >>> res = per_point_privacy(norms, orders=[2.0, 8.0], p=np.inf)  # two points, twenty steps
      >>> bool(res.estimate.epsilon[1] < res.epsilon < res.estimate.epsilon[0] + 1e-9)
      True
    """
    ledger = norms.ledger
    delta = float(ledger.delta if delta is None else delta)
    _validate.check_delta(delta)
    chunk_size = _check_chunk_size(chunk_size)
    orders_np = np.asarray(acc.PER_INSTANCE_ORDERS if orders is None else orders, np.float64)
    n = int(ledger.steps_done)
    if n < 1:
        raise ValueError("the run did no step: there is nothing to account.")
    ck = np.asarray(norms.checkpoint_steps, np.int64)
    r = np.asarray(norms.r, np.float64)
    if r.ndim != 2 or r.shape[1] != ck.size:
        raise ValueError(f"r must have shape (records, {ck.size}), one column per checkpoint; got {r.shape}.")
    _check_poisson(ledger, "norms.ledger")
    q, nm = float(ledger.q), float(ledger.noise_multiplier)
    release = privacy_report(ledger._replace(delta=delta))

    est = acc.per_instance_dpsgd_privacy(orders_np, q, nm, r, delta, num_steps=n, checkpoint_steps=ck, p=p,
                                         chunk_size=chunk_size, r_grid=r_grid)
    est = dataclasses.replace(est, epsilon=np.asarray(est.epsilon), order=np.asarray(est.order),
                              rdp=np.asarray(est.rdp))
    rdp = _realised_rdp(r, ck, n, q, nm, orders_np, 4 * chunk_size)
    conv = acc.rdp_to_epsilon(rdp, orders_np, delta)
    led_assumptions = (
        "Feldman and Zrnic 2021 individual Renyi ledger: each record's per-step individual RDP (Thudi et al. 2024 "
        "Theorem 3.2: add/remove neighbours, Poisson sampling at rate q, clipping at C, noise N(0, "
        "(noise_multiplier*C)^2) on the sum) summed over the steps and converted at delta.",
        "NOT a guarantee: the Renyi filter certifies a budget only when training enforces it (drops a record "
        "before its budget is exceeded, with r known at every step); plain DP-SGD enforced none (with the "
        "data-independent budget no record is ever dropped, and that filter's guarantee is the data-independent "
        "epsilon).",
        f"ESTIMATE: r known only at {ck.size} checkpoints of {n} steps; step t uses the checkpoint nearest to "
        "t - 1 (ties: the earlier).",
        "Data-dependent: the values themselves depend on the data and are not to be released without accounting "
        "for them.",
    )
    realised = acc.PerInstancePrivacy(np.asarray(conv.epsilon, np.float64), np.asarray(conv.order), rdp, None,
                                      "feldman_zrnic2021_individual_renyi_ledger", led_assumptions)
    return PerPointPrivacy(float(release.summary()["worst"]), delta, release.analysis, release.reason, est,
                           realised, ck, n)
