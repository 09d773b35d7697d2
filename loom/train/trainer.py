"""The training loop: build everything from a JobConfig, train, evaluate, checkpoint — on one process or
under torchrun with the configured layout (the step code is the same; see loom.train.step)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
import torch.distributed as dist

from loom.config import JobConfig
from loom.data.sample import Sample
from loom.distributed import CollectiveStalled, is_stalled_collective, stalled_message
from loom.parallel.materialize import WeightSource
from loom.train.build import build_job
from loom.checkpoint.folders import clear_staging, publish, resume_path, staging_dir
from loom.checkpoint.sharded import begin_save, load_sharded
from loom.checkpoint.staging import HostStaging
from loom.train.evaluate import evaluate, heldout_report
from loom.train.flops import peak_matmul_tflops
from loom.train.heldout import heldout_metrics
from loom.train.metrics import MetricsLogger, WandbRun
from loom.train.inputs import StepInputs, collate
from loom.train.step import StepResult
from loom.train.step_data import StepPrefetcher, plan_step, step_inputs


ASYNC_SAVE = "checkpoint: async save writer (gloo)"  # the registry's names for the trainer's own groups
HEALTH = "health: which ranks stopped answering (gloo)"


class Trainer:
    def __init__(self, cfg: JobConfig, device: torch.device | None = None, weights: WeightSource | None = None,
                 rollouts: bool = False) -> None:
        """`weights`: where the run's first weights come from instead of the folders and seeded draws (`loom
        rl`'s rl.init checkpoint); a resumed run then loads its own checkpoint over them. `rollouts`: `loom rl`
        drives the steps with its own samples."""
        self.resume_from = resume_path(cfg.run.resume, cfg.run.out_dir)  # files only: the same on every rank
        # a resumed run takes its weights from the checkpoint: no Hugging Face folder is read, unless the reference
        # policy is the initial one (train.reference = "initial"), which the folders still are
        pretrained = self.resume_from is None or cfg.train.reference == "initial"
        job = build_job(cfg, device, pretrained=pretrained, weights=weights, rollouts=rollouts)
        self.cfg = cfg = job.cfg
        self.device, self.tok, self.model, self.counters = job.device, job.tok, job.model, job.counters
        self.data = job.data
        self.plan, self.optimizer, self.batches = job.plan, job.optimizer, job.batches
        self.weight_aliases, self.weight_names, self.n_params = job.weight_aliases, job.weight_names, job.n_params
        self.model_flops = job.flops
        self.last_flops = 0.0
        self.pending = None  # a checkpoint save not yet complete (run.async_save)
        self.save_staging = HostStaging() if cfg.run.async_save else None  # host buffers reused by every async save
        # rank 0 asks every rank over the health group which ones stopped answering (monitored barrier); the
        # background checkpoint writer's collectives run on a group of their own
        self.health_group = self._world_gloo_group(HEALTH) if self.plan.distributed else None
        self.save_group = self._world_gloo_group(ASYNC_SAVE) if self.plan.distributed and cfg.run.async_save else None
        self.step = 0
        if self.resume_from is not None:
            self.step = self._load(self.resume_from)["step"]
        self.prefetch = StepPrefetcher(
            self.batches, lambda s: plan_step(self.batches, s, cfg, self.tok, self.counters, self.plan.shares,
                                              self.plan.sample_multiple),
            cfg.train.steps, cfg.data.workers, cfg.data.prefetch_steps, pin=self.device.type == "cuda")

    def train_step(self, samples: list[Sample] | None = None) -> StepResult:
        """One optimizer step on this rank's shares of global batch `self.step` — or, on one process, on
        the given samples."""
        if samples is None:
            inputs = step_inputs(self.batches, self.step, self.plan, self.cfg, self.tok, self.counters, self.device,
                                 self.data.bad, prepared=self.prefetch.get(self.step))
        else:
            inputs = StepInputs.of(collate(samples, self.cfg, self.tok).to(self.device), tokens=sum(map(len, samples)))
        self.last_tokens, self.last_stats = inputs.global_tokens, inputs.stats
        t = inputs.totals
        self.last_flops = self.model_flops.of_sums(t.tokens, t.token_squares, t.rows) if t is not None else 0.0
        result = self.plan.train_step(self.model, self.optimizer, inputs, self.cfg, self.step)
        self.step += 1
        return result

    def run(self) -> dict[str, float]:
        cfg, out = self.cfg, Path(self.cfg.run.out_dir)
        wandb = WandbRun(cfg.run.wandb_project, cfg.run.wandb_mode, dataclasses.asdict(cfg)) if cfg.run.wandb else None
        log = MetricsLogger(out, cfg.train.steps, cfg.run.tensorboard, cfg.run.progress, enabled=self.plan.is_logger,
                            wandb=wandb)
        where = f"{dist.get_world_size()} ranks" if self.plan.distributed else str(self.device)
        log.print(f"loom: {self.n_params / 1e6:.2f}M parameters on {where}, "
                  f"{cfg.train.steps} steps → {out}")
        gpu = GPUUse(self.device, dist.get_world_size() if self.plan.distributed else 1)
        tokens, flops, t0, final = 0, 0.0, time.perf_counter(), {}
        try:
            while self.step < cfg.train.steps:
                r = self.train_step()
                tokens, flops = tokens + self.last_tokens, flops + self.last_flops
                elapsed = time.perf_counter() - t0
                use = gpu.since_start(flops, elapsed)
                log.log(self.step, {"loss": r.loss, "grad_norm": r.grad_norm, "lr": r.lr, "skipped": float(r.skipped),
                                    "bad_samples": float(len(self.data.bad)), **self.last_stats, **use,
                                    **{f"{cfg.train.objective}/{k}": v for k, v in r.metrics.items()},
                                    **r.expert_load})
                status = f"loss {r.loss:.3f}  tok/s {tokens / elapsed:,.0f}  lr {r.lr:.1e}" + gpu.status(use)
                if r.skipped:
                    log.print(f"step {self.step}: non-finite grad norm, optimizer step skipped on every rank")
                log.progress(self.step, status, self.step % cfg.train.log_every == 0 or self.step == cfg.train.steps)
                if cfg.train.eval_every and self.step % cfg.train.eval_every == 0 and self.step < cfg.train.steps:
                    metrics = self.evaluate()
                    if metrics:
                        log.log(self.step, metrics, kind="heldout")
                if cfg.run.save_every and self.step % cfg.run.save_every == 0:
                    self.checkpoint()
            log.finish_progress()
            if self.data.bad:  # the same list on every rank: each drew every sample
                log.print(self.data.bad.summary() + f"; all in {out / 'bad_samples.jsonl'}")
                if self._rank0():
                    self.data.bad.write(out / "bad_samples.jsonl")
            if not (cfg.run.save_every and self.step % cfg.run.save_every == 0):
                self.checkpoint()  # the last step's, for run.resume = "auto"
            self.finish_save()
            final = self.evaluate()
            if final:
                log.log(self.step, final, kind="heldout")
                log.print(heldout_report(final, time.perf_counter() - t0))
            if "exact_match" not in final:
                log.print(f"exact match of generated answers: loom eval {out}")
        except Exception as e:
            if self.plan.distributed and is_stalled_collective(e):
                raise CollectiveStalled(stalled_message(e, f"after step {self.step}", cfg.parallel.timeout_s,
                                                        self.health_group)) from e
            raise
        finally:
            self.prefetch.close()
            log.close()
        return final

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics, the same on every rank. One process: token accuracy and exact match of generated
        answers. Under a layout: loss and token accuracy from the step's program run forward only under the
        layout (train/heldout.py) — no rank builds a second model; exact match is `loom eval`'s, from the
        checkpoint."""
        samples = self.data.heldout
        if not samples:
            return {}
        if self.plan.distributed:
            return heldout_metrics(self.plan, self.model, samples, self.cfg, self.tok, self.counters, self.device)
        return evaluate(self.model, samples, self.tok, self.device, self.cfg.train.eval_max_new_tokens,
                        self.cfg.model.attention)

    def checkpoint(self) -> None:
        """A sharded, crash-safe checkpoint of this step in out_dir (collective: every rank calls it). Under
        `run.async_save` the files are written while training goes on and published at the next save or at
        the end; the previous save is finished first."""
        out, run = self.cfg.run.out_dir, self.cfg.run
        self.finish_save()
        if self._rank0():
            clear_staging(out, self.step)
        if self.plan.distributed:
            dist.barrier()
        self.pending = begin_save(staging_dir(out, self.step), self.model, self.optimizer, self.weight_aliases,
                                  self.step, {"config": self.cfg.to_dict()}, self.save_group, run.async_save,
                                  staging=self.save_staging)
        if not run.async_save:
            self.finish_save()

    def finish_save(self) -> None:
        """Completes the pending save, if any, and publishes it as `latest` (collective)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.finish()
        if self._rank0():
            publish(self.cfg.run.out_dir, pending.step, self.cfg.run.keep_last)
        if self.plan.distributed:
            dist.barrier()  # published before any rank goes on (a crash now leaves it complete)

    def _world_gloo_group(self, name: str):
        """A gloo group of every rank, `name`'s own, created through the registry (a world collective)."""
        self.plan.topo.registry.add(name, [tuple(range(dist.get_world_size()))], backend="gloo")
        return self.plan.topo.registry.named(name)

    def _rank0(self) -> bool:
        return not self.plan.distributed or dist.get_rank() == 0

    def _load(self, path: Path) -> dict:
        return load_sharded(path, self.model, self.optimizer, self.weight_aliases)


class GPUUse:
    """MFU since the run started (the step's FLOPs, train/flops.py, over a measured bf16 matmul peak per GPU) and
    this rank's peak memory, on CUDA only: what a user reads off the log line beside tok/s."""

    def __init__(self, device: torch.device, world: int) -> None:
        self.device, self.world = device, world
        self.peak_tflops = peak_matmul_tflops(device) if device.type == "cuda" else 0.0

    def since_start(self, flops: float, elapsed: float) -> dict[str, float]:
        if not self.peak_tflops:
            return {}
        mfu = flops / elapsed / self.world / 1e12 / self.peak_tflops
        return {"mfu": mfu, "peak_mem_gib": torch.cuda.max_memory_allocated(self.device) / 2**30}

    @staticmethod
    def status(use: dict[str, float]) -> str:
        return f"  mfu {use['mfu']:.1%}  mem {use['peak_mem_gib']:.1f} GiB" if use else ""

