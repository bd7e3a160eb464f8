"""DP-SGD at scale: gradient accumulation in micro-batches, mixed precision, trainable-only.

Micro-batches change only the order of the floating-point additions of the clipped sum:
the update equals the one-batch update (same keys: same sample, same noise) to float32
rounding. bfloat16 models get float32 norms, sums and noise. With a ``trainable`` filter
the frozen parameters are not touched.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxdp.data import from_arrays
from jaxdp.models import MLP, softmax_cross_entropy_loss
from jaxdp.training import (DPSGDMechanism, RunOptions, clipped_grad_sum, dpsgd, dpsgd_step, fast_path_supported,
                             train)
from jaxdp.training import _transforms

# float32: the micro-batched and one-batch clipped sums differ in the order of ~100 additions.
F32_TOL = 1e-6


def _setup(n=120, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n, 6)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 3, size=n))
    model = MLP((6, 8, 3), rngs=nnx.Rngs(seed))
    return model, x, y


@pytest.mark.parametrize("capacity,micro", [(64, 16), (64, 7), (10, 4), (64, 64)])
def test_micro_batched_update_equals_one_batch_update(capacity, micro):
    """Same keys, same update to 1e-6 (float32); (10, 4): the batch overflows the 3 fixed
    micro-batches into the while loop; the one-batch step at capacity 64 never does."""
    model, x, y = _setup()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    q, clip = 0.4, 0.5
    tx = dpsgd(optax.sgd(0.3), 1.1, clip, q * x.shape[0], jax.random.key(3))
    key = jax.random.key(7)

    def step(p, s, k, mb, cap):
        return dpsgd_step(softmax_cross_entropy_loss, graphdef, rest, tx, p, s, k, x, y, q, clip, cap,
                          micro_batch_size=mb)

    one, _, out1 = jax.jit(lambda p, s, k: step(p, s, k, None, 64))(params, tx.init(params), key)
    acc, _, out2 = jax.jit(lambda p, s, k: step(p, s, k, micro, capacity))(params, tx.init(params), key)
    assert int(out1.batch_size) == int(out2.batch_size) > 0
    assert int(out2.chunks) == -(-int(out2.batch_size) // micro)
    assert float(out1.max_grad_norm) == pytest.approx(float(out2.max_grad_norm), rel=F32_TOL)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(acc), strict=True):
        np.testing.assert_allclose(b, a, rtol=F32_TOL, atol=F32_TOL)


class _TinyEncoder(nnx.Module):
    """LayerNorm, LoRA-adapted attention projection, RMSNorm and a head on (b, T, d) inputs:
    the closed-form layers of the fast path (norm layers, LoRA adapters) and the ghost norms."""

    def __init__(self, rngs):
        self.ln = nnx.LayerNorm(6, rngs=rngs)
        self.proj = nnx.LoRALinear(6, 8, lora_rank=2, rngs=rngs)
        self.rms = nnx.RMSNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        h = self.rms(jax.nn.gelu(self.proj(self.ln(x))))
        return self.head(h.mean(axis=1))


@pytest.mark.parametrize("wrt", ["all", "adapters"])
def test_micro_batched_update_equals_one_batch_update_transformer_layers(wrt):
    """The same equality on a model of LayerNorm / LoRALinear / RMSNorm over sequences (all
    parameters, or the LoRA adapters only): 1e-6 in float32 with the same keys."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(90, 5, 6)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 3, size=90))
    model = _TinyEncoder(nnx.Rngs(4))
    model.proj.lora.lora_b.set_value(jnp.asarray(rng.normal(size=(2, 8)).astype(np.float32)))  # B = 0 at init
    trainable = nnx.Param if wrt == "all" else nnx.LoRAParam
    graphdef, params, rest = nnx.split(model, trainable, ...)
    q, clip = 0.4, 0.3
    tx = dpsgd(optax.sgd(0.3), 1.1, clip, q * x.shape[0], jax.random.key(3))
    key = jax.random.key(8)

    def step(p, s, k, mb):
        return dpsgd_step(softmax_cross_entropy_loss, graphdef, rest, tx, p, s, k, x, y, q, clip, 64,
                          micro_batch_size=mb, wrt=trainable)

    assert fast_path_supported(softmax_cross_entropy_loss, model, (x[:4], y[:4]), wrt=trainable)
    one, _, out1 = jax.jit(lambda p, s, k: step(p, s, k, None))(params, tx.init(params), key)
    acc, _, out2 = jax.jit(lambda p, s, k: step(p, s, k, 11))(params, tx.init(params), key)
    assert int(out1.batch_size) == int(out2.batch_size) > 0
    assert float(out1.max_grad_norm) == pytest.approx(float(out2.max_grad_norm), rel=F32_TOL)
    assert float(out1.max_grad_norm) > clip  # some examples are clipped
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(acc), strict=True):
        np.testing.assert_allclose(b, a, rtol=F32_TOL, atol=F32_TOL)


def test_train_with_micro_batches_same_epsilon_and_update():
    model, x, y = _setup(seed=1)
    ds = from_arrays(np.asarray(x), np.asarray(y), test_fraction=0.0)
    kw = dict(clip_norm=1.0, noise_multiplier=1.0, batch_size=24, passes=2, learning_rate=0.2)
    opts = RunOptions(progress=False)
    plain = train(MLP((6, 8, 3), rngs=nnx.Rngs(1)), ds, DPSGDMechanism(**kw), noise_seed=3, options=opts)
    micro = train(MLP((6, 8, 3), rngs=nnx.Rngs(1)), ds, DPSGDMechanism(micro_batch_size=5, **kw), noise_seed=3,
                  options=opts)
    np.testing.assert_array_equal(micro.privacy.epsilon, plain.privacy.epsilon)  # the accounting is unchanged
    for a, b in zip(jax.tree.leaves(nnx.state(plain.model, nnx.Param)),
                    jax.tree.leaves(nnx.state(micro.model, nnx.Param)), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)  # 10 steps of float32 rounding
    with pytest.raises(ValueError, match="micro_batch_size"):
        DPSGDMechanism(micro_batch_size=0, **kw)


def test_bfloat16_model_float32_norms_sum_and_noise(monkeypatch):
    model16 = MLP((6, 8, 3), rngs=nnx.Rngs(2), param_dtype=jnp.bfloat16)
    _, x, y = _setup()
    x16 = x.astype(jnp.bfloat16)
    out = clipped_grad_sum(softmax_cross_entropy_loss, model16, (x16[:16], y[:16]), 0.5)
    assert out.norms.dtype == jnp.float32
    assert {leaf.dtype for leaf in jax.tree.leaves(out.grad_sum)} == {jnp.dtype(jnp.float32)}
    # The same norms as the float32 model with the same (bfloat16-representable) weights, to
    # bfloat16 rounding of the activations (8 bits: 2^-8 relative, a few times over).
    params32 = jax.tree.map(lambda p: p.astype(jnp.float32), nnx.state(model16, nnx.Param))
    model32 = MLP((6, 8, 3), rngs=nnx.Rngs(2))
    nnx.update(model32, params32)
    ref = clipped_grad_sum(softmax_cross_entropy_loss, model32, (x16[:16].astype(jnp.float32), y[:16]), 0.5)
    np.testing.assert_allclose(out.norms, ref.norms, rtol=3e-2)
    # The noise is drawn in float32: record the dtype of every normal draw of the step.
    drawn = []
    normal = jax.random.normal
    monkeypatch.setattr(_transforms.jax.random, "normal",
                        lambda key, shape=(), dtype=float, *a, **k: drawn.append(jnp.dtype(dtype))
                        or normal(key, shape, dtype, *a, **k))
    graphdef, params, rest = nnx.split(model16, nnx.Param, ...)
    tx = dpsgd(optax.sgd(0.1), 1.0, 0.5, 16.0, jax.random.key(0))
    opt_state = tx.init(jax.tree.map(lambda p: p.astype(jnp.float32), params))
    new, _, _ = jax.jit(lambda p, s: dpsgd_step(softmax_cross_entropy_loss, graphdef, rest, tx, p, s, jax.random.key(1),
                                                x16, y, 0.2, 0.5, 32, micro_batch_size=8))(params, opt_state)
    assert drawn and set(drawn) == {jnp.dtype(jnp.float32)}, drawn
    assert {leaf.dtype for leaf in jax.tree.leaves(new)} == {jnp.dtype(jnp.bfloat16)}  # the user's dtype kept


def test_bfloat16_norm_and_lora_layers_float32_norms():
    """The closed forms of LayerNorm / RMSNorm / LoRA on a bfloat16 model: float32 norms and
    sums, equal to the float32 model's with the same weights to bfloat16 rounding."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(12, 5, 6)).astype(np.float32)).astype(jnp.bfloat16)
    y = jnp.asarray(rng.integers(0, 3, size=12))
    model32 = _TinyEncoder(nnx.Rngs(5))
    model32.proj.lora.lora_b.set_value(jnp.asarray(rng.normal(size=(2, 8)).astype(np.float32)))
    state = jax.tree.map(lambda p: p.astype(jnp.bfloat16).astype(jnp.float32), nnx.state(model32, nnx.Param))
    nnx.update(model32, state)
    model16 = _TinyEncoder(nnx.Rngs(5))
    nnx.update(model16, jax.tree.map(lambda p: p.astype(jnp.bfloat16), state))
    out = clipped_grad_sum(softmax_cross_entropy_loss, model16, (x, y), 0.5)
    ref = clipped_grad_sum(softmax_cross_entropy_loss, model32, (x.astype(jnp.float32), y), 0.5)
    assert out.norms.dtype == jnp.float32
    assert {leaf.dtype for leaf in jax.tree.leaves(out.grad_sum)} == {jnp.dtype(jnp.float32)}
    np.testing.assert_allclose(out.norms, ref.norms, rtol=3e-2)  # bfloat16 activations: 2^-8, a few times over


def test_bfloat16_training_runs():
    model16 = MLP((6, 8, 3), rngs=nnx.Rngs(2), param_dtype=jnp.bfloat16)
    _, x, y = _setup()
    ds = from_arrays(np.asarray(x), np.asarray(y), test_fraction=0.0)
    res = train(model16, ds, DPSGDMechanism(clip_norm=1.0, noise_multiplier=1.0, batch_size=24, passes=1,
                                            optimizer=optax.adam(1e-2), micro_batch_size=8),
                noise_seed=0, options=RunOptions(progress=False))
    leaves = jax.tree.leaves(nnx.state(res.model, nnx.Param))
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.bfloat16)}
    assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in leaves)


class _Adapted(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.LoRALinear(6, 8, lora_rank=2, rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.body(x)))


def test_only_trainable_parameters_are_clipped_noised_and_updated():
    _, x, y = _setup(seed=3)
    ds = from_arrays(np.asarray(x), np.asarray(y), test_fraction=0.0)
    model = _Adapted(nnx.Rngs(0))
    before = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    mech = DPSGDMechanism(clip_norm=1.0, noise_multiplier=1.0, batch_size=24, passes=1, learning_rate=0.5,
                          trainable=nnx.LoRAParam, micro_batch_size=10, loss_fn=softmax_cross_entropy_loss)
    res = train(model, ds, mech, noise_seed=0, options=RunOptions(progress=False))
    after = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(res.model, nnx.Param))}
    lora = {k for k in before if "lora" in k[-1]}
    assert len(lora) == 2 and len(before) == 2 + 4
    for k in before:
        if k in lora:
            assert not np.array_equal(before[k], after[k]), k  # noised (and trained)
        else:
            np.testing.assert_array_equal(before[k], after[k])  # frozen: public, untouched
    # The noise pytree of a step has exactly the adapters' leaves.
    graphdef, params, rest = nnx.split(model, nnx.LoRAParam, ...)
    assert len(jax.tree.leaves(params)) == 2
