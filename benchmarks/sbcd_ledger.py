"""Benchmark: building a DP-SBCD run's per-position privacy (the ledger's report), before/after.

The ledger of a DP-SBCD run reports ε for every batch position j0 = 0..m-1 (m = batches per
pass). Before session 6 it called ``dpsbcd_rdp(..., batch_index=j)`` once per position inside
one ``jax.jit``: m copies of the LSI scan and the decay sums, O(passes·m²) work and a compiled
program that grows with m. Now one call of ``dpsbcd_rdp_per_batch`` gives all m positions.

Both variants compute exactly what the ledger computes (per-position RDP at one order, the
composition bound, ``rdp_to_epsilon`` over dp_accounting's orders, vmapped over positions);
the script checks that they agree (to 1e-12 relative) and times each in a **fresh process**
(so no compilation cache is shared), alternating old/new:

* ``build``: CPU seconds (``time.process_time``) of the first call: trace + compile + run;
* ``run``: CPU seconds of a second call with other values (compiled; no retrace).

XLA runs single-threaded (``--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1``)
so that CPU time is a fair measure on a shared machine. Workload: 4 layers (the
``LipschitzMLP`` of ``sbcd_epoch.py``), 10 passes, batch 10, n = 10·m. Run::

    python benchmarks/sbcd_ledger.py                 # m = 10, 50, 200
    python benchmarks/sbcd_ledger.py --old-tree DIR  # "old" with the jaxdp of DIR (e.g. a checkout
                                                     # of the commit before the change)
    python benchmarks/sbcd_ledger.py --smoke         # m = 4, 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

PASSES, LAYERS, BATCH = 10, 4, 10
RTOL = 1e-12  # the two variants evaluate the same float64 expressions
_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _one(method: str, m: int, tree: str) -> dict:
    os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    sys.path.insert(0, tree)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxdp.accounting as A

    jax.config.update("jax_enable_x64", True)
    n = m * BATCH
    orders = np.asarray(A.DEFAULT_ORDERS, np.float64)

    def fn(temps, eta, sensitivity, contraction, prox_lipschitz, used, delta):
        kw = dict(learning_rate=eta, sensitivity=sensitivity, contraction=contraction,
                  prox_lipschitz=prox_lipschitz, num_records=n, batch_size=BATCH)
        if method == "old":
            c = jnp.stack([A.dpsbcd_rdp([2.0], temps, batch_index=j, **kw)[0] / 2.0 for j in range(m)])
        else:
            c = A.dpsbcd_rdp_per_batch([2.0], temps, **kw)[:, 0] / 2.0
        steps = jnp.repeat(temps[:, None], m, axis=1)
        comp = jnp.sum(jnp.where(used, eta * jnp.sum(sensitivity**2) / (4.0 * BATCH**2 * steps), 0.0), axis=0)

        def eps(cj):
            return A.rdp_to_epsilon(orders * cj, orders, delta).epsilon

        return jax.vmap(eps)(c), jnp.where(comp > 0, jax.vmap(eps)(comp), 0.0)

    f = jax.jit(fn)
    used = np.ones((PASSES, m), bool)

    def args(scale):
        return (np.linspace(0.02, 0.01, PASSES) * scale, 0.01, np.full(LAYERS, 2.0), np.full(LAYERS, 0.99),
                np.full(LAYERS, 1.0 / 1.0001), used, 1e-5)

    t0 = time.process_time()
    out = jax.block_until_ready(f(*args(1.0)))
    build = time.process_time() - t0
    t0 = time.process_time()
    jax.block_until_ready(f(*args(1.5)))
    run = time.process_time() - t0
    return dict(method=method, m=m, build=build, run=run, eps=np.asarray(out[0]).tolist(), src=A.__file__)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--old-tree", default=_HERE, help="source tree whose jaxdp runs the old variant (default: this "
                   "one; for the code before the change: git archive <commit> | tar -x -C DIR)")
    p.add_argument("--one", nargs=3, metavar=("METHOD", "M", "TREE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(_one(a.one[0], int(a.one[1]), a.one[2])))
        return
    sizes = (4, 8) if a.smoke else (10, 50, 200)
    print(f"old variant from {os.path.abspath(a.old_tree)}")
    print(f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores; "
          f"load average at start {os.getloadavg()[0]:.2f}")
    print(f"{'m':>4} {'old build s':>12} {'new build s':>12} {'ratio':>7} {'old run s':>10} {'new run s':>10}")
    for m in sizes:
        res = {}
        for method in ("old", "new"):
            tree = os.path.abspath(a.old_tree) if method == "old" else _HERE
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", method, str(m), tree],
                                  capture_output=True, text=True, check=True)
            res[method] = json.loads(proc.stdout.strip().splitlines()[-1])
            assert os.path.realpath(res[method]["src"]).startswith(os.path.realpath(tree)), res[method]["src"]
        old, new = res["old"], res["new"]
        for x, y in zip(old["eps"], new["eps"]):
            assert abs(x - y) <= RTOL * abs(x), (m, x, y)
        print(f"{m:>4} {old['build']:>12.2f} {new['build']:>12.2f} {old['build'] / new['build']:>7.1f} "
              f"{old['run']:>10.4f} {new['run']:>10.4f}", flush=True)
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
