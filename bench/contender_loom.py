"""loom as a benchmark contender: the configured layout, packed (THD) or padded (BSHD) batches."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bench.flops import flops_of, matmul_params
from loom.models.encoder_layer import ROW_MULTIPLE
from loom.parallel.compile import row_budgets
from loom.train.build import build_job
from loom.train.inputs import StepInputs
from loom.train.job_model import build_job_model
from loom.train.step_data import step_inputs


class LoomContender:
    def __init__(self, cfg, device: torch.device, workload) -> None:
        self.cfg, self.device, self.workload = cfg, device, workload
        job = build_job(cfg, device)  # its data goes unused: the workload brings the samples
        self.cfg, self.tok, self.model, self.plan, self.optimizer = job.cfg, job.tok, job.model, job.plan, job.optimizer
        self.counters, self.n_params = job.counters, job.n_params
        m = build_job_model(self.cfg, self.tok)  # on meta, whole: the modules' sizes before any split
        lm, vc = m.language.cfg, m.vision.encoder.cfg
        self.spec = {  # before parallelisation: plain module sizes
            "patch": vc.patch_size,
            "llm": (matmul_params(m.language), lm.num_layers, lm.num_heads * lm.dim_per_head),
            "vision": (matmul_params(m.vision), vc.num_layers, vc.hidden_size),
            "llm_length": len,
        }
        if "audio" in m.encoder_names:  # the layout workloads run the vision encoder alone
            ac = m.audio.encoder.cfg
            self.spec["audio"] = (matmul_params(m.audio), ac.num_layers, ac.hidden_size)
        self._computed, self._real = 0, 0
        self._enc_rows: dict[str, list[int]] = {}  # encoder → [real rows, computed rows] over the run
        fixed = self.cfg.train.compile and self.cfg.data.tokens_per_microbatch  # compiled rows have budgets
        budgets = row_budgets(self.cfg, dist.get_world_size() if dist.is_initialized() else 1) if fixed else {}
        self._multiple = {n: budgets[n].multiple if n in budgets else ROW_MULTIPLE for n in self.counters}

    def inputs(self, step: int) -> StepInputs:
        inputs = step_inputs(self.workload, step, self.plan, self.cfg, self.tok, self.counters, self.device)
        self._computed += sum(m.llm.input_ids.numel() for m in inputs.microbatches if m.llm is not None)
        self._real += inputs.tokens
        for name in self.counters:  # each encoder call's real rows against the rows its layers compute
            for mb in inputs.microbatches:
                real = sum(self.counters[name](x) for x in mb.encoder_items.get(name, []))
                step = self._multiple[name]
                computed = -(-max(real, 1) // step) * step  # rounded up; no item: one minimal input
                self._enc_rows[name] = [a + b for a, b in zip(self._enc_rows.get(name, (0, 0)), (real, computed))]
        return inputs

    def step(self, inputs: StepInputs, step: int) -> float:
        return self.plan.train_step(self.model, self.optimizer, inputs, self.cfg, step).loss

    def llm_tokens(self, step: int) -> int:
        return sum(len(s) for s in self.workload.global_batch(step))

    def flops(self, step: int) -> float:
        return flops_of(self.workload.global_batch(step), self.spec)

    def padding_fraction(self) -> float | None:
        return 1 - self._real / self._computed if self._computed else None  # None: this rank runs no LLM

    def encoder_padding(self) -> dict[str, float]:
        """Per encoder: the fraction of the rows its layers computed that were filler (fixed row budgets)."""
        return {n: round(1 - real / computed, 4) for n, (real, computed) in self._enc_rows.items() if computed}

