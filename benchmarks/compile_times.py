"""First-call (trace + compile + run) and steady-state times of every public accountant.

Compile time is the other cost a JAX user feels. Each case runs in a fresh Python process
(so nothing is cached, and JAX's persistent cache is off), and reports the first call and
the best of three later calls. Target: every first call under 3 s on the 2-core CPU.

    python benchmarks/compile_times.py            # all cases, a table
    python benchmarks/compile_times.py --only calibrate_noise_multiplier
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# name -> Python expression evaluated with `A` = jaxdp.accounting, `jnp`, `jax`, `np` (one call).
# A "JIT:" prefix names a one-argument function that is wrapped in the user's jax.jit once and
# then called with 1.0 (so the later calls reuse the user's compiled program).
CASES = {
    "sampled_gaussian_rdp": "A.sampled_gaussian_rdp(A.DEFAULT_ORDERS, 0.01, 1.1)",
    "dpsgd_epsilon": "A.dpsgd_epsilon(0.01, 1.1, 1000, 1e-5)",
    "dpsgd_epsilon (grid 20x10x10)": ("A.dpsgd_epsilon(np.geomspace(1e-4, 0.1, 20)[:, None, None], "
                                      "np.linspace(0.5, 5, 10)[:, None], np.geomspace(10, 1e5, 10), 1e-5)"),
    "schedule_epsilon": "A.schedule_epsilon([0.01, 0.02], [1.1, 1.3], [500, 500], 1e-5)",
    "rdp_to_epsilon": "A.rdp_to_epsilon(A.gaussian_rdp(A.DEFAULT_ORDERS, 2.0), A.DEFAULT_ORDERS, 1e-5).epsilon",
    "calibrate_noise_multiplier": "A.calibrate_noise_multiplier(1.0, 0.01, 1000, 1e-5).noise_multiplier",
    "calibrate_noise_multiplier in the user's jit": (
        "JIT:lambda e: A.calibrate_noise_multiplier(e, 0.01, 1000, 1e-5).noise_multiplier"),
    "calibrate_noise_multiplier, vmap over 1000 targets": (
        "JIT:lambda e: jax.vmap(lambda t: A.calibrate_noise_multiplier(t, 0.01, 1000, 1e-5).noise_multiplier)"
        "(jnp.linspace(0.5, 8, 1000) * e)"),
    "gaussian_hockey_stick": "A.gaussian_hockey_stick(1.0, 0.5)",
    "pnsgd_privacy (n=1408)": ("A.pnsgd_privacy(A.PNSGD(2., 1., 1., 1/16, 60., num_records=1408, batch_size=64, "
                               "passes=10), 1e-5).best"),
    "calibrate_pnsgd_noise_std": "A.calibrate_pnsgd_noise_std(2.0, 1e-5, A.PNSGD(1., 1., 0.5, 1., 2., num_records=100))",
    "stop_pnsgd_contraction_epsilon": "A.stop_pnsgd_contraction_epsilon(1e-5, 10, 1., 1., 1., 80., 1., positions=10)",
    "epsilon(dpsgd_event)": "A.epsilon(A.dpsgd_event(0.01, 1.1, 1000), 1e-5)",
    "epsilon(Composed event)": ("A.epsilon(A.Composed((A.dpsgd_event(0.01, 1.1, 1000), "
                                "A.SelfComposed(A.Gaussian(5.0), 10))), 1e-5)"),
    "gaussian_mechanism_epsilon": "A.gaussian_mechanism_epsilon(1e-5, 2.0)",
    "calibrate_gaussian_noise_multiplier": "A.calibrate_gaussian_noise_multiplier(1.0, 1e-5)",
    "pld_epsilon(dpsgd_event)": "A.pld_epsilon(A.dpsgd_event(256 / 60000, 1.1, 14040), 1e-5)",
    "calibrate_pld_noise_multiplier": ("A.calibrate_pld_noise_multiplier(1.0, 256 / 60000, 14040, 1e-5)"
                                       ".noise_multiplier"),
    "dpsbcd_epsilon": ("A.dpsbcd_epsilon(1e-5, [0.5, 0.5, 0.5], learning_rate=0.1, sensitivity=1.0, contraction=0.5, "
                       "prox_lipschitz=1.0, num_records=100, batch_size=10)"),
}

_CHILD = r"""
import os, sys, time, json
if not os.environ.get("JAXDP_BENCH_WARM_CACHE"):
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
t0 = time.perf_counter()
import jax, jax.numpy as jnp, numpy as np
import jaxdp.accounting as A
t_import = time.perf_counter() - t0
expr = sys.argv[1]
if expr.startswith("JIT:"):
    user_fn = jax.jit(eval(expr[4:]))
    thunk = lambda: user_fn(1.0)
else:
    thunk = lambda: eval(expr)
def run():
    out = thunk()
    jax.block_until_ready(out)
    return out
t = time.perf_counter(); run(); first = time.perf_counter() - t
later = []
for _ in range(3):
    t = time.perf_counter(); run(); later.append(time.perf_counter() - t)
print(json.dumps({"import": t_import, "first": first, "steady": min(later)}))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="run only the case with this name")
    p.add_argument("--warm-cache", action="store_true",
                   help="also time the first call of a second process with JAX's persistent compilation cache "
                        "(jax_compilation_cache_dir) filled by the first")
    args = p.parse_args(argv)
    cases = {k: v for k, v in CASES.items() if args.only in (None, k)}
    if not cases:
        p.error(f"--only: no case named {args.only!r}")
    import platform

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}")
    warm_col = f" {'first, warm cache':>18}" if args.warm_cache else ""
    print(f"{'case':<52} {'first call':>11} {'later call':>11}{warm_col}")
    worst = worst_warm = 0.0
    for name, expr in cases.items():
        proc = subprocess.run([sys.executable, "-c", _CHILD, expr], capture_output=True, text=True,
                              env={**os.environ, "JAXDP_CACHE_DIR": "off"})
        if proc.returncode != 0:
            print(f"{name:<52} failed: {proc.stderr.strip().splitlines()[-1]}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        worst = max(worst, r["first"])
        extra = ""
        if args.warm_cache:
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "JAXDP_CACHE_DIR": "off", "JAXDP_BENCH_WARM_CACHE": "1",
                       "JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                       "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
                for _ in range(2):  # the first process fills the cache, the second reads it
                    w = subprocess.run([sys.executable, "-c", _CHILD, expr], capture_output=True, text=True, env=env)
            warm = json.loads(w.stdout.strip().splitlines()[-1])["first"]
            worst_warm = max(worst_warm, warm)
            extra = f" {warm:>17.2f}s"
        print(f"{name:<52} {r['first']:>10.2f}s {1e3 * r['steady']:>9.2f}ms{extra}")
    print(f"slowest first call: {worst:.2f} s (target < 3 s)")
    if args.warm_cache:
        print(f"slowest first call of a process with a warm persistent cache: {worst_warm:.2f} s")
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"({time.perf_counter() - t0:.0f} s in all)")
    sys.exit(rc)
