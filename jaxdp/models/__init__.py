"""Flax NNX models: convex ones (where the hidden-state guarantees hold) and an MLP, the
constants of common losses, and the :class:`HiddenStateModel` protocol a user's model
implements to get per-record hidden-state ε from :func:`jaxdp.training.train`."""

from ._convex import LogisticRegression as LogisticRegression
from ._convex import LossConstants as LossConstants
from ._convex import SoftmaxRegression as SoftmaxRegression
from ._convex import binary_logistic_loss as binary_logistic_loss
from ._convex import logistic_loss_constants as logistic_loss_constants
from ._convex import softmax_cross_entropy_loss as softmax_cross_entropy_loss
from ._convex import softmax_loss_constants as softmax_loss_constants
from ._convex import squared_loss as squared_loss
from ._convex import squared_loss_constants as squared_loss_constants
from ._mlp import MLP as MLP
from ._protocol import HiddenStateModel as HiddenStateModel

__all__ = [
    "LogisticRegression",
    "SoftmaxRegression",
    "MLP",
    "LossConstants",
    "binary_logistic_loss",
    "softmax_cross_entropy_loss",
    "logistic_loss_constants",
    "softmax_loss_constants",
    "squared_loss",
    "squared_loss_constants",
    "HiddenStateModel",
]

from ._lipschitz import LipschitzDense as LipschitzDense
from ._lipschitz import LipschitzMLP as LipschitzMLP
from ._lipschitz import lipschitz_upper_bound as lipschitz_upper_bound
from ._lipschitz import spectral_norms as spectral_norms

__all__ += ["LipschitzDense", "LipschitzMLP", "lipschitz_upper_bound", "spectral_norms"]
