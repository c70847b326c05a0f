"""Offline preference losses (DPO, conservative DPO, IPO summed and averaged, SimPO) on
hand-computed two-pair cases, their gradients by autograd against the closed forms, their registry;
KTO's loss against the paper's formula written with floats and its reference point (clamped,
detached); the per-sequence log-probs against a per-pair loop, and cached reference log-probs
against a frozen reference model run on the fly."""

import copy
import inspect
import math
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from pipeline.preference.logprobs import (TokenPair, pair_logprobs, reference_logprobs, response_lengths,
                                          sequence_logprobs)
from pipeline.preference.losses import PREFERENCE_LOSSES, dpo_loss, ipo_loss, kto_loss, reference_point, simpo_loss

D = torch.float64


def two_pairs():
    """Pair 1: the policy raised chosen by 1 nat and lowered rejected by 1 nat vs the reference
    (h = 2); pair 2: policy = reference (h = 0). Lengths |y_c| = (2, 4), |y_r| = (4, 2)."""
    t = lambda *v: torch.tensor(v, dtype=D)  # noqa: E731
    return dict(logp_chosen=t(-4.0, -3.0), logp_rejected=t(-6.0, -2.0), ref_chosen=t(-5.0, -3.0),
                ref_rejected=t(-5.0, -2.0)), t(2.0, 4.0), t(4.0, 2.0)


def test_dpo_hand_case():
    x, _, _ = two_pairs()
    loss, stats = dpo_loss(**x, beta=0.5)
    # beta h = (1, 0): -logsigmoid(1) = log(1 + e^-1) = 0.31326168751822286; -logsigmoid(0) = log 2.
    assert loss.item() == pytest.approx((0.31326168751822286 + 0.6931471805599453) / 2, abs=1e-15)
    assert stats["loss"] == pytest.approx(0.5032044340390841, abs=1e-15)
    # Rewards beta (logp - ref): chosen (0.5, 0), rejected (-0.5, 0); pair 2 is a tie, counted wrong.
    assert stats["rewards/chosen"] == 0.25 and stats["rewards/rejected"] == -0.25
    assert stats["rewards/accuracy"] == 0.5 and stats["rewards/margin"] == 0.5
    assert stats["logps/chosen"] == -3.5 and stats["logps/rejected"] == -4.0


def test_conservative_dpo_hand_case():
    x, _, _ = two_pairs()
    loss, _ = dpo_loss(**x, beta=0.5, label_smoothing=0.1)
    # Pair 1: 0.9 log(1 + e^-1) + 0.1 log(1 + e) = 0.9 * 0.31326168751822286 + 0.1 * 1.3132616875182228
    #       = 0.41326168751822285; pair 2: 0.9 log 2 + 0.1 log 2 = log 2. Mean 0.5532044340390841.
    assert loss.item() == pytest.approx(0.5532044340390841, abs=1e-15)


def test_ipo_hand_case_summed_and_averaged():
    x, len_c, len_r = two_pairs()
    # Summed: target 1 / (2 * 0.5) = 1; h = (2, 0) -> ((2 - 1)^2 + (0 - 1)^2) / 2 = 1.
    loss, stats = ipo_loss(**x, beta=0.5)
    assert loss.item() == 1.0 and stats["rewards/margin"] == 0.5
    # Averaged (TRL): h = (1 / 2 - (-1) / 4, 0) = (0.75, 0) -> ((0.75 - 1)^2 + 1) / 2 = 0.53125.
    loss, stats = ipo_loss(**x, beta=0.5, chosen_lengths=len_c, rejected_lengths=len_r)
    assert loss.item() == 0.53125
    # Rewards 0.5 * averaged log-ratios: chosen (0.25, 0), rejected (-0.125, 0).
    assert stats["rewards/chosen"] == 0.125 and stats["rewards/rejected"] == -0.0625
    assert stats["logps/chosen"] == -3.5   # log-probs stay summed


def test_simpo_hand_case():
    x, len_c, len_r = two_pairs()
    loss, stats = simpo_loss(x["logp_chosen"], x["logp_rejected"], len_c, len_r, beta=2.0, gamma=0.5)
    # Pair 1: averages -4/2 = -2, -6/4 = -1.5; z = 2 (-2 + 1.5) - 0.5 = -1.5, -logsigmoid(-1.5) = log(1 + e^1.5)
    #         = 1.7014132779827524. Pair 2: -3/4, -2/2; z = 2 (0.25) - 0.5 = 0 -> log 2.
    assert loss.item() == pytest.approx((1.7014132779827524 + 0.6931471805599453) / 2, abs=1e-15)
    # Rewards 2 * average log-prob: chosen (-4, -1.5), rejected (-3, -2): only pair 2 ranks chosen first.
    assert stats["rewards/chosen"] == -2.75 and stats["rewards/rejected"] == -2.5
    assert stats["rewards/accuracy"] == 0.5 and stats["rewards/margin"] == -0.25


def _grads(loss_fn, logp_c, logp_r, **kw):
    logp_c, logp_r = logp_c.clone().requires_grad_(True), logp_r.clone().requires_grad_(True)
    loss, _ = loss_fn(logp_c, logp_r, **kw)
    return torch.autograd.grad(loss, (logp_c, logp_r))


@pytest.fixture
def random_batch():
    gen = torch.Generator().manual_seed(0)
    n = 7
    r = lambda: -10 * torch.rand(n, generator=gen, dtype=D)  # noqa: E731
    lengths = lambda: torch.randint(1, 12, (n,), generator=gen).to(D)  # noqa: E731
    return n, r(), r(), r(), r(), lengths(), lengths()


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_dpo_gradient_closed_form(random_batch, eps):
    n, lc, lr, rc, rr, _, _ = random_batch
    beta = 0.7
    gc, gr = _grads(lambda a, b: dpo_loss(a, b, rc, rr, beta=beta, label_smoothing=eps), lc, lr)
    h = (lc - rc) - (lr - rr)
    expected = (-beta * (1 - eps) * torch.sigmoid(-beta * h) + beta * eps * torch.sigmoid(beta * h)) / n
    assert torch.allclose(gc, expected, rtol=0, atol=1e-14)
    assert torch.allclose(gr, -expected, rtol=0, atol=1e-14)


def test_conservative_dpo_has_a_finite_minimiser():
    """With eps > 0 the gradient vanishes at beta h = log((1 - eps) / eps) (plain DPO's never does)."""
    beta, eps = 0.5, 0.1
    h = math.log((1 - eps) / eps) / beta
    gc, _ = _grads(lambda a, b: dpo_loss(a, b, torch.zeros(1, dtype=D), torch.zeros(1, dtype=D), beta=beta,
                                         label_smoothing=eps), torch.tensor([h], dtype=D), torch.zeros(1, dtype=D))
    assert abs(gc.item()) < 1e-15


@pytest.mark.parametrize("averaged", [False, True])
def test_ipo_gradient_closed_form(random_batch, averaged):
    n, lc, lr, rc, rr, len_c, len_r = random_batch
    beta = 0.3
    kw = dict(chosen_lengths=len_c, rejected_lengths=len_r) if averaged else {}
    gc, gr = _grads(lambda a, b: ipo_loss(a, b, rc, rr, beta=beta, **kw), lc, lr)
    div_c, div_r = (len_c, len_r) if averaged else (1.0, 1.0)
    h = (lc - rc) / div_c - (lr - rr) / div_r
    dh = 2 * (h - 1 / (2 * beta)) / n
    assert torch.allclose(gc, dh / div_c, rtol=0, atol=1e-13)
    assert torch.allclose(gr, -dh / div_r, rtol=0, atol=1e-13)


def test_simpo_gradient_closed_form(random_batch):
    n, lc, lr, _, _, len_c, len_r = random_batch
    beta, gamma = 2.5, 0.4
    gc, gr = _grads(lambda a, b: simpo_loss(a, b, len_c, len_r, beta=beta, gamma=gamma), lc, lr)
    z = beta * (lc / len_c - lr / len_r) - gamma
    assert torch.allclose(gc, -torch.sigmoid(-z) * beta / len_c / n, rtol=0, atol=1e-14)
    assert torch.allclose(gr, torch.sigmoid(-z) * beta / len_r / n, rtol=0, atol=1e-14)


def test_bad_inputs_are_refused():
    x, len_c, len_r = two_pairs()
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(**x, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(**x, beta=0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match=r"ref_rejected has 1 entries, expected 2"):
        dpo_loss(**{**x, "ref_rejected": torch.zeros(1, dtype=D)}, beta=0.1)
    with pytest.raises(ValueError, match=r"logp_chosen must be \(N,\)"):
        dpo_loss(**{**x, "logp_chosen": torch.zeros(2, 3, dtype=D)}, beta=0.1)
    with pytest.raises(ValueError, match="both chosen_lengths and rejected_lengths"):
        ipo_loss(**x, beta=0.1, chosen_lengths=len_c)
    with pytest.raises(ValueError, match="rejected_lengths must be > 0"):
        simpo_loss(x["logp_chosen"], x["logp_rejected"], len_c, torch.tensor([1.0, 0.0]), beta=1.0, gamma=0.0)
    with pytest.raises(ValueError, match="gamma"):
        simpo_loss(x["logp_chosen"], x["logp_rejected"], len_c, len_r, beta=1.0, gamma=-0.1)
    with pytest.raises(ValueError, match="a batch needs at least one pair or example"):
        simpo_loss(torch.zeros(0, dtype=D), torch.zeros(0, dtype=D), len_c[:0], len_r[:0], beta=1.0, gamma=0.0)


def test_registered_losses_take_what_their_facts_say():
    """`dpo.method`'s values, and each loss called as the dpo stage calls it (the inputs its facts
    name, keywords only) equal to the call by position."""
    assert PREFERENCE_LOSSES.names() == ("dpo", "ipo", "simpo")
    x, len_c, len_r = two_pairs()
    options = {"label_smoothing": 0.1, "gamma": 0.5}
    by_position = {"dpo": dpo_loss(*x.values(), 0.5, 0.1), "ipo": ipo_loss(*x.values(), 0.5),
                   "simpo": simpo_loss(x["logp_chosen"], x["logp_rejected"], len_c, len_r, 0.5, 0.5)}
    for name in PREFERENCE_LOSSES.names():
        facts = PREFERENCE_LOSSES.facts(name)
        given = {"logp_chosen": x["logp_chosen"], "logp_rejected": x["logp_rejected"], "beta": 0.5,
                 **({"ref_chosen": x["ref_chosen"], "ref_rejected": x["ref_rejected"]} if facts["reference"] else {}),
                 **({"chosen_lengths": len_c, "rejected_lengths": len_r} if facts["lengths"] else {}),
                 **{k: options[k] for k in facts["options"]}}
        assert set(given) <= set(inspect.signature(PREFERENCE_LOSSES[name]).parameters)
        loss, stats = PREFERENCE_LOSSES[name](**given)
        assert loss.item() == by_position[name][0].item() and stats == by_position[name][1]
    assert not PREFERENCE_LOSSES.facts("simpo")["reference"]   # SimPO's training pairs need no reference pass
    with pytest.raises(ValueError, match="preference loss must be one of 'dpo', 'ipo', 'simpo', got 'kto'"):
        PREFERENCE_LOSSES["kto"]


# --- KTO --------------------------------------------------------------------------------------------

def kto_by_hand(logp, ref, desirable, kl, kl_ref, beta, lam_d, lam_u) -> tuple[float, float]:
    """The paper's loss with floats and loops: (mean over examples, z_ref)."""
    z = max(0.0, sum(a - b for a, b in zip(kl, kl_ref)) / len(kl))
    sig = lambda t: 1.0 / (1.0 + math.exp(-t))  # noqa: E731
    total = 0.0
    for lp, rf, d in zip(logp, ref, desirable):
        r = lp - rf
        total += lam_d * (1 - sig(beta * (r - z))) if d else lam_u * (1 - sig(beta * (z - r)))
    return total / len(logp), z


def kto_batch(n: int, seed: int):
    g = random.Random(seed)
    logp = [g.uniform(-40, -5) for _ in range(n)]
    ref = [lp + g.gauss(0, 2) for lp in logp]
    kl = [g.uniform(-60, -10) for _ in range(n)]
    kl_ref = [k - g.gauss(0.3, 1) for k in kl]   # an estimate around 0.3, below 0 for some seeds
    des = [g.random() < 0.5 for _ in range(n)]
    des[0], des[-1] = True, False
    return logp, ref, des, kl, kl_ref


@pytest.mark.parametrize("n,seed,beta,lam_d,lam_u", [(2, 0, 0.1, 1.0, 1.0), (7, 1, 2.0, 1.0, 1.5),
                                                     (32, 2, 0.5, 1.33, 1.0), (5, 3, 5.0, 0.5, 2.0)])
def test_kto_loss_equals_the_formula_by_hand(n, seed, beta, lam_d, lam_u):
    logp, ref, des, kl, kl_ref = kto_batch(n, seed)
    z = reference_point(torch.tensor(kl, dtype=D), torch.tensor(kl_ref, dtype=D))
    terms, rewards = kto_loss(torch.tensor(logp, dtype=D), torch.tensor(ref, dtype=D), torch.tensor(des), z,
                              beta, lam_d, lam_u)
    want, want_z = kto_by_hand(logp, ref, des, kl, kl_ref, beta, lam_d, lam_u)
    assert float(z) == pytest.approx(want_z, abs=1e-12)
    assert float(terms.mean()) == pytest.approx(want, rel=1e-12)
    assert rewards.tolist() == pytest.approx([beta * (a - b) for a, b in zip(logp, ref)], rel=1e-12)


def test_kto_reference_point_is_clamped_and_carries_no_gradient():
    kl = torch.tensor([-10.0, -12.0], dtype=D, requires_grad=True)
    assert float(reference_point(kl, torch.tensor([-9.0, -11.0], dtype=D))) == 0.0   # estimate -1: clamped
    z = reference_point(kl, torch.tensor([-11.0, -13.0], dtype=D))
    assert float(z) == 1.0 and not z.requires_grad
    logp = torch.tensor([-5.0, -6.0], dtype=D, requires_grad=True)
    terms, _ = kto_loss(logp, torch.tensor([-5.0, -5.0], dtype=D), torch.tensor([True, False]), z, 1.0)
    terms.sum().backward()
    assert kl.grad is None
    # A desirable response is pushed up, an undesirable one down.
    assert logp.grad[0] < 0 < logp.grad[1]
    with pytest.raises(ValueError, match="detached scalar"):
        kto_loss(logp, logp.detach(), torch.tensor([True, False]), kl.mean(), 1.0)
    with pytest.raises(ValueError, match=r"\(N,\)"):
        kto_loss(logp[None], logp.detach()[None], torch.tensor([[True, False]]), z, 1.0)
    with pytest.raises(ValueError, match="kl_ref_logp has 3 entries, expected 2"):
        reference_point(kl, torch.zeros(3, dtype=D))


def test_kto_lambdas_weigh_each_kind():
    logp, ref, des, kl, kl_ref = kto_batch(9, 4)
    z = reference_point(torch.tensor(kl, dtype=D), torch.tensor(kl_ref, dtype=D))
    args = (torch.tensor(logp, dtype=D), torch.tensor(ref, dtype=D), torch.tensor(des), z, 1.0)
    one, _ = kto_loss(*args, 1.0, 1.0)
    two, _ = kto_loss(*args, 1.0, 2.0)
    undesirable = ~torch.tensor(des)
    assert torch.equal(two[~undesirable], one[~undesirable])
    assert torch.allclose(two[undesirable], 2 * one[undesirable], rtol=0, atol=1e-15)


# --- log-probs of a causal LM -----------------------------------------------------------------

def tiny_lm(seed: int = 0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(cfg)


def random_pairs(n: int, seed: int) -> list[TokenPair]:
    gen = torch.Generator().manual_seed(seed)
    ids = lambda lo, hi: torch.randint(3, 40, (int(torch.randint(lo, hi, (1,), generator=gen)),),  # noqa: E731
                                       generator=gen).tolist()
    return [TokenPair([1] + ids(1, 6), ids(1, 7) + [2], ids(1, 7) + [2]) for _ in range(n)]


def test_sequence_logprobs_equal_a_per_pair_loop():
    torch.set_num_threads(1)
    model = tiny_lm()
    pairs = random_pairs(5, seed=1)
    with torch.no_grad():
        chosen, rejected = pair_logprobs(model, pairs, pad_id=0)
        for i, p in enumerate(pairs):
            for resp, got in ((p.chosen, chosen[i]), (p.rejected, rejected[i])):
                ids = torch.tensor([p.prompt + resp])  # (1, T), no padding at all
                logits = model(input_ids=ids).logits[0].float()  # (T, V)
                # Position t predicts token t + 1: the response is predicted by positions |x| - 1 .. T - 2.
                lp = F.log_softmax(logits[len(p.prompt) - 1:-1], dim=-1)
                expected = lp.gather(1, torch.tensor(resp)[:, None]).sum()
                assert got.item() == pytest.approx(expected.item(), abs=1e-5)
        # The pad id never matters: pads are masked out of attention and of the sum.
        again, _ = pair_logprobs(model, pairs, pad_id=7)
        assert torch.allclose(again, chosen, atol=1e-5)
    lengths_c, lengths_r = response_lengths(pairs)
    assert lengths_c.tolist() == [len(p.chosen) for p in pairs]
    _, lengths = sequence_logprobs(model, [p.prompt for p in pairs], [p.rejected for p in pairs], 0)
    assert torch.equal(lengths, lengths_r)


def _train_dpo(policy, pairs, ref_of_batch, steps: int = 3, batch: int = 4):
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    for step in range(steps):
        lo = (step * batch) % len(pairs)
        logp_c, logp_r = pair_logprobs(policy, pairs[lo:lo + batch], pad_id=0)
        ref_c, ref_r = ref_of_batch(lo, lo + batch)
        loss, _ = dpo_loss(logp_c, logp_r, ref_c, ref_r, beta=0.5, label_smoothing=0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return policy


def test_cached_reference_logprobs_train_exactly_like_a_frozen_reference():
    """3 DPO steps with reference log-probs computed once before training give the same weights as
    3 steps computing them on the fly from a frozen copy of the initial policy."""
    torch.set_num_threads(1)
    pairs = random_pairs(8, seed=2)
    initial = tiny_lm(seed=3)

    # Cached: one pass over all pairs before training, same batches as training (same padding).
    policy = copy.deepcopy(initial)
    ref_c, ref_r = reference_logprobs(policy, pairs, batch_size=4)
    assert ref_c.shape == ref_r.shape == (8,) and ref_c.dtype == torch.float32 and not ref_c.requires_grad
    assert policy.training   # the reference pass restored train mode
    cached = _train_dpo(policy, pairs, lambda lo, hi: (ref_c[lo:hi], ref_r[lo:hi]))

    # On the fly: a frozen copy of the initial policy resident during training.
    frozen = copy.deepcopy(initial).eval().requires_grad_(False)

    def on_the_fly(lo, hi):
        with torch.no_grad():
            return pair_logprobs(frozen, pairs[lo:hi], pad_id=0)
    live = _train_dpo(copy.deepcopy(initial), pairs, on_the_fly)

    moved = max((a - b).abs().max().item() for a, b in zip(cached.parameters(), initial.parameters()))
    assert moved > 1e-3   # training changed the weights, so equality below means something
    for (name, a), b in zip(cached.named_parameters(), live.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), name
    assert all(torch.equal(a, b) for a, b in zip(frozen.parameters(), initial.parameters()))
    # Another reference batch size pads differently; the log-probs agree to float32 rounding.
    ref_c2, ref_r2 = reference_logprobs(initial, pairs, batch_size=3)
    assert torch.allclose(ref_c2, ref_c, atol=1e-5) and torch.allclose(ref_r2, ref_r, atol=1e-5)
    with pytest.raises(ValueError, match="batch_size"):
        reference_logprobs(initial, pairs, batch_size=0)
