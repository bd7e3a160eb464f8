"""``jaxdp per-instance``: per-point ε of a DP-SGD run, after the guarantee of its release.

Thin layer over :func:`jaxdp.training.clipped_norms_at_checkpoints` and
:func:`jaxdp.training.per_point_privacy`: reads the checkpoints of a
``jaxdp train --algorithm dpsgd --checkpoint-dir DIR`` run, rebuilds its model (softmax,
logistic or MLP with ReLU, as ``jaxdp train`` builds them), measures every training
record's clipped gradient norm on each checkpointed model, and prints the data-independent
ε first (the release's guarantee), then the per-point estimate's median, quartiles and the
share of records below the guarantee. Writes a CSV of per-point ε and a histogram.
"""

from __future__ import annotations

import json
import os
import sys

from ._common import data_error, error, fmt, integer, option_message, report_disk_full


class _Usage(ValueError):
    pass


def add_parser(sub) -> None:
    p = sub.add_parser(
        "per-instance",
        help="per-point epsilon of a DP-SGD run from its checkpoints (estimates, after the guarantee)",
        description=(
            "Per-instance privacy of a DP-SGD run saved by 'jaxdp train --algorithm dpsgd --checkpoint-dir DIR'. "
            "Prints the data-independent epsilon first (the guarantee of the released model, the same for every "
            "record), then per-point values: Thudi et al. 2024 Theorem 3.3 with each step's clipped norm taken "
            "from the nearest checkpoint (an ESTIMATE), and each record's realised individual Renyi ledger "
            "(Feldman and Zrnic 2021; informational: plain DP-SGD enforced no filter). Per-point values are not "
            "a release guarantee and depend on the data."
        ),
        epilog=("Example: jaxdp train --algorithm dpsgd --checkpoint-dir run1 --passes 5 && "
                "jaxdp per-instance --checkpoint-dir run1"),
    )
    p.add_argument("--checkpoint-dir", required=True, help="folder of a DP-SGD run's checkpoints")
    p.add_argument("--data", default="digits",
                   help="the run's training data: 'digits' (bundled, default) or an MNIST-format .npz file or IDX "
                        "folder (never downloaded)")
    p.add_argument("--delta", type=float, default=None, help="target delta (default: the run's)")
    p.add_argument("--out", default="jaxdp_per_point.csv", metavar="FILE",
                   help="CSV of per-point epsilon (default jaxdp_per_point.csv; 'none' to skip)")
    p.add_argument("--histogram", default="jaxdp_per_point.png", metavar="FILE",
                   help="histogram of per-point epsilon with the guarantee marked (default jaxdp_per_point.png; "
                        "'none' to skip)")
    p.add_argument("--chunk-size", type=integer("--chunk-size", 1), default=1024,
                   help="records per compiled gradient-norm call: sets the memory (default 1024)")
    p.add_argument("--r-grid", type=int, default=None, metavar="M",
                   help="round each clipped-norm ratio r up to a multiple of 1/M (a power of two, e.g. 16384) for "
                        "the Theorem 3.3 estimate: a table lookup, ~10x faster on large data sets, never below the "
                        "exact estimate (default: exact)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def _path(value: str | None) -> str | None:
    return None if value is None or str(value).lower() == "none" else str(value)


def _check_writable(option: str, path: str | None) -> None:
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise _Usage(f"{option} cannot write {path!r}: its folder does not exist or is not writable")


def _load(text: str):
    from .. import data

    if text == "digits":
        return data.load_digits()
    try:
        return data.load_mnist(text)
    except (FileNotFoundError, ValueError) as err:  # one line naming --data and the file
        raise _Usage(str(data_error("--data", err))) from None


def _model(checkpoint_dir: str, ds, data: str = "digits"):
    """The model ``jaxdp train`` built for the run in ``checkpoint_dir``, and its data (``--data``)."""
    from flax import nnx

    from .. import models
    from ..training import Checkpointer

    if os.path.exists(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
        raise _Usage(f"--checkpoint-dir {checkpoint_dir!r} is a file, not a folder; expected the folder of a DP-SGD "
                     "run's checkpoints")
    ck = Checkpointer(checkpoint_dir)
    try:
        if ck.latest_step() is None:
            raise _Usage(f"--checkpoint-dir {checkpoint_dir!r} holds no checkpoint")
        meta = ck.metadata()
    finally:
        ck.close()
    config = meta.get("config") or {}
    if config.get("algorithm") != "dpsgd":
        raise _Usage(f"--checkpoint-dir {checkpoint_dir!r} does not hold a DP-SGD run (jaxdp train --algorithm dpsgd)")
    d, rngs, kind = ds.x_train.shape[1], nnx.Rngs(0), config.get("model")
    # The run's first weight matrix has one row per feature; its ledger counts the records.
    features = next((shape[0] for shape, _ in (meta.get("_arrays") or {}).values() if len(shape) == 2), None)
    records = (meta.get("ledger") or {}).get("records")
    if (features is not None and features != d) or (records is not None and records != len(ds.x_train)):
        raise _Usage(f"--data {data!r} is not the training data of the run in --checkpoint-dir: the run trained on "
                     f"{records} records of {features} features, --data gives {len(ds.x_train)} records of {d}")
    if kind == "SoftmaxRegression":
        return models.SoftmaxRegression(d, ds.num_classes, rngs=rngs), ds
    if kind == "LogisticRegression":  # jaxdp train's logistic model: odd vs even
        return models.LogisticRegression(d, rngs=rngs), ds._replace(y_train=(ds.y_train % 2).astype(ds.y_train.dtype))
    if kind == "MLP":
        shapes = [s for s, _ in (meta.get("_arrays") or {}).values()]
        widths, i = [d], 0
        while i + 1 < len(shapes) and len(shapes[i]) == 1 and shapes[i + 1] == [widths[-1], shapes[i][0]]:
            widths.append(shapes[i][0])  # nnx.State lists each layer's bias, then its kernel
            i += 2
        return models.MLP(widths, rngs=rngs), ds
    raise _Usage(f"--checkpoint-dir: the run's model {kind!r} is not one jaxdp train builds; use "
                 "jaxdp.training.clipped_norms_at_checkpoints from Python with the model")


def _histogram(path: str, res, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    est = np.asarray(res.estimate.epsilon)
    led = np.asarray(res.ledger.epsilon)
    finite = np.concatenate([est[np.isfinite(est)], led[np.isfinite(led)], [res.epsilon]])
    bins = np.linspace(0.0, max(float(finite.max()), 1e-12) * 1.02, 60)
    fig, ax = plt.subplots(figsize=(7.5, 4.2), constrained_layout=True)
    ax.hist(est, bins=bins, color="C0", alpha=0.75, label="Thudi et al. Thm 3.3 (estimate)")
    ax.hist(led, bins=bins, color="C1", histtype="step", lw=1.4, label="realised individual RDP ledger (informational)")
    ax.axvline(res.epsilon, color="C3", lw=2, label=f"data-independent epsilon = {res.epsilon:.3g} (the guarantee)")
    ax.set_xlabel(f"per-point epsilon at delta={res.delta:g}")
    ax.set_ylabel("records")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write_csv(path: str, res) -> None:
    import numpy as np

    table = np.column_stack([np.arange(len(res.estimate.epsilon)), np.asarray(res.estimate.epsilon),
                             np.asarray(res.ledger.epsilon), np.full(len(res.estimate.epsilon), res.epsilon)])
    np.savetxt(path, table, delimiter=",", fmt=["%d", "%.9g", "%.9g", "%.9g"], comments="",
               header="record,epsilon_estimate_thm33,epsilon_ledger_informational,epsilon_guarantee")


def _summary_line(label: str, summ: dict, n: int) -> str:
    return (f"{label}: median {fmt(summ['median'])}, quartiles {fmt(summ['quartile_1'])} / "
            f"{fmt(summ['quartile_3'])}; {100 * summ['share_below']:.1f} % of {n} records below the guarantee")


def run(args) -> int:
    """Run ``jaxdp per-instance`` for parsed ``args``; returns the exit status."""
    out, hist = _path(args.out), _path(args.histogram)
    try:
        _check_writable("--out", out)
        _check_writable("--histogram", hist)
        if args.chunk_size < 1:
            raise _Usage(f"--chunk-size must be a positive integer; got {args.chunk_size}")
        if args.r_grid is not None and (args.r_grid < 2 or args.r_grid & (args.r_grid - 1)):
            raise _Usage(f"--r-grid must be a power of two >= 2 (e.g. 16384); got {args.r_grid}")
        ds = _load(args.data)
        model, ds = _model(args.checkpoint_dir, ds, args.data)
        from ..training import clipped_norms_at_checkpoints, per_point_privacy

        norms = clipped_norms_at_checkpoints(model, ds, args.checkpoint_dir, chunk_size=args.chunk_size)
        res = per_point_privacy(norms, delta=args.delta, r_grid=args.r_grid)
    except _Usage as err:
        return error(str(err))
    except (ValueError, TypeError, FileNotFoundError) as err:
        status = report_disk_full(err)  # a full disk wrapped in another error: exit 1, not a usage error
        return error(option_message(str(err))) if status is None else status

    n = len(res.estimate.epsilon)
    est, led = res.summary(), res.summary(res.ledger.epsilon)
    ledger = norms.ledger
    payload = {
        "epsilon": res.epsilon, "delta": res.delta, "analysis": res.analysis, "reason": res.reason,
        "private": not ledger.fixed_noise_seed, "records": n, "num_steps": res.num_steps,
        "checkpoint_steps": [int(s) for s in res.checkpoint_steps],
        "estimate": {"analysis": res.estimate.analysis, "assumptions": list(res.estimate.assumptions), **est},
        "ledger": {"analysis": res.ledger.analysis, "assumptions": list(res.ledger.assumptions), **led},
        "out": out, "histogram": hist,
    }
    if args.json:
        print(json.dumps(payload, allow_nan=True))
    else:
        lines = []
        if ledger.fixed_noise_seed:
            lines.append("NOT PRIVATE: the run's noise came from a fixed seed; the epsilon below holds only while "
                         "that seed is secret")
        lines += [
            f"guarantee of the released model: epsilon = {fmt(res.epsilon)} at delta = {res.delta:g} for every "
            f"record (worst case), by {res.analysis}",
            f"  assumptions: {res.reason}",
            (f"per-point values ({n} records, norms at {len(res.checkpoint_steps)} checkpoints of {res.num_steps} "
             "steps); NOT a release guarantee, data-dependent:"),
            _summary_line("  Thudi et al. 2024 Thm 3.3 ESTIMATE", est, n),
        ]
        lines += [f"    - {a}" for a in res.estimate.assumptions]
        lines.append(_summary_line("  realised individual Renyi ledger (informational)", led, n))
        lines += [f"    - {a}" for a in res.ledger.assumptions]
        print("\n".join(lines))
    status = 0
    for option, path, write in (("--out", out, lambda p: _write_csv(p, res)),
                                ("--histogram", hist, lambda p: _histogram(
                                    p, res, f"per-point epsilon, DP-SGD, {n} records, {res.num_steps} steps"))):
        if path is None:
            continue
        try:
            write(path)
        except OSError as exc:
            if report_disk_full(exc if exc.filename else OSError(exc.errno, exc.strerror, path)) is None:
                print(f"jaxdp: error: {option} cannot write {path!r}: {exc.strerror or exc}", file=sys.stderr)
            status = 1
            continue
        if not args.json:
            print(f"wrote {path}")
    return status

