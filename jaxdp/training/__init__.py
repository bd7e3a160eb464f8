"""Private training building blocks: PNSGD and DP-SGD as optax transformations, Poisson
sampling, per-example clipping, the PNSGD training loop.

The update rules here are the ones the hidden-state accountants analyse
(``Y ← Π_K(Y − η(g + Z))``); see :func:`pnsgd` for the noise convention.
"""

from ._clipping import ClippedGrads as ClippedGrads
from ._clipping import clip_per_example_grads as clip_per_example_grads
from ._clipping import clipped_grad_sum as clipped_grad_sum
from ._clipping import fast_path_supported as fast_path_supported
from ._clipping import per_example_grad_norms as per_example_grad_norms
from ._clipping import per_example_grads as per_example_grads
from ._dpsgd import DPSGDStepOutput as DPSGDStepOutput
from ._dpsgd import batch_capacity as batch_capacity
from ._dpsgd import dpsgd as dpsgd
from ._dpsgd import dpsgd_step as dpsgd_step
from ._dpsgd import poisson_sample as poisson_sample
from ._transforms import AddGaussianNoiseState as AddGaussianNoiseState
from ._transforms import ProjectL2BallState as ProjectL2BallState
from ._transforms import add_gaussian_noise as add_gaussian_noise
from ._transforms import pnsgd as pnsgd
from ._transforms import pnsgd_noise_std as pnsgd_noise_std
from ._transforms import project_l2_ball as project_l2_ball
from ._transforms import project_onto_l2_ball as project_onto_l2_ball

__all__ = [
    "AddGaussianNoiseState",
    "ClippedGrads",
    "ProjectL2BallState",
    "add_gaussian_noise",
    "clip_per_example_grads",
    "clipped_grad_sum",
    "batch_capacity",
    "dpsgd",
    "dpsgd_step",
    "DPSGDStepOutput",
    "poisson_sample",
    "fast_path_supported",
    "per_example_grad_norms",
    "per_example_grads",
    "pnsgd",
    "pnsgd_noise_std",
    "project_l2_ball",
    "project_onto_l2_ball",
]

from ._checkpoint import Checkpointer as Checkpointer
from ._checkpoint import latest_checkpoint_step as latest_checkpoint_step
from ._ledger import DPSGDLedger as DPSGDLedger
from ._ledger import PrivacyLedger as PrivacyLedger
from ._ledger import PrivacyReport as PrivacyReport
from ._ledger import privacy_report as privacy_report
from ._config import RunOptions as RunOptions
from ._dpsgd_mechanism import DPSGDMechanism as DPSGDMechanism
from ._dpsgd_mechanism import DPSGDState as DPSGDState
from ._driver import train as train
from ._legacy import TrainState as TrainState
from ._plan import PrivacyPlan as PrivacyPlan
from ._plan import plan_privacy as plan_privacy
from ._pnsgd import PNSGDMechanism as PNSGDMechanism
from ._pnsgd import PNSGDState as PNSGDState
from ._run import TrainingDivergedError as TrainingDivergedError
from ._run import TrainResult as TrainResult
from ._run import accuracy as accuracy

__all__ += [
    "Checkpointer",
    "DPSGDLedger",
    "DPSGDMechanism",
    "DPSGDState",
    "PNSGDMechanism",
    "PNSGDState",
    "PrivacyLedger",
    "PrivacyPlan",
    "PrivacyReport",
    "RunOptions",
    "TrainResult",
    "TrainState",
    "TrainingDivergedError",
    "accuracy",
    "latest_checkpoint_step",
    "plan_privacy",
    "privacy_report",
    "train",
]

from ._per_point import CheckpointNorms as CheckpointNorms  # noqa: E402 (exports appended at the end)
from ._per_point import PerPointPrivacy as PerPointPrivacy  # noqa: E402 (exports appended at the end)
from ._per_point import clipped_norms_at_checkpoints as clipped_norms_at_checkpoints  # noqa: E402 (exports appended at the end)
from ._per_point import per_point_clipped_norms as per_point_clipped_norms  # noqa: E402 (exports appended at the end)
from ._per_point import per_point_privacy as per_point_privacy  # noqa: E402 (exports appended at the end)

__all__ += [
    "CheckpointNorms",
    "PerPointPrivacy",
    "clipped_norms_at_checkpoints",
    "per_point_clipped_norms",
    "per_point_privacy",
]

# DP-SBCD (Chen & Liu 2024): per-record lifted state, block updates.
from ._dpsbcd import DPSBCDMechanism as DPSBCDMechanism  # noqa: E402
from ._dpsbcd import DPSBCDResult as DPSBCDResult  # noqa: E402
from ._dpsbcd import DPSBCDState as DPSBCDState  # noqa: E402
from ._driver import train_dpsbcd as train_dpsbcd  # noqa: E402
from ._ledger import DPSBCDLedger as DPSBCDLedger  # noqa: E402

__all__ += ["DPSBCDLedger", "DPSBCDMechanism", "DPSBCDResult", "DPSBCDState", "train_dpsbcd"]

# Data parallelism over devices (jax.sharding): the batch split, the noise drawn once.
from ._parallel import data_parallel_mesh as data_parallel_mesh  # noqa: E402
from ._parallel import parallel_clipped_grad_sum as parallel_clipped_grad_sum  # noqa: E402
from ._parallel import replicate as replicate  # noqa: E402

__all__ += ["data_parallel_mesh", "parallel_clipped_grad_sum", "replicate"]

from . import samplers as samplers  # noqa: E402 (DP-SGD's batch schemes: DPSGDMechanism(sampler=...))

__all__ += ["samplers"]
