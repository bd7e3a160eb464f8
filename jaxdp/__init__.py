"""jaxdp: JAX-native differential-privacy accounting and private training."""

from . import accounting as accounting

__version__ = "0.1.0"
__all__ = ["accounting", "__version__"]
