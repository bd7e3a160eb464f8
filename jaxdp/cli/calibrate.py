"""``jaxdp calibrate``: the smallest DP-SGD noise multiplier meeting a target (ε, δ)."""

from __future__ import annotations

import math
import sys

from ._common import EXIT_USAGE, add_conversion_options, emit, number, orders, step_count


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="smallest noise multiplier for a target epsilon",
                       description="Smallest DP-SGD noise multiplier meeting the target (epsilon, delta); its "
                                   "epsilon, recomputed, never exceeds the target.")
    p.add_argument("--epsilon", type=number("--epsilon"), required=True, help="target epsilon (> 0)")
    p.add_argument("--q", type=number("--q"), required=True, help="Poisson sampling rate in [0, 1]")
    p.add_argument("--num-steps", type=step_count("--num-steps"), required=True,
                   help="number of noisy steps (a whole number >= 0)")
    p.add_argument("--delta", type=number("--delta"), required=True, help="target delta in (0, 1)")
    add_conversion_options(p)
    p.add_argument("--accountant", choices=("rdp", "pld"), default="rdp",
                   help="rdp (default) or pld: calibrate with the privacy loss distribution's upper bound "
                        "(tighter: a smaller noise multiplier; compiles for about a minute on a first run)")
    p.set_defaults(func=run)


def run(args) -> int:
    from .. import accounting as A

    pld = getattr(args, "accountant", "rdp") == "pld"
    if pld:
        res = A.calibrate_noise_multiplier(args.epsilon, args.q, args.num_steps, args.delta, accountant="pld")
    else:
        res = A.calibrate_noise_multiplier(args.epsilon, args.q, args.num_steps, args.delta, orders=orders(args),
                                           method=args.method)
    nm, eps = float(res.noise_multiplier), float(res.epsilon)
    at_lower = bool(res.at_lower_bound)
    payload = dict(target_epsilon=args.epsilon, q=args.q, num_steps=args.num_steps, delta=args.delta,
                   accountant="pld" if pld else "rdp", noise_multiplier=nm, epsilon=eps, at_lower_bound=at_lower)
    if not math.isfinite(nm):
        # A target out of reach: the command as given has no answer, exit 2 like a bad option; the error on stderr
        # (with --json the payload still goes to stdout, noise_multiplier "inf").
        if args.json:
            emit(args, payload, [])
        print(f"jaxdp: error: --epsilon {args.epsilon:g} is not reachable: no noise multiplier in the search range "
              f"gives epsilon <= {args.epsilon:g} at --delta {args.delta:g} (q={args.q:g}, "
              f"steps={args.num_steps:g}); raise --epsilon or --delta, or lower --q or --num-steps", file=sys.stderr)
        return EXIT_USAGE
    if at_lower:
        # The target is met at the bracket's lower end: that end is not a threshold.
        emit(args, payload, [
            f"any noise multiplier >= {nm:g} meets the target; the smallest searched is {nm:g}, so the "
            f"smallest that meets it may be lower",
            f"at {nm:g}: epsilon = {eps:.6f} <= {args.epsilon:g} at delta = {args.delta:g} "
            f"(q={args.q:g}, steps={args.num_steps:g})",
        ])
        return 0
    emit(args, payload, [
        f"smallest noise multiplier: {nm:.6f}",
        f"it gives epsilon = {eps:.6f} <= {args.epsilon:g} at delta = {args.delta:g} "
        f"(q={args.q:g}, steps={args.num_steps:g}; {'PLD accountant, upper bound' if pld else 'RDP accountant'})",
    ])
    return 0
