from .decoder import SUPPORTED_ARCHITECTURES, DecoderLM
from .loader import build_model, init_random, load_model

__all__ = ["DecoderLM", "SUPPORTED_ARCHITECTURES", "build_model", "init_random", "load_model"]
