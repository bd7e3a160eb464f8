"""Pure, jittable privacy accountants (depends on jax, numpy and scipy only).

Every function computes in float64 whatever the global ``jax_enable_x64`` flag, broadcasts
over leading batch axes, and runs under ``jax.jit``, ``jax.vmap`` and ``jax.grad``.
"""

from ._conversion import DeltaResult as DeltaResult
from ._conversion import EpsilonResult as EpsilonResult
from ._conversion import rdp_to_delta as rdp_to_delta
from ._conversion import rdp_to_epsilon as rdp_to_epsilon
from ._dpsgd import CalibrationResult as CalibrationResult
from ._dpsgd import calibrate_sigma as calibrate_sigma
from ._dpsgd import dpsgd_epsilon as dpsgd_epsilon
from ._dpsgd import schedule_epsilon as schedule_epsilon
from ._rdp import DEFAULT_ORDERS as DEFAULT_ORDERS
from ._rdp import gaussian_rdp as gaussian_rdp
from ._rdp import heterogeneous_rdp as heterogeneous_rdp
from ._rdp import sampled_gaussian_rdp as sampled_gaussian_rdp

__all__ = [
    "DEFAULT_ORDERS",
    "CalibrationResult",
    "DeltaResult",
    "EpsilonResult",
    "calibrate_sigma",
    "dpsgd_epsilon",
    "gaussian_rdp",
    "heterogeneous_rdp",
    "rdp_to_delta",
    "rdp_to_epsilon",
    "sampled_gaussian_rdp",
    "schedule_epsilon",
]
