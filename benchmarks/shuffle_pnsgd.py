"""ε vs the number of passes k for PNSGD with shuffled batches: hidden-state bound vs composition.

Prints the table quoted in docs/hidden_state_poisson.md §8.4 (and writes shuffle_pnsgd.png next to
--out when matplotlib is installed). The run: L = 1, β = 1, η = 0.5, σ = 1 (noise std on the
averaged gradient), D = 1, n = 1000, b = 10 (m = 100 steps a pass), δ = 1e-5. Columns: the
shuffled hidden-state bound (shuffle_pnsgd_epsilon), the shuffled run with every iterate released
(the passes composed), and the fixed public order's best-of (the same order every pass,
pnsgd_privacy's worst record) for comparison.

    PYTHONPATH=$PWD python benchmarks/shuffle_pnsgd.py [--out DIR]
"""

import time

from poisson_pnsgd import arguments, figure  # the same helpers (benchmarks/ is on the path when run as a script)

import jaxdp

A = jaxdp.accounting
RUN = dict(lipschitz=1.0, smoothness=1.0, learning_rate=0.5, noise_std=1.0, diameter=1.0)
GEOM = dict(num_records=1000, batch_size=10)
DELTA = 1e-5
PASSES = [1, 2, 3, 5, 10, 100, 1000]


def _row(k):
    hid = float(A.shuffle_pnsgd_epsilon(DELTA, **RUN, **GEOM, passes=k))
    comp = float(A.epsilon(A.PNSGD(**RUN, **GEOM, passes=k, sampling="shuffle", hidden=False), DELTA))
    fixed = float(A.epsilon(A.PNSGD(**RUN, **GEOM, passes=k), DELTA))
    return hid, comp, fixed


def main():
    args = arguments()
    t0 = time.perf_counter()
    rows = [(k, *_row(k)) for k in PASSES]
    print("| passes k | steps | hidden state, shuffled (shuffle_pnsgd_epsilon) | shuffled, every iterate released "
          "| ratio | fixed public order (best-of) |")
    print("|---|---|---|---|---|---|")
    for k, h, c, f in rows:
        print(f"| {k:,} | {100 * k:,} | {h:.4f} | {c:.4f} | {h / c:.3f} | {f:.4f} |")
    print(f"{time.perf_counter() - t0:.1f} s")
    if args.out:
        figure(args.out, "shuffle_pnsgd.png", [r[0] for r in rows],
               {"shuffled, every iterate released": ([r[2] for r in rows], "o-"),
                "hidden state, shuffled (shuffle_pnsgd_epsilon)": ([r[1] for r in rows], "o-"),
                "fixed public order (best-of)": ([r[3] for r in rows], "o--")}, "passes k (100 steps each)")


if __name__ == "__main__":
    main()
