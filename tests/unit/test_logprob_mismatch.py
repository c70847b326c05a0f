"""The sampler/trainer log-prob mismatch (pipeline/ppo/mismatch.py): a bfloat16 sampler against the
float32 trainer creates a real one; the metric sees it, recomputing restores a first-minibatch ratio
of 1, `auto` decides per precision and device, truncated importance sampling matches a hand
computation, and the measurement changes nothing the update uses."""

import copy
import logging
import math

import pytest
import torch

from conftest import tiny_ppo_inputs
from pipeline.config import Params, PPOConfig, SamplingConfig
from pipeline.ppo import trainer as trainer_mod
from pipeline.ppo.losses import policy_loss, truncated_is_weights
from pipeline.ppo.mismatch import logprob_diff, ratio_deviation, resolve_recompute
from pipeline.ppo.placement import place_models
from pipeline.ppo.trainer import PPOTrainer

TINY = dict(iterations=2, rollout_batch_size=8, minibatch_size=4, micro_batch_size=2, ppo_epochs=1,
            lr=1e-3, critic_lr=1e-3, sampling=SamplingConfig(max_new_tokens=10))
PROMPTS = ["Review the film Silent River . Focus on the music .",
           "What did you think of Lost Harbor ? Talk about the plot ."] * 4


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_ppo_inputs(tmp_path_factory.mktemp("mismatch"))


def _trainer(dirs, **ppo) -> PPOTrainer:
    params = Params(ppo=PPOConfig(**{**TINY, **ppo}))
    return PPOTrainer(params.ppo, place_models(params, dirs / "sft", dirs / "rm"), PROMPTS)


def _bf16_sampler(trainer: PPOTrainer, monkeypatch) -> None:
    """Rollouts from a bfloat16 copy of the actor; scoring and the update stay in float32 (a GPU
    sampler's kernels and precision, in miniature). The untrained actor's logits are near zero
    (a near-uniform policy hides most rounding); its final norm scaled by 8 gives the peaked
    next-token distributions of a trained policy, in both copies alike."""
    with torch.no_grad():
        trainer.m.actor.model.model.norm.weight.mul_(8.0)
    sampler = copy.deepcopy(trainer.m.actor.model).to(torch.bfloat16)
    real = trainer_mod.rollout
    monkeypatch.setattr(trainer_mod, "rollout", lambda policy, *args, **kw: real(sampler, *args, **kw))


def test_bf16_sampler_is_seen_and_recompute_restores_ratio_one(dirs, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="pipeline.ppo.trainer")
    stats = {}
    for recompute, tis_cap in ((False, None), (True, None), ("auto", 1.5)):
        trainer = _trainer(dirs, recompute_logprobs=recompute, tis_cap=tis_cap, logprob_check_rows=8)
        _bf16_sampler(trainer, monkeypatch)
        stats[recompute] = trainer.step()
        assert trainer.recompute is (recompute is not False)   # auto recomputes when tis_cap is set
    off, on, tis = stats[False], stats[True], stats["auto"]
    # The metric sees the mismatch; with 8 check rows (the whole rollout) the measurement without
    # recomputation is the same number as the one recomputation gives for free.
    assert off["val/logprob_diff_max"] > 1e-3 and off["val/logprob_diff_mean"] > 1e-4
    assert off["val/logprob_diff_max"] == pytest.approx(on["val/logprob_diff_max"], rel=1e-9, abs=0)
    # The sampler's log-probs as pi_old: the first ratio is off before any update (clipping would
    # hide this in loss/policy). Recomputed: 1 within 1e-6. What remains is float32 rounding: the
    # update groups rows into other micro-batches than scoring did (per minibatch, length-sorted,
    # each trimmed to its own padding), so the same tokens go through matmuls of other shapes.
    assert off["val/first_ratio_max_dev"] > 1e-3
    assert on["val/first_ratio_max_dev"] < 1e-6 and tis["val/first_ratio_max_dev"] < 1e-6
    assert on["val/first_ratio_mean_dev"] < 1e-7
    # TIS on: weights pi_old / pi_sampler that differ from 1, some cut at the cap of 1.5 or not.
    assert abs(tis["policy/tis_weight"] - 1.0) > 1e-4 and 0.0 <= tis["policy/tis_capfrac"] < 1.0
    assert "policy/tis_weight" not in on
    lines = [r.getMessage() for r in caplog.records if "old log-probs" in r.getMessage()]
    assert len(lines) == 3
    assert lines[0].startswith("ppo: old log-probs: sampler's (ppo.recompute_logprobs: false;")
    assert lines[1].startswith("ppo: old log-probs: recomputed by a training forward (ppo.recompute_logprobs: true;")
    assert lines[2].startswith("ppo: old log-probs: recomputed by a training forward (auto: ppo.tis_cap is set;")
    # The sampler's log-probs differ from the trainer's by more than the tolerance: warned.
    assert any("set ppo.recompute_logprobs: true" in r.getMessage() for r in caplog.records)


def test_fp32_sampler_agrees_and_auto_keeps_the_shortcut(dirs, caplog):
    caplog.set_level(logging.INFO, logger="pipeline.ppo.trainer")
    trainer = _trainer(dirs)   # recompute_logprobs: auto on fp32 CPU
    assert trainer.recompute is False
    stats = trainer.step()
    assert stats["val/logprob_diff_max"] < 1e-5 and stats["val/first_ratio_max_dev"] < 1e-5
    (line,) = [r.getMessage() for r in caplog.records if "old log-probs" in r.getMessage()]
    assert line.startswith("ppo: old log-probs: sampler's (auto: fp32 on cpu, where the sampler's and the "
                           "trainer's are shown equal; measured max |diff| ")
    assert "over 8 rollouts per process" in line
    assert not any("set ppo.recompute_logprobs" in r.getMessage() for r in caplog.records)
    # The same decision for a model whose weights are bfloat16 (model.dtype bfloat16 reaches PPO as
    # the SFT checkpoint's dtype).
    trainer.m.actor.model.to(torch.bfloat16)
    assert PPOTrainer(trainer.cfg, trainer.m, PROMPTS).recompute is True


@pytest.mark.parametrize("setting, precision, dtype, device, tis, expected", [
    ("auto", "fp32", torch.float32, "cpu", False, False),
    ("auto", "bf16", torch.float32, "cpu", False, True),
    ("auto", "fp16", torch.float32, "cpu", False, True),
    ("auto", "fp32", torch.bfloat16, "cpu", False, True),
    ("auto", "fp32", torch.float16, "cpu", False, True),
    ("auto", "fp32", torch.float32, "cuda", False, True),
    ("auto", "fp32", torch.float32, "cpu", True, True),
    (True, "fp32", torch.float32, "cpu", False, True),
    (False, "bf16", torch.bfloat16, "cuda", False, False),   # the user's word stands (and is measured)
])
def test_auto_decides_per_precision_and_device(setting, precision, dtype, device, tis, expected):
    recompute, reason = resolve_recompute(setting, precision, dtype, device, tis)
    assert recompute is expected
    assert reason.startswith("auto: " if setting == "auto" else "ppo.recompute_logprobs: ")


def test_measurements_by_hand():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    sampler = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    trainer = torch.tensor([[-1.1, -1.5, 9.0], [-0.5, 7.0, 0.0]])   # garbage on pads is ignored
    d = logprob_diff(sampler, trainer, mask)
    assert d["val/logprob_diff_mean"] == pytest.approx((0.1 + 0.5 + 0.0) / 3)
    assert d["val/logprob_diff_max"] == pytest.approx(0.5)
    r = ratio_deviation(trainer, sampler, mask)
    devs = [abs(math.exp(-0.1) - 1), abs(math.exp(0.5) - 1), 0.0]
    assert r["val/first_ratio_mean_dev"] == pytest.approx(sum(devs) / 3)
    assert r["val/first_ratio_max_dev"] == pytest.approx(max(devs))


def test_tis_weights_and_loss_by_hand():
    """w_t = min(exp(old_t - sampler_t), cap), detached; the policy loss is sum_t w_t * (PPO-clip
    loss_t) / tokens (Yao et al. 2025; verl's compute_policy_loss_vanilla), computed here by hand."""
    mask = torch.tensor([[True, True, True], [True, True, False]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, 0.0]], dtype=torch.float64)
    sampler = torch.tensor([[-1.2, -1.0, -0.5], [-3.0, -4.5, -50.0]], dtype=torch.float64)
    cap = 2.0
    w, stats = truncated_is_weights(old, sampler, mask, cap)
    raw = [[math.exp(0.2), math.exp(-1.0), 1.0], [math.exp(2.7), math.exp(0.5)]]   # exp(2.7) = 14.9 > cap
    hand = [[min(x, cap) for x in row] for row in raw]
    assert w[0].tolist() == pytest.approx(hand[0]) and w[1, :2].tolist() == pytest.approx(hand[1])
    assert w[1, 2].item() == 1.0   # a pad: exp(50) never computed
    flat = hand[0] + hand[1]
    assert stats["policy/tis_weight"] == pytest.approx(sum(flat) / 5)
    assert stats["policy/tis_capfrac"] == pytest.approx(1 / 5)

    new = torch.tensor([[-0.8, -2.1, -0.2], [-0.3, -3.0, 0.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 2.0], [-0.5, 1.5, 0.0]], dtype=torch.float64)
    loss, _ = policy_loss(new, old, adv, mask, clip_eps=0.2, tis_weights=w)
    expected, grads = 0.0, []
    for (b, t), wt in zip([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)], flat):
        rho, a = math.exp(new[b, t].item() - old[b, t].item()), adv[b, t].item()
        clipped = min(max(rho, 0.8), 1.2) * a
        expected += -wt * min(rho * a, clipped) / 5
        grads.append(-wt * rho * a / 5 if rho * a <= clipped else 0.0)   # d/d logprob; 0 on the clipped branch
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    got = [new.grad[b, t].item() for b, t in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]]
    assert got == pytest.approx(grads, rel=1e-12, abs=1e-15)
    assert not w.requires_grad and new.grad[1, 2].item() == 0.0
    with pytest.raises(ValueError, match="TIS cap must be > 1"):
        truncated_is_weights(old, sampler, mask, 1.0)


def test_the_check_forward_changes_nothing_the_update_uses(dirs):
    """One check row or eight: the same generators' draws, the same weights after two iterations,
    the same update statistics (bit for bit)."""
    results = []
    for rows in (1, 8):
        trainer = _trainer(dirs, logprob_check_rows=rows)
        logs = [trainer.step() for _ in range(2)]
        params = torch.cat([p.detach().flatten() for p in [*trainer.m.actor.model.parameters(),
                                                           *trainer.m.critic.model.parameters()]])
        states = (trainer.sample_gen.get_state(), trainer.shuffle_gen.get_state())
        results.append((params, states, [{k: v for k, v in s.items() if not k.startswith(
            ("time/", "tokens_per_second/", "val/logprob_diff"))} for s in logs]))
    (p1, g1, s1), (p8, g8, s8) = results
    assert torch.equal(p1, p8)
    assert all(torch.equal(a, b) for a, b in zip(g1, g8))
    assert s1 == s8
