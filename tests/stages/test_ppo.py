"""The PPO stage on tiny models: ratio 1 at the first update, accumulation equivalence, packed
update forwards equal to padded ones, the EOS trick, NaN detection, reward functions, and a
killed-then-resumed run equal to an uninterrupted one."""

import csv
import dataclasses
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import assert_same_run, die_in_iteration, tiny_ppo_inputs
from pipeline.models import reward_model as rm
from pipeline.config import DetectorConfig, LoraConfig, Params, PPOConfig, SamplingConfig, from_dict
from pipeline.errors import ConfigError
from pipeline.models.generation import sample
from pipeline.stages import ppo as stage
from pipeline.ppo.placement import place_models
from pipeline.ppo.rollout import rollout
from pipeline.ppo.scoring import policy_logprobs, score_rollout
from pipeline.errors import NumericalError
from pipeline.ppo.trainer import PPOTrainer
from pipeline.data.tokenizer import encode_prompt

TINY_PPO = dict(iterations=4, rollout_batch_size=8, minibatch_size=4, micro_batch_size=2, ppo_epochs=2,
                save_every=2, n_eval_prompts=8, lr=1e-3, critic_lr=1e-3,
                sampling=SamplingConfig(max_new_tokens=10))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Prepared data, a tiny 'SFT' model and a reward model built from it (untrained is enough)."""
    return tiny_ppo_inputs(tmp_path_factory.mktemp("ppo"), n_ppo_prompts=32, n_eval_prompts=8)


def _params(**ppo):
    return Params(ppo=PPOConfig(**{**TINY_PPO, **ppo}))


def test_ratio_is_one_at_first_minibatch_and_sampling_logprobs_match(dirs):
    params = _params()
    m = place_models(params, dirs / "sft", dirs / "rm")
    prompts = ["Review the film Silent River . Focus on the music ."] * 3 + ["Review the film Lost Harbor . Focus on the plot ."]
    gen = torch.Generator().manual_seed(0)
    ro = rollout(m.actor.model, m.tok, prompts, params.ppo.sampling, gen)
    sc = score_rollout(m.actor.forward, m.ref, m.critic.model, m.reward, ro, 1.0, 2, None, None)
    lp, _ = policy_logprobs(m.actor.forward, ro.select(torch.tensor([2, 0])), 1.0)
    ratio = torch.exp(lp - sc.old_logprobs[[2, 0]])[ro.response_mask[[2, 0]]]
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5)
    # The KV-cached sampling pass computed the same log-probs.
    again = sample(m.actor.model, [encode_prompt(m.tok, p) for p in prompts],
                   m.tok.pad_token_id, [m.tok.eos_token_id], params.ppo.sampling, torch.Generator().manual_seed(0))
    assert torch.equal(again.response_ids, ro.input_ids[:, ro.n_prompt:])
    assert torch.allclose(again.logprobs[ro.response_mask], sc.old_logprobs[ro.response_mask], atol=1e-5)
    # Frozen models get no gradients.
    assert not any(p.requires_grad for p in m.ref.parameters())


def test_eos_trick_and_score_clip(dirs):
    params = _params()
    m = place_models(params, dirs / "sft", dirs / "rm")
    ro = rollout(m.actor.model, m.tok, ["Review the film Silent River . Focus on the music ."] * 6,
                 SamplingConfig(max_new_tokens=2), torch.Generator().manual_seed(1))
    assert not ro.ended.all()   # two tokens are too few for most responses to end
    sc = score_rollout(m.actor.forward, m.ref, m.critic.model, m.reward, ro, 1.0, 4, missing_eos_score=-7.0, score_clip=5.0)
    expected = torch.where(ro.ended, sc.raw_scores.clamp(-5, 5), torch.full_like(sc.raw_scores, -5.0))
    assert torch.equal(sc.scores, expected)


def test_micro_batch_accumulation_equals_full_minibatch(dirs):
    """Same update with micro-batches of 1, 2 and 4 rollouts: identical weights (float64)."""
    results = []
    for micro in (4, 2, 1):
        params = _params(micro_batch_size=micro)
        m = place_models(params, dirs / "sft", dirs / "rm")
        m.actor.model.double()
        m.critic.model.double()
        m.ref.double()
        trainer = PPOTrainer(params.ppo, m, ["Review the film Silent River . Focus on the music ."] * 8)
        trainer.step()
        results.append(torch.cat([p.detach().flatten() for p in [*m.actor.model.parameters(), *m.critic.model.parameters()]]))
    assert torch.allclose(results[0], results[1], atol=1e-10, rtol=0)
    assert torch.allclose(results[0], results[2], atol=1e-10, rtol=0)



# Prompts of different lengths: packed rows of different widths, prompts left-padded differently.
VARIED_PROMPTS = ["Review the film Silent River . Focus on the music .", "Review the film Red Canyon .",
                  "What did you think of Lost Harbor ? Talk about the plot and the acting .",
                  "Review Lost Harbor ."] * 2


@pytest.mark.parametrize("variant", [{}, {"shared_backbone": True},
                                     {"lora": LoraConfig(r=4), "critic_lora": LoraConfig(r=4)}],
                         ids=["separate", "shared_backbone", "lora"])
def test_packed_update_equals_padded(dirs, variant):
    """One PPO iteration with ppo.packing (the update's actor and critic forwards on one packed row
    per micro-batch) against padded rows, float64: the same losses and the same actor and critic
    weights after it; the entropy bonus is on, so the entropy's packed gradient counts too."""
    results = []
    for packing in (False, True):
        params = _params(packing=packing, entropy_coef=0.01, **variant)
        m = place_models(params, dirs / "sft", dirs / "rm")
        for model in (m.actor.model, m.critic.model, m.ref):
            model.double()

        def weights() -> torch.Tensor:
            trained = [*m.actor.model.parameters(), *m.critic.model.parameters()]
            return torch.cat([p.detach().flatten() for p in trained])
        start = weights()
        stats = PPOTrainer(params.ppo, m, VARIED_PROMPTS).step()
        results.append((stats, start, weights()))
    (padded, start, trained), (packed, _, trained_packed) = results
    assert (trained - start).abs().max() > 1e-4   # the update moved the weights
    torch.testing.assert_close(trained_packed, trained, atol=1e-8, rtol=0)
    for key in ("loss/policy", "loss/value", "objective/entropy", "policy/approxkl", "policy/clipfrac"):
        assert packed[key] == pytest.approx(padded[key], abs=1e-10, rel=0), key

def test_function_reward_source_gold_oracle(dirs):
    params = _params(reward_source="pipeline.tasks.reviews:gold_scores")
    m = place_models(params, dirs / "sft", dirs / "rm")
    from pipeline.tasks.reviews import gold_score
    prompts = ["Review the film Silent River . Focus on the music ."] * 2
    responses = ["the music was good . overall , see it .", "the plot is bad ."]
    assert m.reward.score(prompts, responses).tolist() == [gold_score(p, r) for p, r in zip(prompts, responses)]


def test_kl_in_reward_and_loss_together_is_rejected():
    with pytest.raises(ConfigError, match=r"params.yaml: ppo.kl_loss_coef: .*never both"):
        from_dict(Params, {"ppo": {"kl_coef": 0.1, "kl_loss_coef": 0.1}}, "params.yaml: ")
    # either alone is fine (a coefficient of 0 with a fixed one: the adaptive controller cannot scale 0)
    from_dict(Params, {"ppo": {"kl_coef": 0.0, "kl_loss_coef": 0.1, "adaptive_kl": False}}, "params.yaml: ")
    with pytest.raises(ConfigError, match=r"params.yaml: ppo.adaptive_kl: needs ppo.kl_coef > 0"):
        from_dict(Params, {"ppo": {"kl_coef": 0.0, "kl_loss_coef": 0.1}}, "params.yaml: ")


def test_nan_reward_stops_with_iteration_and_keeps_checkpoint(dirs, tmp_path, monkeypatch):
    params = _params()
    calls = {"n": 0}
    real_score = rm.score_texts

    def flaky(*args, **kwargs):
        calls["n"] += 1
        out = real_score(*args, **kwargs)
        return out if calls["n"] <= 2 else out * float("nan")   # iterations 1-2 fine, 3 broken
    monkeypatch.setattr(rm, "score_texts", flaky)
    with pytest.raises(NumericalError, match=r"ppo iteration 3: rewards \(scores\) is NaN"):
        stage.run(params, dirs / "data", dirs / "sft", dirs / "rm", tmp_path / "out", progress=False)
    state = json.loads((tmp_path / "out/checkpoint/state.json").read_text())
    assert state["iteration"] == 2


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_a_nan_policy_loss_stops_or_skips_only_the_actors_update(mode, dirs, monkeypatch):
    """The policy loss of the second minibatch of iteration 1 made NaN (its first micro-batch).
    stop: the iteration ends in one error. skip: the actor's update for that minibatch is dropped
    (the next minibatch finds the actor as this one did), the critic's applied, the count is 1."""
    from pipeline.ppo import trainer as trainer_module
    params = _params(on_nonfinite=mode)
    m = place_models(params, dirs / "sft", dirs / "rm")
    trainer = PPOTrainer(params.ppo, m, ["Review the film Silent River . Focus on the music ."] * 8)
    real, calls, actor, critic = trainer_module.policy_loss, {"n": 0}, {}, {}

    def broken(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] in (1, 3, 5):   # the first micro-batch of minibatches 1-3 (two micro-batches each)
            actor[calls["n"]] = torch.cat([p.detach().flatten() for p in m.actor.model.parameters()])
            critic[calls["n"]] = torch.cat([p.detach().flatten() for p in m.critic.model.parameters()])
        loss, stats = real(*args, **kwargs)
        return (loss * float("nan") if calls["n"] == 3 else loss), stats
    monkeypatch.setattr(trainer_module, "policy_loss", broken)
    if mode == "stop":
        with pytest.raises(NumericalError, match=r"^ppo iteration 1: loss/policy is NaN or infinite"):
            trainer.step()
        return
    assert trainer.step()["skipped_updates"] == 1
    assert torch.equal(actor[3], actor[5]) and not torch.equal(actor[1], actor[3])
    assert not torch.equal(critic[3], critic[5])
    assert trainer.step()["skipped_updates"] == 1   # a count, not a per-iteration flag


def test_killed_and_resumed_run_equals_uninterrupted(dirs, tmp_path, monkeypatch):
    # The detector checks from iteration 2 (no warmup, windows of 1): the resumed run rebuilds its
    # state from the checkpoint's rows, so its detector/* columns equal the uninterrupted run's.
    params = _params(detector=DetectorConfig(warmup=0, window=1))
    full = stage.run(params, dirs / "data", dirs / "sft", dirs / "rm", tmp_path / "full", progress=False)

    die_in_iteration(monkeypatch, 3)   # killed during iteration 4; the checkpoint of iteration 2 exists
    with pytest.raises(KeyboardInterrupt):
        stage.run(params, dirs / "data", dirs / "sft", dirs / "rm", tmp_path / "resumed", progress=False)
    assert json.loads((tmp_path / "resumed/checkpoint/state.json").read_text())["iteration"] == 2
    assert not (tmp_path / "resumed/model").exists()
    monkeypatch.undo()
    resumed = stage.run(params, dirs / "data", dirs / "sft", dirs / "rm", tmp_path / "resumed", progress=False)

    assert_same_run(tmp_path / "full", tmp_path / "resumed", full, resumed)
    header = (tmp_path / "full/train.tsv").read_text().splitlines()[0]
    assert (tmp_path / "resumed/train.tsv").read_text().splitlines()[0] == header   # same column order
    # A changed config does not resume from the stale checkpoint: it trains from iteration 1 and
    # its checkpoint belongs to the new run.
    state_file = tmp_path / "resumed/checkpoint/state.json"
    old_fp = json.loads(state_file.read_text())["fingerprint"]
    other = dataclasses.replace(params, ppo=dataclasses.replace(params.ppo, lr=5e-4))
    die_in_iteration(monkeypatch, 3)     # would die at iteration 4 if it resumed at 2
    with pytest.raises(KeyboardInterrupt):
        stage.run(other, dirs / "data", dirs / "sft", dirs / "rm", tmp_path / "resumed", progress=False)
    state = json.loads(state_file.read_text())
    assert state["fingerprint"] != old_fp and state["iteration"] == 2
    assert [r["step"] for r in state["log"]["rows"]] == [1, 2]


def test_stop_token_truncates_rollouts(dirs):
    params = _params()
    m = place_models(params, dirs / "sft", dirs / "rm")
    cfg = SamplingConfig(max_new_tokens=12, stop_token=".")
    ro = rollout(m.actor.model, m.tok, ["Review the film Silent River . Focus on the music ."] * 16, cfg,
                 torch.Generator().manual_seed(3))
    dot, eos = m.tok.convert_tokens_to_ids("."), m.tok.eos_token_id
    ids = ro.input_ids[:, ro.n_prompt:]
    last = ids.gather(1, (ro.response_mask.sum(1, keepdim=True) - 1).clamp(min=0)).squeeze(1)
    assert ro.ended.any() and torch.equal(ro.ended, (last == dot) | (last == eos))
    inner = ro.response_mask.clone()
    inner[torch.arange(16), ro.response_mask.sum(1) - 1] = False   # all but the last real token
    assert not ((ids == dot) & inner).any()


def test_trimmed_length_sorted_micro_batches_change_nothing(dirs):
    """Scoring and the update drop each micro-batch's all-padding columns and group rows of similar
    length: log-probs and values equal those of the full-width batch; the sampler's log-probs
    equal a recomputed training forward (so scoring can reuse them)."""
    from pipeline.ppo.scoring import critic_values, length_sorted_chunks
    params = _params(sampling=SamplingConfig(max_new_tokens=12))
    m = place_models(params, dirs / "sft", dirs / "rm")
    prompts = ["Review the film Silent River . Focus on the music .", "What did you think of Lost Harbor ? Talk about the plot ."] * 4
    ro = rollout(m.actor.model, m.tok, prompts, params.ppo.sampling, torch.Generator().manual_seed(5))
    # An untrained model rarely ends early: end rows at 12, 3, 7, 12, 1, 9, 5, 12 tokens (pads after).
    ro = dataclasses.replace(ro, input_ids=ro.input_ids.clone(), attention_mask=ro.attention_mask.clone(),
                             response_mask=ro.response_mask.clone(), logprobs=ro.logprobs.clone())
    for i, n in enumerate([12, 3, 7, 12, 1, 9, 5, 12]):
        ro.response_mask[i, n:] = False
        ro.attention_mask[i, ro.n_prompt + n:] = 0
        ro.input_ids[i, ro.n_prompt + n:] = m.tok.pad_token_id
        ro.logprobs[i, n:] = 0.0
    lengths = ro.response_mask.sum(1)
    assert lengths.min() < lengths.max()          # varied lengths, so trimming has work to do
    chunks = length_sorted_chunks(ro.response_mask, torch.arange(8), 3)
    assert sorted(torch.cat(chunks).tolist()) == list(range(8))
    assert all(lengths[c].max() <= lengths[p].min() for p, c in zip(chunks, chunks[1:]))
    with torch.no_grad():
        full_lp, _ = policy_logprobs(m.actor.forward, ro, 1.0)
        full_v = critic_values(m.critic.model, ro)
        for idx in chunks:
            mb = ro.select(idx, trim=True)
            r = mb.response_mask.size(1)
            assert r == int(lengths[idx].max()) and mb.input_ids.size(1) <= ro.input_ids.size(1)
            lp, _ = policy_logprobs(m.actor.forward, mb, 1.0)
            keep = mb.response_mask
            assert torch.allclose(lp[keep], full_lp[idx, :r][keep], atol=1e-5)
            assert torch.allclose(critic_values(m.critic.model, mb)[keep], full_v[idx, :r][keep], atol=1e-5)
    reused = score_rollout(m.actor.forward, m.ref, m.critic.model, m.reward, ro, 1.0, 3, None, None)
    recomputed = score_rollout(m.actor.forward, m.ref, m.critic.model, m.reward, ro, 1.0, 3, None, None,
                               recompute_logprobs=True)
    assert torch.allclose(reused.old_logprobs, recomputed.old_logprobs, atol=1e-5)
    assert torch.allclose(reused.values, full_v.masked_fill(~ro.response_mask, 0.0), atol=1e-5)


def test_detector_stop_keeps_the_last_checkpoint_before_the_alarm(dirs, tmp_path):
    from safetensors.torch import load_file
    # Thresholds so low that any change fires; first check at iteration 2 (no warmup, windows of 1).
    tiny = 1e-9
    det = DetectorConfig(warmup=0, window=1, kl_rise=tiny, length_change=tiny, entropy_drop=tiny,
                         distinct_drop=tiny, action="stop")
    params = _params(save_every=1, detector=det)
    m = stage.run(params, dirs / "data", dirs / "sft", dirs / "rm", tmp_path / "out", progress=False)
    first = m["detector/first_fire"]
    assert 2 <= first < 4 and m["detector/fired"] == 1
    assert m["detector/stopped_at"] == first and m["detector/kept_iteration"] == first - 1
    rows = list(csv.DictReader(open(tmp_path / "out/train.tsv"), delimiter="\t"))
    assert [int(r["step"]) for r in rows] == list(range(1, first + 1)) and rows[-1]["detector/fired"] == "1"
    saved = json.loads((tmp_path / "out/metrics.json").read_text())["detector"]
    assert saved == {"first_fire": first, "fired": 1, "stopped_at": first, "kept_iteration": first - 1}
    # The saved model is the actor of the checkpoint before the alarm, not the alarm iteration's.
    assert json.loads((tmp_path / "out/checkpoint/state.json").read_text())["iteration"] == first - 1
    kept = load_file(str(tmp_path / "out/checkpoint/actor.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out/model")).state_dict()
    common = set(kept) & set(model)
    assert len(common) > 5 and all(torch.equal(kept[k], model[k]) for k in common)


def test_critic_warmup_freezes_the_actor_then_releases_it(dirs):
    """critic_warmup: 2 of 3 iterations train the critic alone (actor bits unchanged, its lr logged 0);
    the third moves the actor, whose schedule starts at the peak there."""
    params = _params(iterations=3, critic_warmup=2, lr_schedule="linear")
    m = place_models(params, dirs / "sft", dirs / "rm")
    trainer = PPOTrainer(params.ppo, m, ["Review the film Silent River . Focus on the music ."] * 8)
    actor0 = [p.detach().clone() for p in m.actor.model.parameters()]
    critic0 = [p.detach().clone() for p in m.critic.model.parameters()]
    for _ in range(2):
        stats = trainer.step()
        assert stats["lr"] == 0.0 and stats["policy/grad_norm"] == 0.0 and stats["val/grad_norm"] > 0
    assert all(torch.equal(a, b) for a, b in zip(actor0, m.actor.model.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(critic0, m.critic.model.parameters()))
    stats = trainer.step()
    assert stats["lr"] == pytest.approx(1e-3 * (1 - 3 / 4))   # its 4th of 4 updates: (3 - 2) x 2 epochs x 2 minibatches
    assert stats["policy/grad_norm"] > 0
    assert not all(torch.equal(a, b) for a, b in zip(actor0, m.actor.model.parameters()))


def test_normalize_reward_divides_scores_and_critic_by_the_stored_scale(dirs, tmp_path):
    import shutil
    with pytest.raises(Exception, match=r"^ppo.normalize_reward: the reward model .* stores no reward_scale"):
        place_models(_params(normalize_reward=True), dirs / "sft", dirs / "rm")   # the fixture's RM has none
    shutil.copytree(dirs / "rm", tmp_path / "rm")
    config = json.loads((tmp_path / "rm/config.json").read_text())
    (tmp_path / "rm/config.json").write_text(json.dumps({**config, rm.SCALE_KEY: 2.5}))
    plain = place_models(_params(), dirs / "sft", dirs / "rm")
    unit = place_models(_params(normalize_reward=True), dirs / "sft", tmp_path / "rm")
    prompts, responses = ["Review the film Silent River . Focus on the music ."] * 2, ["the music was good .", "bad ."]
    torch.testing.assert_close(unit.reward.score(prompts, responses), plain.reward.score(prompts, responses) / 2.5)
    torch.testing.assert_close(rm.head(unit.critic.model).weight, rm.head(plain.critic.model).weight / 2.5)


@pytest.mark.parametrize("ppo, match", [
    ({"adaptive_kl": True, "kl_horizon": 10000}, r"ppo.kl_horizon: no longer a key: .* is kl_horizon_iterations, "
                                                  r"in iterations \(an episode count divided by rollout_batch_size\)$"),
    ({"critic_warmup": 100, "iterations": 100}, r"ppo.critic_warmup: 100 iterations leave none of the 100 "),
    ({"critic_warmup": 5, "advantage": "grpo", "samples_per_prompt": 4}, r"ppo.critic_warmup: grpo has no critic"),
    ({"critic_warmup": 5, "shared_backbone": True}, r"ppo.critic_warmup: with shared_backbone"),
    ({"normalize_reward": True, "reward_source": "pipeline.tasks.reviews:gold_scores"}, r"ppo.normalize_reward: .*function"),
])
def test_warmup_horizon_and_normalisation_keys_are_checked(ppo, match):
    with pytest.raises(ConfigError, match=r"^params.yaml: " + match):
        from_dict(Params, {"ppo": ppo}, "params.yaml: ")


def test_quantile_reward_scores_each_rollout_among_the_sft_policys_own(dirs):
    """ppo.quantile_reward_samples: the table holds k shaped scores of the SFT policy per distinct
    training prompt, equal to scoring a rollout of the reference sampled from the table's own stream
    (so the bits are reproducible); a step's scores are their log CDF, its raw ones the RM's."""
    from pipeline import devices
    from pipeline.ppo.quantile_reward import log_quantile
    from pipeline.ppo.scoring import shaped_scores
    k = 4
    params = _params(quantile_reward_samples=k, missing_eos_score=-3.0)
    cfg = params.ppo
    m = place_models(params, dirs / "sft", dirs / "rm")
    prompts = ["Review the film Silent River . Focus on the music ."] * 3 + ["Review the film Lost Harbor . Focus on the plot ."]
    table = stage.reference_scores(m, cfg, prompts, progress=False)
    assert list(table.by_prompt) == [prompts[0], prompts[3]] and all(v.shape == (k,) for v in table.by_prompt.values())
    # rollout_batch_size 8 rows per call: both prompts' 4 samples in one call, from seed + 104729's stream
    ro = rollout(m.ref, m.tok, [prompts[0]] * k + [prompts[3]] * k, cfg.sampling,
                 devices.generator("cpu", cfg.seed + 104729), cfg.max_prompt_length)
    want = shaped_scores(m.reward.score(ro.prompts, ro.responses), ro.ended, -3.0, None).view(2, k)
    torch.testing.assert_close(torch.stack([table.by_prompt[prompts[0]], table.by_prompt[prompts[3]]]), want)
    assert torch.equal(stage.reference_scores(m, cfg, prompts, progress=False).by_prompt[prompts[3]], want[1])

    trainer = PPOTrainer(cfg, m, prompts * 2)
    trainer.quantiles = table
    gen = torch.Generator().manual_seed(3)
    ro = rollout(m.actor.model, m.tok, prompts, cfg.sampling, gen)
    sc = score_rollout(m.actor.forward, m.ref, m.critic.model, m.reward, ro, 1.0, 2, -3.0, None, quantiles=table)
    reference = torch.stack([table.by_prompt[p] for p in prompts])
    torch.testing.assert_close(sc.scores, log_quantile(shaped_scores(sc.raw_scores, ro.ended, -3.0, None), reference))
    stats = trainer.step()
    assert math.log(0.5 / (k + 1)) <= stats["objective/scores"] <= math.log((k + 0.5) / (k + 1))
    assert stats["objective/source_scores"] != stats["objective/scores"]


def test_quantile_reward_run_resumes_to_the_same_run(dirs, tmp_path, monkeypatch):
    """The stage samples the table before training and again on resume: a killed-then-resumed run
    equals an uninterrupted one, and its step log has the reward source's own scores."""
    params = _params(quantile_reward_samples=3, detector=DetectorConfig(enabled=False))
    full = stage.run(params, dirs / "data", dirs / "sft", dirs / "rm", tmp_path / "full", progress=False)
    die_in_iteration(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        stage.run(params, dirs / "data", dirs / "sft", dirs / "rm", tmp_path / "resumed", progress=False)
    monkeypatch.undo()
    resumed = stage.run(params, dirs / "data", dirs / "sft", dirs / "rm", tmp_path / "resumed", progress=False)
    assert_same_run(tmp_path / "full", tmp_path / "resumed", full, resumed)
    with open(tmp_path / "full/train.tsv", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    assert all(float(r["objective/scores"]) <= math.log(3.5 / 4) for r in rows)
    assert len({r["objective/source_scores"] for r in rows}) == len(rows)


@pytest.mark.parametrize("ppo, match", [
    ({"quantile_reward_samples": 1}, r"ppo.quantile_reward_samples: one SFT response per prompt"),
    ({"quantile_reward_samples": 8, "whiten_rewards": True}, r"ppo.whiten_rewards: would rescale the log-CDF reward"),
])
def test_quantile_reward_keys_are_checked(ppo, match):
    with pytest.raises(ConfigError, match=r"^params.yaml: " + match):
        from_dict(Params, {"ppo": ppo}, "params.yaml: ")
