"""Benchmark: one DP-SGD step (Poisson sampling, clipping, noise) against Opacus.

Two models on 28×28×1 inputs, float32, CPU, expected batch 256:

* ``mlp``: MLP 784-256-10 (ReLU) on the flattened image;
* ``cnn``: conv 16 3×3 (SAME) → ReLU → avg-pool 2 → conv 32 3×3 (SAME) → ReLU → avg-pool 2
  → dense 10.

Contenders, all in this process (synthetic data: random unit-norm images, random labels;
the timing does not depend on the values):

* ``jaxdp dpsgd_step``: :func:`jaxdp.training.dpsgd_step` (Poisson sample of rate
  256/N over N records into a static capacity from :func:`batch_capacity` at
  ``--overflow``, by default 1e-2 as ``train`` uses; the clipped-gradient sum on the fast
  path, Gaussian noise, SGD), jitted;
* ``jaxdp in scan``: the same step in a rolled ``lax.scan`` (a ``while`` loop), as
  ``train`` runs it;
* ``jaxdp vmap``: the same step with ``use_fast_path=False`` (``vmap(grad)``);
* ``jax non-private``: gradient of the mean loss on a fixed batch of 256 and an SGD step;
  ``jax non-private in scan``: the same in a rolled ``lax.scan`` (compare it with ``jaxdp in
  scan``: both timed the same way);
* ``noise draw``: the Gaussian noise for all parameters alone (``add_gaussian_noise``);
* ``clipped sum``: :func:`clipped_grad_sum` alone on ``capacity`` rows;
* ``opacus default`` (``grad_sample_mode="hooks"``) and ``opacus ghost``
  (``grad_sample_mode="ghost"``, fast gradient clipping) on the equivalent ``torch.nn``
  model, a fixed batch of 256 (Opacus' Poisson loader would only vary the batch size).

JAX steps (except the two "in scan") are timed inside an unrolled ``lax.scan`` of ``--scan``
steps, after compilation; PyTorch steps in a Python loop of ``--inner`` steps. Each figure
is the median over ``--repeats`` timed blocks. Every block is timed on both clocks: the
table shows ``--clock`` and a second table the CPU seconds per wall second of each
contender, i.e. how many cores it kept busy (with XLA's default CPU flags, jax 0.10, its
dots and convolutions run on one thread whatever the core count; ``--xla-eigen`` sets
``--xla_cpu_use_xnnpack=false``, under which they run on Eigen's intra-op threads). Run::

    python benchmarks/dpsgd_step.py            # full run (a few minutes on 2 cores)
    python benchmarks/dpsgd_step.py --smoke    # seconds
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

B = 256  # expected batch size
N = 10_000  # records the Poisson sample is drawn from
LR = 0.1


_CLOCK = "wall"  # --clock cpu: time.process_time (CPU seconds of this process)
_CPU_PER_WALL = {}  # label -> median CPU seconds per wall second of its blocks


def _median_time(fn, repeats, inner, label=None):
    """Median seconds per step on ``_CLOCK``; records the CPU/wall ratio under ``label``."""
    times, ratios = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        w, c = time.perf_counter() - w, time.process_time() - c
        times.append((c if _CLOCK == "cpu" else w) / inner)
        ratios.append(c / w)
    if label is not None:
        _CPU_PER_WALL[label] = statistics.median(ratios)
    return statistics.median(times)


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, 28, 28, 1))
    x = (x / np.linalg.norm(x.reshape(N, -1), axis=1)[:, None, None, None]).astype(np.float32)
    return x, rng.integers(0, 10, N).astype(np.int32)


def jax_model(name):
    import jax
    from flax import nnx

    rngs = nnx.Rngs(0)
    if name == "mlp":
        class Net(nnx.Module):
            def __init__(self):
                self.l1, self.l2 = nnx.Linear(784, 256, rngs=rngs), nnx.Linear(256, 10, rngs=rngs)

            def __call__(self, x):
                return self.l2(jax.nn.relu(self.l1(x.reshape(x.shape[0], -1))))
    else:
        class Net(nnx.Module):
            def __init__(self):
                self.c1 = nnx.Conv(1, 16, (3, 3), padding="SAME", rngs=rngs)
                self.c2 = nnx.Conv(16, 32, (3, 3), padding="SAME", rngs=rngs)
                self.out = nnx.Linear(7 * 7 * 32, 10, rngs=rngs)

            def __call__(self, x):
                h = nnx.avg_pool(jax.nn.relu(self.c1(x)), (2, 2), strides=(2, 2))
                h = nnx.avg_pool(jax.nn.relu(self.c2(h)), (2, 2), strides=(2, 2))
                return self.out(h.reshape(h.shape[0], -1))
    return Net()


def torch_model(name):
    from torch import nn

    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
                         nn.Flatten(), nn.Linear(7 * 7 * 32, 10))


def bench_jax(name, x, y, repeats, scan, overflow=1e-2):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxdp.models import softmax_cross_entropy_loss as loss
    from jaxdp.training import add_gaussian_noise, batch_capacity, clipped_grad_sum, dpsgd, dpsgd_step

    model = jax_model(name)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    xs, ys = jnp.asarray(x), jnp.asarray(y)
    q = B / N
    capacity = batch_capacity(N, q, overflow)
    out = {"capacity": capacity}

    def timed(label, step, carry, length=scan, unroll=True):
        @jax.jit
        def run(carry):
            # Unrolled: XLA on CPU runs non-canonical convolutions (the plain JAX gradient's)
            # inside a while loop 10-25x slower.
            return jax.lax.scan(lambda c, _: (step(c), None), carry, None, length=length, unroll=unroll)[0]

        carry = jax.block_until_ready(run(carry))  # compile

        def go():
            jax.block_until_ready(run(carry))

        return _median_time(go, repeats, length, (name, label))

    for label, fast in (("jaxdp dpsgd_step", None), ("jaxdp vmap", False)):
        tx = dpsgd(optax.sgd(LR), 1.0, 1.0, float(B), jax.random.key(1))

        def step(c, tx=tx, fast=fast):
            p, s, k = c
            k, sub = jax.random.split(k)
            p, s, _ = dpsgd_step(loss, graphdef, rest, tx, p, s, sub, xs, ys, q, 1.0, capacity,
                                 use_fast_path=fast)
            return p, s, k

        # The vmap path is slow (per-example gradients materialised): fewer steps per block.
        out[label] = timed(label, step, (params, tx.init(params), jax.random.key(2)),
                           scan if fast is None else min(scan, 3))
        if fast is None:
            out["jaxdp in scan"] = timed("jaxdp in scan", step, (params, tx.init(params), jax.random.key(2)),
                                         unroll=False)

    xb, yb = xs[:B], ys[:B]

    def nonprivate(p):
        g = jax.grad(lambda p: jnp.mean(loss(nnx.merge(graphdef, p, rest), xb, yb)))(p)
        return jax.tree.map(lambda a, b: a - LR * b, p, g)

    out["jax non-private"] = timed("jax non-private", nonprivate, params)
    # Rolled as "jaxdp in scan" is. (For the CNN this pays XLA's penalty for non-canonical
    # convolutions in a loop, which jaxdp's own convolutions avoid: see the README.)
    out["jax non-private in scan"] = timed("jax non-private in scan", nonprivate, params, unroll=False)

    noise = add_gaussian_noise(1.0, jax.random.key(3))
    zeros = jax.tree.map(jnp.zeros_like, params)

    def draw(c):
        s, acc = c
        u, s = noise.update(zeros, s)
        return s, jax.tree.map(jnp.add, acc, u)  # use the draw, or XLA removes it

    out["noise draw"] = timed("noise draw", draw, (noise.init(params), zeros))

    xc, yc = xs[:capacity], ys[:capacity]

    def clipped(p):
        cg = clipped_grad_sum(loss, nnx.merge(graphdef, p, rest), (xc, yc), 1.0)
        return jax.tree.map(lambda a, b: a - 1e-6 * b, p, cg.grad_sum)

    out["clipped sum"] = timed("clipped sum", clipped, params)
    return out


def bench_torch(name, x, y, repeats, inner):
    import torch
    from opacus import PrivacyEngine
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    xt = torch.from_numpy(np.ascontiguousarray(np.asarray(x[:B]).transpose(0, 3, 1, 2)))
    yt = torch.from_numpy(np.asarray(y[:B])).long()
    out = {}

    def loop(step):
        def go():
            for _ in range(inner):
                step()
        return go

    for label, mode in (("opacus default", "hooks"), ("opacus ghost", "ghost")):
        model = torch_model(name)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
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
            for _ in range(2):
                step_dp()
            out[label] = _median_time(loop(step_dp), repeats, inner, (name, label))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="seconds: fewer repeats")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--scan", type=int, default=5, help="JAX steps per timed call (unrolled)")
    ap.add_argument("--inner", type=int, default=5, help="PyTorch steps per timed block")
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: CPU seconds of this process (steadier on a shared machine; run XLA and torch "
                         "single-threaded, e.g. XLA_FLAGS='--xla_cpu_multi_thread_eigen=false "
                         "intra_op_parallelism_threads=1' and --torch-threads 1, or idle threads count)")
    ap.add_argument("--torch-threads", type=int, default=None)
    ap.add_argument("--xla-eigen", action="store_true",
                    help="add --xla_cpu_use_xnnpack=false to XLA_FLAGS (dots and convolutions on Eigen's "
                         "intra-op threads instead of XNNPACK's single thread)")
    ap.add_argument("--no-opacus", action="store_true", help="skip the Opacus contenders")
    ap.add_argument("--overflow", type=float, default=1e-2,
                    help="batch_capacity's overflow probability for the padded batch (train uses 1e-2)")
    args = ap.parse_args(argv)
    global _CLOCK
    _CLOCK = args.clock
    if args.xla_eigen:
        if "jax" in sys.modules:
            raise SystemExit("--xla-eigen must be set before jax is imported")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_xnnpack=false").strip()
    if args.smoke:
        args.repeats, args.scan, args.inner = 2, 2, 1
    import jax
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    print(f"machine: {_cpu_model()}, {os.cpu_count()} CPU cores, load average "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}; jax {jax.__version__} ({jax.default_backend()}), "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads); XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(f"expected batch {B} (Poisson, q = {B}/{N}), float32; median of {args.repeats} blocks; ms per step "
          f"({'CPU' if args.clock == 'cpu' else 'wall'} time)\n")
    x, y = data()
    header = ("jaxdp dpsgd_step", "jaxdp in scan", "jaxdp vmap", "jax non-private", "jax non-private in scan",
              "noise draw", "clipped sum", "opacus default", "opacus ghost")
    rows = []
    for name in args.models.split(","):
        res = bench_jax(name, x, y, args.repeats, args.scan, args.overflow)
        nan = float("nan")
        res.update({"opacus default": nan, "opacus ghost": nan} if args.no_opacus
                   else bench_torch(name, x, y, args.repeats, args.inner))
        rows.append((name, res))
    print("model  " + "  ".join(f"{h:>16}" for h in header))
    for name, res in rows:
        print(f"{name:<5}  " + "  ".join(f"{1e3 * res[h]:16.3f}" for h in header))
    print("\nCPU seconds per wall second (cores kept busy):")
    for name, _ in rows:
        print(f"{name:<5}  " + "  ".join(f"{_CPU_PER_WALL.get((name, h), float('nan')):16.2f}" for h in header))
    print()
    for name, res in rows:
        p = res["jaxdp dpsgd_step"]
        floor = res["jax non-private"] + res["noise draw"]
        print(f"{name} (capacity {res['capacity']}): opacus ghost / jaxdp = {res['opacus ghost'] / p:.2f}x "
              f"(target > 1); opacus default / jaxdp = {res['opacus default'] / p:.1f}x; "
              f"jaxdp / (non-private + noise) = {p / floor:.2f}x (target <= 1.5; both in a rolled scan: "
              f"{res['jaxdp in scan'] / (res['jax non-private in scan'] + res['noise draw']):.2f}x); "
              f"noise share of the step = {100 * res['noise draw'] / p:.0f}%; "
              f"vmap path / jaxdp = {res['jaxdp vmap'] / p:.1f}x")
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
