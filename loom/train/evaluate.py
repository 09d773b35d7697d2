"""Held-out evaluation: teacher-forced token accuracy and exact match of greedily generated answers (the RL
sampler's KV-cached decoding at temperature 0: each new token attends to cached keys, not a re-run prefix)."""

from __future__ import annotations

from collections import defaultdict

import torch

from loom.data.batch import IGNORE_INDEX
from loom.data.mrope import with_mrope_positions
from loom.data.packing import pack_samples
from loom.data.sample import Sample
from loom.data.tasks import CHANCE
from loom.data.tokenizer import Vocabulary
from loom.models.multimodal import MultimodalModel
from loom.models.sampler import Sampler, SamplingParams


def answer_span(sample: Sample) -> tuple[int, int]:
    """[start, end) of the sample's last run of targets: what greedy generation from the tokens before it
    must reproduce (a task's answer and <eos>; a conversation's last assistant turn and its end-of-turn)."""
    end = max(i for i, t in enumerate(sample.supervised) if t) + 1
    start = end
    while start > 0 and sample.supervised[start - 1]:
        start -= 1
    return start, end


def prompt_of(sample: Sample) -> Sample:
    """`sample` cut where its answer starts (`answer_span`): the tokens and media generation starts from."""
    start, _ = answer_span(sample)
    return Sample(sample.tokens[:start], [False] * start, sample.images, sample.audio, sample.task, sample.where)


@torch.no_grad()
def evaluate(
    model: MultimodalModel,
    samples: list[Sample],
    tok: Vocabulary,
    device: torch.device,
    max_new_tokens: int,
    backend: str = "auto",
    batch_size: int = 64,
) -> dict[str, float]:
    """Returns `exact_match/<task>`, `token_accuracy/<task>` and their means over all samples (a task: a
    built-in task, or the JSONL file a conversation came from). Exact match: the greedily generated tokens
    (at most `max_new_tokens`) begin with the sample's answer (`answer_span`)."""
    was_training = model.training
    model.eval()
    sampler = Sampler(model, tok.eos_id, tok.pad_id, backend)
    hits, correct, total, per_task = defaultdict(int), defaultdict(int), defaultdict(int), defaultdict(int)
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        for s, (ok, n) in zip(chunk, _teacher_forced(model, chunk, tok, device, backend)):
            correct[s.task] += ok
            total[s.task] += n
        spans = [answer_span(s) for s in chunk]
        answers = [s.tokens[a:b] for s, (a, b) in zip(chunk, spans)]
        n_new = min(max_new_tokens, max(map(len, answers)))
        greedy = SamplingParams(max_new_tokens=n_new, temperature=0)
        generated = [c.tokens for c in sampler.generate([prompt_of(s) for s in chunk], greedy, torch.Generator())]
        for s, answer, out in zip(chunk, answers, generated):
            hits[s.task] += out[: len(answer)] == answer
            per_task[s.task] += 1
    model.train(was_training)
    out = {}
    for task in per_task:
        out[f"exact_match/{task}"] = hits[task] / per_task[task]
        out[f"token_accuracy/{task}"] = correct[task] / total[task]
    out["exact_match"] = sum(hits.values()) / max(1, sum(per_task.values()))
    out["token_accuracy"] = sum(correct.values()) / max(1, sum(total.values()))
    return out


def _teacher_forced(model, samples: list[Sample], tok, device, backend) -> list[tuple[int, int]]:
    """(correct next-token predictions, supervised tokens) per sample, given the true answer so far."""
    if model.language.rotary.sections:  # an M-RoPE model (Qwen2-VL): three position streams from the image grids
        tower = model.encoder("vision").encoder.cfg
        samples = [with_mrope_positions(s, model.placeholder_ids["vision"], tower.patch_size, tower.merge_size)
                   for s in samples]
    batch = pack_samples(samples, tok.pad_id, backend=backend).to(device)
    logits = model(batch.input_ids, batch.positions, batch.spans, batch.modality_inputs)
    right = (logits.argmax(-1) == batch.labels) & (batch.labels != IGNORE_INDEX)
    supervised = batch.labels != IGNORE_INDEX
    bounds = batch.spans.cu_seqlens.tolist()
    return [(int(right[a:b].sum()), int(supervised[a:b].sum())) for a, b in zip(bounds[:-1], bounds[1:])]


def heldout_report(metrics: dict[str, float], seconds: float | None = None) -> str:
    """The held-out table for the console: per task, exact match against chance (when generation ran) and
    token accuracy; the held-out loss when it was measured under the layout."""
    when = f" after {seconds:.0f}s" if seconds is not None else ""
    generated = "exact_match" in metrics
    lines = [f"held-out{when} (exact match of the generated answer, chance in brackets):" if generated
             else f"held-out{when} (teacher-forced, under the training layout):"]
    tasks = sorted(k.split("/", 1)[1] for k in metrics if k.startswith("token_accuracy/"))
    for task in tasks:
        match = f"{metrics['exact_match/' + task]:6.1%}   " if generated else ""
        chance = f"   [chance {CHANCE[task]:.1%}]" if generated and task in CHANCE else ""
        lines.append(f"  {task:<8} {match}token accuracy {metrics['token_accuracy/' + task]:6.1%}{chance}")
    match = f"{metrics['exact_match']:6.1%}   " if generated else ""
    loss = f"   loss {metrics['loss']:.3f}" if "loss" in metrics else ""
    lines.append(f"  {'all':<8} {match}token accuracy {metrics['token_accuracy']:6.1%}{loss}")
    return "\n".join(lines)
