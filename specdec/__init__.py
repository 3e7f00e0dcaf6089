"""specdec: lossless speculative decoding for Gemma models."""

from specdec.api import Target, generate, load
from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams

__all__ = ["Target", "generate", "load", "SamplingParams", "SpecdecError"]
__version__ = "0.1.0"
