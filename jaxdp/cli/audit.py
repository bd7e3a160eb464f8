"""``jaxdp audit``: empirical lower bounds on ε next to the accountants' claims.

For each setting it prints the claimed ε (the accountant's upper bound), the audit's lower
bound (valid with ``--confidence``) and their ratio, writes ``audit.csv`` and then, last,
the plot ``audit.png``: the claimed and empirical ε per setting, and for every many-run setting
its claimed trade-off curve (:func:`jaxdp.accounting.tradeoff`) with the threshold tests'
(FPR, TPR) points and their Clopper–Pearson boxes (:func:`jaxdp.audit.empirical_tradeoff`)
on the same axes (a failed plot never loses the results). The randomness is the
simulation's own (no real data is involved); ``--seed`` makes a run reproducible.
"""

from __future__ import annotations

import os
import sys

from ._common import SEED_RANGE, UsageError, check_out_dir, emit, fmt, number

SETTINGS = ("gaussian", "sampled_gaussian", "pnsgd", "pnsgd_boundary", "dpsgd", "dpsgd_one_run")
# The runs of a setting are vmapped at once: memory grows linearly with --runs. Bounds checked
# before any work (found by fuzzing: --runs 10^11 ran XLA out of memory).
MAX_RUNS = 10**6  # measured: ~0.55 kB per run (643 MB peak at 2e4 runs, 743 MB at 2e5, all settings)
MAX_CANARIES = 10**6


def add_parser(sub) -> None:
    p = sub.add_parser("audit", help="empirical lower bounds on epsilon against the accountants' claims",
                       description="Simulate mechanisms with and without a canary (vmapped over runs) and print, "
                                   "per setting, the claimed epsilon, the empirical lower bound (Clopper-Pearson, "
                                   "or one-run auditing for dpsgd_one_run) and their ratio; write audit.csv and "
                                   "audit.png. A lower bound above a claim means the claim is wrong.")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help=f"comma-separated subset of {', '.join(SETTINGS)} (default: all)")
    p.add_argument("--runs", type=int, default=20_000,
                   help=f"runs per side of each experiment, 2 to {MAX_RUNS:_} (default 20000)")
    p.add_argument("--num-canaries", type=int, default=1000,
                   help=f"canaries of the one-run audit, 10 to {MAX_CANARIES:_} (default 1000)")
    p.add_argument("--confidence", type=number("--confidence"), default=0.95, help="confidence in (0, 1)")
    p.add_argument("--delta", type=number("--delta"), default=1e-5, help="delta in (0, 1) (default 1e-5)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the simulation (default: fresh OS entropy; the audit has no real data to protect)")
    p.add_argument("--out", default="jaxdp_audit", help="output folder (default: ./jaxdp_audit)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def _settings(text: str) -> list[str]:
    picked = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in picked if s not in SETTINGS]
    if not picked or bad:
        raise UsageError(f"--settings must name some of {', '.join(SETTINGS)}; got {text!r}")
    return picked


def run(args) -> int:
    import jax

    picked = _settings(args.settings)
    if not 2 <= args.runs <= MAX_RUNS:  # before any allocation: 10^11 runs ran XLA out of memory
        raise UsageError(f"--runs must be an integer in [2, {MAX_RUNS:_}]; got {args.runs}")
    if not 10 <= args.num_canaries <= MAX_CANARIES:
        raise UsageError(f"--num-canaries must be an integer in [10, {MAX_CANARIES:_}]; got {args.num_canaries}")
    if args.seed is not None and not SEED_RANGE[0] <= args.seed <= SEED_RANGE[1]:  # jax.random.key overflowed
        raise UsageError(f"--seed must be an integer in [-2**63, 2**63 - 1]; got {args.seed}")
    if not 0.0 < args.confidence < 1.0:
        raise UsageError(f"--confidence must be in (0, 1); got {args.confidence:g}")
    if not 0.0 < args.delta < 1.0:
        raise UsageError(f"--delta must be in (0, 1); got {args.delta:g}")
    check_out_dir(args.out)  # before the work, not after

    from .. import audit

    if args.seed is None:  # each driver draws a fresh key from the OS entropy
        keys = dict.fromkeys(SETTINGS)
    else:
        keys = dict(zip(SETTINGS, jax.random.split(jax.random.key(args.seed), len(SETTINGS))))
    d, c, runs = args.delta, args.confidence, args.runs
    rows = []  # (setting, parameters, claimed, lower, ratio)
    curves = []  # (title, claimed trade-off curve (event, accountant), scores_in, scores_out)
    for name in picked:
        k = keys[name]
        if name == "gaussian":
            r, s_in, s_out = audit.audit_gaussian(1.0, d, runs=runs, confidence=c, key=k, return_scores=True)
            rows.append((name, "noise_multiplier=1", r))
            curves.append(("gaussian, noise_multiplier=1", (_A().Gaussian(1.0), "gdp"), s_in, s_out))
        elif name == "sampled_gaussian":
            r, s_in, s_out = audit.audit_gaussian(1.0, d, q=0.5, num_steps=4, runs=runs, confidence=c, key=k,
                                                  return_scores=True)
            rows.append((name, "q=0.5 noise_multiplier=1 num_steps=4", r))
            curves.append(("sampled_gaussian, q=0.5, 4 steps", (_A().dpsgd_event(0.5, 1.0, 4), "pld"), s_in, s_out))
        elif name in ("pnsgd", "pnsgd_boundary"):
            # "pnsgd_boundary": the other records drive the iterate into the boundary +R
            # (crafted gradients, hidden-state threat model); "pnsgd": they are zero.
            attack = "boundary" if name == "pnsgd_boundary" else "zero"
            r, s_in, s_out = audit.audit_pnsgd([1, 3, 6], 6, 0.5, 0.5, 1.0, 1.0, d, runs=runs, confidence=c, key=k,
                                               attack=attack, return_scores=True)
            for i, pos in enumerate((1, 3, 6)):
                rows.append((name, f"position={pos} of 6 learning_rate=0.5 noise_multiplier=0.5 radius=1",
                             audit.AuditResult(r.claimed_epsilon[i], r.lower_bound[i], r.ratio[i])))
                curves.append((f"{name}, position {pos} of 6", (_pnsgd_record_gaussian(pos), "gdp"), s_in[i],
                               s_out[i]))
        elif name == "dpsgd":
            r, s_in, s_out = audit.audit_dpsgd(0.5, 1.0, 4, d, runs=runs, confidence=c, key=k, return_scores=True)
            rows.append((name, "q=0.5 noise_multiplier=1 num_steps=4 (final model only)", r))
            curves.append(("dpsgd, q=0.5, 4 steps, final model", (_A().dpsgd_event(0.5, 1.0, 4), "pld"), s_in, s_out))
        else:
            r = audit.audit_dpsgd_one_run(1.0, 1.0, 1, d, num_canaries=args.num_canaries, confidence=c, key=k)
            rows.append((name, f"q=1 noise_multiplier=1 num_steps=1 canaries={args.num_canaries}", r))

    csv_path = os.path.join(args.out, "audit.csv")
    with open(csv_path, "w") as fh:
        fh.write("setting,parameters,delta,confidence,runs,claimed_epsilon,lower_bound,ratio\n")
        for name, params, r in rows:
            fh.write(f"{name},{params},{d:.10g},{c:.10g},{runs},{float(r.claimed_epsilon):.10g},"
                     f"{float(r.lower_bound):.10g},{float(r.ratio):.10g}\n")
    lines = [f"audit at delta = {d:g}, confidence {c:g}, {runs} runs per side "
             f"({args.num_canaries} canaries for the one-run audit)",
             f"{'setting':<18} {'claimed eps':>12} {'lower bound':>12} {'ratio':>7}  parameters"]
    violated = False
    for name, params, r in rows:
        claimed, lower = float(r.claimed_epsilon), float(r.lower_bound)
        violated |= lower > claimed
        lines.append(f"{name:<18} {fmt(claimed):>12} {fmt(lower):>12} {fmt(float(r.ratio), '.3f'):>7}  {params}")
    if violated:
        lines.append("WARNING: a lower bound exceeds its claim: the claimed epsilon is wrong (or the confidence failed)")
    lines.append(f"wrote {csv_path}")
    png_path = os.path.join(args.out, "audit.png")
    payload = dict(delta=d, confidence=c, runs=runs, csv=csv_path, violated=bool(violated),
                   results=[dict(setting=n, parameters=p, claimed_epsilon=float(r.claimed_epsilon),
                                 lower_bound=float(r.lower_bound), ratio=float(r.ratio)) for n, p, r in rows])
    try:  # the plot is optional and comes last: its failure must not lose the results
        _plot(png_path, rows, curves, d, c)
        plot_error = None
        lines.append(f"wrote {png_path}")
        payload["png"] = png_path
    except Exception as exc:  # matplotlib and OS errors alike, reported in one line
        plot_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        payload["png"] = None
    emit(args, payload, lines)
    if plot_error:
        print(f"jaxdp: error: the plot {png_path!r} could not be written ({plot_error})", file=sys.stderr)
        return 1
    return 0


def _A():
    from .. import accounting

    return accounting


def _pnsgd_record_gaussian(position: int):
    """The pnsgd setting's record at ``position`` as the Gaussian mechanism of its shifted-interpolation μ."""
    from ..training import pnsgd_noise_std

    mu = float(_A().pnsgd_shifted_gdp(position, 6, 1.0, pnsgd_noise_std(0.5, 1.0, 1), 0.5, 2.0, smoothness=2.0))
    return _A().Gaussian(1.0 / mu)


# Trade-off curves are drawn on a log FPR axis from 1e-6 (below any rate 10^6 runs resolve) to 1.
_CURVE_FPR = (-6.0, 0.0, 121)


def _plot(path, rows, curves, delta, confidence) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Rectangle

    from .. import audit

    labels = [n if not p.startswith("position") else f"{n} {p.split()[0]}" for n, p, _ in rows]
    claimed = np.array([float(r.claimed_epsilon) for _, _, r in rows])
    lower = np.array([float(r.lower_bound) for _, _, r in rows])
    x = np.arange(len(rows))
    ncols = min(4, 1 + len(curves))
    nrows = -(-(1 + len(curves)) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.8 * nrows), constrained_layout=True, squeeze=False)
    ax = axes.flat[0]
    ax.bar(x - 0.2, claimed, 0.4, label="claimed epsilon (accountant, upper bound)")
    ax.bar(x + 0.2, lower, 0.4, label=f"empirical lower bound ({confidence:g} confidence)")
    ax.set_xticks(x, labels, rotation=30, ha="right")
    ax.set_ylabel(f"epsilon at delta = {delta:g}")
    ax.legend(fontsize=7)
    fpr = np.logspace(*_CURVE_FPR)
    for ax, (title, (event, accountant), s_in, s_out) in zip(axes.flat[1:], curves):
        # The claimed curve: no test's TPR lies above it at any FPR (both orders of the pair).
        tpr = np.asarray(_A().tradeoff(event, fpr, accountant=accountant), np.float64)
        ax.plot(fpr, tpr, color="C0", label=f"claimed trade-off ({accountant})")
        pts = audit.empirical_tradeoff(s_in, s_out, confidence)
        f_lo, f_hi = np.asarray(pts.fpr_lower), np.asarray(pts.fpr_upper)
        t_lo, t_hi = np.asarray(pts.tpr_lower), np.asarray(pts.tpr_upper)
        for a0, a1, b0, b1 in zip(f_lo, f_hi, t_lo, t_hi):
            ax.add_patch(Rectangle((max(a0, 10**_CURVE_FPR[0]), b0), a1 - max(a0, 10**_CURVE_FPR[0]), b1 - b0,
                                   fill=False, edgecolor="C1", linewidth=0.6, alpha=0.7))
        ax.plot(np.maximum(np.asarray(pts.fpr), 10**_CURVE_FPR[0]), np.asarray(pts.tpr), ".", color="C1", ms=3,
                label=f"threshold tests ({confidence:g} boxes)")
        ax.set_xscale("log")
        ax.set_xlim(10**_CURVE_FPR[0], 1.0)
        ax.set_ylim(0.0, 1.0)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("false-positive rate")
        ax.set_ylabel("true-positive rate")
        ax.legend(fontsize=7, loc="upper left")
    for ax in axes.flat[1 + len(curves):]:
        ax.axis("off")
    fig.savefig(path, dpi=110)
    plt.close(fig)
