"""Sampling: KV-cached log-probs equal a full forward pass; masks stop at eos; filters are right."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

import fake_device
from pipeline.config import SamplingConfig
from pipeline.data.padding import left_pad, right_pad
from pipeline.models.generation import (SYNC_EVERY, cache_keyword, device_stream, filter_logits, kv_cache, race,
                                        sample)

EOS, PAD = 1, 0


def _tiny(arch: str):
    torch.manual_seed(0)
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, bos_token_id=2, eos_token_id=EOS,
                          pad_token_id=PAD)
    else:
        cfg = GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=2,
                         eos_token_id=EOS, pad_token_id=PAD, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _full_forward_logprobs(model, out, temperature):
    ids = torch.cat([out.prompt_ids, out.response_ids], 1)
    mask = torch.cat([out.prompt_mask, out.response_mask], 1).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    P = out.prompt_ids.size(1)
    logp = torch.log_softmax(logits[:, P - 1:-1].float() / temperature, -1)
    return logp.gather(-1, out.response_ids[..., None]).squeeze(-1)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_kv_cached_logprobs_equal_full_forward(arch):
    model = _tiny(arch)
    prompts = [[2, 5, 6, 7, 8, 9], [2, 10, 11], [2, 12, 13, 14]]
    cfg = SamplingConfig(max_new_tokens=12, temperature=0.7)
    out = sample(model, prompts, PAD, [EOS], cfg, torch.Generator().manual_seed(3))
    full = _full_forward_logprobs(model, out, 0.7)
    m = out.response_mask
    assert m.any()
    assert torch.allclose(full[m], out.logprobs[m], atol=1e-5)
    assert (out.logprobs[~m] == 0).all()


def test_left_padded_prompt_samples_like_unpadded():
    """A prompt's greedy continuation must not depend on the other prompts in its batch."""
    model = _tiny("llama")
    cfg = SamplingConfig(max_new_tokens=8)
    alone = sample(model, [[2, 10, 11]], PAD, [EOS], cfg, greedy=True)
    batched = sample(model, [[2, 5, 6, 7, 8, 9], [2, 10, 11]], PAD, [EOS], cfg, greedy=True)
    n = alone.response_ids.size(1)
    assert torch.equal(alone.response_ids[0], batched.response_ids[1, :n])


def test_response_mask_stops_after_first_eos():
    model = _tiny("llama")
    # Force eos to be likely: bias the output layer towards it.
    with torch.no_grad():
        model.lm_head.weight[EOS] += 0.5
    out = sample(model, [[2, 3, 4]] * 8, PAD, [EOS], SamplingConfig(max_new_tokens=10),
                 torch.Generator().manual_seed(0))
    for ids, mask, ended in zip(out.response_ids, out.response_mask, out.ended):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()       # a contiguous prefix
        assert (ids[n:] == PAD).all()
        assert bool(ended) == (ids[n - 1].item() == EOS)
        assert (ids[:n - 1] != EOS).all()                  # eos only as the last real token


def test_left_and_right_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[True, True, True], [False, False, True]]
    ids, mask = right_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert mask.tolist() == [[True, True, True], [True, False, False]]


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    k2 = filter_logits(logits, top_k=2, top_p=1.0)
    assert torch.isfinite(k2).tolist() == [[True, True, False, False, False]]
    # top_p 0.6: 0.5 alone is below 0.6, so the second token is kept; the third is not.
    p6 = filter_logits(logits, top_k=0, top_p=0.6)
    assert torch.isfinite(p6).tolist() == [[True, True, False, False, False]]
    p5 = filter_logits(logits, top_k=0, top_p=0.5)
    assert torch.isfinite(p5).tolist() == [[True, False, False, False, False]]
    assert torch.equal(filter_logits(logits, 0, 1.0), logits)


def test_stop_token_ends_response_and_is_kept():
    model = _tiny("llama")
    STOP = 7
    with torch.no_grad():
        model.lm_head.weight[STOP] += 0.6   # make the stop token likely
    out = sample(model, [[2, 3, 4]] * 8, PAD, [EOS, STOP], SamplingConfig(max_new_tokens=10),
                 torch.Generator().manual_seed(0))
    assert out.ended.any()
    for ids, mask, ended in zip(out.response_ids, out.response_mask, out.ended):
        n = int(mask.sum())
        assert not ((ids[:n - 1] == STOP) | (ids[:n - 1] == EOS)).any()   # nothing after a stop
        assert bool(ended) == (ids[n - 1].item() in (STOP, EOS))


def test_stop_token_must_be_one_token():
    from pipeline.errors import ConfigError
    from pipeline.models.generation import stop_token_id
    from pipeline.tasks.reviews import vocabulary
    from pipeline.data.tokenizer import build_word_tokenizer
    tok = build_word_tokenizer(vocabulary())
    assert stop_token_id(tok, SamplingConfig()) is None
    assert stop_token_id(tok, SamplingConfig(stop_token=".")) == tok.convert_tokens_to_ids(".")
    with pytest.raises(ConfigError, match="sampling.stop_token: 'not a token' is not a single token"):
        stop_token_id(tok, SamplingConfig(stop_token="not a token"))


def test_a_bad_stop_token_is_named_by_its_full_key_in_every_stage():
    """Each stage checks the sampling sections it declares, each named from the top of params."""
    from pipeline.config import Params
    from pipeline.data.tokenizer import build_word_tokenizer
    from pipeline.errors import ConfigError
    from pipeline.models.generation import check_stop_tokens
    from pipeline.stages import registry
    from pipeline.stages.spec import declared_of_type
    from pipeline.tasks.reviews import vocabulary
    tok = build_word_tokenizer(vocabulary())
    found = {name: list(declared_of_type(Params(), spec, SamplingConfig))
             for name, spec in registry.specs().items()}
    assert found["sft"] == found["reward"] == ["sft.sampling"] and found["evaluate"] == ["prompts.sampling"]
    for name in ("ppo", "grpo", "rs", "onpolicy_dpo"):
        assert found[name] == sorted(["prompts.sampling", f"{name}.sampling"]), name
    assert found["dpo"] == found["kto"] == found["compare"] == ["prompts.sampling"] and found["prepare"] == []
    for key in sorted({k for keys in found.values() for k in keys}):
        sections = {k: SamplingConfig(stop_token="good film" if k == key else ".")
                    for k in found["rs"] + [key]}
        with pytest.raises(ConfigError) as err:
            check_stop_tokens(tok, sections)
        assert str(err.value) == f"{key}.stop_token: 'good film' is not a single token of the tokenizer"


def test_each_row_with_its_own_stream_samples_as_it_would_alone():
    """Row generators: a prompt's response depends on its own seed, not on its batch neighbours."""
    model = _tiny("llama")
    cfg = SamplingConfig(max_new_tokens=8)
    prompts = [[2, 5, 6, 7], [2, 10, 11], [2, 12, 13, 14, 15]]
    gens = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]   # noqa: E731
    batched = sample(model, prompts, PAD, [EOS], cfg, row_generators=gens([11, 12, 13]))
    for i, seed in enumerate((11, 12, 13)):
        alone = sample(model, [prompts[i]], PAD, [EOS], cfg, row_generators=gens([seed]))
        n = alone.response_ids.size(1)
        assert torch.equal(alone.response_ids[0], batched.response_ids[i, :n])
    again = sample(model, prompts, PAD, [EOS], cfg, row_generators=gens([11, 12, 13]))
    assert torch.equal(again.response_ids, batched.response_ids)
    other = sample(model, prompts, PAD, [EOS], cfg, row_generators=gens([21, 22, 23]))
    assert not torch.equal(other.response_ids, batched.response_ids)


def test_a_model_that_ignores_the_kv_cache_is_refused():
    from pipeline.errors import CheckpointError
    model = _tiny("llama")

    class Forgetful(torch.nn.Module):   # drops the cache keyword (either name) before the real forward
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, cache=None, past_key_values=None, use_cache=None, **kw):
            return self.inner(**kw)

    with pytest.raises(CheckpointError, match="ignored the KV cache .*holds 0 positions after a prompt of 3"):
        sample(Forgetful(model), [[2, 3, 4]], PAD, [EOS], SamplingConfig(max_new_tokens=4), greedy=True)


def test_the_cache_goes_by_the_keyword_the_installed_transformers_takes():
    """transformers renamed `past_key_values` to `cache` (5.24 takes both, 5.20 only the old name):
    the sampler passes the name every model class of the installed release takes."""
    import inspect

    from transformers import GPT2LMHeadModel, LlamaForCausalLM
    for cls in (LlamaForCausalLM, GPT2LMHeadModel):
        assert cache_keyword() in inspect.signature(cls.forward).parameters, cls
    model, prompt = _tiny("llama"), torch.tensor([[2, 3, 4]])
    from transformers import DynamicCache
    cache = DynamicCache()
    model(input_ids=prompt, use_cache=True, **{cache_keyword(): cache})
    assert cache.get_seq_length() == 3


def test_inverse_cdf_draws_each_token_at_its_probability_and_never_a_filtered_one():
    from pipeline.models.generation import inverse_cdf
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2]])
    # The edges: u = 0 takes the first token with mass, u just below 1 the last.
    assert inverse_cdf(probs, torch.tensor([0.0])).tolist() == [1]
    assert inverse_cdf(probs, torch.tensor([0.999999])).tolist() == [4]
    u = torch.rand(200_000, generator=torch.Generator().manual_seed(0))
    drawn = inverse_cdf(probs.expand(len(u), -1), u)
    freq = torch.bincount(drawn, minlength=5).double() / len(u)
    assert freq[0] == freq[2] == 0
    assert torch.allclose(freq, probs[0].double(), atol=4e-3)


STOPS = [EOS, 3, 4, 5, 6]   # a stop set this wide ends most rows of the untrained model early, unevenly


def _batch_sizes(model) -> list[int]:
    """Records the batch size of each forward of `model` (prefill first)."""
    sizes: list[int] = []
    model.register_forward_pre_hook(lambda mod, args, kwargs: sizes.append(kwargs["input_ids"].size(0)),
                                    with_kwargs=True)
    return sizes


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_ended_rows_leave_the_batch_and_the_responses_stay_the_same(arch):
    """drop_finished: the decoding forwards shrink as rows end (the KV cache rows go with them), and
    with each row's own stream (or greedy) every response, its mask, its end flag and its
    log-probs are those of the full batch (log-probs to float rounding: a smaller batch's products
    may round otherwise)."""
    model = _tiny(arch)
    cfg = SamplingConfig(max_new_tokens=24)
    prompts = [[2, 5 + i, 7, 8 + i][: 2 + i % 3] for i in range(8)]
    gens = lambda: [torch.Generator().manual_seed(s) for s in range(8)]   # noqa: E731
    for kw in ({"row_generators": gens}, {"greedy": True}):
        args = {k: (v() if callable(v) else v) for k, v in kw.items()}
        full = sample(model, prompts, PAD, STOPS, cfg, **args)
        sizes = _batch_sizes(model)
        args = {k: (v() if callable(v) else v) for k, v in kw.items()}
        dropped = sample(model, prompts, PAD, STOPS, cfg, drop_finished=True, **args)
        model._forward_pre_hooks.clear()
        lengths = full.response_mask.sum(1)
        assert lengths.min() < lengths.max() and sizes[0] == 8 and min(sizes) < 8, (lengths, sizes)
        assert sizes == sorted(sizes, reverse=True)
        for name in ("prompt_ids", "response_ids", "response_mask", "ended"):
            assert torch.equal(getattr(dropped, name), getattr(full, name)), (kw, name)
        torch.testing.assert_close(dropped.logprobs, full.logprobs, rtol=0, atol=1e-5)
        assert torch.equal(dropped.logprobs == 0, full.logprobs == 0)   # zero exactly where masked


def test_sub_batches_give_the_responses_of_one_batch():
    """Request.micro_batch through our engine: with each row's own stream the responses are those
    of one batch (5 prompts by 2: three calls, re-padded to one layout); with one stream, each call
    continues the stream where the last stopped."""
    from pipeline.models.rollout_engine import TORCH, Request

    model = _tiny("llama")
    cfg = SamplingConfig(max_new_tokens=12)
    prompts = [[2, 5, 6, 7], [2, 10], [2, 12, 13, 14, 15, 16], [2, 9, 9], [2, 11, 4, 7]]
    seeds = [31, 32, 33, 34, 35]
    one = TORCH.generate(model, Request(prompts, PAD, tuple(STOPS), cfg, seeds=seeds))
    split = TORCH.generate(model, Request(prompts, PAD, tuple(STOPS), cfg, seeds=seeds, micro_batch=2))
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "ended"):
        assert torch.equal(getattr(split, name), getattr(one, name)), name
    torch.testing.assert_close(split.logprobs, one.logprobs, rtol=0, atol=1e-5)
    stream = TORCH.generate(model, Request(prompts, PAD, tuple(STOPS), cfg, stream=torch.Generator().manual_seed(4),
                                           micro_batch=2))
    gen = torch.Generator().manual_seed(4)
    parts = [sample(model, prompts[i:i + 2], PAD, STOPS, cfg, generator=gen) for i in (0, 2, 4)]
    for i, part in zip((0, 2, 4), parts):
        n, P = part.response_ids.shape, part.prompt_ids.size(1)
        assert torch.equal(stream.response_ids[i:i + 2, :n[1]], part.response_ids)
        assert not stream.response_mask[i:i + 2, n[1]:].any() and (stream.response_ids[i:i + 2, n[1]:] == PAD).all()
        assert torch.equal(stream.prompt_ids[i:i + 2, -P:], part.prompt_ids)
        assert not stream.prompt_mask[i:i + 2, :-P].any()


# Prompts from 1 to 13 tokens, in no order of length: a token budget sorts them, so its calls
# hold rows from all over the batch and their results must be put back in place.
VARIED = [[2, 5, 6, 7], [2], [2, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [2, 9, 9],
          [2, 11, 4, 7, 8, 9, 10, 12], [2, 10], [2, 14, 15, 16, 17, 18], [2, 8, 8, 8, 8]]


def test_token_budget_calls_greedy_equal_one_call():
    """Request.max_tokens through our engine, greedy: every prompt's response and log-probs are
    those of one call, in the prompts' order, though the calls sort the prompts by length."""
    from pipeline.models.rollout_engine import TORCH, Request, sampling_calls

    model = _tiny("llama")
    cfg = SamplingConfig(max_new_tokens=8)
    request = Request(VARIED, PAD, tuple(STOPS), cfg, greedy=True, max_tokens=40)
    calls = sampling_calls(request)
    assert len(calls) >= 3 and [i for call in calls for i in call] != list(range(len(VARIED)))
    one = TORCH.generate(model, Request(VARIED, PAD, tuple(STOPS), cfg, greedy=True))
    split = TORCH.generate(model, request)
    lengths = one.response_mask.sum(1)
    assert lengths.min() < lengths.max()   # uneven responses: the calls' widths differ
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "ended"):
        assert torch.equal(getattr(split, name), getattr(one, name)), name
    torch.testing.assert_close(split.logprobs, one.logprobs, rtol=0, atol=1e-5)
    assert torch.equal(split.logprobs == 0, one.logprobs == 0)


@pytest.mark.parametrize("budget", [12, 25, 40, 1000])
def test_token_budget_calls_fit_it_and_sample_each_prompt_once(monkeypatch, budget):
    """Each sampling call holds rows x (longest prompt + max_new_tokens) <= the budget, or one
    prompt longer than it; every prompt is in one call, longest first; with one stream the calls
    draw from it in turn, and each call's rows come back at their prompts' places."""
    from pipeline.models import rollout_engine
    from pipeline.models.rollout_engine import TORCH, Request

    model, new = _tiny("llama"), 6
    cfg = SamplingConfig(max_new_tokens=new)
    seen: list[list[list[int]]] = []

    def recorded(model, prompts, *args, **kwargs):
        seen.append(prompts)
        return sample(model, prompts, *args, **kwargs)

    monkeypatch.setattr(rollout_engine, "sample", recorded)
    stream = torch.Generator().manual_seed(4)
    out = TORCH.generate(model, Request(VARIED, PAD, tuple(STOPS), cfg, stream=stream, max_tokens=budget))
    for call in seen:
        longest = max(len(p) for p in call)
        assert len(call) * (longest + new) <= budget or len(call) == 1, (budget, call)
    assert sorted(map(tuple, (p for call in seen for p in call))) == sorted(map(tuple, VARIED))
    firsts = [len(call[0]) for call in seen]
    assert firsts == sorted(firsts, reverse=True)
    # 12: below any two rows (2 x (1 + 6) > 12), a call each; 1000: one call; else in between.
    assert len(seen) == 8 if budget == 12 else len(seen) == 1 if budget == 1000 else 1 < len(seen) < 8
    monkeypatch.undo()
    gen = torch.Generator().manual_seed(4)
    P = out.prompt_ids.size(1)
    assert P == max(len(p) for p in VARIED)
    for call in seen:
        part = sample(model, call, PAD, STOPS, cfg, generator=gen)
        width = part.response_ids.size(1)
        for j, prompt in enumerate(call):
            i = VARIED.index(prompt)
            pads = P - len(prompt)
            assert out.prompt_ids[i, pads:].tolist() == prompt and not out.prompt_mask[i, :pads].any()
            assert torch.equal(out.response_ids[i, :width], part.response_ids[j])
            assert torch.equal(out.response_mask[i, :width], part.response_mask[j])
            assert torch.equal(out.logprobs[i, :width], part.logprobs[j]) and out.ended[i] == part.ended[j]
            assert not out.response_mask[i, width:].any()


# ---- On an accelerator (the fake one, tests/helpers/fake_device.py): no read from the device per token

NEVER = 99   # a stop id outside the tiny models' vocabulary (40): no row ends early


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("mode", ["stream", "greedy", "row_streams", "drop_finished"])
def test_on_an_accelerator_the_sampler_reads_from_the_device_once_per_sync_window(arch, mode):
    """A GPU's host waits for the device at each scalar read, copy to the host and data-sized output
    (fake_device.waits_for_device). T sampled tokens, no row ending early, read: the done check once
    every SYNC_EVERY tokens (and, with drop_finished, whether a row ended), transformers' padding
    check of the prefill's mask, and the response width at the end; nothing per token (a draw by
    torch.multinomial reads its input, a CPU stream's draw copies the probabilities to the host)."""
    T = 40   # two whole windows and part of a third
    kw = {"stream": {"generator": torch.Generator().manual_seed(0)}, "greedy": {"greedy": True},
          "row_streams": {"row_generators": [torch.Generator().manual_seed(s) for s in (1, 2)]},
          "drop_finished": {"generator": torch.Generator().manual_seed(0), "drop_finished": True}}[mode]
    model = _tiny(arch)
    with fake_device.use_fake_gpu() as dev:
        model.to(dev)
        with fake_device.HostSyncs() as syncs:
            out = sample(model, [[2, 5, 6, 7], [2, 10]], PAD, [NEVER], SamplingConfig(max_new_tokens=T), **kw)
        assert out.response_ids.device == dev and out.response_ids.shape == (2, T)
    checks = 2 if mode == "drop_finished" else 1
    assert len(syncs.calls) <= checks * math.ceil(T / SYNC_EVERY) + 2, syncs.calls


def test_the_accelerators_draw_is_multinomials_without_its_host_reads():
    """`race` is torch.multinomial's one-sample algorithm: from the same stream it draws the same
    ids (zero-probability tokens among them, as top-k and top-p leave them) and leaves the stream
    where multinomial does. On the fake accelerator, with no read from the device, its draws from
    a fixed distribution come at their probabilities and never pick a token of probability 0."""
    probs = torch.softmax(torch.randn(64, 40, generator=torch.Generator().manual_seed(0)), dim=-1)
    probs[:, ::3] = 0.0
    for seed in range(20):
        ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        want = torch.multinomial(probs, 1, generator=theirs).squeeze(-1)
        assert torch.equal(race(probs, ours), want)
        assert torch.equal(ours.get_state(), theirs.get_state())
    p, n = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2]), 200_000
    with fake_device.use_fake_gpu() as dev:
        with fake_device.HostSyncs() as syncs:
            drawn = race(p.to(dev).expand(n, -1), torch.Generator().manual_seed(0))
        assert drawn.device == dev and syncs.calls == []
    freq = torch.bincount(fake_device.real(drawn), minlength=5).double() / n
    assert freq[0] == freq[2] == 0
    # One frequency's standard error over 200k draws is at most 1.1e-3: 4e-3 is 3.5 of them.
    assert torch.allclose(freq, p.double(), atol=4e-3)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("streams", ["one", "per_row"])
def test_on_an_accelerator_the_sampler_gives_the_cpus_responses(arch, streams):
    """The fake accelerator makes no stream of its own, so it draws from the CPU stream it is given
    (device_stream), by `race`, into a preallocated KV cache: the responses are the CPU run's
    (torch.multinomial, a dynamic cache) from the same seed, and the log-probs too, to float
    rounding. With each row's own stream, rows leave that cache as they end (drop_finished; with
    one stream the device draws for the ended rows until its next check, so the draws differ)."""
    from transformers import DynamicCache, StaticCache
    model = _tiny(arch)
    prompts = [[2, 5 + i, 7, 8 + i][: 2 + i % 3] for i in range(8)]
    cfg = SamplingConfig(max_new_tokens=24, temperature=0.7, top_k=20, top_p=0.95)
    kw = lambda: ({"generator": torch.Generator().manual_seed(5)} if streams == "one" else   # noqa: E731
                  {"row_generators": [torch.Generator().manual_seed(s) for s in range(8, 16)], "drop_finished": True})
    want = sample(model, prompts, PAD, STOPS, cfg, **kw())
    with fake_device.use_fake_gpu() as dev:
        model.to(dev)
        assert isinstance(kv_cache(model, dev, 8), StaticCache)
        assert isinstance(kv_cache(model, torch.device("cpu"), 8), DynamicCache)
        sizes = _batch_sizes(model)
        got = sample(model, prompts, PAD, STOPS, cfg, **kw())
    lengths = want.response_mask.sum(1)
    assert lengths.min() < lengths.max()   # rows ended at different tokens
    assert (min(sizes) < 8) == (streams == "per_row"), sizes   # and left the batch
    for name in ("prompt_ids", "response_ids", "response_mask", "ended"):
        assert torch.equal(fake_device.real(getattr(got, name)), getattr(want, name)), name
    torch.testing.assert_close(fake_device.real(got.logprobs), want.logprobs, rtol=0, atol=1e-5)


def test_a_stream_off_the_accelerator_seeds_one_on_it_once_per_call(monkeypatch):
    """device_stream: a stream on the device (or none) draws as it is, and so does the CPU stream
    where the device makes no stream (the fake one). Where it makes one (a stand-in here), the
    given stream seeds it with its next 63 bits: the same seed, the same stream; the given stream
    moves on by that one draw, so the next call gets another."""
    dev = fake_device.install()
    cpu = torch.Generator().manual_seed(7)
    assert device_stream(None, dev) is None and device_stream(cpu, torch.device("cpu")) is cpu
    assert device_stream(cpu, dev) is cpu and torch.equal(cpu.get_state(), torch.Generator().manual_seed(7).get_state())
    plain = torch.Generator
    asked: list[str] = []
    monkeypatch.setattr(torch, "Generator", lambda device="cpu": asked.append(str(device)) or plain())
    first, again = (device_stream(plain().manual_seed(7), dev) for _ in range(2))
    assert asked == ["fakegpu:0", "fakegpu:0"]
    reference = plain().manual_seed(7)
    seeds = [int(torch.randint(2 ** 63 - 1, (), generator=reference)) for _ in range(2)]
    assert first.initial_seed() == again.initial_seed() == seeds[0]
    assert device_stream(cpu, dev).initial_seed() == seeds[0] and device_stream(cpu, dev).initial_seed() == seeds[1]
    assert torch.equal(cpu.get_state(), reference.get_state())


def test_a_nan_logit_fails_the_call_on_either_device():
    """torch.multinomial refuses invalid probabilities on the CPU; `race` would pick the nan token,
    so on an accelerator the sampler checks the probabilities there and reads the verdict once, at
    the end of the call."""
    model = _tiny("llama")
    with torch.no_grad():
        model.lm_head.weight[5] = float("nan")
    cfg = SamplingConfig(max_new_tokens=4)
    with pytest.raises(RuntimeError, match="probability tensor contains either `inf`, `nan` or element < 0"):
        sample(model, [[2, 3, 4]], PAD, [EOS], cfg, torch.Generator().manual_seed(0))
    with fake_device.use_fake_gpu() as dev:
        model.to(dev)
        with pytest.raises(RuntimeError, match="sampling: the next-token probabilities held nan, inf or a negative"):
            sample(model, [[2, 3, 4]], PAD, [EOS], cfg, torch.Generator().manual_seed(0))
