"""Pure, jittable privacy accountants (depends on jax, numpy and scipy only).

Every function computes in float64 whatever the global ``jax_enable_x64`` flag, broadcasts
over leading batch axes, and runs under ``jax.jit``, ``jax.vmap`` and ``jax.grad``.

One door per job: an event tree says what a pipeline did; ``epsilon``, ``delta`` and
``rdp`` evaluate it with a registered accountant (``accountant="rdp"``, the default, or
``"pld"``); ``calibrate_noise_multiplier`` calibrates DP-SGD with either. The names below
are grouped by topic; the analyses behind each accountant stay public for those who need
one theorem's bound.

Interpreter exit: importing this package registers ``gc.freeze`` with :mod:`atexit`, so the
garbage collections of Python's finalisation skip the objects alive at exit (JAX's modules
and caches: about 0.2 s of a fresh process's 1-2 s on a 2-core machine). Memory goes back
to the operating system either way; the only difference is that objects in reference cycles
still alive at exit are not finalised (``__del__`` of such objects is not guaranteed at exit
in Python anyway). Exit handlers registered earlier still run after it, unchanged.
``JAXDP_GC_FREEZE_AT_EXIT=0`` in the environment (read at import) leaves exit as Python has it.
"""

import atexit
import functools
import gc
import importlib
import os

from .._deprecations import deprecation_getattr as _deprecation_getattr

# Public names, each loaded from its module on first use (PEP 562 below): a first ε of DP-SGD
# imports the modules it needs, not all of them (issue 21: a fresh process's first answer).
_PUBLIC = {
    "_accountants": ("delta", "epsilon", "pnsgd_record_epsilon", "rdp", "register_accountant", "pld_bracket"),
    "_allocation": ("RandomAllocation", "balls_in_bins_event", "random_allocation_event", "random_allocation_rdp"),
    "_composition": (
        "ADVANCED_COMPOSITION_FORMS", "advanced_composition", "amplify_by_poisson_sampling",
        "amplify_by_sampling_without_replacement", "basic_composition", "optimal_homogeneous_composition",
    ),
    "_contraction": (
        "log_pnsgd_contraction_delta", "pnsgd_contraction_delta", "pnsgd_contraction_epsilon", "pnsgd_laplace_delta",
        "step_contraction", "stop_pnsgd_contraction_delta", "stop_pnsgd_contraction_epsilon",
    ),
    "_conversion": ("DeltaResult", "EpsilonResult", "rdp_to_delta", "rdp_to_epsilon"),
    "_divergences": ("hockey_stick_divergence", "kl_divergence"),
    "_dpsbcd": ("dpsbcd_composition_rdp", "dpsbcd_epsilon", "dpsbcd_rdp", "dpsbcd_rdp_per_batch"),
    "_dpsgd": ("CalibrationResult", "calibrate_noise_multiplier", "dpsgd_epsilon", "schedule_epsilon"),
    "_events": (
        "DPSBCD", "PNSGD", "ApproxDP", "RELATIONS", "Composed", "Event", "Gaussian", "Laplace", "PoissonSampled",
        "SelfComposed", "dpsgd_event", "relation_of",
    ),
    "_hockey_stick": (
        "gaussian_hockey_stick", "gaussian_hockey_stick_complement", "laplace_hockey_stick",
        "log_gaussian_hockey_stick",
    ),
    "_individual_filter": ("individual_filter_privacy", "individual_filter_step"),
    "_iteration": (
        "linear_rdp_delta", "linear_rdp_epsilon", "pnsgd_iteration_rdp", "skip_pnsgd_iteration_rdp",
        "stop_pnsgd_iteration_rdp", "strongly_convex_iteration_rdp",
    ),
    "_mechanisms": (
        "GAUSSIAN_CALIBRATIONS", "calibrate_gaussian_noise_multiplier", "calibrate_laplace_scale",
        "gaussian_mechanism", "gaussian_mechanism_delta", "gaussian_mechanism_epsilon", "laplace_mechanism",
    ),
    "_parity": ("ZCDP", "RandomizedResponse", "SingleEpochTreeAggregation"),
    "_per_instance": ("PER_INSTANCE_ORDERS", "per_instance_composition_orders", "per_instance_dpsgd_privacy"),
    "_per_instance_rdp": ("PerInstancePrivacy", "per_instance_sampled_gaussian_rdp"),
    "_pld": ("PLD_GRID_SIZE", "PLD_TAIL_BOUND", "PLD_STAGES", "PLDBracket"),
    "_pnsgd": ("PNSGDPrivacy", "pnsgd_privacy"),
    "_pnsgd_calibrate": ("calibrate_pnsgd_noise_std",),
    "_pnsgd_poisson": ("POISSON_PNSGD_SPLITS", "poisson_pnsgd_epsilon", "poisson_pnsgd_rdp"),
    "_pnsgd_shuffle": ("shuffle_pnsgd_epsilon", "shuffle_pnsgd_rdp"),
    "_rdp": ("DEFAULT_ORDERS", "gaussian_rdp", "heterogeneous_rdp", "laplace_rdp", "sampled_gaussian_rdp"),
    "_sampling": (
        "SampledWithoutReplacement", "SampledWithReplacement", "TruncatedPoissonSampled",
        "sampled_with_replacement_rdp", "sampled_without_replacement_rdp", "shuffled_event", "truncated_poisson_rdp",
    ),
    "_shifted": ("pnsgd_shifted_gdp", "pnsgd_shifted_rdp", "shifted_contraction"),
    "_shuffle_lower": ("shuffled_lower_epsilon",),
    "_tradeoff": ("TRADEOFF_ACCOUNTANTS", "TRADEOFF_EPSILONS", "gdp_mu", "tradeoff"),
}

__all__ = [
    # Events: what a pipeline did, as data.
    "Event",
    "Gaussian",
    "Laplace",
    "ApproxDP",
    "PoissonSampled",
    "SampledWithoutReplacement",
    "SampledWithReplacement",
    "TruncatedPoissonSampled",
    "RandomAllocation",
    "RandomizedResponse",
    "ZCDP",
    "SingleEpochTreeAggregation",
    "SelfComposed",
    "Composed",
    "PNSGD",
    "DPSBCD",
    "RELATIONS",
    "dpsgd_event",
    "shuffled_event",
    "balls_in_bins_event",
    "shuffled_lower_epsilon",
    "relation_of",
    # Accountants of events: ε, δ and the RDP curve, by accountant="rdp" (default) or "pld".
    "epsilon",
    "delta",
    "rdp",
    "register_accountant",
    "pnsgd_record_epsilon",
    # Trade-off curves of events (TPR bound at each FPR) and the Gaussian-DP parameter.
    "tradeoff",
    "gdp_mu",
    "TRADEOFF_ACCOUNTANTS",
    "TRADEOFF_EPSILONS",
    # The PLD accountant's defaults, and both of its bounds at once.
    "PLD_GRID_SIZE",
    "PLD_TAIL_BOUND",
    "PLD_STAGES",
    "PLDBracket",
    "pld_bracket",
    # DP-SGD in one call, and its noise calibration (accountant="rdp" or "pld").
    "dpsgd_epsilon",
    "schedule_epsilon",
    "calibrate_noise_multiplier",
    "CalibrationResult",
    # Rényi DP curves and their conversion to (ε, δ).
    "DEFAULT_ORDERS",
    "gaussian_rdp",
    "laplace_rdp",
    "sampled_gaussian_rdp",
    "sampled_without_replacement_rdp",
    "sampled_with_replacement_rdp",
    "truncated_poisson_rdp",
    "random_allocation_event",
    "random_allocation_rdp",
    "heterogeneous_rdp",
    "rdp_to_epsilon",
    "rdp_to_delta",
    "EpsilonResult",
    "DeltaResult",
    "linear_rdp_epsilon",
    "linear_rdp_delta",
    # Divergences.
    "gaussian_hockey_stick",
    "gaussian_hockey_stick_complement",
    "log_gaussian_hockey_stick",
    "laplace_hockey_stick",
    "hockey_stick_divergence",
    "kl_divergence",
    # Classic mechanisms, composition theorems and amplification by subsampling.
    "gaussian_mechanism",
    "gaussian_mechanism_delta",
    "gaussian_mechanism_epsilon",
    "calibrate_gaussian_noise_multiplier",
    "GAUSSIAN_CALIBRATIONS",
    "laplace_mechanism",
    "calibrate_laplace_scale",
    "basic_composition",
    "advanced_composition",
    "ADVANCED_COMPOSITION_FORMS",
    "optimal_homogeneous_composition",
    "amplify_by_poisson_sampling",
    "amplify_by_sampling_without_replacement",
    # Projected noisy SGD: every analysis at once, and its calibration.
    "pnsgd_privacy",
    "PNSGDPrivacy",
    "calibrate_pnsgd_noise_std",
    # PNSGD with Poisson batches (hidden state, flat in the number of steps).
    "poisson_pnsgd_rdp",
    "poisson_pnsgd_epsilon",
    "shuffle_pnsgd_rdp",
    "shuffle_pnsgd_epsilon",
    "POISSON_PNSGD_SPLITS",
    # PNSGD theorems: contraction (Asoodeh et al.).
    "step_contraction",
    "pnsgd_contraction_delta",
    "log_pnsgd_contraction_delta",
    "pnsgd_contraction_epsilon",
    "pnsgd_laplace_delta",
    "stop_pnsgd_contraction_delta",
    "stop_pnsgd_contraction_epsilon",
    # PNSGD theorems: amplification by iteration (Feldman et al., Balle et al.).
    "pnsgd_iteration_rdp",
    "skip_pnsgd_iteration_rdp",
    "stop_pnsgd_iteration_rdp",
    "strongly_convex_iteration_rdp",
    # PNSGD theorems: shifted interpolation (Bok, Su & Altschuler).
    "shifted_contraction",
    "pnsgd_shifted_gdp",
    "pnsgd_shifted_rdp",
    # DP-SBCD.
    "dpsbcd_rdp",
    "dpsbcd_rdp_per_batch",
    "dpsbcd_epsilon",
    "dpsbcd_composition_rdp",
    # Per-instance (data-dependent) accounting.
    "per_instance_sampled_gaussian_rdp",
    "per_instance_dpsgd_privacy",
    "per_instance_composition_orders",
    "PerInstancePrivacy",
    "PER_INSTANCE_ORDERS",
    "individual_filter_step",
    "individual_filter_privacy",
]

_MODULE_OF = {name: module for module, names in _PUBLIC.items() for name in names}


def _deprecated_pld_epsilon():
    """The old ``pld_epsilon`` through the door, which puts the RDP fallback where the grid cannot
    certify δ."""
    # Imported on first use, as every public name (the table below is built at import).
    from ._accountants import epsilon
    from ._pld import pld_epsilon  # on first use, as above

    return functools.wraps(pld_epsilon)(functools.partial(epsilon, accountant="pld"))


class _Deprecated(dict):
    """``{old name: (message, build)}``: the object is built (its module imported) on first use."""

    def __getitem__(self, name):
        message, build = super().__getitem__(name)
        return message, build()


# Names with a second door, kept for one release: each warns and names its replacement.
_deprecations = _Deprecated({
    # Deprecated after jaxdp 0.1.0 (issue 21: one door per job): they warn for one release, then go.
    "pld_epsilon": (
        "jaxdp.accounting.pld_epsilon is deprecated: use jaxdp.accounting.epsilon(event, delta, accountant='pld') "
        "(grid_size, tail_bound and estimate are keyword options of epsilon).",
        _deprecated_pld_epsilon,
    ),
    "pld_delta": (
        "jaxdp.accounting.pld_delta is deprecated: use jaxdp.accounting.delta(event, epsilon, accountant='pld') "
        "(grid_size, tail_bound and estimate are keyword options of delta).",
        lambda: importlib.import_module("._pld", __name__).pld_delta,
    ),
    "calibrate_pld_noise_multiplier": (
        "jaxdp.accounting.calibrate_pld_noise_multiplier is deprecated: use "
        "jaxdp.accounting.calibrate_noise_multiplier(target_epsilon, q, num_steps, delta, accountant='pld') "
        "(grid_size, tail_bound and solver_iterations are keyword options of it).",
        lambda: importlib.import_module("._dpsgd", __name__).calibrate_pld_noise_multiplier,
    ),
})
__getattr__ = _deprecation_getattr(__name__, _deprecations, lazy=_MODULE_OF)
del _deprecation_getattr


def __dir__():
    return sorted(set(globals()) | set(_MODULE_OF))


# Python's finalisation runs full collections over every tracked object: after ``import jax``
# that is ~10^5 objects and 0.2-0.3 s of a fresh process's exit (perf: gc_collect_main), more
# than a tenth of a first ε. Frozen objects are skipped; reference counting still frees what
# module teardown releases (see the module docstring). JAXDP_GC_FREEZE_AT_EXIT=0 opts out.
if os.environ.get("JAXDP_GC_FREEZE_AT_EXIT", "1").strip() != "0":
    atexit.register(gc.freeze)
