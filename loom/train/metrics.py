"""What a user watches: a live progress bar (or plain lines), TensorBoard scalars, Weights & Biases (when asked
for), and metrics.jsonl."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


@dataclass
class WandbRun:
    """Where a W&B run goes: its project, "online" or "offline" (written under out_dir/wandb, `wandb sync` later),
    and the job's config shown on the run's page. The run is named after out_dir."""

    project: str
    mode: str = "online"
    config: dict = field(default_factory=dict)


class MetricsLogger:
    def __init__(
        self, out_dir: str | Path, total_steps: int, tensorboard: bool, progress: bool, enabled: bool = True,
        wandb: WandbRun | None = None,
    ) -> None:
        self.enabled = enabled  # one logger per job: other ranks get a silent one
        self.out_dir = Path(out_dir)
        self.console = Console(stderr=True, quiet=not enabled)
        self._jsonl, self._tb, self._bar, self._wandb = None, None, None, None
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.out_dir / "metrics.jsonl").open("a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.out_dir / "tensorboard"))
        if wandb is not None:
            import wandb as wandb_lib  # optional dependency: config validation checked it is installed

            self._wandb = wandb_lib.init(project=wandb.project, name=self.out_dir.name, dir=str(self.out_dir),
                                         mode=wandb.mode, config=wandb.config)
        if progress and sys.stderr.isatty():
            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._bar.add_task("train", total=total_steps, status="")
            self._bar.start()

    def log(self, step: int, values: dict[str, float], kind: str = "train") -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, "kind": kind, **values}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(f"{kind}/{k}", v, step)
        if self._wandb is not None:
            self._wandb.log({f"{kind}/{k}": v for k, v in values.items()}, step=step)

    def progress(self, step: int, status: str, print_line: bool) -> None:
        """Advances the bar; without a bar, prints the status line when asked to."""
        if self._bar is not None:
            self._bar.update(self._task, completed=step, status=status)
        elif print_line:
            self.console.print(f"step {step}  {status}", highlight=False, markup=False)

    def finish_progress(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def print(self, text: str) -> None:
        # soft_wrap: a log that is not a terminal gets whole lines (a path is not broken at column 80)
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def close(self) -> None:
        self.finish_progress()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._jsonl is not None:
            self._jsonl.close()
