"""`loom rl CONFIG`: GRPO (or DPO) on the policy's own samples, an iteration at a time, under the job's layout.

A command of its own rather than `[rl]` read by `loom train`: its unit is an iteration, not a step, and its
samples come from the policy rather than from the dataset. It reuses everything else of a training run: the
Trainer's build (model, layout, optimizer, reference policy), its step program, checkpoints and metrics.

One iteration, on every rank:
1. stream the policy's weights into the sampler's copy (rl/rollouts.py `PolicyCopy`);
2. draw `rl.prompts_per_iteration` prompts (rl/prompts.py: the job's training data, or rl.prompts' JSONL;
   seeded: the same on every rank and layout) and sample G completions of each (`sample_rollouts`);
3. reward each (rl/rewards.py) and drop what cannot be trained on (a reward that failed, a group whose rewards
   are all equal under rl.equal_groups = "skip"); then, for GRPO, normalise within each group into advantages
   and score the rollouts with the trainer's own forward (rl/score.py) on the weights that sampled them: the
   behaviour logprobs the ratio reads, and the mismatch against the sampler's; for DPO (train.objective =
   "dpo"), pair each group's best completion with its worst (rl/pairs.py);
4. K = rl.steps_per_iteration steps over the rollouts or pairs, a seeded 1/K of them each.
Under DPO the held-out evaluation adds the implicit-reward accuracy of held-out pairs made once from the
reference policy's own completions (rl/pairs.py).
Checkpoints are taken between iterations only, so a resumed run restarts an iteration from its beginning: with
the same prompts, seeds and weights it draws and trains exactly what the first run would have.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch

from loom.checkpoint.read import CheckpointWeights
from loom.config import ConfigError, JobConfig
from loom.data.batch import round_up
from loom.data.loader import GlobalBatches
from loom.data.chat import ChatTokenizer
from loom.data.sample import Sample
from loom.models.sampler import Sampler, SamplingParams
from loom.train.grpo import BEHAVIOUR, SAMPLER
from loom.rl.pairs import answer_gains, completion_sample, pair_accuracy, preference_pairs
from loom.rl.prompts import JsonlPrompts, TrainingPrompts
from loom.rl.rewards import all_equal, group_advantages, load_reward, reward_of
from loom.rl.rollouts import PolicyCopy, Prompt, Rollout, sample_rollouts
from loom.rl.score import score_samples
from loom.train.evaluate import evaluate
from loom.train.inputs import plan_inputs
from loom.train.length_rules import limit
from loom.train.job_data import media_rules
from loom.train.metrics import MetricsLogger
from loom.train.trainer import Trainer


class RLLoop:
    def __init__(self, cfg: JobConfig, device: torch.device | None = None) -> None:
        r = cfg.rl
        if cfg.train.objective not in ("grpo", "dpo"):
            raise ConfigError(f"loom rl trains with GRPO or DPO: set train.objective = 'grpo' or 'dpo' (it is "
                              f"{cfg.train.objective!r})")
        grpo = cfg.train.objective == "grpo"
        recorded = r.temperature or 1.0  # greedy sampling (0) records its logprobs at temperature 1
        if grpo and recorded != cfg.train.grpo.temperature:
            greedy = " (greedy: its logprobs are recorded at temperature 1)" if not r.temperature else ""
            raise ConfigError(f"rl.temperature = {r.temperature} samples{greedy}, train.grpo.temperature = "
                              f"{cfg.train.grpo.temperature} scores: the ratio needs them equal")
        self.reward = load_reward(r.reward)  # a missing function is found before any weight is read
        # the learning-rate schedule spans the run's optimizer steps
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=r.iterations * r.steps_per_iteration))
        self.trainer = t = Trainer(cfg, device, CheckpointWeights(r.init) if r.init else None, rollouts=True)
        self.cfg = t.cfg
        self.prompts = TrainingPrompts(t.data.train, t.tok)
        if r.prompts:
            if not isinstance(t.tok, ChatTokenizer):
                raise ConfigError(f"rl.prompts = {r.prompts!r} is rendered with a chat template: set model.tokenizer "
                                  f"and data.sources (the held-out conversations come from them)")
            self.prompts = JsonlPrompts(r.prompts, t.tok, media_rules(self.cfg), t.counters)
            self.prompts.check_all()
        self.order = GlobalBatches(self.prompts, min(r.prompts_per_iteration, len(self.prompts)), cfg.data.seed)
        self.copy = PolicyCopy(self.cfg, t.tok, t.device)
        decode_backend = cfg.train.compile_backend if cfg.train.compile else None  # a compiled decode: 2.4× on a GPU
        self.sampler = Sampler(self.copy.model, t.tok.eos_id, t.tok.pad_id, cfg.model.attention, decode_backend)
        self.params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p)
        self.iteration = t.step // r.steps_per_iteration
        self.heldout_pairs: list[Sample] = []  # DPO: chosen, rejected, … from the reference's completions
        self.heldout_reference: list[float] = []  # each one's summed logprob under the reference
        if not grpo and t.data.heldout:
            self._make_heldout_pairs()

    def run(self) -> dict[str, float]:
        cfg, r, t = self.cfg, self.cfg.rl, self.trainer
        out = Path(cfg.run.out_dir)
        log = MetricsLogger(out, r.iterations, cfg.run.tensorboard, cfg.run.progress, enabled=t.plan.is_logger)
        log.print(f"loom rl: {r.iterations} iterations of {r.prompts_per_iteration} prompts × {r.group_size} "
                  f"completions, {r.steps_per_iteration} GRPO step(s) each → {out}")
        final = {}
        try:
            while self.iteration < r.iterations:
                metrics = self.iterate()
                log.log(self.iteration, metrics)
                objective = (f"kl {metrics.get('grpo/kl', 0.0):.4f}" if cfg.train.objective == "grpo"
                             else f"pair margin {metrics.get('dpo/reward_margin', 0.0):.4f}")
                status = (f"reward {metrics['rl/reward_mean']:.3f}  {objective}  "
                          f"sample tok/s {metrics['rl/sample_tokens_per_s']:,.0f}")
                log.progress(self.iteration, status,
                             self.iteration % cfg.train.log_every == 0 or self.iteration == r.iterations)
                if r.eval_every and self.iteration % r.eval_every == 0 and self.iteration < r.iterations:
                    log.log(self.iteration, self.evaluate(), kind="heldout")
                if r.save_every and self.iteration % r.save_every == 0:
                    t.checkpoint()
            log.finish_progress()
            if not (r.save_every and self.iteration % r.save_every == 0):
                t.checkpoint()
            t.finish_save()
            final = self.evaluate()
            if final:
                log.log(self.iteration, final, kind="heldout")
        finally:
            log.close()
        return final

    def iterate(self) -> dict[str, float]:
        """Iteration `self.iteration` (see the module docstring), then the next one's number; its metrics."""
        metrics = self._iteration()
        self.iteration += 1
        return metrics

    def _iteration(self) -> dict[str, float]:
        cfg, r, t = self.cfg, self.cfg.rl, self.trainer
        start = time.perf_counter()
        self.copy.refresh(t.model)
        prompts, too_long = self._fitting([self.prompts[i] for i in self.order.indices(self.iteration)])
        rollouts = sample_rollouts(self.sampler, prompts, self.params, r.group_size, r.prompts_per_sampling_batch,
                                   cfg.train.seed, self.iteration)
        sampled = time.perf_counter()
        counts = self._rewarded(prompts, rollouts)
        metrics = {"rl/reward_mean": _mean([ro.reward for ro in rollouts if ro.reward is not None]),
                   "rl/reward_std": _std([ro.reward for ro in rollouts if ro.reward is not None]),
                   "rl/response_length": _mean([len(ro.completion.tokens) for ro in rollouts]),
                   "rl/sample_tokens_per_s": sum(len(ro.completion.tokens) for ro in rollouts) / (sampled - start),
                   "rl/prompts_too_long": float(too_long), **counts}
        if cfg.train.objective == "dpo":
            items, equal = preference_pairs(prompts, rollouts)
        else:
            items, equal, mismatch = self._advantaged(prompts, rollouts)
        metrics.update({"rl/equal_reward_groups": float(equal), "rl/trained_rollouts": float(sum(map(len, items)))})
        if not items:
            return metrics
        metrics.update(self._train(items))
        if cfg.train.objective == "grpo":
            measured = metrics.pop("grpo/sampler_mismatch", 0.0)
            metrics["rl/logprob_mismatch"] = measured if mismatch is None else mismatch
        return metrics

    def _advantaged(self, prompts: list[Prompt], rollouts: list[Rollout]
                    ) -> tuple[list[list[Sample]], int, float | None]:
        """GRPO's rollouts as samples, one item each, their group advantages a field; the groups whose rewards are
        all equal; and the mean |sampler's − trainer's logprob| when a scoring pass measured it here. With K > 1
        steps the trainer's logprobs on the sampling weights are the behaviour logprobs; with one, the step's own
        lp is (exactly what a scoring pass would give), and the sampler's ride along to be compared in it."""
        kept, equal = [], 0
        for p in range(len(prompts)):
            group = [ro for ro in rollouts if ro.prompt == p and ro.reward is not None]
            if not group:
                continue
            rewards = [ro.reward for ro in group]
            if all_equal(rewards):
                equal += 1
                if self.cfg.rl.equal_groups == "skip":
                    continue
            for ro, a in zip(group, group_advantages(rewards, self.cfg.rl.advantage)):
                ro.advantage = a
                kept.append(ro)
        samples = [completion_sample(prompts[ro.prompt].sample, ro,
                                     {"advantage": [ro.advantage] * (len(prompts[ro.prompt].sample)
                                                                      + len(ro.completion.tokens))})
                   for ro in kept]
        mismatch = None  # measured by the training step itself (grpo/sampler_mismatch)
        if self.cfg.rl.steps_per_iteration == 1:  # the one step runs on the sampling weights: lp_old = lp, r = 1
            for sample, ro in zip(samples, kept):
                sample.token_fields[SAMPLER] = _at_completion(sample, ro.completion.logprobs)
        elif samples:  # later steps run on updated weights: the behaviour logprobs come from a scoring pass
            mismatch = self._score_behaviour(samples, kept)
        return [[s] for s in samples], equal, mismatch

    def _train(self, items: list[list[Sample]]) -> dict[str, float]:
        """K = rl.steps_per_iteration steps over the items (a rollout, or a DPO pair's two sequences), a seeded
        1/K of them each; the steps' mean metrics."""
        cfg, r, t = self.cfg, self.cfg.rl, self.trainer
        start, tokens = time.perf_counter(), 0
        step_metrics: list[dict[str, float]] = []
        order = torch.randperm(len(items), generator=torch.Generator().manual_seed(cfg.train.seed + self.iteration))
        for k in range(r.steps_per_iteration):
            part = [items[i] for i in order[k :: r.steps_per_iteration].tolist()]
            if not part:
                continue
            samples = [s for item in part for s in item]
            indices = [i for i, item in enumerate(part) for _ in item]  # a pair's two sequences: one item
            inputs = plan_inputs(samples, indices, cfg, t.tok, t.counters, t.plan.shares, t.plan.sample_multiple,
                                 t.device)
            result = t.plan.train_step(t.model, t.optimizer, inputs, cfg, t.step)
            t.step += 1
            tokens += inputs.global_tokens
            step_metrics.append({"loss": result.loss, "grad_norm": result.grad_norm,
                                 **{f"{cfg.train.objective}/{name}": v for name, v in result.metrics.items()}})
        metrics = {"rl/train_tokens_per_s": tokens / (time.perf_counter() - start)}
        metrics.update({k: _mean([m[k] for m in step_metrics]) for k in step_metrics[0]} if step_metrics else {})
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Held-out exact match of greedy answers from the sampler's copy (refreshed: the policy's weights now),
        the same on every rank."""
        held = self.trainer.data.heldout
        if not held:
            return {}
        self.copy.refresh(self.trainer.model)
        metrics = evaluate(self.copy.model, held, self.trainer.tok, self.trainer.device,
                           self.cfg.train.eval_max_new_tokens, self.cfg.model.attention)
        if self.heldout_pairs:
            dpo = self.cfg.train.dpo
            gains = answer_gains([s.logprobs for s in self._scores(self.heldout_pairs)], self.heldout_reference,
                                 dpo.length_normalise)
            metrics.update(pair_accuracy(gains, dpo.beta))
        return metrics

    def _make_heldout_pairs(self) -> None:
        """Pairs from the reference policy's completions of the held-out prompts, and their reference sums."""
        t, r = self.trainer, self.cfg.rl
        prompts, _ = self._fitting(list(TrainingPrompts(t.data.heldout, t.tok)))
        t.plan.reference.swap()  # the model holds the reference's weights until the swap back
        try:
            self.copy.refresh(t.model)
            rollouts = sample_rollouts(self.sampler, prompts, self.params, r.group_size,
                                       r.prompts_per_sampling_batch, self.cfg.train.seed, -1)  # no iteration's seed
            for ro in rollouts:
                ro.reward, _ = reward_of(self.reward, prompts[ro.prompt].record, t.tok.decode(ro.completion.tokens),
                                         prompts[ro.prompt].where)
            pairs, _ = preference_pairs(prompts, rollouts)
            self.heldout_pairs = [s for pair in pairs for s in pair]
            self.heldout_reference = [sum(s.logprobs) for s in self._scores(self.heldout_pairs)]
        finally:
            t.plan.reference.swap()

    def _scores(self, samples: list[Sample]) -> list:
        t = self.trainer
        return score_samples(t.plan, t.model, samples, self.cfg, t.tok, t.counters, t.device, 0,
                             self.cfg.train.grpo.temperature if self.cfg.train.objective == "grpo" else 1.0)

    def _fitting(self, prompts: list[Prompt]) -> tuple[list[Prompt], int]:
        """The prompts whose rollouts (prompt + rl.max_new_tokens) fit a microbatch; the others are named once."""
        key, budget = limit(self.cfg)
        if not budget:
            return prompts, 0
        need = [round_up(len(p.sample) + self.cfg.rl.max_new_tokens, self.trainer.plan.sample_multiple)
                for p in prompts]
        long = [p for p, n in zip(prompts, need) if n > budget]
        if long and self.trainer.plan.is_logger:
            print(f"loom rl: {len(long)} prompts skipped: {long[0].where}: {len(long[0].sample)} prompt tokens + "
                  f"rl.max_new_tokens = {self.cfg.rl.max_new_tokens} exceed {key} = {budget}")
        return [p for p, n in zip(prompts, need) if n <= budget], len(long)

    def _rewarded(self, prompts: list[Prompt], rollouts: list[Rollout]) -> dict[str, float]:
        """Each rollout's reward (None where the function failed); the counts of failures and empty completions."""
        tok = self.trainer.tok
        problems, empty = [], []
        for ro in rollouts:
            text = tok.decode(ro.completion.tokens)
            if not text.strip():
                empty.append(prompts[ro.prompt].where)
            ro.reward, why = reward_of(self.reward, prompts[ro.prompt].record, text, prompts[ro.prompt].where)
            if why:
                problems.append(why)
        if problems and self.trainer.plan.is_logger:
            print(f"loom rl: {len(problems)} completions without a reward, e.g. {problems[0]}")
        if empty and self.trainer.plan.is_logger:  # trained on (an answer that stops at once is an answer)
            print(f"loom rl: {len(empty)} empty completions, e.g. of {empty[0]}")
        return {"rl/reward_errors": float(len(problems)), "rl/empty_completions": float(len(empty))}

    def _score_behaviour(self, samples: list[Sample], kept: list[Rollout]) -> float:
        """The trainer's logprobs of each completion on the sampling weights become its `logprobs` field; the
        mean |sampler's − trainer's| is returned."""
        gaps = []
        for sample, score, ro in zip(samples, self._scores(samples), kept):
            sample.token_fields[BEHAVIOUR] = _at_completion(sample, score.logprobs)
            gaps += [abs(a - b) for a, b in zip(score.logprobs, ro.completion.logprobs)]
        return _mean(gaps)


def _at_completion(sample: Sample, values: list[float]) -> list[float]:
    """A field of `sample` holding `values` at its completion's label positions (the last len(values) tokens
    are the completion; label position i predicts token i + 1), 0 elsewhere."""
    first = len(sample) - len(values) - 1
    field = [0.0] * len(sample)
    field[first:first + len(values)] = values
    return field


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _std(values: list[float]) -> float:
    m = _mean(values)
    return math.sqrt(_mean([(v - m) ** 2 for v in values]))
