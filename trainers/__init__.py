"""Trainer integrations: TRL's GRPOTrainer / RLOOTrainer / AsyncGRPOTrainer over rollout's RolloutWorker."""
from .trl_generator import (TRL_REQUIREMENT, TRLGenerationAdapter, attach_generator, check_trl_version,
                            iter_trainer_weights, make_rollout_func, sampling_params_from_trl_args)

__all__ = ["TRL_REQUIREMENT", "TRLGenerationAdapter", "attach_generator", "check_trl_version",
           "iter_trainer_weights", "make_rollout_func", "sampling_params_from_trl_args",
           "EngineRolloutWorker", "EngineWeightTransfer"]


def __getattr__(name):   # the AsyncGRPO adapters import trl.experimental lazily
    if name in ("EngineRolloutWorker", "EngineWeightTransfer"):
        from . import trl_async
        return getattr(trl_async, name)
    raise AttributeError(name)
