"""Batches split over 8 host devices (jax.sharding) give the single-device results.

One subprocess holds every check (XLA_FLAGS=--xla_force_host_platform_device_count=8 must be
set before jax starts; each extra process costs seconds of import).
"""

import functools
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np

import jaxdp.accounting as A
from jaxdp import _sharding

# Sharded and single-device runs of the same float64 program: equal up to a few ulps
# (the partitioned program may fuse differently).
RTOL = 1e-12

SCRIPT = textwrap.dedent(
    """
    import functools, json, sys
    import jax, numpy as np
    import jaxdp.accounting as A, jaxdp.grids as G
    from jaxdp import _sharding as S

    # One compiled program serves every check: the same function, chunk length 16, 8 devices.
    f = functools.partial(A.dpsgd_epsilon, orders=(2.0, 4.0, 8.0, 16.0, 32.0), method="improved")
    q = np.geomspace(1e-4, 0.5, 13)  # 13 configurations: padded to 16
    out = dict(devices=jax.device_count())
    args = [S.shard_leading_axis(np.broadcast_to(v, q.shape)) for v in (q, 1.1, 1000.0, 1e-5)]
    out["input_devices"] = len(args[0].sharding.device_set)
    out["input_dtype"] = str(args[0].dtype)
    with jax.enable_x64(True):
        eps = S._jit(f)(*args)  # the computation follows the data: the output stays split
    out["output_devices"] = len(eps.sharding.device_set)
    out["output_spec"] = str(eps.sharding.spec)
    out["dpsgd"] = np.asarray(eps)[:13].tolist()
    # The event algebra on a sharded batch: an event whose leaves are split over the devices.
    event_eps = jax.jit(lambda q, s, t, d: A.epsilon(A.dpsgd_event(q, s, t), d, orders=f.keywords["orders"]))
    with jax.enable_x64(True):
        ev = event_eps(*args)
    out["event_devices"] = len(ev.sharding.device_set)
    out["event"] = np.asarray(ev)[:13].tolist()
    out["apply"] = S.sharded_apply(f, q[:8, None], [0.7, 3.0], 100.0, 1e-6).tolist()  # 16 configurations
    res = G.epsilon_grid(q, [0.7, 3.0], [10.0, 1000.0], 1e-5, chunk_size=16, orders=f.keywords["orders"])
    out["grid"] = np.asarray(res.epsilon).ravel().tolist()
    json.dump(out, sys.stdout)
    """
)


def test_sharded_batches_equal_single_device_results():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["devices"] == 8
    assert out["input_devices"] == out["output_devices"] == out["event_devices"] == 8 and "batch" in out["output_spec"]
    assert out["input_dtype"] == "float64"
    # Single-device references, computed here (one device) in one jitted call over all of them.
    q = np.geomspace(1e-4, 0.5, 13)
    qg, sg, tg = np.meshgrid(q, [0.7, 3.0], [10.0, 1000.0], indexing="ij")
    qa, sa = np.broadcast_arrays(q[:8, None], np.array([0.7, 3.0]))
    cols = [np.concatenate(c) for c in zip(
        (q, np.full(13, 1.1), np.full(13, 1000.0), np.full(13, 1e-5)),
        (qa.ravel(), sa.ravel(), np.full(16, 100.0), np.full(16, 1e-6)),
        (qg.ravel(), sg.ravel(), tg.ravel(), np.full(52, 1e-5)))]
    f = jax.jit(functools.partial(A.dpsgd_epsilon, orders=(2.0, 4.0, 8.0, 16.0, 32.0)))
    with jax.enable_x64(True):  # float64 inputs stay float64 at the jit boundary
        want = np.asarray(f(*cols))
    np.testing.assert_allclose(out["dpsgd"], want[:13], rtol=RTOL, atol=0)
    np.testing.assert_allclose(out["event"], want[:13], rtol=RTOL, atol=0)
    np.testing.assert_allclose(np.ravel(out["apply"]), want[13:29], rtol=RTOL, atol=0)
    np.testing.assert_allclose(out["grid"], want[29:], rtol=RTOL, atol=0)


def test_padding_repeats_the_last_row_and_rounds_up():
    assert [_sharding.padded_length(n, 8) for n in (1, 8, 9, 16)] == [8, 8, 16, 16]
    padded = _sharding.pad_leading_axis(np.array([1.0, 2.0, 3.0]), 8)
    assert padded.tolist() == [1.0, 2.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]
    x = _sharding.shard_leading_axis(np.array([0.5, 0.25]))
    assert x.dtype == np.float64 and x.shape == (_sharding.padded_length(2, len(x.sharding.device_set)),)
