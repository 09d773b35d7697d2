"""The single-process training loop: build everything from a JobConfig, train, evaluate, checkpoint."""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from loom.config import JobConfig
from loom.data.batch import Batch, pad_samples
from loom.data.format import to_sample
from loom.data.loader import GlobalBatches
from loom.data.packing import pack_samples
from loom.data.sample import Sample
from loom.data.tasks import CHANCE, TaskDataset
from loom.data.tokenizer import ByteTokenizer
from loom.models.hf import make_module
from loom.models.multimodal import MultimodalModel, build_model
from loom.train.checkpoint import load_checkpoint, save_checkpoint
from loom.train.evaluate import evaluate
from loom.train.loss import token_loss_sum
from loom.train.metrics import MetricsLogger
from loom.train.optim import build_optimizer, clip_and_check, set_lr


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    skipped: bool
    tokens: int


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device = 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return torch.device(name)


def build_job_model(cfg: JobConfig, tok: ByteTokenizer, pretrained: bool = True) -> MultimodalModel:
    """The job's model; a module whose `hf` folder is set loads its weights from there when `pretrained`
    (its sizes were already taken from that folder by load_config). Projectors start from random weights."""
    m = cfg.model
    return build_model(
        m.language,
        m.vision if "vision" in m.encoders else None,
        m.audio if "audio" in m.encoders else None,
        tok.placeholder_ids,
        make=functools.partial(make_module, pretrained=pretrained),
    )


def collate(samples: list[Sample], cfg: JobConfig, tok: ByteTokenizer) -> Batch:
    d, backend = cfg.data, cfg.model.attention
    if d.format == "thd":
        return pack_samples(samples, tok.pad_id, d.pad_to_multiple, backend=backend)
    return pad_samples(samples, tok.pad_id, d.pad_to_multiple, backend=backend)


class Trainer:
    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        torch.manual_seed(cfg.train.seed)
        self.device = resolve_device(cfg.train.device)
        self.tok = ByteTokenizer()
        self.model = build_job_model(cfg, self.tok, pretrained=not cfg.run.resume).to(self.device)
        self.counters = {n: self.model.encoder(n).num_tokens for n in self.model.encoder_names}
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.step = 0
        d = cfg.data
        sizes = dict(patch_size=cfg.model.vision.patch_size, n_audio_features=cfg.model.audio.num_features)
        self.train_set = TaskDataset(d.tasks, "train", d.train_size, seed=d.seed, **sizes)
        self.heldout = TaskDataset(d.tasks, "heldout", d.heldout_size, seed=d.seed, **sizes)
        self.batches = GlobalBatches(
            self.train_set, cfg.train.global_batch_size, d.seed, lambda ex: to_sample(ex, self.tok, self.counters)
        )
        if cfg.run.resume:
            self.step = load_checkpoint(cfg.run.resume, self.model, self.optimizer)["step"]

    def autocast(self):
        if self.cfg.train.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self, samples: list[Sample]) -> StepResult:
        batch = collate(samples, self.cfg, self.tok).to(self.device)
        n_supervised = batch.num_supervised
        lr = set_lr(self.optimizer, self.step, self.cfg.train)
        with self.autocast():
            logits = self.model(batch.input_ids, batch.positions, batch.layout, batch.modality_inputs)
        loss_sum = token_loss_sum(logits, batch.labels)
        (loss_sum / max(1, n_supervised)).backward()
        norm, finite = clip_and_check(self.model, self.cfg.train.grad_clip)
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return StepResult(loss_sum.item() / max(1, n_supervised), norm, lr, not finite, sum(len(s) for s in samples))

    def run(self) -> dict[str, float]:
        cfg, out = self.cfg, Path(self.cfg.run.out_dir)
        log = MetricsLogger(out, cfg.train.steps, cfg.run.tensorboard, cfg.run.progress)
        n_params = sum(p.numel() for p in self.model.parameters())
        log.print(f"loom: {n_params / 1e6:.2f}M parameters on {self.device}, {cfg.train.steps} steps → {out}")
        tokens, t0, final = 0, time.perf_counter(), {}
        try:
            while self.step < cfg.train.steps:
                r = self.train_step(self.batches.shard(self.step))
                tokens += r.tokens
                elapsed = time.perf_counter() - t0
                log.log(self.step, {"loss": r.loss, "grad_norm": r.grad_norm, "lr": r.lr, "skipped": float(r.skipped)})
                status = f"loss {r.loss:.3f}  tok/s {tokens / elapsed:,.0f}  lr {r.lr:.1e}"
                if r.skipped:
                    log.print(f"step {self.step}: non-finite grad norm, optimizer step skipped")
                log.progress(self.step, status, self.step % cfg.train.log_every == 0 or self.step == cfg.train.steps)
                if cfg.train.eval_every and self.step % cfg.train.eval_every == 0 and self.step < cfg.train.steps:
                    log.log(self.step, self.evaluate(), kind="heldout")
                if cfg.run.save_every and self.step % cfg.run.save_every == 0:
                    self.save(out / f"step-{self.step}")
            log.finish_progress()
            log.print(f"evaluating on {len(self.heldout)} held-out examples …")
            final = self.evaluate()
            log.log(self.step, final, kind="heldout")
            self.save(out / "final")
            log.print(heldout_report(final, time.perf_counter() - t0))
        finally:
            log.close()
        return final

    def evaluate(self) -> dict[str, float]:
        examples = [self.heldout[i] for i in range(len(self.heldout))]
        t = self.cfg.train
        return evaluate(self.model, examples, self.tok, self.counters, self.device, t.eval_max_new_tokens,
                        self.cfg.model.attention)

    def save(self, path: Path) -> None:
        save_checkpoint(path, self.model, self.optimizer, self.step, {"config": self.cfg.to_dict()})


def heldout_report(metrics: dict[str, float], seconds: float) -> str:
    lines = [f"held-out after {seconds:.0f}s (exact match of the generated answer, chance in brackets):"]
    for key, value in sorted(metrics.items()):
        if key.startswith("exact_match/"):
            task = key.split("/", 1)[1]
            lines.append(f"  {task:<8} {value:6.1%}   token accuracy {metrics['token_accuracy/' + task]:6.1%}"
                         f"   [chance {CHANCE[task]:.1%}]")
    lines.append(f"  {'all':<8} {metrics['exact_match']:6.1%}   token accuracy {metrics['token_accuracy']:6.1%}")
    return "\n".join(lines)
