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
* balls-in-bins (random allocation, 1 of t steps per pass): the NumPy/numba PLD of
  moshenfeld/PLD_accounting (PyPI ``pld-accounting``), run in its own virtual environment
  (``--peer-python``, default /work/venv-alloc/bin/python; it is not a jaxdp dependency)
  in a subprocess that times each configuration after its import; a tight PLD (jaxdp's
  is an RDP bound), so both ε are printed.

    python benchmarks/batch_schemes.py                  # 2,000 configurations per scheme
    python benchmarks/batch_schemes.py --peer-sample 20
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
    p.add_argument("--alloc-peer-sample", type=int, default=3)
    p.add_argument("--peer-python", default="/work/venv-alloc/bin/python")
    p.add_argument("--peer-timeout", type=float, default=900.0)
    p.add_argument("--schemes", default="wor,trunc,wr,alloc",
                   help="comma-separated subset of wor,trunc,wr,alloc (default: all)")
    args = p.parse_args()
    chosen = set(args.schemes.split(","))
    if not chosen or chosen - {"wor", "trunc", "wr", "alloc"}:
        p.error(f"--schemes must be a comma-separated subset of wor,trunc,wr,alloc; got {args.schemes!r}")

    rng = np.random.default_rng(0)
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


# The peer, run by its own interpreter: ε and seconds per configuration, after the import.
_PEER = """
import json, sys, time
from PLD_accounting import PrivacyParams, AllocationSchemeConfig, gaussian_allocation_epsilon_configurable
out = []
for s, t, e in json.loads(sys.argv[1]):
    t0 = time.perf_counter()
    eps = gaussian_allocation_epsilon_configurable(
        params=PrivacyParams(sigma=s, num_steps=t, num_epochs=e, delta=float(sys.argv[2])),
        config=AllocationSchemeConfig())
    out.append((eps, time.perf_counter() - t0))
print(json.dumps(out))
"""


def _balls_in_bins(args, rng):
    import jaxdp.accounting as A

    n = args.alloc_configs
    sig = np.exp(rng.uniform(math.log(0.6), math.log(3.0), n))
    t = rng.integers(10, 2_000, n).astype(float)
    passes = rng.integers(1, 50, n).astype(float)
    eps, comp, best = _time_jaxdp(lambda a, b, c: A.balls_in_bins_event(a, b, c), (sig, t, passes), args.repeats)
    line = f"balls-in-bins: jaxdp RDP {best / n * 1e3:.2f} ms/config over {n} (compile {comp:.1f} s)"
    if not os.path.exists(args.peer_python):
        print(line + f"; peer not installed ({args.peer_python}): pip install pld-accounting into a separate venv")
        return
    sub = rng.choice(n, size=min(args.alloc_peer_sample, n), replace=False)
    cfg = [(float(sig[i]), int(t[i]), int(passes[i])) for i in sub]
    try:
        res = subprocess.run([args.peer_python, "-c", _PEER, json.dumps(cfg), repr(DELTA)], capture_output=True,
                             text=True, timeout=args.peer_timeout, check=True)
    except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as err:
        print(line + f"; peer failed or ran past {args.peer_timeout:.0f} s: {type(err).__name__}")
        return
    peer = json.loads(res.stdout.strip().splitlines()[-1])
    secs = np.array([p[1] for p in peer])
    print(line + f"; PLD_accounting PLD median {np.median(secs) * 1e3:.0f} ms/config (first, with numba compile: "
          f"{secs[0]:.1f} s); ratio {np.median(secs) / (best / n):.0f}x")
    for (s, tt, e), (pe, _), me in zip(cfg, peer, eps[sub]):
        print(f"  σ={s:.3f} t={tt} passes={e}: ε jaxdp RDP {me:.4f}, PLD_accounting PLD {pe:.4f}")


if __name__ == "__main__":
    main()
