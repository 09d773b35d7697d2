"""The sampler (loom/rl/sampler.py) with its KV cache (loom/models/kv_cache.py): greedy decoding equals
generation that re-runs the whole prefix (no cache), for prompts of different lengths with images and clips, with
grouped-query and with multi-head latent attention (its cache holds latents, and decode attends in the latent
space);
each recorded logprob equals the teacher-forced one of the finished sequence at the sampling temperature; top-p
keeps the smallest set that reaches p; a seed fixes the samples."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import sharpen, tiny_audio_config, tiny_llm_config, tiny_vision_config

from loom.data.packing import pack_samples
from loom.data.sample import Sample
from loom.models.multimodal import build_model
from loom.rl.sampler import Sampler, SamplingParams, pick
from loom.data.batch import gather_modality_inputs
from loom.train.evaluate import prompt_of


@torch.no_grad()
def greedy_generate(model, prompts: list[list[int]], samples: list[Sample], tok, max_new_tokens: int
                    ) -> list[list[int]]:
    """The reference: greedy decoding without a cache, the whole prefix re-run for every new token. The encoders
    run once; their embeddings fill the placeholders at every step."""
    embeds = model.encode(gather_modality_inputs(samples))
    seqs = [list(p) for p in prompts]
    done = [False] * len(seqs)
    for _ in range(max_new_tokens):
        batch = pack_samples([Sample(s, [False] * len(s), [], []) for s in seqs], tok.pad_id)
        logits = model.language(batch.input_ids, batch.positions, batch.spans, model.inserts(batch.input_ids, embeds))
        for i, t in enumerate(logits[batch.spans.cu_seqlens[1:].long() - 1].argmax(-1).tolist()):
            if not done[i]:
                seqs[i].append(t)
                done[i] = t == tok.eos_id
        if all(done):
            break
    return [s[len(p):] for s, p in zip(seqs, prompts)]


@pytest.fixture
def prompts(mixed_samples):
    return [prompt_of(s) for s in mixed_samples if any(s.supervised)]


# DeepSeek-V3's shape of attention, small: a query bottleneck, a latent, values narrower than keys (12 + 6 wide)
LATENT = dict(num_kv_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
              rope_interleave=True)


@pytest.fixture(params=["gqa", "mla"])
def model(request, tiny_model, tok):
    """Logits far from uniform (no near-ties for greedy decoding to break) that never predict a media
    placeholder (greedy_generate, the reference, would take a generated one for a media slot)."""
    if request.param == "mla":
        torch.manual_seed(0)
        llm = dataclasses.replace(tiny_llm_config(), **LATENT)
        tiny_model = build_model(llm, tiny_vision_config(), tiny_audio_config(), tok.placeholder_ids).eval()
    model = sharpen(tiny_model)
    placeholders = list(tok.placeholder_ids.values())

    def never_placeholders(module, args, logits):
        logits[..., placeholders] = float("-inf")
        return logits

    model.language.lm_head.register_forward_hook(never_placeholders)
    return model


@pytest.mark.parametrize("compile_backend", [None, "aot_eager"], ids=["eager", "compiled-decode"])
def test_greedy_with_the_cache_equals_regenerating_the_prefix(model, tok, prompts, compile_backend):
    sampler = Sampler(model, tok.eos_id, tok.pad_id, compile_backend=compile_backend)
    got = sampler.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0), torch.Generator())
    want = greedy_generate(model, [p.tokens for p in prompts], prompts, tok, 12)
    assert [c.tokens for c in got] == want
    assert len({len(p) for p in prompts}) > 1  # prompts of different lengths share the batch


def test_recorded_logprobs_are_the_teacher_forced_ones(model, tok, prompts):
    params = SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.9)
    completions = Sampler(model, tok.eos_id, tok.pad_id).generate(prompts, params,
                                                                       torch.Generator().manual_seed(3))
    whole = [Sample(p.tokens + c.tokens, [False] * len(p) + [True] * len(c.tokens), p.images, p.audio)
             for p, c in zip(prompts, completions)]
    batch = pack_samples(whole, tok.pad_id)
    with torch.no_grad():
        logits = model(batch.input_ids, batch.positions, batch.spans, batch.modality_inputs)
    logp = torch.log_softmax(logits.float() / params.temperature, -1)
    starts = batch.spans.cu_seqlens.tolist()
    for start, p, c in zip(starts, prompts, completions):
        positions = torch.arange(len(p) - 1, len(p) - 1 + len(c.tokens)) + start  # each token's predictor
        want = logp[positions, torch.tensor(c.tokens)]
        torch.testing.assert_close(torch.tensor(c.logprobs), want, rtol=0, atol=1e-5)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).expand(4000, 3)
    g = torch.Generator().manual_seed(0)
    only_first, _ = pick(logits, SamplingParams(top_p=0.5), g)
    assert set(only_first.tolist()) == {0}
    two, logprob = pick(logits, SamplingParams(top_p=0.8), g)
    assert set(two.tolist()) == {0, 1}
    assert abs((two == 0).float().mean().item() - 2 / 3) < 0.03  # renormalised over the kept set
    torch.testing.assert_close(logprob[two == 1], torch.full_like(logprob[two == 1], 0.3).log())  # before top-p


def test_a_seed_fixes_the_samples(model, tok, prompts):
    sampler = Sampler(model, tok.eos_id, tok.pad_id)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    runs = [[c.tokens for c in sampler.generate(prompts, params, torch.Generator().manual_seed(s))]
            for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_a_latent_attention_cache_holds_each_tokens_latent_not_its_heads():
    """2 layers × 2 rows × 10 places × (16-wide latent + 4-wide rotary key), where grouped heads would hold
    4 heads × (12-wide key + 6-wide value) a token."""
    from loom.models.kv_cache import KVCache

    cfg = dataclasses.replace(tiny_llm_config(), **LATENT)
    cache = KVCache(cfg, ["0", "1"], 2, 10, torch.float32, torch.device("cpu"))
    held = [t for layer in cache.layers.values() for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    assert sum(t.numel() for t in held) == 2 * 2 * 10 * (16 + 4)
