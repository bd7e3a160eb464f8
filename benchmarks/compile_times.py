"""First-call (trace + compile + run) and steady-state times of every public accountant, and where they go.

Compile time is the other cost a JAX user feels. Each case runs in a fresh Python process
with jaxdp's program cache empty (``JAXDP_CACHE_DIR`` set to a new folder; JAX's own
persistent cache off), and reports the import of ``jaxdp.accounting`` (with the modules of
the names the case uses, which load on first use), the first call split into tracing,
lowering to StableHLO and XLA compilation (JAX's monitoring events,
summed over every program the call compiles; programs compiled at once by
``_program_cache.prepare``, as ``pnsgd_privacy``'s three are, overlap, so their sum can
exceed the call's wall time), the first call's CPU time (XLA compiles on several threads;
on a loaded machine CPU time is the steadier figure), the size of the
lowered programs jaxdp's cache keys, and the best of three later calls. ``--warm-cache``
runs a second process on the folder the first one filled: its first call loads the
compiled programs (without tracing where jaxdp's index has the call's signature).

Targets (issue 21, on an idle 2-core CPU): ``dpsgd_epsilon`` ≤ 1 s, ``calibrate_noise_multiplier``
and ``pnsgd_privacy`` ≤ 2 s, ``grad`` through ``calibrate_noise_multiplier`` ≤ 5 s.

    python benchmarks/compile_times.py                  # all cases, a table
    python benchmarks/compile_times.py --only calibrate_noise_multiplier --warm-cache
    python benchmarks/compile_times.py --targets --repeat 3 --compare-tree /tmp/main   # alternated, CPU ratios
    python benchmarks/compile_times.py --check-bits   # jaxdp's compiler options change no value
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
# then called with 1.0 (so the later calls reuse the user's compiled program); "GRAD:" one whose
# jax.grad is taken eagerly at 1.0.
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
    "grad through calibrate_noise_multiplier": (
        "GRAD:lambda e: A.calibrate_noise_multiplier(e, 0.01, 1000, 1e-5).noise_multiplier"),
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
    "epsilon(dpsgd_event, accountant='pld')": (
        "A.epsilon(A.dpsgd_event(256 / 60000, 1.1, 14040), 1e-5, accountant='pld')"),
    "calibrate_noise_multiplier(accountant='pld')": ("A.calibrate_noise_multiplier(1.0, 256 / 60000, 14040, 1e-5, "
                                                     "accountant='pld').noise_multiplier"),
    "dpsbcd_epsilon": ("A.dpsbcd_epsilon(1e-5, [0.5, 0.5, 0.5], learning_rate=0.1, sensitivity=1.0, contraction=0.5, "
                       "prox_lipschitz=1.0, num_records=100, batch_size=10)"),
}

_CHILD = r"""
import collections, os, sys, time, json
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
t0 = time.perf_counter()
import jax, jax.numpy as jnp, numpy as np
import jaxdp.accounting as A
import re
for name in sorted(set(re.findall(r"\bA\.(\w+)", sys.argv[1]))):  # public names load on first use: import
    getattr(A, name)  # the modules the call needs here, so that the first call is trace, compile and run
from jaxdp import _program_cache
t_import = time.perf_counter() - t0
spent = collections.Counter()
jax.monitoring.register_event_duration_secs_listener(lambda name, secs, **kw: spent.update({name: secs}))
sizes = []
_program = _program_cache._program
def _sized(lowered):
    out = _program(lowered)
    sizes.append(len(lowered.as_text()))
    return out
_program_cache._program = _sized
expr = sys.argv[1]
if expr.startswith("JIT:"):
    user_fn = jax.jit(eval(expr[4:]))
    thunk = lambda: user_fn(1.0)
elif expr.startswith("GRAD:"):
    user_fn = eval(expr[5:])
    thunk = lambda: jax.grad(user_fn)(1.0)
else:
    thunk = lambda: eval(expr)
def run():
    out = thunk()
    jax.block_until_ready(out)
    return out
t = time.perf_counter(); c = time.process_time(); run(); first = time.perf_counter() - t
first_cpu = time.process_time() - c
phases = {k: spent[f"/jax/core/compile/{v}"] for k, v in
          (("trace", "jaxpr_trace_duration"), ("lower", "jaxpr_to_mlir_module_duration"),
           ("compile", "backend_compile_duration"))}
later = []
for _ in range(3):
    t = time.perf_counter(); run(); later.append(time.perf_counter() - t)
print(json.dumps({"import": t_import, "first": first, "first_cpu": first_cpu, "steady": min(later), "lowered": sum(sizes), **phases,
                  **{k: v for k, v in _program_cache.stats.items()}}))
"""


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --check-bits: every public accountant (values and gradients) on small grids, with jaxdp's
# compiler options and with XLA's defaults (argv[2] == "defaults"), value by value.
_BITS_CHILD = r"""
import os, sys, json
import numpy as np
import jax
import jaxdp.accounting as A
from jaxdp import _program_cache
if sys.argv[2] == "defaults":
    _program_cache._CPU_OPTIONS = {}
out = {}
def rec(name, v):
    out[name] = np.asarray(v, dtype=np.float64).ravel()
rec("dpsgd grid", A.dpsgd_epsilon(np.geomspace(1e-4, 0.1, 20)[:, None, None], np.linspace(0.5, 5, 10)[:, None],
                                  np.geomspace(10, 1e5, 10), 1e-5))
rec("dpsgd grid, delta 1e-8", A.dpsgd_epsilon(np.geomspace(1e-4, 0.1, 7)[:, None], np.linspace(0.6, 9, 9), 3000, 1e-8))
rec("schedule", A.schedule_epsilon([0.01, 0.02], [1.1, 1.3], [500, 500], 1e-5))
for e in (0.3, 1.0, 3.0, 8.0):
    for q in (0.001, 0.01, 0.2):
        rec(f"calibrate {e} {q}", A.calibrate_noise_multiplier(e, q, 1000, 1e-5).noise_multiplier)
rec("grad calibrate", jax.grad(lambda e: A.calibrate_noise_multiplier(e, 0.01, 1000, 1e-5).noise_multiplier)(1.0))
for n, b, p in ((1408, 64, 10), (100, 10, 1), (333, 7, 3)):
    r = A.pnsgd_privacy(A.PNSGD(2., 1., 1., 1/16, 60., num_records=n, batch_size=b, passes=p), 1e-5)
    for k in ("contraction", "iteration", "strongly_convex", "composition", "shifted_gdp", "best"):
        rec(f"pnsgd {n} {k}", getattr(r, k))
rec("pnsgd strongly convex", A.pnsgd_privacy(A.PNSGD(1., 1., 0.5, 1., 2., num_records=100, strong_convexity=0.1), 1e-6).best)
rec("calibrate_pnsgd_noise_std", A.calibrate_pnsgd_noise_std(2.0, 1e-5, A.PNSGD(1., 1., 0.5, 1., 2., num_records=100)))
rec("stop_pnsgd_contraction", A.stop_pnsgd_contraction_epsilon(1e-5, 10, 1., 1., 1., 80., 1., positions=10))
rec("epsilon(event)", A.epsilon(A.dpsgd_event(0.01, 1.1, 1000), 1e-5))
rec("epsilon(Composed)", A.epsilon(A.Composed((A.dpsgd_event(0.01, 1.1, 1000), A.SelfComposed(A.Gaussian(5.0), 10))), 1e-5))
rec("gaussian_mechanism_epsilon", A.gaussian_mechanism_epsilon(1e-5, np.linspace(0.3, 5, 17)))
rec("calibrate_gaussian", A.calibrate_gaussian_noise_multiplier(1.0, 1e-5))
rec("hockey stick", A.gaussian_hockey_stick(np.linspace(0, 4, 9), 0.5))
rec("pld", A.epsilon(A.dpsgd_event(256 / 60000, 1.1, 14040), 1e-5, accountant="pld"))
rec("calibrate pld", A.calibrate_noise_multiplier(1.0, 256 / 60000, 14040, 1e-5, accountant="pld").noise_multiplier)
rec("dpsbcd", A.dpsbcd_epsilon(1e-5, [0.5, 0.5, 0.5], learning_rate=0.1, sensitivity=1.0, contraction=0.5,
                               prox_lipschitz=1.0, num_records=100, batch_size=10))
rec("sampled_gaussian_rdp", A.sampled_gaussian_rdp(A.DEFAULT_ORDERS, 0.01, 1.1))
rec("grad dpsgd_epsilon", jax.grad(lambda s: A.dpsgd_epsilon(0.01, s, 1000, 1e-5))(1.1))
np.savez(sys.argv[1], **out)
"""


def _child(expr: str, cache: str, root: str = ROOT) -> dict:
    env = {**os.environ, "JAXDP_CACHE_DIR": cache}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _CHILD, expr], capture_output=True, text=True, env=env, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_bits() -> int:
    """Run :data:`_BITS_CHILD` with jaxdp's compiler options and with XLA's; 0 if every bit agrees."""
    import numpy as np

    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("options", "defaults"):
            out = os.path.join(tmp, f"{mode}.npz")
            env = {**os.environ, "JAXDP_CACHE_DIR": "off", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
            proc = subprocess.run([sys.executable, "-c", _BITS_CHILD, out, mode], capture_output=True, text=True,
                                  env=env, cwd=ROOT)
            if proc.returncode != 0:
                print(proc.stderr.strip().splitlines()[-1])
                return 1
            got[mode] = dict(np.load(out))
    a, b = got["options"], got["defaults"]
    differ = 0
    for name in a:
        x, y = a[name], b[name]
        same = (x.view(np.uint64) == y.view(np.uint64)) | (np.isnan(x) & np.isnan(y))
        if not same.all():
            differ += int((~same).sum())
            print(f"{name}: {(~same).sum()} of {x.size} values differ")
    total = sum(v.size for v in a.values())
    print(f"check-bits: {total} values in {len(a)} groups, {differ} differ "
          f"(compiler options {'same bits' if not differ else 'CHANGE VALUES'})")
    return 1 if differ else 0


_TARGETS = {"dpsgd_epsilon": 1.0, "calibrate_noise_multiplier": 2.0, "pnsgd_privacy (n=1408)": 2.0,
            "grad through calibrate_noise_multiplier": 5.0}


def compare(cases: dict, other: str | None, repeat: int) -> int:
    """Each case ``repeat`` times in fresh processes, this tree and ``other`` alternated; medians."""
    import statistics

    trees = {"this": ROOT} if other is None else {"this": ROOT, "other": os.path.abspath(other)}
    print(f"trees: {trees}; {repeat} run(s) each, alternated; load average before: "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for name, expr in cases.items():
        runs = {t: [] for t in trees}
        for _ in range(repeat):
            for t, root in trees.items():
                with tempfile.TemporaryDirectory() as cache:
                    runs[t].append(_child(expr, cache, root) | {"load": os.getloadavg()[0]})
        line = [f"{name}:"]
        for t, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) for k in ("first", "first_cpu", "compile", "trace", "lower")}
            cpus = ", ".join(f"{r['first_cpu']:.2f}" for r in rs)
            line.append(f"{t} first {med['first']:.2f} s wall / {med['first_cpu']:.2f} s CPU (XLA {med['compile']:.2f}, "
                        f"trace {med['trace']:.2f}, lower {med['lower']:.2f}; CPU runs {cpus}; "
                        f"load {min(r['load'] for r in rs):.1f}-{max(r['load'] for r in rs):.1f})")
        if other is not None:
            ratio = statistics.median(r["first_cpu"] for r in runs["this"]) / statistics.median(
                r["first_cpu"] for r in runs["other"])
            line.append(f"CPU ratio this/other {ratio:.2f}")
        print("\n  ".join(line), flush=True)
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="run only the case with this name")
    p.add_argument("--warm-cache", action="store_true",
                   help="also time the first call of a second process on jaxdp's program cache filled by the first")
    p.add_argument("--compare-tree", default=None, metavar="DIR",
                   help="also run an older tree (git archive) in the same alternation, and print CPU-time ratios")
    p.add_argument("--repeat", type=int, default=1, help="runs per case and tree, alternated (default 1)")
    p.add_argument("--targets", action="store_true", help="run only the four cases issue 21 sets targets for")
    p.add_argument("--check-bits", action="store_true",
                   help="compare every public accountant's values with jaxdp's compiler options and with XLA's defaults")
    args = p.parse_args(argv)
    if args.check_bits:
        return check_bits()
    cases = {k: v for k, v in CASES.items() if args.only in (None, k)}
    if args.targets:
        cases = {k: v for k, v in cases.items() if k in _TARGETS}
    if not cases:
        p.error(f"--only: no case named {args.only!r}")
    if args.compare_tree or args.repeat > 1:
        return compare(cases, args.compare_tree, args.repeat)
    import platform

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    warm_col = f" {'warm first':>10} {'(untraced)':>10}" if args.warm_cache else ""
    print(f"{'case (fresh process, empty cache)':<52} {'import':>6} {'first':>6} {'trace':>6} {'lower':>6} "
          f"{'XLA':>6} {'lowered':>9} {'later':>9} {'1st CPU':>7}{warm_col}")
    worst = {}
    for name, expr in cases.items():
        with tempfile.TemporaryDirectory() as cache:
            try:
                r = _child(expr, cache)
                w = _child(expr, cache) if args.warm_cache else None
            except RuntimeError as err:
                print(f"{name:<52} failed: {err}")
                continue
        worst[name] = r["first"]
        extra = f" {w['first']:>9.2f}s {w.get('untraced', 0):>10d}" if w else ""
        print(f"{name:<52} {r['import']:>5.2f}s {r['first']:>5.2f}s {r['trace']:>5.2f}s {r['lower']:>5.2f}s "
              f"{r['compile']:>5.2f}s {r['lowered'] / 1e3:>7.0f}kB {1e3 * r['steady']:>7.2f}ms {r['first_cpu']:>6.2f}s{extra}", flush=True)
    for name, limit in _TARGETS.items():
        if name in worst:
            print(f"target: {name} first call {worst[name]:.2f} s (≤ {limit:g} s idle): "
                  f"{'met' if worst[name] <= limit else 'not met'}")
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"({time.perf_counter() - t0:.0f} s in all)")
    sys.exit(rc)
