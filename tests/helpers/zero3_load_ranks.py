"""One rank of the ZeRO-3 loading test (tests/system/test_distributed.py): joins a 2-process DeepSpeed
group (gloo), loads a policy and initialises a reward model inside `loading.partitioned`, loads the
rs stage's SFT policy as the stage does and samples from it as its candidates are sampled, and
writes what this rank holds of them and what it sampled.

    RANK=r LOCAL_RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/helpers/zero3_load_ranks.py SFT_DIR OUT.json
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from pipeline.config import DistributedConfig, Params, SamplingConfig, from_dict  # noqa: E402
from pipeline.measurement.policy import Policy, measure_policies  # noqa: E402
from pipeline.models import reward_model as rm  # noqa: E402
from pipeline.models.checkpoints import load_policy  # noqa: E402
from pipeline.stages import rs  # noqa: E402
from pipeline.training import distributed, loading  # noqa: E402

PROMPTS = ["Review the film Silent River . Focus on the music .",
           "What did you think of Lost Lantern ? Talk about the acting ."]


def held(model: torch.nn.Module) -> dict[str, int]:
    """Elements of the model's weights: in all, in this rank's partitions, materialised whole here."""
    params = list(model.parameters())
    return {"whole": sum(getattr(p, "ds_numel", p.numel()) for p in params),
            "partition": sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params),
            "materialised": sum(p.numel() for p in params),
            "zero_params": sum(hasattr(p, "ds_id") for p in params), "params": len(params)}


def main(sft_dir: Path, out: Path) -> None:
    cfg = DistributedConfig(backend="deepspeed", zero_stage=3, num_processes=2)
    ctx = distributed.init(cfg)
    with loading.partitioned(cfg, ctx):
        policy, _ = load_policy(sft_dir, dtype=torch.float32)
        reward, _ = rm.init_reward_model(sft_dir, seed=0, head_std=None)
    head = rm.head(reward)
    import deepspeed
    with deepspeed.zero.GatheredParameters([head.weight]):
        weight = head.weight.detach().clone()
    std = 1.0 / math.sqrt(weight.shape[1] + 1)   # reward_model.init_reward_model's default
    expected = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)) * std
    # The rs stage's load, then its candidates' sampling from the partitioned model and from the
    # same checkpoint loaded whole on every rank (one batch of prompts: rank 0 samples it).
    params = from_dict(Params, {"rs": {"distributed": {"backend": "deepspeed", "zero_stage": 3, "num_processes": 2}}}, "")
    rs_policy, tok = rs.load_sft(params, sft_dir, ctx)
    whole, _ = load_policy(sft_dir, dtype=torch.float32)
    sampled = {name: measure_policies([Policy(name, loading.Loaded(m), 5)], tok, PROMPTS,
                                      SamplingConfig(max_new_tokens=6), ctx=ctx)[name].texts
               for name, m in (("partitioned", rs_policy), ("whole", whole))}
    out.with_suffix(f".rank{ctx.rank}.json").write_text(json.dumps({
        "policy": held(policy), "reward": held(reward), "head_as_seeded": bool(torch.equal(weight, expected)),
        "rs": held(rs_policy), "rs_dtype": str(next(rs_policy.parameters()).dtype), "sampled": sampled}))
    distributed.shutdown(ctx)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
