"""Benchmark: data-parallel private steps over 1, 2, 4, 8 devices (issue 12, training).

One DP-SGD step (:func:`jaxdp.training.dpsgd_step`: Poisson sample, per-example clipping,
noise drawn once, SGD) and one PNSGD step (the step :func:`jaxdp.training.train` scans:
:func:`~jaxdp.training.parallel_clipped_grad_sum` on a fixed batch, noise, projection) of
an MLP 784-256-10 on a synthetic 784-feature set (rows of unit norm, random labels),
expected / fixed batch 256, float32, with the batch split over a mesh of ``k`` devices
(``devices=k`` in ``train``), against the one-device step (``mesh=None``) in the same
process.

On a CPU the devices are simulated: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
(set by this script before JAX starts) splits the host into 8 devices that share its cores,
so on a 2-core machine the figures measure the **overhead** of the sharding (the partition,
the ``psum``, the replicated noise), not a speed-up; on a machine with several accelerators
the same code splits the per-example work between them. Steps are timed inside a
``lax.scan`` of ``--scan`` steps after compilation; each figure is the median over
``--repeats`` timed blocks. Run::

    python benchmarks/sharded_training.py            # full run (about a minute)
    python benchmarks/sharded_training.py --smoke    # a few seconds
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

DEVICES = (1, 2, 4, 8)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={max(DEVICES)}").strip()

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _median_time(fn, repeats, inner):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) / inner)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scan", type=int, default=10)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxdp.models import MLP, softmax_cross_entropy_loss
    from jaxdp.training import batch_capacity, data_parallel_mesh, dpsgd, dpsgd_step, pnsgd, replicate
    from jaxdp.training._loop import _make_step

    n, features, hidden, b = (1024, 64, 32, 64) if args.smoke else (4096, 784, 256, 256)
    repeats, scan = (2, 2) if args.smoke else (args.repeats, args.scan)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, features))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    y = rng.integers(0, 10, n).astype(np.int32)
    model = MLP((features, hidden, 10), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    q = b / n
    capacity = batch_capacity(n, q)

    def timed(step, carry, mesh):
        if mesh is not None:
            carry = replicate(carry, mesh)

        @jax.jit
        def run(carry):
            return jax.lax.scan(lambda c, _: (step(c), None), carry, None, length=scan)[0]

        carry = jax.block_until_ready(run(carry))  # compile

        def go():
            jax.block_until_ready(run(carry))

        return _median_time(go, repeats, scan)

    results = {}
    for k in (None, *DEVICES):
        mesh = None if k is None else data_parallel_mesh(k)
        X, Y, R = (jnp.asarray(x), jnp.asarray(y), rest) if mesh is None else replicate((x, y, rest), mesh)

        tx = dpsgd(optax.sgd(0.1), 1.0, 1.0, float(b), jax.random.key(0))

        def dp_step(c, tx=tx, mesh=mesh, X=X, Y=Y, R=R):
            p, s, key = c
            key, k_step = jax.random.split(key)
            p, s, _ = dpsgd_step(softmax_cross_entropy_loss, graphdef, R, tx, p, s, k_step, X, Y, q, 1.0, capacity,
                                 mesh=mesh)
            return p, s, key

        t_dp = timed(dp_step, (params, tx.init(params), jax.random.key(1)), mesh)

        txp = pnsgd(0.5, 1.0, 1.0, 100.0, jax.random.key(0), batch_size=b)
        one = _make_step(graphdef, R, softmax_cross_entropy_loss, txp, 1.0, None, mesh)
        xb, yb = X[:b], Y[:b]
        carry = (params, txp.init(params), jnp.zeros((), jnp.int32), jnp.zeros(()), jnp.zeros((), jnp.int32))
        t_pn = timed(lambda c, one=one, xb=xb, yb=yb: one(c, xb, yb, b), carry, mesh)
        results[k] = (t_dp, t_pn)

    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
    print(f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{jax.device_count()} host devices, load {load[0]:.2f}, jax {jax.__version__}")
    print(f"# MLP {features}-{hidden}-10, batch {b} of {n}, float32, median of {repeats} x {scan} steps")
    base_dp, base_pn = results[None]
    print("| devices | DP-SGD ms/step | vs 1 device | PNSGD ms/step | vs 1 device |")
    print("|---|---|---|---|---|")
    for k, (t_dp, t_pn) in results.items():
        label = "none (mesh=None)" if k is None else str(k)
        print(f"| {label} | {1e3 * t_dp:.2f} | {t_dp / base_dp:.2f}x | {1e3 * t_pn:.2f} | {t_pn / base_pn:.2f}x |")


if __name__ == "__main__":
    main()
