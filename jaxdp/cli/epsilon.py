"""``jaxdp epsilon``: ε of DP-SGD (Poisson-sampled Gaussian) at a target δ, by RDP."""

from __future__ import annotations

import math
import sys

from ._common import add_conversion_options, emit, number, orders, step_count


def add_parser(sub) -> None:
    p = sub.add_parser("epsilon", help="epsilon of DP-SGD (Poisson-sampled Gaussian, RDP accountant)",
                       description="Epsilon of DP-SGD at a target delta, from the exact sampled-Gaussian RDP. "
                                   "Add/remove neighbours; the noise multiplier is the noise std over the clip "
                                   "norm C of the clipped-gradient sum (as in Opacus and dp_accounting).")
    p.add_argument("--q", type=number("--q"), required=True, help="Poisson sampling rate in [0, 1]")
    p.add_argument("--noise-multiplier", type=number("--noise-multiplier"), required=True,
                   help="noise std over the sensitivity C of the clipped sum (> 0)")
    p.add_argument("--num-steps", type=step_count("--num-steps"), required=True,
                   help="number of noisy steps (a whole number >= 0)")
    p.add_argument("--delta", type=number("--delta"), required=True, help="target delta in (0, 1)")
    add_conversion_options(p)
    p.add_argument("--accountant", choices=("rdp", "pld"), default="rdp",
                   help="rdp (default) or pld: the privacy loss distribution (FFT, connect-the-dots upper "
                        "bound, tighter)")
    p.set_defaults(func=run)


def run(args) -> int:
    from .. import accounting as A

    if getattr(args, "accountant", "rdp") == "pld":
        eps = float(A.pld_epsilon(A.dpsgd_event(args.q, args.noise_multiplier, args.num_steps), args.delta))
        payload = dict(q=args.q, noise_multiplier=args.noise_multiplier, num_steps=args.num_steps,
                       delta=args.delta, accountant="pld", grid_size=A.PLD_GRID_SIZE, epsilon=eps)
        emit(args, payload, [
            f"DP-SGD, Poisson sampling q={args.q:g}, noise multiplier={args.noise_multiplier:g}, "
            f"steps={args.num_steps:g}",
            f"epsilon = {eps:.6f} at delta = {args.delta:g} (PLD accountant, upper bound, "
            f"{A.PLD_GRID_SIZE} loss bins)",
        ])
        return 0
    o = orders(args)
    rdp = A.heterogeneous_rdp(o, [args.q], [args.noise_multiplier], [args.num_steps])
    res = A.rdp_to_epsilon(rdp, o, args.delta, method=args.method)
    eps, order = float(res.epsilon), float(res.order)
    if math.isnan(eps):  # never print "epsilon = nan" with success
        print("jaxdp: error: the accountant returned NaN for these inputs (a bug: please report the command)",
              file=sys.stderr)
        return 1
    payload = dict(q=args.q, noise_multiplier=args.noise_multiplier, num_steps=args.num_steps, delta=args.delta,
                   method=args.method, epsilon=eps, order=order)
    emit(args, payload, [
        f"DP-SGD, Poisson sampling q={args.q:g}, noise multiplier={args.noise_multiplier:g}, "
        f"steps={args.num_steps:g}",
        f"epsilon = {eps:.6f} at delta = {args.delta:g} (optimal Renyi order {order:g}, {args.method} conversion)",
    ])
    return 0
