"""Benchmark: time per step of private PNSGD vs the same non-private step vs Opacus DP-SGD.

Two workloads, batch size 256, float32, CPU:

* ``digits``: softmax regression 64 → 10 on the bundled digits data;
* ``mnist-like``: an MLP 784-256-10 (ReLU) on a synthetic 784-feature set (random rows
  scaled to unit norm, random labels: the timing does not depend on the values).

Contenders, all in this process on the same batch:

* ``jax private``: the step :func:`jaxdp.training.train` scans (per-example clipping by
  ``clipped_grad_sum``, dense-layer fast path, Gaussian noise, projection), jitted;
* ``jax vmap``: the same step with the fast path disabled (``vmap(grad)``, per-example
  gradients materialised);
* ``jax non-private``: the gradient of the mean loss and an SGD step, jitted;
* ``torch non-private``: the equivalent ``torch.nn`` model and ``torch.optim.SGD``;
* ``opacus default``: Opacus DP-SGD, ``grad_sample_mode="hooks"`` (per-sample gradients);
* ``opacus ghost``: Opacus ghost clipping, ``grad_sample_mode="ghost"``.

JAX steps are timed inside a ``lax.scan`` of ``--scan`` steps (as ``train`` runs them),
after compilation; PyTorch steps in a Python loop. Each figure is the median over
``--repeats`` timed blocks. Run::

    python benchmarks/training_step.py            # full run (about a minute)
    python benchmarks/training_step.py --smoke    # a few seconds
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

B = 256


def _median_time(fn, repeats, inner):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) / inner)
    return statistics.median(times)


def workload(name, seed=0):
    rng = np.random.default_rng(seed)
    if name == "digits":
        from jaxdp.data import load_digits

        ds = load_digits()
        return ds.x_train[:B], ds.y_train[:B], (64, 10)
    x = rng.normal(size=(B, 784))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    return x, rng.integers(0, 10, B).astype(np.int32), (784, 256, 10)


def bench_jax(x, y, sizes, repeats, scan):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxdp.models import MLP, SoftmaxRegression, softmax_cross_entropy_loss
    from jaxdp.training import pnsgd
    from jaxdp.training._loop import _make_step

    model = (SoftmaxRegression(sizes[0], sizes[1], rngs=nnx.Rngs(0)) if len(sizes) == 2
             else MLP(sizes, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    xb, yb = jnp.asarray(x), jnp.asarray(y)
    lr = 0.5
    out = {}

    def timed(step, carry):
        @jax.jit
        def run(carry):
            return jax.lax.scan(lambda c, _: (step(c), None), carry, None, length=scan)[0]

        carry = jax.block_until_ready(run(carry))  # compile

        def go():
            jax.block_until_ready(run(carry))

        return _median_time(go, repeats, scan)

    for label, fast in (("jax private", None), ("jax vmap", False)):
        tx = pnsgd(lr, 1.0, 1.0, 100.0, jax.random.key(0), batch_size=B)
        one = _make_step(graphdef, rest, softmax_cross_entropy_loss, tx, 1.0, fast)
        carry = (params, tx.init(params), jnp.zeros((), jnp.int32), jnp.zeros(()), jnp.zeros((), jnp.int32))
        out[label] = timed(lambda c, one=one: one(c, xb, yb, B), carry)

    def nonprivate(p):
        def mean_loss(p):
            return jnp.mean(softmax_cross_entropy_loss(nnx.merge(graphdef, p, rest), xb, yb))

        g = jax.grad(mean_loss)(p)
        return jax.tree.map(lambda a, b: a - lr * b, p, g)

    out["jax non-private"] = timed(nonprivate, params)
    return out


def bench_torch(x, y, sizes, repeats, inner):
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    xt, yt = torch.from_numpy(np.asarray(x)), torch.from_numpy(np.asarray(y)).long()

    def make():
        if len(sizes) == 2:
            return nn.Linear(sizes[0], sizes[1])
        return nn.Sequential(nn.Linear(sizes[0], sizes[1]), nn.ReLU(), nn.Linear(sizes[1], sizes[2]))

    out = {}
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    crit = nn.CrossEntropyLoss()

    def step_plain():
        opt.zero_grad()
        crit(model(xt), yt).backward()
        opt.step()

    def loop(step):
        def go():
            for _ in range(inner):
                step()
        return go

    for _ in range(3):
        step_plain()
    out["torch non-private"] = _median_time(loop(step_plain), repeats, inner)

    from opacus import PrivacyEngine

    for label, mode in (("opacus default", "hooks"), ("opacus ghost", "ghost")):
        model = make()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        dl = DataLoader(TensorDataset(xt, yt), batch_size=B)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = PrivacyEngine()
            if mode == "ghost":
                pm, popt, pcrit, _ = engine.make_private(
                    module=model, optimizer=opt, criterion=nn.CrossEntropyLoss(), data_loader=dl,
                    noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost", poisson_sampling=False)
            else:
                pm, popt, _ = engine.make_private(module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0,
                                                  max_grad_norm=1.0, poisson_sampling=False)
                pcrit = nn.CrossEntropyLoss()

        def step_dp(pm=pm, popt=popt, pcrit=pcrit):
            popt.zero_grad()
            pcrit(pm(xt), yt).backward()
            popt.step()

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):
                step_dp()
            out[label] = _median_time(loop(step_dp), repeats, inner)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a few seconds: fewer repeats")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--scan", type=int, default=20, help="JAX steps per timed call")
    ap.add_argument("--inner", type=int, default=10, help="PyTorch steps per timed block")
    args = ap.parse_args(argv)
    if args.smoke:
        args.repeats, args.scan, args.inner = 2, 3, 2
    import jax
    import torch

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}; jax {jax.__version__} "
          f"({jax.default_backend()}), torch {torch.__version__} ({torch.get_num_threads()} threads)")
    print(f"batch size {B}, float32; median of {args.repeats} blocks; milliseconds per step\n")
    header = ("workload", "jax private", "jax vmap", "jax non-private", "torch non-private", "opacus default",
              "opacus ghost")
    rows = []
    for name in ("digits", "mnist-like"):
        x, y, sizes = workload(name)
        res = bench_jax(x, y, sizes, args.repeats, args.scan)
        res.update(bench_torch(x, y, sizes, args.repeats, args.inner))
        rows.append((name + " " + "-".join(map(str, sizes)), res))
    widths = [max(len(h), 22) if i == 0 else max(len(h), 9) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths))))
    for label, res in rows:
        cells = [label.ljust(widths[0])] + [f"{1e3 * res[h]:.3f}".rjust(w) for h, w in zip(header[1:], widths[1:])]
        print("  ".join(cells))
    print("\nratios (private JAX step = 1):")
    for label, res in rows:
        p = res["jax private"]
        print(f"  {label}: private / non-private JAX = {p / res['jax non-private']:.2f}x; "
              f"vmap path / private = {res['jax vmap'] / p:.1f}x; opacus ghost / private = "
              f"{res['opacus ghost'] / p:.1f}x; opacus default / private = {res['opacus default'] / p:.1f}x; "
              f"torch non-private / private = {res['torch non-private'] / p:.2f}x")
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
