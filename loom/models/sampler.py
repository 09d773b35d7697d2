"""loom's own batched sampler: G completions per prompt from a whole (unsharded) copy of the policy, with a KV
cache — the prompts prefilled packed (THD: no padding, each prompt's images and clips through the encoders
once), then one token per sequence per decode step, batched.

Each sampled token's log-probability is recorded under the distribution it was drawn from before top-p
truncation: log softmax(logits / temperature), which is what the trainer's scoring computes at GRPO's
temperature, so the per-step mismatch between the two measures numerics alone. Temperature 0 is greedy (its
logprobs at temperature 1). A sequence stops after its end-of-sequence token or `max_new_tokens`.

The copy is fed by the weight stream after each update (rl/stream.py: the path an external engine takes), so it
never shares storage with the sharded training model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loom.data.batch import gather_modality_inputs
from loom.data.mrope import with_mrope_positions
from loom.data.packing import pack_samples
from loom.data.sample import Sample
from loom.data.spans import TokenSpans
from loom.models.kv_cache import KVCache
from loom.models.multimodal import MultimodalModel


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # the smallest set of tokens whose probability reaches top_p; 1: all


@dataclass
class Completion:
    tokens: list[int]  # generated, the end-of-sequence token included when it stopped there
    logprobs: list[float]  # each token's under log softmax(logits / temperature), before top-p


class Sampler:
    def __init__(self, model: MultimodalModel, eos_id: int, pad_id: int, backend: str = "auto",
                 compile_backend: str | None = None) -> None:
        """`backend`: the prefill's attention (model.attention); decode attends over the cache with SDPA.
        `compile_backend`: the decode step through torch.compile with it (one shape per generate call: traced
        once per batch size and capacity), which fuses each layer's small ops — decoding is launch-bound."""
        self.model, self.eos_id, self.pad_id, self.backend = model, eos_id, pad_id, backend
        # media placeholders are inputs only: a sampled one would stand for rows no encoder made
        self.never = list(model.placeholder_ids.values())
        self.spans = TokenSpans(max_seqlen=1, backend=backend)  # decode: padded, one token per row
        self.decode = (torch.compile(self._decode, backend=compile_backend, dynamic=False) if compile_backend
                       else self._decode)

    def _decode(self, fed: torch.Tensor, cache: KVCache, shift: torch.Tensor) -> torch.Tensor:
        """One token per row through the LLM: its next-token logits; the cache holds one more key per row. `shift`:
        each row's position minus its cache length (M-RoPE's: an image's tokens advance the position by less
        than their count)."""
        logits = self.model.language(fed, (cache.lengths + shift)[:, None], self.spans, None, cache)[:, 0]
        cache.advance(1)
        return logits

    @torch.no_grad()
    def generate(self, prompts: list[Sample], params: SamplingParams, generator: torch.Generator
                 ) -> list[Completion]:
        """One completion per prompt (repeat a prompt G times for a group), in order."""
        model, lm = self.model, self.model.language
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        cache = KVCache(lm.cfg, list(lm.layers), len(prompts), max(map(len, prompts)) + params.max_new_tokens,
                        next(lm.parameters()).dtype, device)
        text = [Sample(p.tokens, [False] * len(p), [], [], rope_positions=self._streams(p)) for p in prompts]
        batch = pack_samples(text, self.pad_id, backend=self.backend).to(device)
        # the answer's positions go on from each prompt's largest + 1 (its length, but for M-RoPE's images)
        shift = torch.tensor([max(map(max, t.rope_positions)) + 1 - len(t) if t.rope_positions else 0 for t in text],
                             device=device)
        embeds = model.encode({k: [x.to(device) for x in v] for k, v in gather_modality_inputs(prompts).items()})
        ends = batch.spans.cu_seqlens[1:].long() - 1  # each prompt's last token: its logits start the answer
        last = lm(batch.input_ids, batch.positions, batch.spans, model.inserts(batch.input_ids, embeds), cache, ends)
        cache.advance(torch.tensor([len(p) for p in prompts], device=device))
        out = [Completion([], []) for _ in prompts]
        done = [False] * len(prompts)
        for step in range(params.max_new_tokens):
            token, logprob = pick(last, params, generator, self.never)
            for row, (t, lp) in enumerate(zip(token.tolist(), logprob.tolist())):
                if not done[row]:
                    out[row].tokens.append(t)
                    out[row].logprobs.append(lp)
                    done[row] = t == self.eos_id
            if all(done) or step == params.max_new_tokens - 1:
                break
            # finished rows decode padding (their outputs are ignored): every row keeps one shape
            fed = torch.where(torch.tensor(done, device=device), self.pad_id, token)[:, None]
            last = self.decode(fed, cache, shift)
        model.train(was_training)
        return out

    def _streams(self, prompt: Sample) -> list[tuple[int, int, int]] | None:
        """An M-RoPE model's (Qwen2-VL's) three position streams of a prompt, from its images' grids; else None."""
        if not self.model.language.rotary.sections:
            return None
        tower = self.model.encoder("vision").encoder.cfg
        return with_mrope_positions(prompt, self.model.placeholder_ids["vision"], tower.patch_size,
                                    tower.merge_size).rope_positions


def pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, never: list[int] = ()
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """A token per row of [rows, vocab] logits — never one of `never` — and its logprob under the policy's
    log softmax(logits / temperature), before top-p and before `never` is taken out."""
    if params.temperature == 0:
        allowed = logits.float().index_fill(-1, torch.tensor(never, dtype=torch.long, device=logits.device),
                                            float("-inf")) if never else logits
        token = allowed.argmax(-1)
        return token, torch.log_softmax(logits.float(), -1).gather(-1, token[:, None])[:, 0]
    logp = torch.log_softmax(logits.float() / params.temperature, -1)
    probs = logp.exp()
    if never:
        probs = probs.index_fill(-1, torch.tensor(never, dtype=torch.long, device=probs.device), 0.0)
    if params.top_p < 1:
        ordered, order = probs.sort(-1, descending=True)
        # keep a token while the mass before it is below top_p: the most likely one always stays
        keep = (ordered.cumsum(-1) - ordered) < params.top_p
        probs = torch.zeros_like(probs).scatter(-1, order, ordered * keep)
    token = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return token, logp.gather(-1, token[:, None])[:, 0]
