"""PPO math by equivalence: hand-computed tables from the seeds, plain
per-sample reference loops against the vectorised code, and micro-batch
accumulation against the full minibatch. float64 on CPU."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.ppo.advantages import (
    AdaptiveKLController, FixedKLController, assemble_rewards, explained_variance, gae, kl_penalty, masked_mean,
    masked_var, masked_whiten,
)
from pipeline.models.logprobs import entropy_from_logits, logprobs_from_logits
from pipeline.ppo.losses import policy_loss, value_loss

F64 = torch.float64


def ragged_mask(lengths: list[int], num_steps: int) -> torch.Tensor:
    """(B, R) bool right-padded mask with the given number of real tokens per row."""
    return torch.arange(num_steps)[None, :] < torch.tensor(lengths)[:, None]


def one_token(values: list[float]) -> torch.Tensor:
    """(B, 1) float64 column."""
    return torch.tensor(values, dtype=F64)[:, None]


# ---------------------------------------------------------------- policy loss

CLIP_TABLE = [  # seed 003 §3, eps = 0.2: (advantage, ratio, objective, clipped branch taken)
    (2.0, 1.5, 2.4, True),
    (-2.0, 0.5, -1.6, True),
    (-2.0, 1.5, -3.0, False),
    (2.0, 0.5, 1.0, False),
]


@pytest.mark.parametrize("advantage, ratio, objective, _clipped", CLIP_TABLE)
def test_clip_table_values(advantage: float, ratio: float, objective: float, _clipped: bool) -> None:
    loss, _ = policy_loss(
        logprobs=one_token([math.log(ratio)]),
        old_logprobs=one_token([0.0]),
        advantages=one_token([advantage]),
        response_mask=ragged_mask([1], 1),
        clip_eps=0.2,
    )
    assert loss.item() == pytest.approx(-objective, abs=1e-12)


def test_clip_table_gradient_zero_exactly_where_clipped() -> None:
    # The four table rows plus a fifth token inside [1 - eps, 1 + eps], where
    # both branches tie and neither is "clipped".
    advantages = one_token([a for a, _, _, _ in CLIP_TABLE] + [1.0])
    ratios = one_token([r for _, r, _, _ in CLIP_TABLE] + [1.1])
    logprobs = ratios.log().requires_grad_()
    loss, stats = policy_loss(logprobs, torch.zeros_like(ratios), advantages, ragged_mask([1] * 5, 1), 0.2)
    loss.backward()
    grad = logprobs.grad[:, 0]
    # Unclipped: d(-rho A / 5)/d log rho = -rho A / 5 (token mean over 5 tokens).
    expected = [0.0, 0.0, 2.0 * 1.5 / 5, -2.0 * 0.5 / 5, -1.1 / 5]
    assert grad.tolist() == pytest.approx(expected, abs=1e-12)
    assert grad[0].item() == 0.0 and grad[1].item() == 0.0  # exactly zero, not merely small
    assert [g != 0 for g in grad.tolist()] == [not clipped for *_, clipped in CLIP_TABLE] + [True]
    assert stats["policy/clipfrac"] == pytest.approx(2 / 5)
    assert stats["val/ratio_max"] == pytest.approx(1.5)
    assert stats["val/ratio"] == pytest.approx(5.1 / 5)


def test_seed000_good_action_high_ratio() -> None:
    loss, _ = policy_loss(one_token([math.log(1.5)]), one_token([0.0]), one_token([1.0]), ragged_mask([1], 1), 0.2)
    assert loss.item() == pytest.approx(-1.2, abs=1e-12)


def test_seed003_one_sgd_step_through_policy_loss() -> None:
    # Two-token model: p(good) = sigmoid(z), old p = 0.5, A = 1, lr = 0.2.
    z = torch.zeros(1, 1, dtype=F64, requires_grad=True)
    logprobs = torch.nn.functional.logsigmoid(z)
    loss, _ = policy_loss(logprobs, one_token([math.log(0.5)]), one_token([1.0]), ragged_mask([1], 1), 0.2)
    loss.backward()
    with torch.no_grad():
        z -= 0.2 * z.grad
    assert z.item() == pytest.approx(0.1, abs=1e-12)
    # seed 003 prints 0.5255 (a rounding typo); sigmoid(0.1) = 0.524979...
    assert torch.sigmoid(z).item() == pytest.approx(0.52498, abs=1e-5)


def test_dual_clip_values_and_gradients() -> None:
    # (A, rho): dual clip floor 3 * A = -6 applies only to the first row.
    advantages = one_token([-2.0, -2.0, 2.0, -2.0])
    ratios = one_token([5.0, 1.5, 5.0, 0.5])
    mask = ragged_mask([1] * 4, 1)
    expected_objective = [-6.0, -3.0, 2.4, -1.6]  # plain PPO would give -10 for the first row
    for row, objective in enumerate(expected_objective):
        loss, _ = policy_loss(ratios[row : row + 1].log(), torch.zeros(1, 1, dtype=F64),
                              advantages[row : row + 1], mask[:1], 0.2, dual_clip=3.0)
        assert loss.item() == pytest.approx(-objective, abs=1e-12)
    plain, _ = policy_loss(ratios[:1].log(), torch.zeros(1, 1, dtype=F64), advantages[:1], mask[:1], 0.2)
    assert plain.item() == pytest.approx(10.0, abs=1e-12)

    logprobs = ratios.log().requires_grad_()
    loss, stats = policy_loss(logprobs, torch.zeros_like(ratios), advantages, mask, 0.2, dual_clip=3.0)
    loss.backward()
    # Row 0 at the floor and rows 2, 3 PPO-clipped: zero; row 1: -rho A / 4.
    assert logprobs.grad[:, 0].tolist() == pytest.approx([0.0, 0.75, 0.0, 0.0], abs=1e-12)
    assert stats["policy/dual_clipfrac"] == pytest.approx(0.25)
    assert stats["policy/clipfrac"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logprobs, torch.zeros_like(ratios), advantages, mask, 0.2, dual_clip=1.0)


def test_policy_loss_ignores_garbage_on_pads() -> None:
    gen = torch.Generator().manual_seed(0)
    mask = ragged_mask([3, 1, 4], 4)
    old = -torch.rand(3, 4, generator=gen, dtype=F64)
    advantages = torch.randn(3, 4, generator=gen, dtype=F64)
    clean = (old + 0.1 * torch.randn(3, 4, generator=gen, dtype=F64)).requires_grad_()
    dirty = torch.where(mask, clean.detach(), torch.full_like(old, 1e4)).requires_grad_()
    loss_clean, stats_clean = policy_loss(clean, old, advantages, mask, 0.2)
    loss_dirty, stats_dirty = policy_loss(dirty, old, advantages, mask, 0.2)
    loss_clean.backward()
    loss_dirty.backward()
    assert loss_dirty.item() == pytest.approx(loss_clean.item(), abs=1e-12)
    assert torch.equal(dirty.grad, clean.grad)
    assert stats_dirty == pytest.approx(stats_clean)
    # Masked token mean: the same loss as a loop over real tokens.
    rho = (clean.detach() - old).exp()
    terms = [-min(rho[b, t] * advantages[b, t], rho[b, t].clamp(0.8, 1.2) * advantages[b, t]).item()
             for b in range(3) for t in range(4) if mask[b, t]]
    assert loss_clean.item() == pytest.approx(sum(terms) / len(terms), abs=1e-12)


# ----------------------------------------------------------------- value loss


def test_clipped_value_loss_matches_elementwise_formula() -> None:
    gen = torch.Generator().manual_seed(1)
    mask = ragged_mask([5, 2, 0, 4], 5)
    values, old_values, returns = (torch.randn(4, 5, generator=gen, dtype=F64) for _ in range(3))
    eps = 0.2
    loss, stats = value_loss(values, old_values, returns, mask, eps)
    terms, clipped = [], []
    for b in range(4):
        for t in range(5):
            if not mask[b, t]:
                continue
            v, v_old, ret = values[b, t].item(), old_values[b, t].item(), returns[b, t].item()
            v_clip = v_old + min(max(v - v_old, -eps), eps)
            terms.append(0.5 * max((v - ret) ** 2, (v_clip - ret) ** 2))
            clipped.append((v_clip - ret) ** 2 > (v - ret) ** 2)
    assert loss.item() == pytest.approx(sum(terms) / len(terms), abs=1e-12)
    assert stats["val/clipfrac"] == pytest.approx(sum(clipped) / len(clipped))
    assert 0 < sum(clipped) < len(clipped)  # both branches exercised

    unclipped, stats = value_loss(values, old_values, returns, mask, None)
    plain = [0.5 * (values[b, t] - returns[b, t]).item() ** 2 for b in range(4) for t in range(5) if mask[b, t]]
    assert unclipped.item() == pytest.approx(sum(plain) / len(plain), abs=1e-12)
    assert stats["val/clipfrac"] == 0.0


# ----------------------------------------------------- micro-batch accumulation


def test_micro_batch_accumulation_equals_full_minibatch() -> None:
    gen = torch.Generator().manual_seed(2)
    batch, num_steps, features, vocab = 6, 7, 5, 11
    mask = ragged_mask([7, 3, 5, 1, 6, 2], num_steps)
    inputs = torch.randn(batch, num_steps, features, generator=gen, dtype=F64)
    labels = torch.randint(vocab, (batch, num_steps), generator=gen)
    policy_head = torch.randn(features, vocab, generator=gen, dtype=F64)
    value_head = torch.randn(features, generator=gen, dtype=F64)
    with torch.no_grad():  # "old" quantities from a perturbed model, so some tokens clip
        old_logprobs = logprobs_from_logits(inputs @ (policy_head + 0.3), labels)
        old_values = inputs @ (value_head + 0.3)
    advantages = torch.randn(batch, num_steps, generator=gen, dtype=F64)
    returns = torch.randn(batch, num_steps, generator=gen, dtype=F64)

    def grads(rows: list[slice], denominator: float | None) -> list[torch.Tensor]:
        w_policy = policy_head.clone().requires_grad_()
        w_value = value_head.clone().requires_grad_()
        for s in rows:
            logprobs = logprobs_from_logits(inputs[s] @ w_policy, labels[s])
            pg, _ = policy_loss(logprobs, old_logprobs[s], advantages[s], mask[s], 0.2, 3.0, denominator)
            vf, _ = value_loss(inputs[s] @ w_value, old_values[s], returns[s], mask[s], 0.2, denominator)
            (pg + 0.5 * vf).backward()
        return [w_policy.grad, w_value.grad]

    full = grads([slice(0, batch)], None)
    micro = grads([slice(0, 2), slice(2, 5), slice(5, 6)], float(mask.sum()))
    for g_full, g_micro in zip(full, micro):
        assert g_full.abs().max() > 0
        assert torch.allclose(g_full, g_micro, rtol=1e-12, atol=1e-12)
    # Plain per-micro-batch token means weight tokens unevenly: a different gradient.
    naive = grads([slice(0, 2), slice(2, 5), slice(5, 6)], None)
    assert not torch.allclose(full[0], naive[0], rtol=1e-6, atol=1e-6)


# ----------------------------------------------------- rewards and advantages


def reference_gae(rewards: torch.Tensor, values: torch.Tensor, lengths: list[int],
                  gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample backward recursion as in seed 000 §16.2.4, with the state
    after the last real token terminal (value 0)."""
    advantages = torch.zeros_like(rewards)
    returns = torch.zeros_like(rewards)
    for b, length in enumerate(lengths):
        running = 0.0
        for t in reversed(range(length)):
            next_value = values[b, t + 1].item() if t + 1 < length else 0.0
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            running = delta + gamma * lam * running
            advantages[b, t] = running
            returns[b, t] = running + values[b, t].item()
    return advantages, returns


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
def test_gae_matches_per_sample_loop(gamma: float, lam: float) -> None:
    gen = torch.Generator().manual_seed(3)
    lengths = [8, 5, 0, 1, 3, 7]
    mask = ragged_mask(lengths, 8)
    rewards = torch.randn(6, 8, generator=gen, dtype=F64)
    values = torch.randn(6, 8, generator=gen, dtype=F64)  # pads hold garbage on purpose
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    ref_advantages, ref_returns = reference_gae(rewards, values, lengths, gamma, lam)
    assert torch.allclose(advantages, ref_advantages, rtol=1e-12, atol=1e-12)
    assert torch.allclose(returns, ref_returns, rtol=1e-12, atol=1e-12)
    assert not advantages[~mask].any() and not returns[~mask].any()


def test_gae_gamma_lam_one_is_reward_to_go_minus_value() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0, 9.0]], dtype=F64)  # 9.0 sits on a pad
    values = torch.tensor([[0.5, 0.25, 0.125, 9.0]], dtype=F64)
    advantages, returns = gae(rewards, values, ragged_mask([3], 4), 1.0, 1.0)
    assert returns.tolist() == [[1.0, 1.0, 1.0, 0.0]]
    assert advantages.tolist() == [[0.5, 0.75, 0.875, 0.0]]


def test_gae_rejects_holes_in_the_mask() -> None:
    mask = torch.tensor([[True, False, True]])
    with pytest.raises(ValueError, match="right-padded"):
        gae(torch.zeros(1, 3, dtype=F64), torch.zeros(1, 3, dtype=F64), mask, 1.0, 0.95)


def test_assemble_rewards_matches_loop() -> None:
    gen = torch.Generator().manual_seed(4)
    lengths = [6, 2, 0, 1, 4]
    mask = ragged_mask(lengths, 6)
    scores = torch.randn(5, generator=gen, dtype=F64)
    kl = torch.randn(5, 6, generator=gen, dtype=F64)
    kl_coef = 0.05
    rewards, stats = assemble_rewards(scores, kl, mask, kl_coef)
    expected = torch.zeros(5, 6, dtype=F64)
    for b, length in enumerate(lengths):
        for t in range(length):
            expected[b, t] = -kl_coef * kl[b, t]
        if length > 0:
            expected[b, length - 1] += scores[b]
    assert torch.allclose(rewards, expected, rtol=1e-12, atol=1e-12)
    non_score = [sum(-kl_coef * kl[b, t].item() for t in range(n)) for b, n in enumerate(lengths)]
    assert stats["objective/non_score_reward"] == pytest.approx(sum(non_score) / 5)
    assert stats["objective/kl"] == pytest.approx(-sum(non_score) / kl_coef / 5)
    assert stats["objective/rlhf_reward"] == pytest.approx((sum(non_score) + scores.sum().item()) / 5)


def test_masked_whiten_mean_zero_std_one_zero_pads() -> None:
    gen = torch.Generator().manual_seed(5)
    mask = ragged_mask([5, 3, 1, 4], 5)
    x = 3.0 + 2.0 * torch.randn(4, 5, generator=gen, dtype=F64)
    x = torch.where(mask, x, torch.full_like(x, 1e6))  # pads must not leak into the statistics
    white = masked_whiten(x, mask)
    real = white[mask]
    assert real.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert real.std().item() == pytest.approx(1.0, abs=1e-6)
    assert not white[~mask].any()
    kept = masked_whiten(x, mask, shift_mean=False)
    assert kept[mask].mean().item() == pytest.approx(x[mask].mean().item(), abs=1e-12)
    assert masked_var(x, mask).item() == pytest.approx(x[mask].var().item(), rel=1e-12)
    assert masked_mean(x, mask, dim=1).tolist() == pytest.approx([x[b][mask[b]].mean().item() for b in range(4)])


def test_explained_variance() -> None:
    gen = torch.Generator().manual_seed(6)
    mask = ragged_mask([4, 2, 3], 4)
    returns = torch.randn(3, 4, generator=gen, dtype=F64)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    constant = torch.full_like(returns, returns[mask].mean().item())
    assert explained_variance(constant, returns, mask) == pytest.approx(0.0, abs=1e-12)
    values = torch.randn(3, 4, generator=gen, dtype=F64)
    r, v = returns[mask], values[mask]
    expected = 1 - ((r - v).var(unbiased=False) / r.var(unbiased=False)).item()
    assert explained_variance(values, returns, mask) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_explained_variance_is_nan_for_returns_constant_up_to_rounding(dtype) -> None:
    """Returns assembled as (returns - values) + values in float32 are constant only up to rounding;
    their variance is noise, and the ratio once came out near -1e33 for most such batches."""
    gen = torch.Generator().manual_seed(7)
    for _ in range(100):
        c = float(torch.randn(1, generator=gen)) * 3
        mask = torch.rand(8, 20, generator=gen) > 0.3
        values = torch.randn(8, 20, generator=gen, dtype=dtype)
        returns = (torch.full((8, 20), c, dtype=dtype) - values) + values
        assert math.isnan(explained_variance(values, returns, mask))
    # A real spread just above rounding is still measured.
    returns = torch.full((8, 20), 2.0, dtype=dtype) + 1e-3 * torch.randn(8, 20, generator=gen, dtype=dtype)
    assert math.isfinite(explained_variance(returns, returns, mask))


# ------------------------------------------------------------------- KL


def test_kl_estimators_match_formulas() -> None:
    gen = torch.Generator().manual_seed(7)
    logprobs = -3 * torch.rand(4, 6, generator=gen, dtype=F64)
    ref_logprobs = -3 * torch.rand(4, 6, generator=gen, dtype=F64)
    k1, k2, k3 = (kl_penalty(logprobs, ref_logprobs, e) for e in ("k1", "k2", "k3"))
    for b in range(4):
        for t in range(6):
            lp, lr = logprobs[b, t].item(), ref_logprobs[b, t].item()
            assert k1[b, t].item() == pytest.approx(lp - lr, abs=1e-12)
            assert k2[b, t].item() == pytest.approx(0.5 * (lp - lr) ** 2, abs=1e-12)
            assert k3[b, t].item() == pytest.approx(math.exp(lr - lp) - (lr - lp) - 1, abs=1e-12)
    assert (k3 >= 0).all() and (k2 >= 0).all()
    for estimator in ("k1", "k2", "k3"):
        assert not kl_penalty(logprobs, logprobs, estimator).any()
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(logprobs, ref_logprobs, "k4")  # type: ignore[arg-type]


def test_k1_k3_are_unbiased_for_true_kl() -> None:
    gen = torch.Generator().manual_seed(8)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=F64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=F64)
    true_kl = (p * (p / q).log()).sum().item()
    tokens = torch.multinomial(p, 400_000, replacement=True, generator=gen)[None, :]
    logprobs, ref_logprobs = p.log()[tokens], q.log()[tokens]
    for estimator in ("k1", "k3"):
        assert kl_penalty(logprobs, ref_logprobs, estimator).mean().item() == pytest.approx(true_kl, abs=3e-3)


def test_adaptive_kl_controller_update_and_state_dict() -> None:
    controller = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10_000)
    # error = clip(6.6 / 6 - 1, -0.2, 0.2) = 0.1; beta = 0.1 * (1 + 0.1 * 256 / 10000)
    assert controller.update(current_kl=6.6, n_steps=256) == pytest.approx(0.100256, abs=1e-15)
    # error = clip(12 / 6 - 1) = 0.2 (clipped); beta *= 1 + 0.2 * 512 / 10000
    assert controller.update(current_kl=12.0, n_steps=512) == pytest.approx(0.100256 * 1.01024, abs=1e-15)
    # error = clip(0 / 6 - 1) = -0.2 (clipped)
    low = AdaptiveKLController(0.1, 6.0, 10_000)
    assert low.update(0.0, 1000) == pytest.approx(0.1 * 0.98, abs=1e-15)

    restored = AdaptiveKLController(init_kl_coef=0.5, target=6.0, horizon=10_000)
    restored.load_state_dict(controller.state_dict())
    assert restored.kl_coef == controller.kl_coef
    assert restored.update(7.0, 64) == controller.update(7.0, 64)
    with pytest.raises(ValueError, match="adaptive"):
        restored.load_state_dict(FixedKLController(0.2).state_dict())


def test_fixed_kl_controller() -> None:
    controller = FixedKLController(0.05)
    assert controller.update(100.0, 1000) == 0.05
    other = FixedKLController(0.2)
    other.load_state_dict(controller.state_dict())
    assert other.kl_coef == 0.05


# ------------------------------------------------------------ from logits


def test_logprobs_and_entropy_from_logits() -> None:
    gen = torch.Generator().manual_seed(9)
    logits = 5 * torch.randn(3, 4, 13, generator=gen, dtype=F64)
    labels = torch.randint(13, (3, 4), generator=gen)
    log_softmax = torch.log_softmax(logits, dim=-1)
    expected_logprobs = log_softmax.gather(-1, labels[..., None]).squeeze(-1)
    expected_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    assert torch.allclose(logprobs_from_logits(logits, labels), expected_logprobs, rtol=1e-12, atol=1e-12)
    assert torch.allclose(entropy_from_logits(logits), expected_entropy, rtol=1e-12, atol=1e-12)
    # Shift invariance with huge logits: a naive exp would overflow.
    shifted = logits + 1e4
    assert torch.allclose(logprobs_from_logits(shifted, labels), expected_logprobs, atol=1e-9)
    assert torch.allclose(entropy_from_logits(shifted), expected_entropy, atol=1e-9)
    assert entropy_from_logits(torch.zeros(1, 1, 13, dtype=F64)).item() == pytest.approx(math.log(13))


def test_logprobs_from_logits_gradient_matches_log_softmax() -> None:
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(2, 3, 7, generator=gen, dtype=F64)
    labels = torch.randint(7, (2, 3), generator=gen)
    weights = torch.randn(2, 3, generator=gen, dtype=F64)
    ours = logits.clone().requires_grad_()
    (logprobs_from_logits(ours, labels) * weights).sum().backward()
    reference = logits.clone().requires_grad_()
    (torch.log_softmax(reference, -1).gather(-1, labels[..., None]).squeeze(-1) * weights).sum().backward()
    assert torch.allclose(ours.grad, reference.grad, rtol=1e-12, atol=1e-12)
    ours.grad = None
    (entropy_from_logits(ours) * weights).sum().backward()
    reference.grad = None
    log_p = torch.log_softmax(reference, -1)
    (-(log_p.exp() * log_p).sum(-1) * weights).sum().backward()
    assert torch.allclose(ours.grad, reference.grad, rtol=1e-12, atol=1e-12)


def test_adaptive_kl_in_iterations_reaches_its_target() -> None:
    """The horizon in iterations, one update per iteration: a policy whose KL answers the coefficient
    as KL = 1.2 / beta (6 nats at the initial 0.2) settles within 5% of a 3-nat target in 100
    iterations at horizon 10, and not at all with an episode count taken as iterations."""
    for horizon, settles in ((10.0, True), (10_000.0, False)):
        controller = AdaptiveKLController(init_kl_coef=0.2, target=3.0, horizon=horizon)
        for _ in range(100):
            kl = 1.2 / controller.kl_coef
            controller.update(kl, 1)
        assert (abs(1.2 / controller.kl_coef - 3.0) < 0.15) is settles


def test_update_chunks_under_a_budget_fill_it_with_the_trimmed_width() -> None:
    """PPO's micro-batches by a token budget: every row once, longest response first; each
    micro-batch's trimmed rollout (left-padded prompts, right-padded responses, `select(trim=True)`)
    holds rows x (its longest prompt + its longest response) tokens, within the budget unless a
    row alone exceeds it, and no micro-batch could have taken the next row. One long prompt in the
    rollout does not shrink the micro-batches of the short ones (the cut counts each micro-batch's
    own prompts, not the rollout's widest)."""
    from pipeline.ppo.rollout import Rollout
    from pipeline.ppo.scoring import update_chunks

    gen = torch.Generator().manual_seed(0)
    prompts = [120] + torch.randint(5, 40, (15,), generator=gen).tolist()      # one long prompt
    responses = torch.randint(1, 60, (16,), generator=gen).tolist()
    P, R = max(prompts), max(responses)
    prompt_mask = torch.arange(P)[None, :] >= P - torch.tensor(prompts)[:, None]   # (16, P) left-padded
    response_mask = ragged_mask(responses, R)                                       # (16, R) right-padded
    attention = torch.cat([prompt_mask, response_mask], 1).long()                   # (16, P + R)
    ids = torch.where(attention.bool(), 7, 0)
    ro = Rollout([""] * 16, [""] * 16, ids, attention, response_mask, torch.ones(16, dtype=torch.bool), P)
    prompt_lengths = attention[:, :P].sum(1)
    rows = torch.randperm(16, generator=gen)
    budget = 400
    parts = update_chunks(response_mask, rows, 4, prompt_lengths, budget)
    order = torch.cat(parts)
    assert sorted(order.tolist()) == list(range(16))
    assert (response_mask[order].sum(1).diff() <= 0).all()            # longest response first
    for k, part in enumerate(parts):
        trimmed = ro.select(part, trim=True).input_ids                 # (rows, its longest prompt + response)
        width = max(prompts[i] for i in part.tolist()) + max(responses[i] for i in part.tolist())
        assert trimmed.shape == (len(part), width)
        assert trimmed.numel() <= budget or len(part) == 1
        if k + 1 < len(parts):                                          # the next row would not have fitted
            nxt = int(parts[k + 1][0])
            grown = max(prompts[i] for i in part.tolist() + [nxt]) + max(responses[i] for i in part.tolist())
            assert (len(part) + 1) * grown > budget
    # Against counting every row at the rollout's prompt width (P): fewer, fuller micro-batches.
    wide = update_chunks(response_mask, rows, 4, torch.full((16,), P), budget)
    assert len(parts) < len(wide)
    # Without a budget: fixed runs of `size` rows, longest response first.
    fixed = update_chunks(response_mask, rows, 4, prompt_lengths, None)
    assert [len(p) for p in fixed] == [4, 4, 4, 4]
