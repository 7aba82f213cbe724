"""The rollout job: prompts -> RolloutWorker(s) -> parquet parts + W&B (logic in rollout/job.py).

    python scripts/rollout.py +experiment=grpo
    python scripts/rollout.py +experiment=grpo fleet.num_workers=2          # 2 Ray actors (docs/fleet.md)
    python scripts/rollout.py +experiment=grpo sampling.n=4 data.limit=64 output_dir=outputs/try
    python scripts/rollout.py +experiment=grpo model=local model.path=/ckpt data=jsonl data.path=p.jsonl reward=null
    python scripts/rollout.py +experiment=grpo --cfg job      # print the composed config
"""
import importlib
import os
import sys

# This file shares the package's name and Python puts scripts/ first on sys.path, so
# `import rollout` (here, or in a sibling script such as generate.py) would find this file.
# Drop scripts/ from sys.path; when a sibling imports this file as `rollout`, hand it the package.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
if __name__ != "__main__":
    del sys.modules[__name__]
    sys.modules[__name__] = importlib.import_module(__name__)
else:
    import hydra
    from omegaconf import DictConfig

    from rollout.job import register_configs, run

    register_configs()

    @hydra.main(config_path="../conf", config_name="config", version_base="1.3")
    def main(cfg: DictConfig) -> None:
        run(cfg)

    main()
