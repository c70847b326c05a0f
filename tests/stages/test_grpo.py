"""Critic-free online RL in the PPO trainer: GRPO, RLOO and REINFORCE++ with
baseline build no critic (three models, in placement, checkpoints, outputs and the memory plan),
use the group advantages of group_advantages.py on a real rollout, survive groups of equal scores,
accumulate every loss aggregation exactly over micro-batches, refuse k = 1, and resume exactly."""

import dataclasses
import json
import math

import pytest
import torch

from conftest import assert_same_run, die_in_iteration, tiny_ppo_inputs
from pipeline.config import GRPOConfig, Params, PPOConfig, SamplingConfig, check_process_shape, from_dict
from pipeline.errors import ConfigError
from pipeline.ppo import advantages as adv
from pipeline.ppo import group_advantages as group
from pipeline.ppo.placement import place_models
from pipeline.ppo.trainer import PPOTrainer
from pipeline.stages import grpo as stage
from pipeline.stages import registry
from pipeline.training import memory_plan

# 8 responses per iteration = 2 prompts x k = 4; minibatches of 4 rows, micro-batches of 2.
TINY = dict(iterations=4, rollout_batch_size=8, samples_per_prompt=4, minibatch_size=4, micro_batch_size=2,
            ppo_epochs=1, save_every=2, n_eval_prompts=4, lr=1e-3, sampling=SamplingConfig(max_new_tokens=8))
PROMPTS = ["Review the film Silent River . Focus on the music .", "Review the film Lost Harbor . Focus on the plot ."]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_ppo_inputs(tmp_path_factory.mktemp("critic_free"), n_ppo_prompts=16)


def _params(**grpo) -> Params:
    return Params(grpo=GRPOConfig(**{**TINY, **grpo}))


def _trainer(dirs, **grpo) -> PPOTrainer:
    params = _params(**grpo)   # the models as the grpo stage places them, from its own section
    return PPOTrainer(params.grpo, place_models(params, dirs / "sft", dirs / "rm", section="grpo"), PROMPTS * 4)


def test_group_advantages_on_a_real_rollout_equal_the_estimators_by_hand(dirs):
    for estimator, kl_coef, kl_loss_coef in (("grpo", 0.0, 0.05), ("rloo", 0.1, 0.0), ("reinforce_baseline", 0.1, 0.0)):
        trainer = _trainer(dirs, advantage=estimator, kl_coef=kl_coef, kl_loss_coef=kl_loss_coef)
        assert trainer.m.critic is None   # three models: actor, reference, reward
        torch.manual_seed(0)
        with torch.no_grad():   # move the actor off the reference, so the KL (and its penalty) is not 0
            for p in trainer.m.actor.model.parameters():
                p.add_(0.2 * torch.randn_like(p))
        prompts = [p for p in PROMPTS for _ in range(4)]
        from pipeline.ppo.rollout import rollout
        from pipeline.ppo.scoring import score_rollout
        ro = rollout(trainer.m.actor.model, trainer.m.tok, prompts, trainer.cfg.sampling, trainer.sample_gen)
        assert len(set(ro.responses[:4])) > 1   # one prompt's k rows are sampled independently
        sc = score_rollout(trainer.m.actor.forward, trainer.m.ref, None, trainer.m.reward, ro, 1.0, 2, None, None)
        assert sc.values is None
        batch, stats = trainer.make_batch(ro, sc)
        assert batch.returns is None and "val/explained_variance" not in stats
        # By hand: the score minus kl_coef times the response's summed KL, then the group baseline.
        kl = torch.where(ro.response_mask, adv.kl_penalty(sc.old_logprobs, sc.ref_logprobs, trainer.cfg.kl_estimator), 0.0).sum(1)
        assert kl.abs().min() > 1e-3
        seq = sc.scores - kl_coef * kl
        fn = {"grpo": lambda s: group.grpo_advantages(s, 4), "rloo": lambda s: group.rloo_advantages(s, 4),
              "reinforce_baseline": lambda s: group.reinforce_baseline_advantages(s, 4)}[estimator]
        expected = fn(seq)[0]
        assert torch.allclose(batch.advantages[:, 0], expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(batch.advantages, torch.where(ro.response_mask, batch.advantages[:, :1], 0.0))
        if estimator == "rloo":   # the leave-one-out mean by a loop over each group
            for i in range(8):
                g = range(i // 4 * 4, i // 4 * 4 + 4)
                other = sum(float(seq[j]) for j in g if j != i) / 3
                assert math.isclose(float(batch.advantages[i, 0]), float(seq[i]) - other, abs_tol=1e-5)


def test_all_equal_group_scores_give_zero_advantage_and_a_finite_step(dirs, monkeypatch):
    trainer = _trainer(dirs)
    monkeypatch.setattr(trainer.m.reward, "score", lambda prompts, responses: torch.full((len(prompts),), 1.5))
    stats = trainer.step()
    assert stats["objective/zero_std_frac"] == 1.0 and stats["objective/group_std"] == 0.0
    assert all(math.isfinite(v) for v in stats.values())
    assert stats["loss/policy"] == 0.0   # zero advantage: no policy gradient, only the KL term
    assert not {"loss/value", "val/grad_norm", "val/explained_variance", "val/vpred"} & set(stats)
    assert all(torch.isfinite(p).all() for p in trainer.m.actor.model.parameters())


@pytest.mark.parametrize("mode", ["seq_mean", "seq_sum_norm"])
def test_micro_batch_accumulation_equals_full_minibatch_for_every_aggregation(dirs, mode):
    """Same update with micro-batches of 4, 2 and 1 rows: identical weights (float64)."""
    results = []
    for micro in (4, 2, 1):
        trainer = _trainer(dirs, micro_batch_size=micro, loss_aggregation=mode, entropy_coef=0.01)
        trainer.m.actor.model.double()
        trainer.m.ref.double()
        trainer.step()
        results.append(torch.cat([p.detach().flatten() for p in trainer.m.actor.model.parameters()]))
    assert not torch.equal(results[0], torch.cat([p.detach().flatten().double() for p in
                                                  _trainer(dirs).m.actor.model.parameters()]))   # it moved
    assert torch.allclose(results[0], results[1], atol=1e-10, rtol=0)
    assert torch.allclose(results[0], results[2], atol=1e-10, rtol=0)


def test_aggregations_add_up_over_micro_batches_and_differ():
    """aggregate() of micro-batches (each with the minibatch's denominator) sums to the minibatch's
    loss_aggregation; on responses of unequal length the three modes differ."""
    from pipeline.ppo.losses import aggregate
    torch.manual_seed(0)
    per_token = torch.randn(6, 5, dtype=torch.float64)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 1, 3, 2, 5, 4])[:, None]
    full = {}
    for mode in ("token_mean", "seq_mean", "seq_sum_norm"):
        full[mode] = group.loss_aggregation(per_token, mask, mode, max_len=8)
        denom = float(mask.sum()) if mode == "token_mean" else 6.0
        parts = sum(aggregate(per_token[i], mask[i], mode, denom, 8) for i in ([0, 1], [2, 3, 4], [5]))
        assert torch.allclose(parts, full[mode], atol=1e-12, rtol=0)
    assert len({round(float(v), 9) for v in full.values()}) == 3


def test_group_estimator_config_is_checked():
    def load(section, **keys):
        return from_dict(Params, {section: keys}, "params.yaml: ")
    with pytest.raises(ConfigError, match=r"params.yaml: ppo.samples_per_prompt: advantage: grpo .* >= 2, got 1"):
        load("ppo", advantage="grpo")
    with pytest.raises(ConfigError, match=r"params.yaml: grpo.samples_per_prompt: .* got 1"):
        load("grpo", samples_per_prompt=1)
    with pytest.raises(ConfigError, match=r"grpo.kl_loss_coef: .*never both"):
        load("grpo", kl_coef=0.1)   # the grpo default has kl_loss_coef 0.15
    # Batch sizes against processes: checked when the grpo stage starts (its SPEC's shape), so a
    # distributed setup for the default pipeline loads whatever the comparison's sizes; ppo's at load.
    assert (stage.SPEC.shape, registry.spec("ppo").shape) == ("start", "load")
    split = load("grpo", rollout_batch_size=10, minibatch_size=5, micro_batch_size=5)
    with pytest.raises(ConfigError, match=r"grpo.rollout_batch_size: 10 responses must be divisible by .* = 4"):
        check_process_shape(split, "grpo")
    with pytest.raises(ConfigError, match=r"^ppo.minibatch_size: 48 must divide ppo.rollout_batch_size"):
        check_process_shape(load("ppo", minibatch_size=48), "ppo")
    # The prompts are the prompts section's: the old per-stage key names its new place.
    for section in ("grpo", "ppo"):
        with pytest.raises(ConfigError, match=rf"^params.yaml: {section}.dataset: moved to prompts.dataset"):
            load(section, dataset={"path": "prompts.jsonl"})
    with pytest.raises(ConfigError, match=r"grpo.whiten_rewards"):
        load("grpo", whiten_rewards=True)
    # A partial section keeps GRPO's defaults; critic keys are accepted and unused.
    cfg = load("grpo", lr=3e-4, critic_lr=1.0, shared_backbone=True).grpo
    assert (cfg.advantage, cfg.samples_per_prompt, cfg.kl_coef, cfg.kl_loss_coef, cfg.kl_estimator) == \
           ("grpo", 4, 0.0, 0.15, "k3") and not cfg.uses_critic
    assert PPOConfig().uses_critic and PPOConfig().samples_per_prompt == 1   # ppo is unchanged


def test_memory_plan_counts_three_models(dirs):
    shape = lambda d, head: memory_plan.checkpoint_shape(d, head, False)   # noqa: E731
    actor, rm = shape(dirs / "sft", False), shape(dirs / "rm", True)
    folders = {"data": dirs / "data", "sft": dirs / "sft", "reward": dirs / "rm"}
    params = _params()
    plan = memory_plan.stage_plan("grpo", stage.SPEC.plan, params, folders)
    assert plan.stage == "grpo"
    assert plan.device["weights"] == 4 * actor.params                 # one trained model: the actor
    assert plan.device["frozen"] == 4 * (actor.params + rm.params)    # reference and reward
    gae = dataclasses.replace(params, grpo=dataclasses.replace(params.grpo, advantage="gae", kl_coef=0.2,
                                                              kl_loss_coef=0.0))
    four = memory_plan.stage_plan("grpo", stage.SPEC.plan, gae, folders)
    assert four.device["weights"] == 4 * (actor.params + rm.params)   # actor and critic (from the RM)
    assert plan.total < four.total


def test_grpo_stage_has_no_critic_and_resumes_exactly(dirs, tmp_path, monkeypatch):
    params = _params()
    folders = (dirs / "data", dirs / "sft", dirs / "rm")
    full = stage.run(params, *folders, tmp_path / "full", progress=False)
    files = {p.name for p in (tmp_path / "full").rglob("*")}
    assert "actor.safetensors" in files and not any("critic" in f for f in files)
    assert json.loads((tmp_path / "full/config.json").read_text())["grpo"]["advantage"] == "grpo"
    assert "grpo/gold" in full or "grpo/rm" in full
    columns = (tmp_path / "full/train.tsv").read_text().splitlines()[0].split("\t")
    assert "objective/group_std" in columns and not {"loss/value", "val/grad_norm"} & set(columns)

    die_in_iteration(monkeypatch, 3)   # killed during iteration 4; the checkpoint of iteration 2 exists
    with pytest.raises(KeyboardInterrupt):
        stage.run(params, *folders, tmp_path / "resumed", progress=False)
    assert json.loads((tmp_path / "resumed/checkpoint/state.json").read_text())["iteration"] == 2
    monkeypatch.undo()
    resumed = stage.run(params, *folders, tmp_path / "resumed", progress=False)
    assert_same_run(tmp_path / "full", tmp_path / "resumed", full, resumed)
