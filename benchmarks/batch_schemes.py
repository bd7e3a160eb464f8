"""Benchmark: ε of fixed-size and truncated sampling schemes, jaxdp (one batched jit) vs dp_accounting.

Per scheme, a random grid of configurations; jaxdp evaluates the whole grid as one batched
event under ``jax.jit`` (compile time reported separately, best of ``--repeats``), and the
peer runs per configuration on a subsample (its rate extrapolated per configuration):

* sampling without replacement (replace-one), T steps: dp_accounting ``RdpAccountant``
  (REPLACE_ONE) on ``SampledWithoutReplacementDpEvent``, the same theorem: the largest
  relative ε difference is printed;
* truncated Poisson (add/remove-one): dp_accounting ``PLDAccountant`` on
  ``TruncatedSubsampledGaussianDpEvent`` (its only accountant for the event; a different,
  PLD analysis, so the ε of both are printed side by side, not compared for equality);
* sampling with replacement: dp_accounting 0.6.0 has the event but no accountant; jaxdp
  alone is timed;
* balls-in-bins / random allocation (k of t steps per pass): jaxdp on a random grid, then
  jaxdp and the NumPy/numba PLD of moshenfeld/PLD_accounting 2.0 (PyPI ``pld-accounting``
  with ``numba``) on one fixed grid of 21 configurations. The peer runs in its own virtual
  environment (``--peer-python``, default /work/venv-alloc/bin/python; not a jaxdp
  dependency) in a subprocess, timed per configuration after a numba warm-up, with
  ``loss_discretization = --peer-disc × passes`` (its default 0.01 with 10 passes did not
  finish a configuration in 4 minutes: its composition divides the discretisation by the
  passes). Both its upper (DOMINATES) and lower (IS_DOMINATED) ε are printed; jaxdp's
  certified RDP bound must not be below the peer's lower bound (flagged if it is).

    python benchmarks/batch_schemes.py                  # 2,000 configurations per scheme
    python benchmarks/batch_schemes.py --peer-sample 20
    python benchmarks/batch_schemes.py --alloc-only --alloc-configs 64   # the random-allocation rows
    python benchmarks/batch_schemes.py --schemes wor      # one scheme (same configurations)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DELTA = 1e-5


def _time_jaxdp(make_event, args, repeats):
    import jax

    import jaxdp.accounting as A

    with jax.enable_x64(True):
        f = jax.jit(lambda *xs: A.epsilon(make_event(*xs), DELTA))
        t0 = time.perf_counter()
        f(*args).block_until_ready()
        compile_s = time.perf_counter() - t0
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            eps = f(*args).block_until_ready()
            best = min(best, time.perf_counter() - t0)
    return np.asarray(eps), compile_s, best


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", type=int, default=2000)
    p.add_argument("--peer-sample", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--alloc-configs", type=int, default=200)
    p.add_argument("--alloc-peer-grid", type=int, default=1, help="0: skip the peer grid")
    p.add_argument("--peer-disc", type=float, default=0.02,
                   help="the peer's loss_discretization per pass (its composition divides it by the passes)")
    p.add_argument("--peer-python", default="/work/venv-alloc/bin/python")
    p.add_argument("--peer-timeout", type=float, default=1800.0)
    p.add_argument("--alloc-only", action="store_true", help="only the random-allocation rows (= --schemes alloc)")
    p.add_argument("--schemes", default="wor,trunc,wr,alloc",
                   help="comma-separated subset of wor,trunc,wr,alloc (default: all)")
    args = p.parse_args()
    chosen = set(args.schemes.split(","))
    if not chosen or chosen - {"wor", "trunc", "wr", "alloc"}:
        p.error(f"--schemes must be a comma-separated subset of wor,trunc,wr,alloc; got {args.schemes!r}")

    rng = np.random.default_rng(0)
    if args.alloc_only:
        print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
              f"load {os.getloadavg()[0]:.1f}")
        _balls_in_bins(args, rng)
        print(f"load at the end {os.getloadavg()[0]:.1f}")
        return
    n = args.configs
    sub = rng.choice(n, size=min(args.peer_sample, n), replace=False)
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}; {n} configurations per scheme, peer on {len(sub)}")

    # Sampling without replacement. Every scheme draws its grid whether it runs or not, so a
    # subset sees the same configurations as the full run.
    recs = rng.integers(1_000, 100_000, n).astype(float)
    m = np.maximum(1.0, np.round(np.exp(rng.uniform(math.log(1e-3), math.log(0.1), n)) * recs))
    sig = np.exp(rng.uniform(math.log(0.6), math.log(5.0), n))
    steps = rng.integers(100, 10_000, n).astype(float)
    if "wor" in chosen:
        _wor(args, recs, m, sig, steps, sub)
    _rest(args, rng, n, sub, chosen)
    print(f"load at the end {os.getloadavg()[0]:.1f}")


def _wor(args, recs, m, sig, steps, sub):
    import dp_accounting as dpa
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    import jaxdp.accounting as A

    n = len(recs)
    eps, comp, best = _time_jaxdp(
        lambda a, b, c, d: A.SelfComposed(A.SampledWithoutReplacement(a, b, A.Gaussian(c, relation="replace_one")), d),
        (recs, m, sig, steps), args.repeats)
    t0 = time.perf_counter()
    ref = []
    for i in sub:
        acc = rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
        ev = dpa.SampledWithoutReplacementDpEvent(int(recs[i]), int(m[i]), dpa.GaussianDpEvent(float(sig[i])))
        acc.compose(dpa.SelfComposedDpEvent(ev, int(steps[i])))
        ref.append(acc.get_epsilon(DELTA))
    peer = (time.perf_counter() - t0) / len(sub)
    rel = np.max(np.abs(eps[sub] / np.array(ref) - 1.0))
    print(f"without replacement: jaxdp {best / n * 1e6:.1f} µs/config (compile {comp:.1f} s); dp_accounting RDP "
          f"{peer * 1e3:.1f} ms/config; ratio {peer / (best / n):.0f}x; max rel. ε difference {rel:.2e}")


def _rest(args, rng, n, sub, chosen):
    import dp_accounting as dpa
    from dp_accounting.pld import pld_privacy_accountant as pld

    import jaxdp.accounting as A

    # Truncated Poisson.
    recs = rng.integers(1_000, 100_000, n).astype(float)
    q = np.exp(rng.uniform(math.log(1e-3), math.log(0.05), n))
    cap = np.ceil(q * recs + 4.0 * np.sqrt(q * recs) + 1.0)
    sig = np.exp(rng.uniform(math.log(0.6), math.log(5.0), n))
    steps = rng.integers(100, 3_000, n).astype(float)
    if "trunc" in chosen:
        eps, comp, best = _time_jaxdp(
            lambda a, b, c, d, e: A.SelfComposed(A.TruncatedPoissonSampled(a, b, c, A.Gaussian(d)), e),
            (q, recs, cap, sig, steps), args.repeats)
        t0 = time.perf_counter()
        ref = []
        for i in sub:
            acc = pld.PLDAccountant()
            ev = dpa.TruncatedSubsampledGaussianDpEvent(int(recs[i]), float(q[i]), int(cap[i]), float(sig[i]))
            acc.compose(dpa.SelfComposedDpEvent(ev, int(steps[i])))
            ref.append(acc.get_epsilon(DELTA))
        peer = (time.perf_counter() - t0) / len(sub)
        ratio = np.median(eps[sub] / np.array(ref))
        print(f"truncated Poisson: jaxdp RDP {best / n * 1e6:.1f} µs/config (compile {comp:.1f} s); dp_accounting "
              f"PLD {peer * 1e3:.1f} ms/config; ratio {peer / (best / n):.0f}x; median ε jaxdp RDP / dp_accounting "
              f"PLD {ratio:.3f} (cap = mean + 4 sd)")

    # Sampling with replacement (no peer accountant).
    recs = rng.integers(1_000, 100_000, n).astype(float)
    sig = np.exp(rng.uniform(math.log(0.6), math.log(5.0), n))
    steps = rng.integers(100, 10_000, n).astype(float)
    if "wr" in chosen:
        eps, comp, best = _time_jaxdp(
            lambda a, c, d: A.SelfComposed(A.SampledWithReplacement(a, 64, A.Gaussian(c, relation="replace_one")), d),
            (recs, sig, steps), args.repeats)
        print(f"with replacement (m = 64): jaxdp {best / n * 1e6:.1f} µs/config (compile {comp:.1f} s); "
              "dp_accounting 0.6.0: no accountant for the event (neither RDP nor PLD supports it)")
    if "alloc" in chosen:
        _balls_in_bins(args, rng)


# The peer, run by its own interpreter: for each (σ, t, k, passes, loss_discretization) its
# upper (DOMINATES) and lower (IS_DOMINATED) ε and the seconds each took, after a warm-up
# call that compiles its numba kernels.
_PEER = """
import json, sys, time
from PLD_accounting import (AllocationSchemeConfig, BoundType, PrivacyParams, gaussian_allocation_epsilon_configurable,
                            has_numba)
def eps(s, t, k, e, disc, bound):
    return gaussian_allocation_epsilon_configurable(
        params=PrivacyParams(sigma=s, num_steps=t, num_selected=k, num_epochs=e, delta=float(sys.argv[2])),
        config=AllocationSchemeConfig(loss_discretization=disc), bound_type=bound)
t0 = time.perf_counter()
eps(1.0, 10, 1, 2, 0.1, BoundType.DOMINATES)
eps(1.0, 10, 1, 2, 0.1, BoundType.IS_DOMINATED)
print(json.dumps({"warmup_s": time.perf_counter() - t0, "numba": has_numba()}), flush=True)
for s, t, k, e, disc in json.loads(sys.argv[1]):
    row = []
    for bound in (BoundType.DOMINATES, BoundType.IS_DOMINATED):
        t0 = time.perf_counter()
        row += [eps(s, t, k, e, disc, bound), time.perf_counter() - t0]
    print(json.dumps(row), flush=True)
"""

# The configurations both run: σ × t × passes (k = 1), and a few k > 1.
_PEER_GRID = [(s, t, 1, e) for s in (0.8, 1.0, 2.0) for t in (10, 100, 1000) for e in (1, 10)] + [
    (1.0, 100, 4, 1), (1.0, 300, 3, 1), (2.0, 100, 3, 10)]


def _balls_in_bins(args, rng):
    import jax

    import jaxdp.accounting as A

    n = args.alloc_configs
    sig = np.exp(rng.uniform(math.log(0.6), math.log(3.0), n))
    t = rng.integers(10, 2_000, n).astype(float)
    passes = rng.integers(1, 50, n).astype(float)
    eps, comp, best = _time_jaxdp(lambda a, b, c: A.balls_in_bins_event(a, b, c), (sig, t, passes), args.repeats)
    from jaxdp.accounting import _allocation

    n_orders = len(A.DEFAULT_ORDERS)
    n_quad = len(_allocation._coarse_index(n_orders)) + _allocation._PRUNE_K
    print(f"balls-in-bins: jaxdp RDP {best / n * 1e3:.2f} ms/config over {n} random configurations (compile "
          f"{comp:.1f} s; ε: add-direction quadrature at {n_quad} of {n_orders} orders)")
    if not args.alloc_peer_grid:
        return
    # The peer's grid, jaxdp first: one batched jit per k (k is static).
    grid = _PEER_GRID
    mine = np.zeros(len(grid))
    k1 = [i for i, g in enumerate(grid) if g[2] == 1]
    cols = [np.array([grid[i][j] for i in k1], dtype=float) for j in (0, 1, 3)]
    e1, comp1, best1 = _time_jaxdp(lambda a, b, c: A.balls_in_bins_event(a, b, c), tuple(cols), args.repeats)
    mine[k1] = e1
    with jax.enable_x64(True):
        for i, (s, tt, k, e) in enumerate(grid):
            if k > 1:
                mine[i] = float(A.epsilon(A.random_allocation_event(s, tt, k, e), DELTA))
    per_cfg = best1 / len(k1)
    if not os.path.exists(args.peer_python):
        print(f"peer not installed ({args.peer_python}): pip install pld-accounting numba into a separate venv")
        return
    cfg = [(float(s), int(tt), int(k), int(e), args.peer_disc * e) for s, tt, k, e in grid]
    try:
        out = subprocess.run([args.peer_python, "-c", _PEER, json.dumps(cfg), repr(DELTA)], capture_output=True,
                             text=True, timeout=args.peer_timeout, check=True).stdout
    except subprocess.TimeoutExpired as err:  # keep the configurations it finished
        out = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        print(f"peer ran past {args.peer_timeout:.0f} s; the configurations it finished follow")
    except subprocess.CalledProcessError as err:
        print(f"peer failed: {err.stderr.strip().splitlines()[-1:]}")
        return
    lines = [json.loads(x) for x in out.strip().splitlines() if x.strip()]
    if len(lines) < 2:
        print("peer finished no configuration")
        return
    peer, rows = lines[0], np.array(lines[1:])  # rows (done, 4): ε upper, s, ε lower, s
    grid, mine = grid[:len(rows)], mine[:len(rows)]
    k1 = [i for i in k1 if i < len(rows)]
    up_s = rows[k1, 1]
    print(f"peer grid ({len(grid)} configurations, δ = {DELTA:g}): jaxdp RDP {per_cfg * 1e3:.1f} ms/config "
          f"(k = 1, {len(k1)} in one batched jit; compile {comp1:.1f} s); PLD_accounting 2.0 PLD (numba "
          f"{peer['numba']}, warm-up {peer['warmup_s']:.1f} s, loss_discretization {args.peer_disc:g} × passes) "
          f"upper bound median {np.median(up_s):.2f} s/config (max {np.max(up_s):.1f} s); ratio "
          f"{np.median(up_s) / per_cfg:.0f}x (median peer upper-bound time / jaxdp batched time per configuration)")
    print("  σ     t     k  passes | ε jaxdp RDP | ε PLD_accounting upper [lower] | jaxdp / upper | peer s (up, low)")
    for (s, tt, k, e), me, (pu, su, pl, sl) in zip(grid, mine, rows):
        flag = "  BELOW the peer's lower bound" if me < pl else ("  below the peer's upper bound" if me < pu else "")
        print(f"  {s:<5} {tt:<5} {k:<2} {e:<6} | {me:11.4f} | {pu:9.4f} [{pl:.4f}] | {me / pu:6.3f} | "
              f"{su:.1f}, {sl:.1f}{flag}")


if __name__ == "__main__":
    main()
