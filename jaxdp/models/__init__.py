"""Flax NNX models: convex ones (where the hidden-state guarantees hold) and an MLP."""

from ._convex import LogisticRegression as LogisticRegression
from ._convex import LossConstants as LossConstants
from ._convex import SoftmaxRegression as SoftmaxRegression
from ._convex import binary_logistic_loss as binary_logistic_loss
from ._convex import logistic_loss_constants as logistic_loss_constants
from ._convex import softmax_cross_entropy_loss as softmax_cross_entropy_loss
from ._convex import softmax_loss_constants as softmax_loss_constants
from ._mlp import MLP as MLP

__all__ = [
    "LogisticRegression",
    "SoftmaxRegression",
    "MLP",
    "LossConstants",
    "binary_logistic_loss",
    "softmax_cross_entropy_loss",
    "logistic_loss_constants",
    "softmax_loss_constants",
]

from ._lipschitz import LipschitzDense as LipschitzDense
from ._lipschitz import LipschitzMLP as LipschitzMLP
from ._lipschitz import lipschitz_upper_bound as lipschitz_upper_bound
from ._lipschitz import spectral_norms as spectral_norms

__all__ += ["LipschitzDense", "LipschitzMLP", "lipschitz_upper_bound", "spectral_norms"]
