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
from ._hockey_stick import gaussian_hockey_stick as gaussian_hockey_stick
from ._hockey_stick import gaussian_hockey_stick_complement as gaussian_hockey_stick_complement
from ._hockey_stick import laplace_hockey_stick as laplace_hockey_stick
from ._hockey_stick import log_gaussian_hockey_stick as log_gaussian_hockey_stick
from ._conversion import DeltaResult as DeltaResult
from ._conversion import EpsilonResult as EpsilonResult
from ._conversion import rdp_to_delta as rdp_to_delta
from ._conversion import rdp_to_epsilon as rdp_to_epsilon
from ._dpsgd import CalibrationResult as CalibrationResult
from ._dpsgd import calibrate_noise_multiplier as calibrate_noise_multiplier
from ._dpsgd import dpsgd_epsilon as dpsgd_epsilon
from ._dpsgd import schedule_epsilon as schedule_epsilon
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
]
