"""Trainer integrations: TRL's GRPOTrainer / RLOOTrainer / AsyncGRPOTrainer over rollout's RolloutWorker
(in-process), or over a rollout server (`attach_http_generator`)."""
from .trl_generator import (TRL_REQUIREMENT, TRLGenerationAdapter, attach_generator, check_trl_version,
                            iter_trainer_weights, make_rollout_func, sampling_params_from_trl_args)

__all__ = ["TRL_REQUIREMENT", "TRLGenerationAdapter", "attach_generator", "check_trl_version",
           "iter_trainer_weights", "make_rollout_func", "sampling_params_from_trl_args",
           "EngineRolloutWorker", "EngineWeightTransfer", "HTTPWorker", "attach_http_generator"]


def __getattr__(name):   # the AsyncGRPO adapters import trl.experimental lazily
    if name in ("EngineRolloutWorker", "EngineWeightTransfer"):
        from . import trl_async
        return getattr(trl_async, name)
    if name in ("HTTPWorker", "attach_http_generator"):
        from . import trl_http
        return getattr(trl_http, name)
    raise AttributeError(name)
