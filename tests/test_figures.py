"""The deterministic figures the README, examples/README.md and docs/ quote are what the code computes.

Each test recomputes figures with the accountant call behind them (no training: a figure
that a training run reports is the accountant evaluated at the run's constants) and checks
that every file quoting them still quotes the same text. A change of the code that moves a
figure fails here, and so does an edit of a quoted figure without this test. Random
figures (accuracy, time) are quoted as measured ranges with the machine and are not tested.
"""

import math
import pathlib

import numpy as np
import pytest

import jaxdp.accounting as A

ROOT = pathlib.Path(__file__).resolve().parent.parent
DELTA = 1e-5
DIGITS_TRAIN = 1438  # load_digits(): 1,797 examples, 20 % held out


def quoted(text: str, *files: str) -> None:
    for name in files:
        body = (ROOT / name).read_text()
        assert text in body, f"{name} no longer quotes {text!r}: update the figure there and in this test"


def f(x: float, digits: int) -> str:
    return f"{x:.{digits}f}"


def _pnsgd(lipschitz, smoothness, learning_rate, noise_multiplier, clip_norm, batch_size, radius, passes,
           strong_convexity=0.0):
    """ε per record of ``train``'s PNSGD on the digits: (best, median, worst, composition, by analysis)."""
    n = (DIGITS_TRAIN // batch_size) * batch_size  # drop_remainder
    run = A.PNSGD(lipschitz, smoothness, learning_rate, noise_multiplier * 2 * clip_norm / batch_size, 2 * radius,
                  num_records=n, strong_convexity=strong_convexity, batch_size=batch_size, passes=passes)
    out = A.pnsgd_privacy(run, DELTA)
    best = np.asarray(out.best)
    return float(best.min()), float(np.median(best)), float(best.max()), float(np.asarray(out.composition).max()), out


def test_dpsgd_mnist_figures():
    eps = float(A.dpsgd_epsilon(256 / 60000, 1.1, 14040, DELTA))
    quoted(f(eps, 6), "README.md", "docs/reference.md")
    quoted(f(eps, 4), "examples/README.md")
    pld = float(A.epsilon(A.dpsgd_event(256 / 60000, 1.1, 14040), DELTA, accountant="pld"))
    quoted(f(pld, 4), "README.md")
    quoted(f"RDP {f(eps, 3)}, PLD {f(pld, 3)}", "docs/accountants.md")
    sigma = float(A.calibrate_noise_multiplier(1.0, 256 / 60000, 14040, DELTA).noise_multiplier)
    quoted(f(sigma, 5), "README.md", "docs/reference.md")
    quoted(f(sigma, 4), "examples/README.md")
    # docs/reference.md's PLD paragraph (60 epochs counted as 14,063 steps) and the composed pipeline
    rdp2, pld2 = (float(A.dpsgd_epsilon(256 / 60000, 1.1, 14063, DELTA)),
                  float(A.epsilon(A.dpsgd_event(256 / 60000, 1.1, 14063), DELTA, accountant="pld")))
    quoted(f"RDP {f(rdp2, 3)}, PLD {f(pld2, 3)}", "docs/reference.md")
    run = A.Composed((A.dpsgd_event(q=256 / 60000, noise_multiplier=1.1, num_steps=14040), A.Laplace(20.0)))
    quoted(f(float(A.epsilon(run, DELTA)), 4), "docs/reference.md")


def test_dpsgd_digits_figures():
    # README section 2, example 14, docs/training.md: 30 passes of expected batch 128 calibrated to 1.9
    steps = 30 * math.ceil(DIGITS_TRAIN / 128)
    nm = float(A.calibrate_noise_multiplier(1.9, 128 / DIGITS_TRAIN, steps, DELTA).noise_multiplier)
    quoted(f"noise multiplier {f(nm, 4)}: epsilon = 1.900", "README.md")
    quoted(f"noise multiplier {f(nm, 3)}", "docs/training.md")
    assert float(A.dpsgd_epsilon(128 / DIGITS_TRAIN, nm, steps, DELTA)) <= 1.9
    # jaxdp train --algorithm dpsgd defaults: batch 64, 10 passes, noise multiplier 1
    quoted(f"give ε = {f(float(A.dpsgd_epsilon(64 / DIGITS_TRAIN, 1.0, 10 * 23, DELTA)), 2)}", "docs/training.md")
    # README section 4, example 15, docs/reports.md: MLP, batch 128, C = 4, 10 passes
    eps = float(A.dpsgd_epsilon(128 / DIGITS_TRAIN, 1.0, 10 * math.ceil(DIGITS_TRAIN / 128), DELTA))
    quoted(f"epsilon = {f(eps, 2)} for every record", "README.md")
    quoted(f(eps, 2), "examples/README.md", "docs/reports.md")
    # jaxdp per-instance --help's example: softmax, batch 64, 5 passes
    quoted(f"epsilon = {f(float(A.dpsgd_epsilon(64 / DIGITS_TRAIN, 1.0, 5 * 23, DELTA)), 3)}", "docs/reports.md")


def test_main_job_figures():
    # jaxdp train defaults: softmax on digits, X = 1 (L = 2, beta = 1), C = L, eta = 1, nu = 1, b = 64, R = 30
    best, med, worst, comp, _ = _pnsgd(2.0, 1.0, 1.0, 1.0, 2.0, 64, 30.0, 10)
    text = f"{f(best, 2)} / {f(med, 2)} / {f(worst, 2)}"
    quoted(text, "README.md", "examples/README.md", "docs/accountants.md", "docs/reports.md")
    quoted(f(comp, 1), "README.md", "examples/README.md", "docs/accountants.md", "docs/reports.md")


def test_custom_model_figures():
    # README section 3, example 16: least squares, X = 1, |target| <= 1, R = 1: L = 2 + sqrt(2), beta = 2
    lip = (math.sqrt(2) + 1) * math.sqrt(2)
    best, med, worst, comp, _ = _pnsgd(lip, 2.0, 0.05, 2.0, lip, 64, 1.0, 20)
    quoted(f"{f(best, 2)} / {f(med, 2)} / {f(worst, 2)}", "README.md", "examples/README.md")
    quoted(f"every iterate released: {f(comp, 2)}", "README.md")
    quoted(f"against {f(comp, 1)} under composition", "examples/README.md")


def test_logistic_at_epsilon_below_one():
    # jaxdp train --model logistic --learning-rate 0.1 --noise-multiplier 6 --passes 20 --radius 10
    best, med, worst, comp, out = _pnsgd(math.sqrt(2), 0.5, 0.1, 6.0, math.sqrt(2), 64, 10.0, 20)
    assert worst <= 1
    quoted(f"{f(best, 2)} / {f(med, 2)} / {f(worst, 2)}", "docs/training.md", "examples/README.md")
    it = np.asarray(out.iteration)
    quoted(f"{f(it.min(), 2)} / {f(np.median(it), 2)} / {f(it.max(), 2)}", "docs/training.md")
    quoted(f(comp, 2), "docs/training.md")


def test_random_stop_figures():
    # --schedule random-stop at the digits defaults: 22 batches as the steps, L/b per step
    ev = A.PNSGD(lipschitz=2.0 / 64, smoothness=1.0, learning_rate=1.0, noise_std=1 / 16, diameter=60.0,
                 num_records=22, schedule="random_stop")
    quoted(f"{f(float(A.epsilon(ev, DELTA)), 2)} (best position", "docs/training.md")
    quoted(f"against {f(float(A.gaussian_mechanism_epsilon(DELTA, 1.0)), 2)}", "docs/training.md")


def test_audit_claims():
    # README section 5 and docs/reference.md's audit table (claimed epsilon column)
    gauss = float(A.gaussian_mechanism_epsilon(DELTA, 1.0))
    quoted(f"claimed {f(gauss, 3)}", "README.md")
    sampled = float(A.epsilon(A.dpsgd_event(0.5, 1.0, 4), DELTA, accountant="pld"))
    dpsgd = float(A.dpsgd_epsilon(0.5, 1.0, 4, DELTA))
    one_run = float(A.dpsgd_epsilon(1.0, 1.0, 1, DELTA))
    for v in (gauss, sampled, dpsgd, one_run):
        quoted(f"| {f(v, 3)} |", "docs/reference.md")


@pytest.mark.slow
def test_audit_pnsgd_claims():
    ev = A.PNSGD(lipschitz=1.0, smoothness=2.0, learning_rate=0.5, noise_std=1.0, diameter=2.0, num_records=6)
    eps = np.asarray(A.pnsgd_record_epsilon(ev, DELTA))
    for p in (1, 3, 6):
        quoted(f"| {f(eps[p - 1], 3)} |", "docs/reference.md")


def test_shifted_interpolation_table():
    # docs/reference.md: "before" is the best of the other analyses, "after" the best-of with shifted GDP
    def before_after(**kw):
        o = A.pnsgd_privacy(A.PNSGD(**kw), DELTA)
        others = np.min(np.stack([np.asarray(getattr(o, k)) for k in
                                  ("contraction", "iteration", "strongly_convex", "composition")]), 0)
        return others, np.asarray(o.best)

    default = dict(lipschitz=2.0, smoothness=1.0, learning_rate=1.0, noise_std=1 / 16, diameter=2.0,
                   num_records=1408, batch_size=64)
    b, a = before_after(**default, passes=100)
    quoted(f"| worst | {f(b.max(), 3)} | {f(a.max(), 3)} |", "docs/reference.md")
    b, a = before_after(**default, passes=400)
    quoted(f"| {f(b.max(), 3)} / {f(b.min(), 3)} | {f(a.max(), 3)} / {f(a.min(), 3)} |", "docs/reference.md")
    sc = dict(lipschitz=1.0, smoothness=1.0, learning_rate=0.5, noise_std=1.0, diameter=2.0, num_records=1000,
              strong_convexity=0.1)
    b, a = before_after(**sc)
    quoted(f"| 990 | {f(b[989], 4)} (strongly convex analysis) | {f(a[989], 4)} (shifted GDP) |", "docs/reference.md")
    b, a = before_after(**sc, passes=5)
    quoted(f"| 990 | {f(b[989], 4)} (iteration) | {f(a[989], 4)} |", "docs/reference.md")


def test_pld_table():
    # docs/pld.md's accuracy table: jaxdp's PLD and RDP columns (dp_accounting's is the peer's figure)
    for q, sigma, steps, pld_digits, rdp_digits in ((256 / 60000, 1.1, 14063, 3, 4), (0.001, 0.8, 1000, 4, 3),
                                                   (0.1, 2.0, 100, 5, None)):
        pld = float(A.epsilon(A.dpsgd_event(q, sigma, steps), DELTA, accountant="pld"))
        quoted(f"| {f(pld, pld_digits)} (", "docs/pld.md")
        if rdp_digits:
            quoted(f"| {f(float(A.dpsgd_epsilon(q, sigma, steps, DELTA)), rdp_digits)} |", "docs/pld.md")


def test_per_instance_order_inflation_example():
    # docs/per_instance.md: Theorem 3.3 against classical composition at q = 0.01, sigma = 1, alpha = 8, r = 1
    classical = 1000 * float(A.sampled_gaussian_rdp([8.0], 0.01, 1.0)[0])
    quoted(f"composition gives {f(classical, 3)}", "docs/per_instance.md")
    r = np.ones((1, 1000))
    ceil = A.per_instance_dpsgd_privacy([8.0], 0.01, 1.0, r, DELTA, order_rounding="ceil")
    levels = A.per_instance_dpsgd_privacy([8.0], 0.01, 1.0, r, DELTA)
    quoted(f"RDP of {f(float(np.asarray(ceil.rdp)[0, 0]), 1)} with the", "docs/per_instance.md")
    quoted(f"{f(float(np.asarray(levels.rdp)[0, 0]), 1)} with the default levels", "docs/per_instance.md")


def test_gaussian_calibration_table():
    # docs/classic_mechanisms.md: the analytic calibration against the tail bounds
    rows = {(1.0, 1e-5): "| (1, 1e-5) |", (0.5, 1e-5): "| (0.5, 1e-5) |", (0.1, 1e-6): "| (0.1, 1e-6) |"}
    ratios = []
    for (eps, delta), head in rows.items():
        cells = [float(A.calibrate_gaussian_noise_multiplier(eps, delta, method=m))
                 for m in ("analytic", "6.91", "6.81", "6.84")]
        line = head + " " + " | ".join(f(c, 4) for c in cells) + " |"
        if eps < 1:
            dr = float(A.calibrate_gaussian_noise_multiplier(eps, delta, method="dwork_roth"))
            line += f" {f(dr, 4)} |"
            cells.append(dr)
        quoted(line, "docs/classic_mechanisms.md")
        ratios += [c / cells[0] for c in cells[1:]]
    quoted(f"That is {round(100 * (min(ratios) - 1))}–{round(100 * (max(ratios) - 1))} % more noise",
           "docs/classic_mechanisms.md")


def _example(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), ROOT / "examples" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_contraction_crossovers_of_example_03():
    import jax

    ex = _example("03_contraction_figures.py")
    with jax.enable_x64(True):
        got = {i: ex.crossover(ex.FIG3, i) for i in (20, 30)}
    for i, x in got.items():
        quoted(f"{x:.5f}", "examples/README.md", "examples/03_contraction_figures.py")


def test_dpsbcd_example_17_figures():
    """docs/dpsbcd.md's ε column: the worst position's ε of the decreasing schedule D, per K."""
    from jaxdp.data import load_digits

    ex = _example("17_dpsbcd.py")
    schedule = lambda k: ex.O_END + ex.O_SLOPE * np.arange(k - 1, -1, -1)  # noqa: E731
    synthetic = ex._epsilon_fn(3, 4800, 960)  # (20, 64, 64, 5): 3 layers; 4,800 training records, 5 batches
    for k in (10, 30, 50):
        quoted(f"| 6000×20, 5 classes | {k} | {f(synthetic(schedule(k)), 3)} |", "docs/dpsbcd.md")
    n = len(load_digits().x_train)
    digits = ex._epsilon_fn(2, (n // 288) * 288, 288)  # (64, 64, 10): 2 layers; batches of 288
    for k in (20, 60):
        quoted(f"| digits | {k} | {f(digits(schedule(k)), 3)} |", "docs/dpsbcd.md")


def test_tradeoff_figures():
    # docs/reference.md, "Trade-off curves": the Gaussian mechanism σ = 1 at FPR 0.05
    ev = A.Gaussian(1.0)
    vals = [float(A.tradeoff(ev, 0.05, **kw)) for kw in (dict(accountant="gdp"), dict(accountant="pld"),
                                                          dict(accountant="pld", estimate="lower"), {})]
    quoted("exact {}; PLD upper {}, lower {}; RDP {}".format(*(f(v, 5) for v in vals)), "docs/reference.md")


def test_shuffle_lower_bound_figures():
    """docs/batch_schemes.md and examples/README.md: the shuffling lower bound against Poisson's ε
    (T = 1000, δ = 1e-6, one pass; σ from examples/23's grid)."""
    import jax

    sig = np.geomspace(0.3, 3.0, 16)[[4, 8]]  # 0.5544 and 1.0244
    with jax.enable_x64(True):
        lower = np.asarray(A.shuffled_lower_epsilon(sig, 1000, 1, 1e-6))
        poisson = np.asarray(A.epsilon(A.dpsgd_event(1e-3, sig, 1000), 1e-6, accountant="pld"))
    quoted(f"σ = {f(sig[0], 2)} gives\n  at least {f(lower[0], 1)} against Poisson's {f(poisson[0], 2)}, and "
           f"σ = {f(sig[1], 2)} gives at least {f(lower[1], 2)} against {f(poisson[1], 2)}.", "docs/batch_schemes.md")
