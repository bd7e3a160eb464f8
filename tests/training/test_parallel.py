"""Data-parallel private training over devices: same result as one device, noise drawn once.

The multi-device checks run in ONE subprocess with 8 host CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``: the flag must be set before JAX
starts, and one process keeps the CI cost to one JAX import); this file is also that
subprocess's script (``python test_parallel.py --child``). References: per-example gradients
taken one example at a time and clipped and summed in NumPy float64; the documented noise
key schedule of ``add_gaussian_noise``; the Gaussian variance :math:`\\nu^2C^2`; and the
one-device run with the same keys.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdp.models import SoftmaxRegression
from jaxdp.training import data_parallel_mesh, parallel_clipped_grad_sum

DEVICES = 8
# float32 sums over at most 61 rows added in another order: a few ulps of the largest term.
RTOL, ATOL = 2e-5, 2e-6


def _loss(model, x, y):
    return model.loss(x, y)


def _data(n=61, d=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x * 2.0, (np.arange(n) % 3).astype(np.int32)


def _reference_clipped_sum(w, bias, x, y, clip_norm, mask):
    """Clipped sum in float64 from the closed-form softmax cross-entropy gradients.

    Example i: logits z = x_i W + b, p = softmax(z); dW = x_i (p - e_{y_i})^T, db = p - e_{y_i}.
    """
    x = np.asarray(x, np.float64)
    z = x @ np.asarray(w, np.float64) + np.asarray(bias, np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    delta = p - np.eye(p.shape[1])[y]
    norms = np.sqrt(np.sum(x**2, axis=1) * np.sum(delta**2, axis=1) + np.sum(delta**2, axis=1))
    c = np.asarray(mask, np.float64) * np.minimum(1.0, clip_norm / norms)
    return np.einsum("i,id,ik->dk", c, x, delta), np.einsum("i,ik->k", c, delta), norms


def _check_clipped_sum(mesh, use_fast_path):
    model = SoftmaxRegression(6, 3, rngs=nnx.Rngs(0))
    # A non-zero start, so that the examples' gradients differ in both layers.
    w = jax.random.normal(jax.random.key(5), model.linear.kernel.shape)
    model.linear.kernel[...] = w
    x, y = _data(13)
    mask = np.array([1] * 10 + [0, 1, 0], np.float32)
    out = jax.jit(lambda x, y, m: parallel_clipped_grad_sum(_loss, model, (x, y), 0.7, mesh, mask=m,
                                                            use_fast_path=use_fast_path))(x, y, mask)
    ref_w, ref_b, ref_norms = _reference_clipped_sum(w, model.linear.bias[...], x, y, 0.7, mask)
    np.testing.assert_allclose(np.asarray(out.grad_sum["linear"]["kernel"][...]), ref_w, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(out.grad_sum["linear"]["bias"][...]), ref_b, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(out.norms), ref_norms, rtol=RTOL)


# ----------------------------------------------------------------------------------------
# In-process (one device in CI)
# ----------------------------------------------------------------------------------------


def test_clipped_sum_one_device_matches_reference():
    # The vmap(grad) path on more devices: in the 8-device child.
    _check_clipped_sum(data_parallel_mesh(1), None)


def test_mesh_validation():
    n = jax.device_count()
    with pytest.raises(ValueError, match="devices must be an integer in"):
        data_parallel_mesh(0)
    with pytest.raises(ValueError, match="devices must be an integer in"):
        data_parallel_mesh(n + 1)
    with pytest.raises(ValueError, match="devices must be a non-empty sequence"):
        data_parallel_mesh([])
    other = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("batch",))
    with pytest.raises(ValueError, match="'data' axis"):
        data_parallel_mesh(other)
    with pytest.raises(ValueError, match="mesh must be"):
        parallel_clipped_grad_sum(_loss, SoftmaxRegression(6, 3, rngs=nnx.Rngs(0)), _data(4), 1.0, other)
    assert data_parallel_mesh().shape["data"] == n


def test_train_rejects_bad_devices():
    from jaxdp.training import train

    with pytest.raises(ValueError, match="devices"):
        train(SoftmaxRegression(6, 3, rngs=nnx.Rngs(0)), _data(), algorithm="dpsgd", learning_rate=0.5,
              noise_multiplier=1.0, clip_norm=1.0, batch_size=8, devices=jax.device_count() + 1, progress=False)


def test_eight_devices():
    """All multi-device checks, in one subprocess with 8 host devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ALL OK" in proc.stdout


# ----------------------------------------------------------------------------------------
# The child: 8 devices
# ----------------------------------------------------------------------------------------


def _assert_trees_close(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=RTOL, atol=ATOL)


def _assert_replicated(tree):
    for leaf in jax.tree.leaves(tree):
        sh = leaf.sharding
        assert sh.is_fully_replicated and len(sh.device_set) == DEVICES, sh


def _child_train_equal():
    """(a) 8 devices == 1 device for both algorithms (same keys); (c) replicated output."""
    import warnings

    from jaxdp.training import train

    data = _data()
    runs = {
        # PNSGD: batch 12, not a multiple of 8 (padded to 16); fast path.
        "pnsgd": dict(learning_rate=0.5, radius=5.0, clip_norm=0.5, convex=False, batch_size=12),
        # DP-SGD: the vmap(grad) path, a capacity that is not a multiple of 8.
        "dpsgd": dict(algorithm="dpsgd", learning_rate=0.5, clip_norm=0.5, batch_size=10, use_fast_path=False),
    }
    for name, kw in runs.items():
        res = {}
        for devices in (None, DEVICES):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # noise_seed is fixed: not private (a test)
                res[devices] = train(SoftmaxRegression(6, 3, rngs=nnx.Rngs(0)), data, noise_multiplier=1.0,
                                     noise_seed=3, progress=False, account=False, devices=devices, **kw)
        one, many = res[None], res[DEVICES]
        _assert_trees_close(one.state.params, many.state.params)
        assert int(one.state.step) == int(many.state.step) > 1
        assert int(one.state.clipped) == int(many.state.clipped)
        assert one.state.ledger == many.state.ledger._replace(max_grad_norm=one.state.ledger.max_grad_norm)
        np.testing.assert_allclose(float(one.state.max_grad_norm), float(many.state.max_grad_norm), rtol=RTOL)
        _assert_replicated(many.state.params)
        _assert_replicated(many.state.opt_state)
        _assert_replicated(nnx.split(many.model, nnx.Param, ...)[1])
        moved = float(sum(jnp.sum(jnp.abs(u - v)) for u, v in zip(
            jax.tree.leaves(many.state.params), jax.tree.leaves(nnx.split(SoftmaxRegression(
                6, 3, rngs=nnx.Rngs(0)), nnx.Param, ...)[1]), strict=True)))
        assert moved > 0.1, name
        print(name, "equal on 1 and 8 devices; replicated output")


class _Vector(nnx.Module):
    def __init__(self, size):
        self.w = nnx.Param(jnp.zeros((size,), jnp.float32))


def _zero_loss(model, x, y):
    # Zero per-example losses that still depend on the parameters: zero gradients.
    return 0.0 * (x[:, :1] @ model.w[None, :1]).sum(axis=1)


def _child_noise_once():
    """(b) zero gradients: the update is the noise, drawn once for the global sum."""
    import optax

    from jaxdp.training import dpsgd, dpsgd_step, replicate

    mesh = data_parallel_mesh(DEVICES)
    size, nu, clip = 4096, 1.5, 2.0
    key = jax.random.key(11)
    graphdef, params, rest = nnx.split(_Vector(size), nnx.Param, ...)
    tx = dpsgd(optax.sgd(1.0), nu, clip, 1.0, key)  # learning rate 1, batch_size 1: update = -(S + Z)
    args = replicate((params, tx.init(params), *_data()), mesh)
    p, _, _ = jax.jit(lambda p, s, xx, yy: dpsgd_step(
        _zero_loss, graphdef, rest, tx, p, s, jax.random.key(2), xx, yy, 0.3, clip, 8, mesh=mesh))(*args)
    noise = -np.asarray(p["w"][...], np.float64)
    # The documented key schedule of add_gaussian_noise (split the key, take the second half,
    # one key per leaf): exactly the one-device draw, not a per-device one.
    _, noise_key = jax.random.split(key)
    want = nu * clip * np.asarray(jax.random.normal(jax.random.split(noise_key, 1)[0], (size,), jnp.float32))
    np.testing.assert_allclose(noise, want, rtol=1e-6, atol=1e-6)
    # Variance nu^2 C^2 (not 8x: independent per-device draws summed; not 64x: one draw psum'ed).
    # The sample variance of 4096 normals has relative sd sqrt(2/4096) = 2.2 %; allow 5 sd.
    ratio = float(np.mean(noise**2)) / (nu * clip) ** 2
    assert abs(ratio - 1.0) < 5 * np.sqrt(2 / size), ratio
    print(f"noise once: variance ratio {ratio:.4f}")


def _child_sampling_unchanged():
    """The padded capacity (5 -> 8, several chunks) changes neither the sample nor the sum."""
    import optax

    from jaxdp.training import dpsgd, dpsgd_step, poisson_sample, replicate

    mesh = data_parallel_mesh(DEVICES)
    model = SoftmaxRegression(6, 3, rngs=nnx.Rngs(0))
    w = np.asarray(jax.random.normal(jax.random.key(5), model.linear.kernel.shape))
    model.linear.kernel[...] = w
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x, y = _data()
    q, clip = 0.3, 0.5
    tx = dpsgd(optax.sgd(1.0), 0.0, clip, 1.0, jax.random.key(0))  # no noise: update = -S
    step = jax.jit(lambda p, s, k, xx, yy: dpsgd_step(_loss, graphdef, rest, tx, p, s, k, xx, yy, q, clip, 5,
                                                      mesh=mesh))
    rep = replicate((params, tx.init(params), x, y), mesh)
    for seed in range(2):
        k = jax.random.key(100 + seed)
        p8, _, o8 = step(*rep[:2], k, *rep[2:])
        idx, size = poisson_sample(k, x.shape[0], q)
        size = int(size)
        assert int(o8.batch_size) == size and int(o8.chunks) == -(-size // 8) > 1
        sampled = np.zeros(x.shape[0], np.float64)
        sampled[np.asarray(idx)[:size]] = 1.0
        ref_w, ref_b, _ = _reference_clipped_sum(w, np.zeros(3), x, y, clip, sampled)
        np.testing.assert_allclose(-np.asarray(p8["linear"]["kernel"][...]) + w, ref_w, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(-np.asarray(p8["linear"]["bias"][...]), ref_b, rtol=RTOL, atol=ATOL)
    print("sampling unchanged by the padding")


def _child_micro_batches():
    """Micro-batches (issue 25) split over the devices: m = 3 rounded up to 8, several of them,
    the noise once: the same update as one device without micro-batches, same keys."""
    import optax

    from jaxdp.training import dpsgd, dpsgd_step, replicate

    mesh = data_parallel_mesh(DEVICES)
    model = SoftmaxRegression(6, 3, rngs=nnx.Rngs(0))
    model.linear.kernel[...] = np.asarray(jax.random.normal(jax.random.key(5), model.linear.kernel.shape))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x, y = (jnp.asarray(a) for a in _data())
    tx = dpsgd(optax.sgd(1.0), 1.3, 0.5, 4.0, jax.random.key(0))
    one = jax.jit(lambda p, s, k: dpsgd_step(_loss, graphdef, rest, tx, p, s, k, x, y, 0.3, 0.5, x.shape[0]))
    many = jax.jit(lambda p, s, k, xx, yy: dpsgd_step(_loss, graphdef, rest, tx, p, s, k, xx, yy, 0.3, 0.5, 12,
                                                      mesh=mesh, micro_batch_size=3))
    rep = replicate((params, tx.init(params), x, y), mesh)
    k = jax.random.key(7)
    p1, _, o1 = one(params, tx.init(params), k)
    p8, _, o8 = many(*rep[:2], k, *rep[2:])
    assert int(o8.batch_size) == int(o1.batch_size) and int(o8.chunks) == -(-int(o8.batch_size) // 8) > 1
    _assert_trees_close(p8, p1)
    print("micro-batches over 8 devices == one batch on one device")


def _child():
    assert jax.device_count() == DEVICES, jax.devices()
    for use_fast_path in (None, False):
        _check_clipped_sum(data_parallel_mesh(DEVICES), use_fast_path)
    print("clipped sum on 8 devices == float64 reference (fast path and vmap)")
    _child_noise_once()
    _child_sampling_unchanged()
    _child_train_equal()
    _child_micro_batches()
    print("ALL OK")


if __name__ == "__main__" and "--child" in sys.argv:
    _child()
