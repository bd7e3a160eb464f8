"""Pure, jittable privacy accountants (depends on jax, numpy and scipy only).

Every function computes in float64 whatever the global ``jax_enable_x64`` flag, broadcasts
over leading batch axes, and runs under ``jax.jit``, ``jax.vmap`` and ``jax.grad``.
"""

from ._contraction import log_pnsgd_contraction_delta as log_pnsgd_contraction_delta
from ._contraction import pnsgd_contraction_delta as pnsgd_contraction_delta
from ._contraction import pnsgd_contraction_epsilon as pnsgd_contraction_epsilon
from ._contraction import pnsgd_laplace_delta as pnsgd_laplace_delta
from ._contraction import step_contraction as step_contraction
from ._contraction import stop_pnsgd_contraction_delta as stop_pnsgd_contraction_delta
from ._contraction import stop_pnsgd_contraction_epsilon as stop_pnsgd_contraction_epsilon
from ._conversion import DeltaResult as DeltaResult
from ._conversion import EpsilonResult as EpsilonResult
from ._conversion import rdp_to_delta as rdp_to_delta
from ._conversion import rdp_to_epsilon as rdp_to_epsilon
from ._dpsgd import CalibrationResult as CalibrationResult
from ._dpsgd import calibrate_noise_multiplier as calibrate_noise_multiplier
from ._dpsgd import dpsgd_epsilon as dpsgd_epsilon
from ._dpsgd import schedule_epsilon as schedule_epsilon
from ._events import PNSGD as PNSGD
from ._events import RELATIONS as RELATIONS
from ._events import Composed as Composed
from ._events import Event as Event
from ._events import Gaussian as Gaussian
from ._events import Laplace as Laplace
from ._events import PoissonSampled as PoissonSampled
from ._events import SelfComposed as SelfComposed
from ._events import delta as delta
from ._events import dpsgd_event as dpsgd_event
from ._events import epsilon as epsilon
from ._events import pnsgd_record_epsilon as pnsgd_record_epsilon
from ._events import rdp as rdp
from ._events import register_accountant as register_accountant
from ._events import relation_of as relation_of
from ._hockey_stick import gaussian_hockey_stick as gaussian_hockey_stick
from ._hockey_stick import gaussian_hockey_stick_complement as gaussian_hockey_stick_complement
from ._hockey_stick import laplace_hockey_stick as laplace_hockey_stick
from ._hockey_stick import log_gaussian_hockey_stick as log_gaussian_hockey_stick
from ._iteration import linear_rdp_delta as linear_rdp_delta
from ._iteration import linear_rdp_epsilon as linear_rdp_epsilon
from ._iteration import pnsgd_iteration_rdp as pnsgd_iteration_rdp
from ._iteration import skip_pnsgd_iteration_rdp as skip_pnsgd_iteration_rdp
from ._iteration import stop_pnsgd_iteration_rdp as stop_pnsgd_iteration_rdp
from ._iteration import strongly_convex_iteration_rdp as strongly_convex_iteration_rdp
from ._pnsgd import PNSGDPrivacy as PNSGDPrivacy
from ._pnsgd import calibrate_pnsgd_noise_std as calibrate_pnsgd_noise_std
from ._pnsgd import pnsgd_privacy as pnsgd_privacy
from ._rdp import DEFAULT_ORDERS as DEFAULT_ORDERS
from ._rdp import gaussian_rdp as gaussian_rdp
from ._rdp import heterogeneous_rdp as heterogeneous_rdp
from ._rdp import laplace_rdp as laplace_rdp
from ._rdp import sampled_gaussian_rdp as sampled_gaussian_rdp

__all__ = [
    "DEFAULT_ORDERS",
    "calibrate_pnsgd_noise_std",
    "calibrate_noise_multiplier",
    "CalibrationResult",
    "DeltaResult",
    "dpsgd_epsilon",
    "EpsilonResult",
    "gaussian_hockey_stick",
    "gaussian_hockey_stick_complement",
    "gaussian_rdp",
    "heterogeneous_rdp",
    "laplace_hockey_stick",
    "linear_rdp_delta",
    "linear_rdp_epsilon",
    "log_gaussian_hockey_stick",
    "log_pnsgd_contraction_delta",
    "pnsgd_contraction_delta",
    "pnsgd_contraction_epsilon",
    "pnsgd_iteration_rdp",
    "pnsgd_laplace_delta",
    "pnsgd_privacy",
    "PNSGDPrivacy",
    "rdp_to_delta",
    "rdp_to_epsilon",
    "sampled_gaussian_rdp",
    "schedule_epsilon",
    "skip_pnsgd_iteration_rdp",
    "step_contraction",
    "stop_pnsgd_contraction_delta",
    "stop_pnsgd_contraction_epsilon",
    "stop_pnsgd_iteration_rdp",
    "strongly_convex_iteration_rdp",
    "Event",
    "Gaussian",
    "Laplace",
    "PoissonSampled",
    "SelfComposed",
    "Composed",
    "PNSGD",
    "RELATIONS",
    "delta",
    "dpsgd_event",
    "epsilon",
    "pnsgd_record_epsilon",
    "rdp",
    "register_accountant",
    "relation_of",
    "laplace_rdp",
]

# Classic mechanisms, composition theorems, subsampling and discrete divergences.
from ._composition import ADVANCED_COMPOSITION_FORMS as ADVANCED_COMPOSITION_FORMS
from ._composition import advanced_composition as advanced_composition
from ._composition import amplify_by_poisson_sampling as amplify_by_poisson_sampling
from ._composition import (
    amplify_by_sampling_without_replacement as amplify_by_sampling_without_replacement,
)
from ._composition import basic_composition as basic_composition
from ._composition import optimal_homogeneous_composition as optimal_homogeneous_composition
from ._divergences import hockey_stick_divergence as hockey_stick_divergence
from ._divergences import kl_divergence as kl_divergence
from ._mechanisms import GAUSSIAN_CALIBRATIONS as GAUSSIAN_CALIBRATIONS
from ._mechanisms import calibrate_gaussian_noise_multiplier as calibrate_gaussian_noise_multiplier
from ._mechanisms import calibrate_laplace_scale as calibrate_laplace_scale
from ._mechanisms import gaussian_mechanism as gaussian_mechanism
from ._mechanisms import gaussian_mechanism_delta as gaussian_mechanism_delta
from ._mechanisms import gaussian_mechanism_epsilon as gaussian_mechanism_epsilon
from ._mechanisms import laplace_mechanism as laplace_mechanism

__all__ += [
    "ADVANCED_COMPOSITION_FORMS",
    "advanced_composition",
    "amplify_by_poisson_sampling",
    "amplify_by_sampling_without_replacement",
    "basic_composition",
    "calibrate_gaussian_noise_multiplier",
    "calibrate_laplace_scale",
    "GAUSSIAN_CALIBRATIONS",
    "gaussian_mechanism",
    "gaussian_mechanism_delta",
    "gaussian_mechanism_epsilon",
    "hockey_stick_divergence",
    "kl_divergence",
    "laplace_mechanism",
    "optimal_homogeneous_composition",
]

# Per-instance (data-dependent) accounting: Thudi et al. 2024, Feldman and Zrnic 2021.
from ._per_instance import PER_INSTANCE_ORDERS as PER_INSTANCE_ORDERS  # noqa: E402
from ._per_instance import PerInstancePrivacy as PerInstancePrivacy  # noqa: E402
from ._per_instance import individual_filter_privacy as individual_filter_privacy  # noqa: E402
from ._per_instance import individual_filter_step as individual_filter_step  # noqa: E402
from ._per_instance import per_instance_composition_orders as per_instance_composition_orders  # noqa: E402
from ._per_instance import per_instance_dpsgd_privacy as per_instance_dpsgd_privacy  # noqa: E402
from ._per_instance import per_instance_sampled_gaussian_rdp as per_instance_sampled_gaussian_rdp  # noqa: E402

__all__ += [
    "PER_INSTANCE_ORDERS",
    "PerInstancePrivacy",
    "individual_filter_privacy",
    "individual_filter_step",
    "per_instance_composition_orders",
    "per_instance_dpsgd_privacy",
    "per_instance_sampled_gaussian_rdp",
]

# DP-SBCD (Chen & Liu 2024): hidden-state RDP of noisy block coordinate descent.
from ._dpsbcd import dpsbcd_epsilon as dpsbcd_epsilon  # noqa: E402
from ._dpsbcd import dpsbcd_rdp as dpsbcd_rdp  # noqa: E402
from ._dpsbcd import dpsbcd_rdp_per_batch as dpsbcd_rdp_per_batch  # noqa: E402
from ._events import DPSBCD as DPSBCD  # noqa: E402

__all__ += ["DPSBCD", "dpsbcd_epsilon", "dpsbcd_rdp", "dpsbcd_rdp_per_batch"]

# Privacy loss distributions (PLD): tight accounting by FFT, with an upper and a lower bound.
from ._pld import PLD_GRID_SIZE as PLD_GRID_SIZE  # noqa: E402
from ._pld import PLD_TAIL_BOUND as PLD_TAIL_BOUND  # noqa: E402
from ._pld import PLDBracket as PLDBracket  # noqa: E402
from ._pld import calibrate_pld_noise_multiplier as calibrate_pld_noise_multiplier  # noqa: E402
from ._pld import pld_bracket as pld_bracket  # noqa: E402
from ._pld import pld_delta as pld_delta  # noqa: E402
from ._pld import pld_epsilon as pld_epsilon  # noqa: E402

__all__ += [
    "PLD_GRID_SIZE",
    "PLD_TAIL_BOUND",
    "PLDBracket",
    "calibrate_pld_noise_multiplier",
    "pld_bracket",
    "pld_delta",
    "pld_epsilon",
]

# Shifted interpolation (Bok, Su & Altschuler 2024): per-record GDP of PNSGD.
from ._shifted import pnsgd_shifted_gdp as pnsgd_shifted_gdp  # noqa: E402
from ._shifted import pnsgd_shifted_rdp as pnsgd_shifted_rdp  # noqa: E402
from ._shifted import shifted_contraction as shifted_contraction  # noqa: E402

__all__ += [
    "pnsgd_shifted_gdp",
    "pnsgd_shifted_rdp",
    "shifted_contraction",
]
