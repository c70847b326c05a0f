"""One rank of the offload_frozen placement test (tests/system/test_distributed.py): joins a 2-process
DeepSpeed group (gloo), places PPO's four models at ZeRO-3 with `offload_frozen` (place_models), and
writes, in the order the models were built, the parameter offload each was built under (the config
`deepspeed.zero.Init` read), then each engine's parameter offload after `deepspeed.initialize`.

    RANK=r LOCAL_RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/helpers/zero3_placement_ranks.py SFT_DIR RM_DIR OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402

from pipeline.config import DistributedConfig, Params, PPOConfig  # noqa: E402
from pipeline.ppo.placement import place_models  # noqa: E402
from pipeline.training import distributed  # noqa: E402

built: list = []
_init = deepspeed.zero.Init.__init__


def spying_init(self, *args, **kwargs):
    """Records the parameter offload of the DeepSpeed config a model is built under (what
    transformers hands zero.Init from the live `HfDeepSpeedConfig`)."""
    config = kwargs.get("config_dict_or_path") or {}
    built.append(config.get("zero_optimization", {}).get("offload_param", {}).get("device", "none"))
    _init(self, *args, **kwargs)


def main(sft_dir: Path, rm_dir: Path, out: Path) -> None:
    deepspeed.zero.Init.__init__ = spying_init
    dist = DistributedConfig(backend="deepspeed", zero_stage=3, num_processes=2, offload_frozen=True)
    params = Params(ppo=PPOConfig(distributed=dist, rollout_batch_size=4, minibatch_size=2, micro_batch_size=1))
    ctx = distributed.init(dist)
    m = place_models(params, sft_dir, rm_dir, ctx)
    engines = {"actor": m.actor.engine, "critic": m.critic.engine, "frozen": m.frozen.engine}
    out.with_suffix(f".rank{ctx.rank}.json").write_text(json.dumps({
        "built_under": built,
        # Each engine's config, and where its parameter offload (DeepSpeedZeRoOffload) keeps partitions.
        "engine_offload": {k: [e.zero_offload_param() is not None,
                               str(getattr(getattr(e.optimizer, "parameter_offload", e.optimizer), "offload_device", None))]
                           for k, e in engines.items()}}))
    distributed.shutdown(ctx)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
