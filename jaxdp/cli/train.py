"""``jaxdp train``: PNSGD (or DP-SGD, or DP-SBCD) on a real data set, with ε per record position.

Thin layer over :func:`jaxdp.training.train`: loads the data (bundled digits by default,
or local MNIST / Fashion-MNIST files), builds the model, trains, and prints the test
accuracy and ε per record position under amplification by iteration (hidden iterates)
versus composition (every iterate released), then writes a plot of ε against position.

The defaults (softmax regression on digits, η = 1, ν = 1, b = 64, 10 passes, R = 30) were
tuned on the 2-core development machine: about 84 % test accuracy with ε best / median /
worst ≈ 2.8 / 2.9 / 5.3 per record at δ = 1e-5 (composition: 17.9), in ~15 s.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings

from ._common import check_out_dir, data_error, error, option_message, report_disk_full, seed

_MODELS = ("logistic", "softmax", "mlp")
_SBCD_HIDDEN = "dpsbcd hidden-state (Chen & Liu Thm 4.6, layers summed)"  # the report's name for it
_DATASETS = ("digits", "mnist", "fashion-mnist")
def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model with PNSGD and report epsilon per record position",
        description=(
            "Train with projected noisy SGD (only the final iterate released) and print the test accuracy and "
            "epsilon per record position under amplification by iteration versus composition. Convex models "
            "(logistic, softmax) clip at their Lipschitz bound, checked at run time; the MLP is not convex and "
            "gets the composition bound. Default: softmax regression on the bundled digits data."
        ),
        epilog=(
            "At epsilon <= 1 for every record (about 77% test accuracy on odd vs even digits): "
            "jaxdp train --model logistic --learning-rate 0.1 --noise-multiplier 6 --passes 20 --radius 10"
        ),
    )
    p.add_argument("--dataset", choices=_DATASETS, default="digits", help="data set (default: digits, bundled)")
    p.add_argument("--data-path", default=None, help="MNIST/Fashion-MNIST .npz file or IDX directory (never downloaded)")
    p.add_argument("--algorithm", choices=("pnsgd", "dpsgd", "dpsbcd"), default="pnsgd",
                   help="pnsgd (default: projected noisy SGD, per-record hidden-state epsilon for convex models), "
                        "dpsgd (Poisson-sampled DP-SGD for any model; --batch-size is the expected batch size and "
                        "--noise-multiplier is relative to C, as in Opacus) or dpsbcd (block coordinate descent of a "
                        "bias-free Lipschitz ReLU network, --model mlp; Chen & Liu 2024's hidden-state bound, which "
                        "sums the layers without proof; needs --noise-temperature and --contraction)")
    p.add_argument("--sampler", choices=("poisson", "truncated-poisson", "fixed-size", "balls-in-bins", "shuffle"),
                   default=None,
                   help="the batch scheme; the epsilon is always the scheme's. --algorithm dpsgd (default poisson): "
                        "truncated-poisson (needs --max-batch-size), fixed-size (without replacement, replace-one "
                        "neighbours), balls-in-bins or shuffle (no amplification certified: the report says so first). "
                        "--algorithm pnsgd (default: the fixed shuffled-once order): poisson or truncated-poisson, "
                        "secret Poisson batches with the hidden-state bound that stops growing after a burn-in "
                        "(needs eta*beta*B/b <= 2, B the --max-batch-size), or shuffle, a fresh secret permutation "
                        "every pass with the hidden-state bound that does not grow with the passes. --batch-size sets "
                        "the (expected) batch")
    p.add_argument("--max-batch-size", "--max-batch", type=int, default=None, metavar="B", dest="max_batch_size",
                   help="--sampler truncated-poisson: the cap on a batch (records beyond it are dropped)")
    p.add_argument("--selected", type=int, default=None, metavar="K",
                   help="--sampler balls-in-bins: each record in K uniformly random steps of each epoch (random "
                        "allocation, K of ceil(K*N/b) steps; default 1)")
    p.add_argument("--model", choices=_MODELS, default="softmax",
                   help="softmax (default), logistic (odd vs even digit) or mlp (one hidden layer of 128)")
    p.add_argument("--passes", type=int, default=None,
                   help="passes over the data in the same order (default 10; 1 with --schedule random-stop)")
    p.add_argument("--batch-size", type=int, default=64, help="records per step (default 64)")
    p.add_argument("--learning-rate", type=float, default=1.0,
                   help="learning rate eta; convex models need 0 < eta <= 2/(beta + rho) (default 1)")
    p.add_argument("--noise-multiplier", type=float, default=None,
                   help="noise std over the sensitivity of the noised gradient (default 1). pnsgd: relative to "
                        "the replace-one sensitivity 2C/b of the averaged clipped gradient (Opacus's multiplier for "
                        "the same noise is twice this); dpsgd: relative to the clip norm C on the clipped sum, as in "
                        "Opacus and dp_accounting; dpsbcd: not used (--noise-temperature)")
    p.add_argument("--target-epsilon", type=float, default=None, metavar="EPSILON",
                   help="pnsgd, dpsgd: instead of --noise-multiplier, the smallest noise multiplier whose reported "
                        "worst-record epsilon at --delta is at most EPSILON for this run (its q, steps, records used "
                        "and analysis)")
    p.add_argument("--radius", type=float, default=30.0, help="radius R of the parameter ball, D = 2R (default 30)")
    p.add_argument("--clip-norm", type=float, default=None,
                   help="clip norm C (default: the Lipschitz bound for convex models, 1 for the MLP)")
    p.add_argument("--delta", type=float, default=1e-5, help="target delta (default 1e-5)")
    p.add_argument("--noise-temperature", default=None, metavar="O[,O...]",
                   help="dpsbcd: noise temperature o > 0 of the weight steps N(0, 2*eta*o): one value for every pass "
                        "or one per pass, comma-separated (sets the number of passes)")
    p.add_argument("--contraction", type=float, default=None,
                   help="dpsbcd: Lipschitz constant L_F of every block's gradient map, as you state it (required: the "
                        "paper gives none; 1 for a convex beta-smooth block with eta <= 2/beta)")
    p.add_argument("--weight-decay", type=float, default=0.0,
                   help="dpsbcd: weight decay lambda of the proximal step (default 0)")
    p.add_argument("--max-spectral-norm", type=float, default=3.0,
                   help="dpsbcd: spectral-norm bound rho of every layer of the Lipschitz MLP (default 3)")
    p.add_argument("--order-seed", type=seed("--order-seed"), default=0,
                   help="public seed of the record order and the model's initialisation (default 0)")
    p.add_argument("--insecure-noise-seed", type=seed("--insecure-noise-seed"), default=None, metavar="N",
                   help="fix the seed of the noise and stopping time, for tests and reproductions only: the run is "
                        "then NOT private (by default that key comes from the OS entropy and is never shown)")
    p.add_argument("--schedule", choices=("fixed", "random-stop"), default="fixed",
                   help="fixed passes (default) or one pass stopped at a uniform random step")
    p.add_argument("--devices", type=int, default=None, metavar="K",
                   help="data parallelism over the first K devices (pnsgd and dpsgd; noise drawn once for the "
                        "global batch; default: one device)")
    p.add_argument("--checkpoint-dir", default=None, help="save atomic checkpoints here (every pass)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--plot", metavar="FILE", default="jaxdp_train.png",
                   help="write a plot of epsilon against position (default jaxdp_train.png; 'none' to skip)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--smoke", action="store_true", help="a seconds-long run (one pass) to check the set-up")
    p.set_defaults(func=run)


def _cli_message(msg: str) -> str:
    return (option_message(msg).replace("resume=True", "--resume").replace("checkpoint_dir", "--checkpoint-dir")
            .replace("schedule='random_stop'", "--schedule random-stop")
            .replace("devices must be an integer", "--devices must be an integer"))


def _load(args):
    from .. import data

    if args.dataset == "digits":
        if args.data_path is not None:
            raise _Usage("--data-path is only used with --dataset mnist or fashion-mnist")
        return data.load_digits()
    if args.data_path is None:
        raise _Usage(f"--data-path is required with --dataset {args.dataset} (a .npz file or a directory of IDX "
                     "files; jaxdp never downloads data)")
    loader = data.load_mnist if args.dataset == "mnist" else data.load_fashion_mnist
    try:
        return loader(args.data_path)
    except (FileNotFoundError, ValueError) as err:  # one line naming --data-path and the file
        raise _Usage(str(data_error("--data-path", err))) from None


_NOT_PRIVATE = ("NOT PRIVATE (--insecure-noise-seed): anyone who knows that seed can regenerate the noise and "
                "remove it; the epsilon below holds only while the seed is secret")


class _Usage(ValueError):
    pass


def _model(args, ds):
    from flax import nnx

    from .. import models

    d = ds.x_train.shape[1]
    rngs = nnx.Rngs(args.order_seed)
    if args.algorithm == "dpsbcd":
        if args.model != "mlp":
            raise _Usage("--algorithm dpsbcd trains a bias-free Lipschitz ReLU network: pass --model mlp")
        return models.LipschitzMLP((d, 128, ds.num_classes), rngs=rngs,
                                   max_spectral_norm=args.max_spectral_norm), ds
    if args.model == "softmax":
        return models.SoftmaxRegression(d, ds.num_classes, rngs=rngs), ds
    if args.model == "logistic":
        binary = ds._replace(y_train=(ds.y_train % 2).astype(ds.y_train.dtype),
                             y_test=(ds.y_test % 2).astype(ds.y_test.dtype), num_classes=2,
                             name=ds.name + " (odd vs even)")
        return models.LogisticRegression(d, rngs=rngs), binary
    return models.MLP((d, 128, ds.num_classes), rngs=rngs), ds


def _plot(path: str, report, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.5, 4.2), constrained_layout=True)
    pos = report.positions
    comp = report.composition
    cap = 10 * max(float(np.max(comp)), 1e-12)
    styles = {"best": ("C0", 2.2, "best (reported)"), "iteration": ("C1", 1.4, "amplification by iteration"),
              "contraction": ("C2", 1.2, "contraction coefficients"),
              "random-stop (Thm 5)": ("C1", 1.2, "random stopping (Asoodeh Thm 5)"),
              "random-stop (Thm 26)": ("C2", 1.2, "random stopping (Feldman Thm 26)"),
              "strongly_convex": ("C4", 1.0, "strongly convex"), "composition": ("C3", 1.6, "composition"),
              _SBCD_HIDDEN: ("C0", 2.2, "DP-SBCD hidden state (reported; layers summed without proof)")}
    for name, values in report.by_analysis.items():
        v = np.asarray(values)
        if not np.any(np.isfinite(v) & (v <= cap)):
            continue  # vacuous here (e.g. contraction over several passes)
        color, lw, label = styles.get(name, ("k", 1.0, name))
        if report.analysis == "composition" and name == "composition":
            label = "composition (reported)"
        ax.plot(pos, np.where(v <= cap, v, np.nan), color=color, lw=lw, label=label,
                ls="-" if name in ("best", "composition", _SBCD_HIDDEN) else "--",
                zorder=1 if name in ("best", _SBCD_HIDDEN) else 2)
    ax.set_xlabel("record position in the (shuffled-once) order")
    ax.set_ylabel(f"epsilon at delta={report.delta:g}")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    """Run ``jaxdp train`` for parsed ``args``; returns the exit status (2 for bad arguments)."""
    if args.resume and args.checkpoint_dir is None:
        return error("--resume needs --checkpoint-dir")
    if args.devices is not None and args.devices < 1:
        return error(f"--devices must be an integer >= 1; got {args.devices}")
    if args.devices is not None and args.algorithm == "dpsbcd":
        return error("--devices is not supported with --algorithm dpsbcd (its block updates run on one device)")
    if args.passes is None:
        passes = 1 if (args.smoke or args.schedule == "random-stop") else 10
    else:
        passes = 1 if args.smoke else args.passes
    try:
        if str(args.plot).lower() != "none":
            _check_writable(args.plot)
        if args.checkpoint_dir is not None:  # a file, or a read-only folder, fails now, not after a pass
            check_out_dir(args.checkpoint_dir, "--checkpoint-dir")
        _sampler(args)  # argument errors before any work
        sbcd = {}
        if args.algorithm == "dpsbcd":
            sbcd, passes = _dpsbcd_options(args, passes)
        ds = _load(args)
        model, ds = _model(args, ds)
        noise = _noise(args)
        clip = args.clip_norm
        if clip is None and (args.model == "mlp" or args.algorithm != "pnsgd"):
            clip = 1.0
        from ..training import DPSBCDMechanism, DPSGDMechanism, PNSGDMechanism, RunOptions, train

        common = dict(learning_rate=args.learning_rate, batch_size=args.batch_size, clip_norm=clip)
        if args.algorithm == "dpsbcd":
            mechanism = DPSBCDMechanism(**common, **sbcd)
        elif args.algorithm == "dpsgd":
            mechanism = DPSGDMechanism(**common, **noise, passes=passes, sampler=_sampler(args))
        else:
            mechanism = PNSGDMechanism(**common, **noise, passes=passes, radius=args.radius,
                                       schedule=args.schedule.replace("-", "_"), **_pnsgd_sampling(args))
        options = RunOptions(checkpoint_dir=args.checkpoint_dir, resume=args.resume, devices=args.devices,
                             progress=not args.json and sys.stderr.isatty())
        start = time.perf_counter()
        with warnings.catch_warnings():  # the command prints its own NOT PRIVATE line
            warnings.filterwarnings("ignore", message="noise_seed is fixed", category=UserWarning)
            # Other warnings (e.g. a skipped damaged checkpoint) as one line each, no source line.
            warnings.showwarning = lambda message, *_a, **_k: print(f"jaxdp: warning: {message}", file=sys.stderr)
            res = train(model, ds, mechanism, delta=args.delta, order_seed=args.order_seed,
                        noise_seed=args.insecure_noise_seed, options=options)
        total = time.perf_counter() - start
    except (ValueError, TypeError) as err:
        status = report_disk_full(err)  # orbax may wrap a full disk in another error
        return status if status is not None else error(_cli_message(str(err)))
    except FloatingPointError as err:  # TrainingDivergedError: a broken model gets no report
        return error(_cli_message(str(err)), status=1)

    rep, led = res.privacy, res.ledger
    worst = rep.summary()["worst"]
    plot = None if str(args.plot).lower() == "none" else args.plot
    payload = {
        # The guarantee of the release first, for every mechanism (then whether the noise was secret).
        "epsilon_worst": worst, "delta": rep.delta, "private": not led.fixed_noise_seed, "analysis": rep.analysis,
        "reason": rep.reason, "dataset": ds.name, "model": args.model, "algorithm": args.algorithm,
        "test_accuracy": res.test_accuracy, "epsilon": rep.summary(), "ledger": led.public(),
        "train_seconds": res.seconds, "total_seconds": total,
    }
    if args.algorithm == "dpsgd":
        payload["sampler"] = args.sampler or "poisson"
        if args.selected is not None:
            payload["selected"] = args.selected
    if args.algorithm == "dpsgd" or rep.note:
        payload["note"] = rep.note
    if args.algorithm == "dpsgd":
        plot = None  # epsilon is the same for every record: nothing to plot
        lines = _dpsgd_lines(ds, args, res, rep, led, total)
    elif args.algorithm == "dpsbcd":
        payload["by_analysis"] = {name: rep.summary(v) for name, v in rep.by_analysis.items()}
        lines = _dpsbcd_lines(ds, res, rep, led, total)
    else:
        payload["by_analysis"] = {name: rep.summary(v) for name, v in rep.by_analysis.items()}
        payload["amplified"] = rep.summary(rep.amplified) if rep.amplified is not None else None
        payload["composition"] = rep.summary(rep.composition)
        lines = _pnsgd_lines(ds, args, res, rep, led, total)
    payload["plot"] = plot
    if args.checkpoint_dir is not None:
        signed = bool(os.environ.get("JAXDP_CHECKPOINT_KEY"))
        payload["checkpoints_authenticated"] = signed
        lines.append(f"checkpoints in {args.checkpoint_dir}: " + (
            "signed with $JAXDP_CHECKPOINT_KEY (HMAC-SHA-256)" if signed else
            "unauthenticated (set JAXDP_CHECKPOINT_KEY to sign them, so that an edited checkpoint is refused)"))
    title = (f"PNSGD, {args.model} on {ds.name}: {led.passes} pass(es), b={led.batch_size}, "
             f"eta={led.learning_rate:g}, nu={led.noise_multiplier:g}; accuracy {res.test_accuracy:.3f}"
             if args.algorithm == "pnsgd" else
             f"DP-SBCD, Lipschitz MLP on {ds.name}: {led.passes} pass(es), b={led.batch_size}, "
             f"eta={led.learning_rate:g}; accuracy {res.test_accuracy:.3f}")
    if args.json:
        print(json.dumps(payload, allow_nan=True))
        return _write_plot(plot, rep, title)
    head = [_NOT_PRIVATE] if led.fixed_noise_seed else []
    if getattr(rep, "note", None):  # a batch scheme without certified amplification says so before any epsilon
        head.append(rep.note)
    head.append(f"guarantee of the released model: epsilon = {_f(worst)} at delta = {rep.delta:g} for every record "
                f"(worst case), by {rep.analysis}")
    print("\n".join(head + lines))  # the results first: a failed plot must not lose them
    status = _write_plot(plot, rep, title)
    if plot and status == 0:
        print(f"wrote {plot}")
    return status


def _pnsgd_sampling(args) -> dict:
    """PNSGD's ``sampling`` and ``max_batch_size`` from --sampler (none: the fixed order)."""
    if args.sampler is None:
        return {}
    if args.sampler == "shuffle":
        return {"sampling": "shuffle"}
    return {"sampling": "poisson", "max_batch_size": args.max_batch_size}


def _sampler(args):
    """DP-SGD's sampler from --sampler and --max-batch (None: Poisson, as without the option)."""
    pnsgd_ok = ("poisson", "truncated-poisson", "shuffle")
    if args.sampler is not None and args.algorithm != "dpsgd" and not (args.algorithm == "pnsgd"
                                                                         and args.sampler in pnsgd_ok):
        raise _Usage(f"--sampler {args.sampler} needs --algorithm dpsgd"
                     + (" or pnsgd" if args.sampler in pnsgd_ok else ""))
    if (args.max_batch_size is not None) != (args.sampler == "truncated-poisson"):
        raise _Usage("--sampler truncated-poisson needs --max-batch-size, and --max-batch-size needs --sampler "
                     "truncated-poisson")
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise _Usage(f"--max-batch-size must be an integer >= 1; got {args.max_batch_size}")
    if args.selected is not None and args.sampler != "balls-in-bins":
        raise _Usage("--selected needs --sampler balls-in-bins")
    if args.selected is not None and args.selected < 1:
        raise _Usage(f"--selected must be an integer >= 1; got {args.selected}")
    if args.sampler in (None, "poisson") or args.algorithm != "dpsgd":
        return None
    from ..training import samplers

    kwargs = {"max_batch_size": args.max_batch_size} if args.max_batch_size else {}
    if args.selected is not None:
        kwargs["selected"] = args.selected
    return samplers.by_name(args.sampler, **kwargs)


def _noise(args) -> dict:
    """The mechanism's noise: --noise-multiplier (default 1), or --target-epsilon (calibrated by the mechanism)."""
    if args.target_epsilon is None:
        return {"noise_multiplier": 1.0 if args.noise_multiplier is None else args.noise_multiplier}
    if args.algorithm == "dpsbcd":
        raise _Usage("--target-epsilon is not supported with --algorithm dpsbcd: give --noise-temperature")
    if args.noise_multiplier is not None:
        raise _Usage("give --noise-multiplier or --target-epsilon, not both")
    if not args.target_epsilon > 0 or math.isinf(args.target_epsilon):
        raise _Usage(f"--target-epsilon must be a positive number; got {args.target_epsilon}")
    return {"target_epsilon": args.target_epsilon}


def _f(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


def _dpsbcd_options(args, passes):
    """``train``'s DP-SBCD arguments from the options, and the number of passes."""
    if args.noise_temperature is None:
        raise _Usage("--noise-temperature is required with --algorithm dpsbcd (no default: the bound depends on it)")
    if args.contraction is None:
        raise _Usage("--contraction is required with --algorithm dpsbcd (L_F of the block gradient maps: the paper "
                     "states none, so there is no default)")
    if args.schedule != "fixed":
        raise _Usage("--schedule is not used with --algorithm dpsbcd (its passes are fixed)")
    try:
        temps = [float(v) for v in args.noise_temperature.split(",")]
    except ValueError:
        raise _Usage(f"--noise-temperature must be a number or comma-separated numbers; got "
                     f"{args.noise_temperature!r}") from None
    if len(temps) == 1:
        temps = temps * passes
    elif args.smoke:
        temps = temps[:1]
    elif args.passes is not None and args.passes != len(temps):
        raise _Usage(f"--passes ({args.passes}) must match the {len(temps)} values of --noise-temperature")
    return dict(noise_temperature=temps, contraction=args.contraction, weight_decay=args.weight_decay), len(temps)


def _dpsbcd_lines(ds, res, rep, led, total) -> list[str]:
    return [
        f"  assumptions: {rep.reason}",
        (f"DP-SBCD on {ds.name} ({len(ds.x_train)} train / {len(ds.x_test)} test), Lipschitz MLP, {led.passes} "
         f"pass(es) of {led.steps_per_pass} batches of {led.batch_size}"
         + (f" ({led.unused} records unused)" if led.unused else "")),
        (f"  eta={led.learning_rate:g}, noise temperature={led.noise_temperature}, C={led.clip_norm:.4g}, "
         f"weight decay={led.weight_decay:g}, L_F={led.contraction[0]:g}, delta={led.delta:g}, "
         f"order seed={led.order_seed}"),
        f"test accuracy: {100 * res.test_accuracy:.1f} %   (training {res.seconds:.1f} s, total {total:.1f} s)",
        "",
        rep.table(),
    ]


def _dpsgd_lines(ds, args, res, rep, led, total) -> list[str]:
    return [
        f"  assumptions: {rep.reason}",
        (f"DP-SGD on {ds.name} ({len(ds.x_train)} train / {len(ds.x_test)} test), {args.model} model, {led.passes} "
         f"pass(es) = {led.total_steps} steps of expected batch {led.batch_size} (q = {led.q:.4g}), "
         f"{args.sampler or 'poisson'} batches"),
        (f"  learning rate={led.learning_rate}, noise multiplier={led.noise_multiplier:g} (relative to C, as in "
         f"Opacus), C={led.clip_norm:.4g}, delta={led.delta:g}"),
        f"test accuracy: {100 * res.test_accuracy:.1f} %   (training {res.seconds:.1f} s, total {total:.1f} s)",
    ]


def _pnsgd_lines(ds, args, res, rep, led, total) -> list[str]:
    amp = rep.summary(rep.amplified) if rep.amplified is not None else None
    comp = rep.summary(rep.composition)
    runs = ("one pass stopped at a secret uniform step" if led.schedule == "random_stop"
            else f"{led.passes} pass(es) of {led.steps_per_pass} batches of {led.batch_size}")
    if getattr(led, "sampling", "sequential") == "shuffle":
        runs = (f"{led.passes} pass(es) of {led.steps_per_pass} batches of {led.batch_size}, reshuffled (secret) "
                "every pass")
    if getattr(led, "sampling", "sequential") == "poisson":
        runs = (f"{led.total_steps} steps of secret Poisson batches (q = {led.q:.4g}, expected {led.batch_size}"
                + (f", cut to {led.max_batch_size}" if led.max_batch_size else "") + ")")
    lines = [
        f"  assumptions: {rep.reason}",
        (f"PNSGD on {ds.name} ({len(ds.x_train)} train / {len(ds.x_test)} test), {args.model} model, {runs}"
         + (f" ({led.unused} records unused)" if led.unused else "")),
        (f"  eta={led.learning_rate:g}, noise multiplier={led.noise_multiplier:g} (sigma={led.noise_std:.4g} on the "
         f"averaged gradient), C={led.clip_norm:.4g}, R={led.diameter / 2:g}, delta={led.delta:g}, "
         f"order seed={led.order_seed}"),
        f"test accuracy: {100 * res.test_accuracy:.1f} %   (training {res.seconds:.1f} s, total {total:.1f} s)",
        f"epsilon per record position (best / median / worst over {rep.positions.size} positions):",
    ]
    if amp is not None:
        label = "random stopping" if led.schedule == "random_stop" else "amplified, best analysis"
        lines.append(f"  {label + ' (hidden iterates):':<44} {_f(amp['best'])} / {_f(amp['median'])} / "
                     f"{_f(amp['worst'])}")
    else:
        lines.append(f"  {'amplification by iteration:':<44} not valid here (see the assumptions)")
    lines.append(f"  {'composition (every iterate released):':<44} {_f(comp['best'])} / {_f(comp['median'])} / "
                 f"{_f(comp['worst'])}")
    lines.append("")
    lines.append(rep.table())
    return lines


def _write_plot(plot, rep, title) -> int:
    if not plot:
        return 0
    try:
        _plot(plot, rep, title)
    except OSError as exc:
        print(f"jaxdp: error: --plot cannot write {plot!r}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # any plotting failure, after the results were printed
        first = str(exc).splitlines()[0] if str(exc) else ""
        print(f"jaxdp: error: --plot could not write {plot!r} ({type(exc).__name__}: {first})", file=sys.stderr)
        return 1
    return 0


def _check_writable(path: str) -> None:
    """Refuse an output file that cannot be written, before the training starts."""
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise _Usage(f"--plot cannot write {path!r}: its folder does not exist or is not writable")
    if os.path.isdir(path) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise _Usage(f"--plot cannot write {path!r}: it is a folder or a file that is not writable")
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext:
        from matplotlib.backend_bases import FigureCanvasBase

        kinds = FigureCanvasBase.get_supported_filetypes()
        if ext not in kinds:
            raise _Usage(f"--plot cannot write {path!r}: unknown image type .{ext} (use one of "
                         f"{', '.join(sorted(kinds))})")
