"""rollout: an RL rollout-generation engine with trainer-exact logprobs."""
from .engine import RolloutEngine
from .request import Completion, RequestOutput, SamplingParams

__all__ = ["RolloutEngine", "SamplingParams", "RequestOutput", "Completion"]
__version__ = "0.1.0"
