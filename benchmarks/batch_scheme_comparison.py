"""The comparison a user needs: what each DP-SGD batch scheme costs, at equal ε and at equal noise.

1. **Digits at equal ε** (ε ∈ {1, 2, 4}, δ = 1e-5): DP-SGD through ``DPSGDMechanism`` with
   ``target_epsilon`` and each sampler of :mod:`jaxdp.training.samplers`; prints the noise
   multiplier each scheme needs and the test accuracy it reaches (MLP 64-64-10, batch 128,
   ``--passes`` passes, SGD at learning rate 1, C = 1; model init seed 0, noise seeds 0..``--seeds``-1).
2. **ε at equal noise on a large grid**: N = 60,000, batch b ∈ {64, 256, 1024}, passes
   ∈ {1, 10, 50}, noise multiplier ν on 30 points in [0.5, 5], each scheme's event
   (:meth:`~jaxdp.training.samplers.Sampler.event`) under one batched ``jit`` per scheme.
   Truncated Poisson is capped at b + 4√b.

Poisson and truncated Poisson are add/remove-one; fixed size, balls-in-bins and shuffle are
replace-one (N public; the differing record's contribution moves by 2C): the columns are the
ε each scheme is certified for under its own relation, which is how a run reports them.
Balls-in-bins is accounted for by random allocation's certified event (``balls_in_bins_event``).

    python benchmarks/batch_scheme_comparison.py                 # both parts, writes docs/batch_schemes.png
    python benchmarks/batch_scheme_comparison.py --skip-training # the grid only (seconds)
    python benchmarks/batch_scheme_comparison.py --digits-table docs/batch_schemes.md  # grid rerun, digits from the table
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DELTA = 1e-5
SCHEMES = ("poisson", "truncated-poisson", "fixed-size", "fixed-size-replace", "balls-in-bins", "shuffle")


def _sampler(name: str, batch_size: int):
    from jaxdp.training import samplers as S

    if name == "truncated-poisson":
        return S.TruncatedPoisson(int(math.ceil(batch_size + 4 * math.sqrt(batch_size))))
    if name == "fixed-size-replace":
        return S.FixedSize(replace=True)
    return S.by_name(name)


def digits_at_equal_epsilon(passes: int, seeds: int, batch_size: int = 128):
    import optax
    from flax import nnx

    from jaxdp.data import load_digits
    from jaxdp.models import MLP
    from jaxdp.training import DPSGDMechanism, RunOptions, train

    ds = load_digits()
    rows = []
    for target in (1.0, 2.0, 4.0):
        for name in SCHEMES:
            accs, nu, eps, secs = [], None, None, 0.0
            for seed in range(seeds):
                mech = DPSGDMechanism(clip_norm=1.0, optimizer=optax.sgd(1.0), target_epsilon=target,
                                      batch_size=batch_size, passes=passes, sampler=_sampler(name, batch_size))
                t0 = time.perf_counter()
                res = train(MLP((64, 64, 10), rngs=nnx.Rngs(0)), ds, mech, delta=DELTA, noise_seed=seed,
                            options=RunOptions(progress=False))
                secs += time.perf_counter() - t0
                accs.append(res.test_accuracy)
                nu, eps = res.mechanism.noise_multiplier, res.privacy.summary()["worst"]
            rows.append((target, name, nu, eps, accs))
            print(f"  eps={target:g} {name:20s} nu={nu:8.4f} eps_reported={eps:.4f} accuracy "
                  f"{' '.join(f'{100 * a:.1f}' for a in accs)} %  ({secs:.0f} s)", flush=True)
    return rows


def grid_at_equal_noise():
    import jax

    import jaxdp.accounting as A
    from jaxdp.training import samplers as S

    n = 60_000
    nus = np.linspace(0.5, 5.0, 30)
    out = {}
    for b in (64, 256, 1024):
        for passes in (1, 10, 50):
            for name in SCHEMES:
                bound = _sampler(name, b).bind(n, b)
                steps = passes * bound.steps_per_pass
                with jax.enable_x64(True):
                    f = jax.jit(jax.vmap(lambda nu, s=bound, t=steps: A.epsilon(s.event(nu, t, n), DELTA)))
                    t0 = time.perf_counter()
                    eps = np.asarray(f(nus))
                    secs = time.perf_counter() - t0
                out[(b, passes, name)] = eps
                print(f"  b={b:5d} passes={passes:3d} {name:20s} T={steps:6d} eps(nu=1)={np.interp(1.0, nus, eps):9.4g}"
                      f"  ({secs:.1f} s)", flush=True)
    return nus, out


def _markdown_grid(nus, out):
    lines = ["| b | passes | ν | " + " | ".join(SCHEMES) + " |", "|---|---|---|" + "---|" * len(SCHEMES)]
    for (b, passes) in sorted({k[:2] for k in out}):
        for nu in (0.8, 1.0, 2.0, 4.0):
            cells = [f"{np.interp(nu, nus, out[(b, passes, s)]):.3g}" for s in SCHEMES]
            lines.append(f"| {b} | {passes} | {nu:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _markdown_digits(rows):
    lines = ["| ε | scheme | noise multiplier | ε reported | test accuracy (%) |", "|---|---|---|---|---|"]
    for target, name, nu, eps, accs in rows:
        lines.append(f"| {target:g} | {name} | {nu:.3f} | {eps:.4f} | "
                     f"{' / '.join(f'{100 * a:.1f}' for a in accs)} |")
    return "\n".join(lines)


def _digits_from_table(path):
    """The digits rows of a Markdown table written by ``_markdown_digits`` (e.g. docs/batch_schemes.md).

    Lets the figure be redrawn from the published table when only the grid is rerun; the
    label "fixed-size, with replacement" is the scheme fixed-size-replace.
    """
    rows = []
    names = {"fixed-size, with replacement": "fixed-size-replace"}
    with open(path) as fh:
        for line in fh:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) != 5 or names.get(cells[1], cells[1]) not in SCHEMES:
                continue
            try:
                target, nu, eps = float(cells[0]), float(cells[2]), float(cells[3])
            except ValueError:
                continue
            accs = [float(a) / 100 for a in cells[4].split("/")]
            rows.append((target, names.get(cells[1], cells[1]), nu, eps, accs))
    return rows


def _plot(path, nus, out, rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if rows else 1, figsize=(11 if rows else 6, 4.2), squeeze=False)
    ax = axes[0, 0]
    for s in SCHEMES:
        ax.semilogy(nus, out[(256, 10, s)], label=s, linestyle="--" if s == "shuffle" else "-")
    ax.set_ylim(0.05, 1e3)  # with replacement is off the chart (its RDP bound is vacuous here)
    ax.set_xlabel("noise multiplier ν (relative to C)")
    ax.set_ylabel("ε at δ = 1e-5")
    ax.set_title("ε at equal noise: N = 60,000, b = 256, 10 passes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if rows:
        ax = axes[0, 1]
        width = 0.13
        targets = sorted({r[0] for r in rows})
        for i, s in enumerate(SCHEMES):
            acc = [100 * np.mean(next(r[4] for r in rows if r[0] == t and r[1] == s)) for t in targets]
            ax.bar(np.arange(len(targets)) + (i - 2.5) * width, acc, width, label=s)
        ax.set_xticks(np.arange(len(targets)), [f"ε = {t:g}" for t in targets])
        ax.set_ylabel("test accuracy (%)")
        ax.set_title("digits, MLP, DP-SGD at equal ε (δ = 1e-5)")
        ax.set_ylim(0, 125)  # room for the legend above the bars
        ax.set_yticks(range(0, 101, 20))
        ax.legend(fontsize=7, ncol=3, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    global SCHEMES
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--passes", type=int, default=10)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--skip-training", action="store_true")
    p.add_argument("--schemes", default=",".join(SCHEMES),
                   help=f"comma-separated subset of {','.join(SCHEMES)} (default: all)")
    p.add_argument("--digits-table", default=None,
                   help="skip training and plot the digits rows of this Markdown table (docs/batch_schemes.md)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.add_argument("--plot", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs",
                                                 "batch_schemes.png"), help="PNG to write ('' for none)")
    args = p.parse_args()
    chosen = tuple(args.schemes.split(","))
    if not chosen or any(c not in SCHEMES for c in chosen):
        p.error(f"--schemes must be a comma-separated subset of {','.join(SCHEMES)}; got {args.schemes!r}")
    SCHEMES = chosen
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}")
    print("ε at equal noise (grid):")
    nus, out = grid_at_equal_noise()
    rows = []
    if args.digits_table:
        rows = _digits_from_table(args.digits_table)
        print(f"digits at equal ε: {len(rows)} rows read from {args.digits_table} (not retrained)")
    elif not args.skip_training:
        print(f"digits at equal ε ({args.passes} passes, noise seeds 0..{args.seeds - 1}):")
        rows = digits_at_equal_epsilon(args.passes, args.seeds)
    print(f"load at the end {os.getloadavg()[0]:.1f}\n")
    print(_markdown_grid(nus, out))
    if rows:
        print()
        print(_markdown_digits(rows))
    if args.json:
        import json

        with open(args.json, "w") as fh:
            json.dump({"nus": nus.tolist(), "grid": {"|".join(map(str, k)): v.tolist() for k, v in out.items()},
                       "digits": rows}, fh)
    if args.plot:  # --plot '' skips the figure (e.g. for a subset of the schemes)
        _plot(args.plot, nus, out, rows)
        print(f"\nwrote {args.plot}")


if __name__ == "__main__":
    main()
