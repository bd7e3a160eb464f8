"""Per-point clipped norms for a whole data set and at DP-SGD checkpoints.

References: an explicit per-example ``jax.grad`` loop (one record at a time, no vmap, no
fast path) and the unchunked ``per_example_grad_norms``; the realised individual RDP
against the closed-form binomial sum of Thudi et al. Thm 3.2 evaluated in Python floats
with ``math``; the nearest-checkpoint rule against a direct loop over steps.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdp.data import from_arrays
from jaxdp.models import MLP, SoftmaxRegression, softmax_cross_entropy_loss
from jaxdp.training import (
    Checkpointer,
    CheckpointNorms,
    clipped_norms_at_checkpoints,
    per_example_grad_norms,
    per_point_clipped_norms,
    train,
)
from jaxdp.training._per_point import _realised_rdp, _steps_per_checkpoint

RTOL = 2e-5  # float32 gradients: the fast path and the reference sum squares in different orders


class _Bilinear(nnx.Module):
    """Parameters outside nnx.Linear: forces the vmap(grad) path."""

    def __init__(self, d, k):
        self.w = nnx.Param(jnp.linspace(-1.0, 1.0, d * k).reshape(d, k))
        self.s = nnx.Param(jnp.ones((k,)) * 0.5)

    def __call__(self, x):
        return jnp.tanh(x @ self.w) * self.s


def _reference_norms(loss_fn, model, x, y):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    out = []
    for i in range(x.shape[0]):
        g = jax.grad(lambda p, i=i: loss_fn(nnx.merge(graphdef, p, rest), x[i:i + 1], y[i:i + 1])[0])(params)
        out.append(math.sqrt(sum(float(np.sum(np.asarray(leaf, np.float64) ** 2)) for leaf in jax.tree.leaves(g))))
    return np.array(out)


def _data(n=13, d=6, k=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype(np.float32) * 2.0, rng.integers(0, k, size=n)


@pytest.mark.parametrize("make", [lambda: MLP((6, 5, 3), rngs=nnx.Rngs(1)), lambda: _Bilinear(6, 3)],
                         ids=["fast_path", "vmap_grad"])
@pytest.mark.parametrize("chunk_size", [1, 4, 13, 50])
def test_chunked_norms_match_unchunked_and_explicit_grad(make, chunk_size):
    model = make()
    x, y = _data()
    ref = _reference_norms(softmax_cross_entropy_loss, model, x, y)
    unchunked = np.asarray(per_example_grad_norms(softmax_cross_entropy_loss, model, (x, y)), np.float64)
    np.testing.assert_allclose(unchunked, ref, rtol=RTOL)
    c = float(np.median(ref))  # about half the records are clipped
    r = per_point_clipped_norms(softmax_cross_entropy_loss, model, (x, y), c, chunk_size=chunk_size)
    assert r.dtype == np.float64 and r.shape == (13,)
    assert np.all((r >= 0) & (r <= 1))
    np.testing.assert_allclose(r, np.minimum(ref, c) / c, rtol=RTOL)
    assert np.sum(r == 1.0) >= 6


def test_norms_validate_their_arguments():
    x, y = _data()
    model = MLP((6, 5, 3), rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="clip_norm"):
        per_point_clipped_norms(softmax_cross_entropy_loss, model, (x, y), 0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        per_point_clipped_norms(softmax_cross_entropy_loss, model, (x, y), 1.0, chunk_size=0)

    def nan_at_5(m, xb, yb):  # one chunk holds every record, so row 5 is record 5
        return jnp.where(jnp.arange(xb.shape[0]) == 5, jnp.nan, 1.0) * softmax_cross_entropy_loss(m, xb, yb)

    with pytest.raises(ValueError, match="record 5"):  # a NaN loss must not read as r = 0
        per_point_clipped_norms(nan_at_5, model, (x, y), 1.0, chunk_size=13)
    x[3, 0] = np.nan
    with pytest.raises(ValueError, match="record 3"):
        per_point_clipped_norms(softmax_cross_entropy_loss, model, (x, y), 1.0)


def test_steps_per_checkpoint_is_the_nearest_rule():
    for ck, n in (([0], 5), ([0, 3], 7), ([2, 5, 9], 12), ([0, 1, 2, 3], 4), ([4], 10)):
        want = np.zeros(len(ck), int)
        for t in range(1, n + 1):
            dist = [abs(c - (t - 1)) for c in ck]
            want[dist.index(min(dist))] += 1  # first minimum: ties go to the earlier checkpoint
        np.testing.assert_array_equal(_steps_per_checkpoint(np.array(ck), n), want)


def _sgm_rdp_integer(alpha, q, sigma, r):
    """Thudi et al. Thm 3.2 at integer alpha, summed directly (Python floats)."""
    s = sum(math.comb(alpha, k) * (1 - q) ** (alpha - k) * q ** k * math.exp(r * r * (k * k - k) / (2 * sigma ** 2))
            for k in range(alpha + 1))
    return math.log(s) / (alpha - 1)


def test_realised_rdp_matches_the_binomial_sum():
    r = np.array([[1.0, 0.5, 0.2], [0.0, 0.3, 0.9], [0.7, 0.7, 0.7]])
    ck, n, q, sigma, orders = np.array([0, 4, 8]), 11, 0.05, 1.1, [2, 3, 8]
    counts = _steps_per_checkpoint(ck, n)  # [2, 4, 5]
    got = _realised_rdp(r, ck, n, q, sigma, np.array(orders, float), block=2)
    for i in range(3):
        for j, a in enumerate(orders):
            want = sum(counts[c] * _sgm_rdp_integer(a, q, sigma, r[i, c]) for c in range(3))
            assert got[i, j] == pytest.approx(want, rel=1e-12, abs=1e-300)


def _tiny(n=30, d=4):
    rng = np.random.default_rng(0)
    return from_arrays(rng.normal(size=(n, d)), rng.integers(0, 3, size=n), test_fraction=0.0)


RUN = dict(algorithm="dpsgd", learning_rate=0.5, noise_multiplier=1.0, clip_norm=1.0, batch_size=6, passes=2,
           progress=False, noise_seed=3, steps_per_call=2, checkpoint_every=2)


def test_every_checkpoint_is_kept_and_read_back(tmp_path):
    ds = _tiny()
    graphdef, params0, rest = nnx.split(SoftmaxRegression(4, 3, rngs=nnx.Rngs(0)), nnx.Param, ...)
    seen = {0: params0}

    def record(state):
        seen[int(state.step)] = state.params

    folder = tmp_path / "ck"
    with pytest.warns(UserWarning, match="noise_seed"):
        train(SoftmaxRegression(4, 3, rngs=nnx.Rngs(0)), ds, checkpoint_dir=folder, callback=record, **RUN)
    kept = Checkpointer(folder, max_to_keep=None).steps()  # training steps, from the metadata
    assert kept == [0, 2, 4, 6, 8, 10]  # the initial model and every later one (10 steps)
    norms = clipped_norms_at_checkpoints(SoftmaxRegression(4, 3, rngs=nnx.Rngs(0)), ds, folder, chunk_size=7)
    assert isinstance(norms, CheckpointNorms)
    assert norms.checkpoint_steps.tolist() == [0, 2, 4, 6, 8]  # the final model starts no step
    assert norms.ledger.steps_done == 10 and norms.ledger.q == pytest.approx(6 / 30)
    assert norms.r.shape == (30, 5) and np.all((norms.r >= 0) & (norms.r <= 1))
    for j, s in enumerate(norms.checkpoint_steps):
        ref = _reference_norms(softmax_cross_entropy_loss, nnx.merge(graphdef, seen[int(s)], rest), ds.x_train.astype(np.float32), ds.y_train)
        np.testing.assert_allclose(norms.r[:, j], np.minimum(ref, 1.0), rtol=RTOL)


def test_checkpoints_of_another_run_are_refused(tmp_path):
    ds = _tiny()
    folder = tmp_path / "ck"
    with pytest.warns(UserWarning):
        train(SoftmaxRegression(4, 3, rngs=nnx.Rngs(0)), ds, checkpoint_dir=folder, **{**RUN, "passes": 1})
    with pytest.raises(ValueError, match="fingerprint"):
        clipped_norms_at_checkpoints(SoftmaxRegression(4, 3, rngs=nnx.Rngs(0)), _tiny(n=31), folder)
    with pytest.raises(ValueError, match="parameters"):
        clipped_norms_at_checkpoints(MLP((4, 2, 3), rngs=nnx.Rngs(0)), ds, folder)
    with pytest.raises(ValueError, match="loss_fn"):
        clipped_norms_at_checkpoints(SoftmaxRegression(4, 3, rngs=nnx.Rngs(0)), ds, folder,
                                     loss_fn=lambda m, x, y: softmax_cross_entropy_loss(m, x, y))
    with pytest.raises(FileNotFoundError):
        clipped_norms_at_checkpoints(SoftmaxRegression(4, 3, rngs=nnx.Rngs(0)), ds, tmp_path / "empty")
    other = Checkpointer(tmp_path / "pnsgd")
    other.save(3, {"w": np.zeros(2)}, {"config": {"algorithm": "pnsgd"}})
    other.close()
    with pytest.raises(ValueError, match="DP-SGD"):
        clipped_norms_at_checkpoints(SoftmaxRegression(4, 3, rngs=nnx.Rngs(0)), ds, tmp_path / "pnsgd")
