"""One name per quantity: every public signature uses the glossary's names.

The test walks every public function and class of the library and fails if a parameter
name is not in the glossary below (add a new quantity there AND in docs/reference.md's table)
or is a known second name for a quantity that already has one.
"""

import importlib
import inspect

import pytest

MODULES = ("jaxdp.accounting", "jaxdp.training", "jaxdp.models", "jaxdp.data", "jaxdp.interop", "jaxdp.audit",
           "jaxdp.grids")

# The glossary (docs/reference.md, section "Names and units"), as parameter names.
GLOSSARY = {
    # privacy quantities
    "epsilon", "delta", "orders", "rdp", "q", "noise_multiplier", "noise_std", "scale", "sensitivity",
    "relation", "num_steps", "num_records", "positions", "batch_size", "passes", "count", "method",
    "target_epsilon", "target_delta", "delta_prime", "coefficient", "form", "schedule", "contraction",
    # losses and optimisation
    "learning_rate", "lipschitz", "smoothness", "strong_convexity", "diameter", "radius", "clip_norm",
    "interval_length", "convex", "loss_fn", "label_bound",
    # divergences of two shifted distributions: r = shift / noise std (Gaussian), shift (Laplace)
    "r", "shift", "analysis", "strongly_convex_form",
    # solvers and composition
    "total_delta", "max_num_steps", "solver_iterations", "noise_multiplier_bounds",
    # per-instance accounting
    "budget", "consumed", "halted", "halt_step", "checkpoint_steps", "runs", "order_rounding", "order_levels",
    "chunk_size", "assumptions", "r_grid",
    # DP-SBCD and Lipschitz networks
    "noise_temperature", "prox_lipschitz", "batch_index", "max_spectral_norm", "power_iterations", "penalty",
    "weight_decay",
    # DP-SGD
    "optimizer", "algorithm", "capacity", "overflow", "mask", "micro_batch_size",
    # truncated Poisson sampling (the cap on a batch; records beyond it are dropped)
    "max_batch_size",
    # balls-in-bins / random allocation: steps of one pass, steps per record (k of t); which direction of the divergence
    "steps_per_pass", "selected", "direction",
    # dp_accounting parity events: randomized response, zCDP, tree aggregation
    "noise_parameter", "num_buckets", "rho", "xi", "step_counts",
    # PNSGD with Poisson batches: how batches are drawn, fractions of the noise variance spent on the shift
    "sampling", "splits",
    # randomness: the public order and the secret noise key
    "key", "order_seed", "noise_seed", "seed", "checkpoint_key",
    # PLD accounting: static grid options
    "grid_size", "tail_bound", "estimate", "fallback", "stages",
    # trade-off curves: false-positive rates and the ε grid of the PLD profile
    "fpr", "epsilons",
    # empirical auditing (jaxdp.audit)
    "scores_in", "scores_out", "scores", "included", "confidence", "thresholds", "successes", "trials",
    "num_canaries", "num_guesses", "num_correct", "attack", "canary_steps",
}

# Names that would be a second name for a glossary quantity.
SECOND_NAMES = {
    "sigma": "noise_multiplier (or noise_std for an absolute scale)",
    "lr": "learning_rate", "eta": "learning_rate", "step_size": "learning_rate",
    "steps": "num_steps (noisy steps) or num_records (records)",
    "position": "positions", "n": "num_records", "iterations": "num_steps",
    "noise_scale": "noise_std or scale", "stddev": "noise_std", "std": "noise_std",
    "eps": "epsilon", "target_eps": "target_epsilon", "sampling_rate": "q", "sample_rate": "q",
    "epochs": "passes", "l2_norm_clip": "clip_norm", "max_grad_norm": "clip_norm",
    "alpha": "orders", "alphas": "orders",
}


def _public_callables():
    for modname in MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        for name in getattr(mod, "__all__", []):
            obj = getattr(mod, name)
            if inspect.isclass(obj):
                if issubclass(obj, tuple):  # NamedTuple results: fields are read, not passed
                    continue
                target = obj.__init__
            elif callable(obj):
                target = obj
            else:
                continue
            try:
                sig = inspect.signature(target)
            except (TypeError, ValueError):
                continue
            yield f"{modname}.{name}", sig


def test_second_names_are_absent():
    bad = []
    for qual, sig in _public_callables():
        for p in sig.parameters:
            if p in SECOND_NAMES:
                bad.append(f"{qual}({p}=...): use {SECOND_NAMES[p]}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("modname", MODULES)
def test_every_quantity_is_in_the_glossary(modname):
    unknown = {}
    for qual, sig in _public_callables():
        if not qual.startswith(modname + "."):
            continue
        for p, par in sig.parameters.items():
            if p in ("self", "args", "kwargs") or par.kind in (par.VAR_POSITIONAL, par.VAR_KEYWORD):
                continue
            if p not in GLOSSARY and p not in _LOCAL_NAMES:
                unknown.setdefault(p, []).append(qual)
    assert not unknown, f"parameter names missing from the glossary: {unknown}"


# Names that are not quantities (objects passed through, options of one function).
_LOCAL_NAMES = {
    "model", "data", "fn", "x", "y", "value", "event", "events", "accountant", "dp_event", "state", "ledger",
    "params", "grads", "updates", "loss", "path", "name", "rngs", "progress", "account", "callback",
    "return_intermediates", "return_scores", "return_burn_in", "steps_per_call", "checkpoint_dir", "checkpoint_every", "resume",
    "use_fast_path", "drop_remainder", "test_fraction", "in_features", "out_features", "features",
    "num_classes", "feature_norm_bound", "directory", "step", "arrays", "metadata", "max_to_keep",
    "hidden", "p", "batch", "normalize", "dtype", "param_dtype", "activation", "axis", "layer_sizes",
    "iterations_limit", "lower", "upper", "bracket", "tolerance", "x_test", "y_test", "order",
    "digits", "kind", "inputs", "labels", "example_axis", "per_example_grads", "model_or_params", "tree",
    "p_prime", "graphdef", "rest", "tx", "opt_state", "sample_key", "norms", "result",
    "mechanism", "options",  # train(model, data, mechanism, options=RunOptions(...))
    "checkpoint_key",  # RunOptions: the HMAC key of the checkpoints
    "devices", "mesh",  # data parallelism: where the batch is split (jax devices or a Mesh)
    "wrt", "trainable",  # nnx filters of the trained parameters (the others are frozen, public)
    "sampler",  # DPSGDMechanism: the batch scheme (jaxdp.training.samplers)
}


def _table_names(path):
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / path).read_text()
    section = text.split("## Names and units", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {n for row in rows for n in re.findall(r"`([a-z_0-9]+)`", row)}


def test_readme_glossary_names_are_the_tests_names():
    """Every name in the "Names and units" tables (docs/reference.md: all; README: the main ones) is here."""
    full, short = _table_names("docs/reference.md"), _table_names("README.md")
    assert len(full) > 40, full
    assert full <= GLOSSARY, sorted(full - GLOSSARY)
    assert short <= full, sorted(short - full)
