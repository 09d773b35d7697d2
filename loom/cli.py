"""Command line: `loom train|verify|plan [CONFIG] [--section.key=value ...]`, `loom eval CHECKPOINT`,
`loom export CHECKPOINT --hf OUT`.

`train` and `verify` run on one process, or on every rank under `torchrun --nproc-per-node=N -m loom ...`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from loom.config import ConfigError
from loom.data.conversations import BadSample
from loom.exit_codes import CONFIG_ERROR, DATA_ERROR, STALLED
from loom.job import load_config
from loom.rank_gpus import CPU_RANKS_OVERRIDE, NoGpuOfItsOwn, cpu_ranks_note


DEFAULT_CONFIG = Path(__file__).with_name("default.toml")  # what `loom train` runs with no CONFIG


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loom", description="Multimodal training with a layout per module.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (defaults: the tiny vision+audio+text model on CPU)")
    train.add_argument("config", nargs="?", help="TOML job config; omitted: loom's default job (loom/default.toml)")
    train.add_argument("--layout", choices=["auto"], default=None,
                       help="auto: the layout `loom plan --search` predicts fastest, chosen before any model is built")
    train.add_argument("--gpus", type=int, default=None, help="--layout=auto: ranks (default: layout.world_size)")
    train.add_argument("--calibration", default=None, metavar="FILE",
                       help="--layout=auto: this machine's rates (measured into FILE first if it does not exist)")
    train.add_argument("--gpu-memory", type=float, default=None, metavar="GiB",
                       help="--layout=auto: leave out layouts predicted over 80%% of it per GPU")
    verify = sub.add_parser("verify", help="run the layout and the one-process reference side by side and compare")
    verify.add_argument("config", nargs="?", help="TOML job config; omitted: loom's default job")
    verify.add_argument("--steps", type=int, default=3, help="optimizer steps to compare (default 3)")
    verify.add_argument("--tolerance", type=float, default=None,
                        help="one max relative difference for every quantity (default: per quantity and dtype, "
                             "see docs/verify.md)")
    verify.add_argument("--against", default="layout", choices=["layout", "compile", "bf16"],
                        help="layout (default): the config's layout on N ranks; on one process: the model "
                             "compiled, or in bf16, against the eager fp32 reference")
    plan = sub.add_parser("plan", help="print the rank map of a config and draw it as a PNG (starts no process)")
    plan.add_argument("config", nargs="?", help="TOML job config")
    plan.add_argument("--world-size", type=int, default=None, help="ranks to plan for (default: layout.world_size)")
    plan.add_argument("--png", default=None, help="where to write the picture (default: <config name>.plan.png)")
    plan.add_argument("--search", action="store_true",
                      help="search the layouts of CONFIG on --gpus N: the fastest ones the cost model predicts, and "
                           "the best written as a config")
    plan.add_argument("--gpus", type=int, default=None, help="--search / --calibrate: the GPUs (ranks) to plan for")
    plan.add_argument("--gpu-memory", type=float, default=None, metavar="GiB",
                      help="--search: leave out layouts predicted to need more than 80%% of it per GPU (the "
                           "cost model under-predicts peaks by up to 19%%: --memory-headroom)")
    plan.add_argument("--memory-headroom", type=float, default=None, metavar="FRACTION",
                      help="--search: the share of --gpu-memory left free for what the model does not see "
                           "(default 0.2)")
    plan.add_argument("--calibration", default=None, metavar="FILE",
                      help="--search: the machine's measured rates (default: H200 figures from bench/RESULTS.md); "
                           "--calibrate: where to write them")
    plan.add_argument("--calibrate", action="store_true",
                      help="measure matmul rate, host overhead and collective bandwidths on --gpus N local ranks")
    plan.add_argument("--top", type=int, default=10, help="--search: layouts to print (default 10)")
    plan.add_argument("--out", default=None, help="--search: where to write the best layout's config "
                                                  "(default: <config name>.search.toml)")
    score = sub.add_parser("score", help="per-token logprobs, entropy and top-k of a JSONL's conversations")
    score.add_argument("config", help="TOML job config (data.sources: the conversation format)")
    score.add_argument("--data", required=True, help="JSONL of conversations to score (their assistant turns)")
    score.add_argument("--out", required=True, help="folder for scores.jsonl")
    score.add_argument("--checkpoint", default=None, help="a loom checkpoint (step-N) to score with")
    rl = sub.add_parser("rl", help="GRPO on the policy's own samples: sample, reward, score, train, repeat ([rl])")
    rl.add_argument("config", nargs="?", help="TOML job config with train.objective = 'grpo' and an [rl] table")
    evaluate = sub.add_parser("eval", help="held-out metrics of a saved checkpoint on one process (generation too)")
    evaluate.add_argument("checkpoint", help="a checkpoint folder (step-N), or a run's out_dir (its latest)")
    evaluate.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda")
    export = sub.add_parser("export", help="write a loom checkpoint's modules as Hugging Face folders")
    export.add_argument("checkpoint", help="a loom checkpoint folder (step-N)")
    export.add_argument("--hf", required=True, metavar="OUT_DIR",
                        help="writes OUT_DIR/language, OUT_DIR/vision, OUT_DIR/audio (config.json + model.safetensors)")
    args, extra = parser.parse_known_args(_join_space_separated(sys.argv[1:] if argv is None else argv))
    if args.command == "verify" and args.steps < 1:
        parser.error(f"--steps {args.steps}: verify needs at least one step")
    if args.command in ("export", "eval") and extra:
        parser.error(f"unexpected arguments {extra}")
    if args.command == "plan" and (args.search or args.calibrate):
        if args.search and args.calibrate:
            parser.error("--search and --calibrate are separate steps: calibrate first, then pass --calibration FILE")
        if not args.gpus or args.gpus < 1:
            parser.error(f"--{'search' if args.search else 'calibrate'} needs --gpus N (N ≥ 1), got {args.gpus}")
        if args.calibrate:
            if not args.calibration:
                parser.error("--calibrate needs --calibration FILE: where to write the measurements")
            return _calibrate(args.gpus, args.calibration)
    if args.command == "export":
        return _export(args.checkpoint, args.hf)
    if args.command == "eval":
        return _eval(args.checkpoint, args.device)
    overrides = extra
    if args.command == "score":  # the conversations to score come in as the held-out file
        overrides = [*extra, f"--data.heldout={args.data}"]
    bad = [o for o in overrides if not o.startswith("--")]
    if bad:
        parser.error(f"unexpected arguments {bad}; overrides look like --train.steps=50")
    launched = "WORLD_SIZE" in os.environ  # under torchrun (or another launcher)
    if args.command == "train" and args.layout == "auto":  # the search's world: the launcher's, or --gpus
        if args.gpus is not None and args.gpus < 1:
            parser.error(f"--gpus {args.gpus}: --layout=auto needs N ≥ 1 ranks")
        from loom.plan_search.auto import neutral_layouts

        world = int(os.environ["WORLD_SIZE"]) if launched else args.gpus
        overrides = [*overrides, *neutral_layouts(args.config or str(DEFAULT_CONFIG), overrides),
                     *([f"--layout.world_size={world}"] if world else [])]
    world_size = args.world_size if args.command == "plan" else (int(os.environ["WORLD_SIZE"]) if launched else None)
    config = args.config or str(DEFAULT_CONFIG)
    try:
        cfg = load_config(config, overrides, world_size)
        if args.command == "plan":
            return _search(config, overrides, cfg, args) if args.search else _plan(cfg, args)
        if args.command == "train" and args.layout == "auto":
            overrides, cfg = _auto_layout(config, overrides, cfg, args, launched)
            world_size = int(os.environ["WORLD_SIZE"]) if launched else None
        if not launched and cfg.layout.world_size > 1 and _ranks_on_cpu(cfg, args.command):
            overrides = [*overrides, CPU_RANKS_OVERRIDE]
            cfg = load_config(config, overrides, world_size)  # as the ranks will read it: checked on CPU too
    except ConfigError as e:
        if _traceback_asked():
            raise
        print(f"loom: config error: {e}", file=sys.stderr)
        return CONFIG_ERROR
    if not launched and cfg.layout.world_size > 1:
        flags = []
        if args.command == "verify":  # the ranks parse the same verify flags
            flags = [f"--steps={args.steps}", f"--against={args.against}"]
            flags += [f"--tolerance={args.tolerance}"] if args.tolerance is not None else []
        if args.command == "score":
            flags = [f"--data={args.data}", f"--out={args.out}"]
            flags += [f"--checkpoint={args.checkpoint}"] if args.checkpoint else []
        code = launch_local(cfg.layout.world_size, [args.command, config, *flags, *overrides])
        if code == 0 and args.command == "train":  # generation's exact match, from the checkpoint, on one process
            return _eval(cfg.run.out_dir, cfg.train.device)
        return code
    return _run(args, cfg)


def launch_local(n_ranks: int, loom_args: list[str]) -> int:
    """A config that asks for N ranks, started without a launcher: start N local ranks with torchrun (through
    loom/launch.py, so a config or data error ends with its own code and rank 0's message alone)."""
    cmd = [sys.executable, "-m", "loom.launch", "--standalone", f"--nproc-per-node={n_ranks}",
           "-m", "loom", *loom_args]
    print(f"loom: starting {n_ranks} local ranks: torchrun --standalone --nproc-per-node={n_ranks} -m loom "
          f"{' '.join(loom_args)}", file=sys.stderr)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(cmd, env=env)


def _ranks_on_cpu(cfg, command: str) -> bool:
    """Whether the local ranks run on CPU because the machine has GPUs, but fewer than the job's ranks (said in
    one line, with how to use the GPUs)."""
    note = cpu_ranks_note(cfg.layout.world_size, torch.cuda.device_count(), cfg.parallel.backend, cfg.train.device,
                          command)
    if note:
        print(note, file=sys.stderr)
    return note is not None


def _run(args, cfg) -> int:
    """train / verify: the same code on one process and on every rank of a torchrun launch."""
    from loom.distributed import CollectiveStalled, init_distributed, launched_world_size, shutdown

    # under torchrun the rank's device follows train.device and the backend; one process honours train.device
    device = None
    if launched_world_size() > 1:
        try:
            device = init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s,
                                      Path(cfg.run.out_dir) / "nccl-traces", cfg.train.device)
        except NoGpuOfItsOwn as e:
            return _no_gpu_of_its_own(e)
    try:
        if args.command == "verify":
            from loom.train.verify import ReferenceNotFinite, VerifyUsageError, verify

            try:
                checks = verify(cfg, args.steps, args.tolerance, device, against=args.against)
            except VerifyUsageError as e:
                print(f"loom verify: {e}", file=sys.stderr)
                return 2
            except ReferenceNotFinite as e:
                print(f"loom verify: {e}", file=sys.stderr)
                return 1
            return 0 if all(c.passed for c in checks) else 1
        if args.command == "score":
            from loom.rl.score_cli import run_score

            run_score(cfg, args.out, args.checkpoint, device)
            return 0
        if args.command == "rl":
            from loom.rl.loop import RLLoop

            RLLoop(cfg, device).run()
            return 0
        from loom.train.trainer import Trainer

        if getattr(args, "auto_overrides", None):  # every rank searched alone: prove they chose alike
            from loom.plan_search.auto import agree_on_choice

            agree_on_choice(args.auto_overrides, device or torch.device("cpu"))
        Trainer(cfg, device).run()
        return 0
    except CollectiveStalled as e:
        print(e, file=sys.stderr)
        return STALLED
    except ConfigError as e:
        if _traceback_asked():
            raise
        print(f"loom: config error: {e}", file=sys.stderr)
        return CONFIG_ERROR
    except BadSample as e:  # every rank raises the same one (found by all, or agreed on before the step)
        if _traceback_asked():
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"loom: data error: {e}", file=sys.stderr, flush=True)
        _after_rank_0_spoke()
        return DATA_ERROR
    finally:
        shutdown()


def _no_gpu_of_its_own(error: NoGpuOfItsOwn) -> int:
    """Every rank of the launch decided the same: one prints the config error, the others exit after it."""
    if _traceback_asked():
        raise error
    if error.speaks:
        print(f"loom: config error: {error}", file=sys.stderr, flush=True)
    else:  # no process group yet: wait for torchrun to stop this rank once the speaking one exits
        time.sleep(error.wait_s)
    return CONFIG_ERROR


def _traceback_asked() -> bool:
    """LOOM_TRACEBACK=1: a config or data error raised with its traceback, not just its message."""
    return os.environ.get("LOOM_TRACEBACK") == "1"


def _after_rank_0_spoke(wait_s: float = 30.0) -> None:
    """Every rank raised the same error; none exits before rank 0 has printed it (torchrun stops the other
    ranks when the first one exits, which could cut rank 0 off mid-report). Through the rendezvous store, not a
    collective, and for `wait_s` at most: a rank that did not raise cannot leave the others hanging."""
    from datetime import timedelta

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        store.set("loom/error-reported", "1")
        return
    try:
        store.wait(["loom/error-reported"], timedelta(seconds=wait_s))
    except (RuntimeError, dist.DistError):  # rank 0 did not say it: exit anyway
        pass


def _plan(cfg, args) -> int:
    from loom.topology import Topology
    from loom.topology.plan import draw_plan, print_plan

    world = args.world_size or cfg.layout.world_size
    if not world:
        raise ConfigError("loom plan needs a world size: set layout.world_size in the config or pass --world-size N")
    topo = Topology.plan(cfg, world)
    print_plan(topo)
    stem = os.path.splitext(os.path.basename(args.config))[0] if args.config else "default"
    png = draw_plan(topo, args.png or f"{stem}.plan.png")
    print(f"picture: {png}")
    return 0


def _search(config: str, overrides: list[str], cfg, args) -> int:
    from rich.console import Console

    from loom.plan_search.calibration import load_calibration
    from loom.plan_search.report import (chosen_config_text, default_output, ranking_table, summary_line,
                                         write_chosen)
    from loom.plan_search.search import MEMORY_HEADROOM, search
    from loom.plan_search.workload import job_facts

    cal = load_calibration(args.calibration)
    facts = job_facts(cfg)
    headroom = MEMORY_HEADROOM if args.memory_headroom is None else args.memory_headroom
    if not 0 <= headroom < 1:
        raise ConfigError(f"--memory-headroom {headroom}: a share of --gpu-memory in [0, 1)")
    result = search(config, overrides, cfg, facts, args.gpus, cal, args.gpu_memory, args.top, headroom=headroom)
    console = Console(width=max(160, Console().width))
    modules = [*cfg.model.encoders, "language"]
    console.print(f"calibration: {cal.device}" + (f" ({args.calibration})" if args.calibration else ""))
    console.print(summary_line(result))
    if not result.ranked:
        limit = (f" within {1 - headroom:.0%} of --gpu-memory {args.gpu_memory} GiB (--memory-headroom {headroom})"
                 if args.gpu_memory else "")
        raise ConfigError(f"no layout of {config} on {args.gpus} GPUs is accepted by loom{limit}; "
                          f"{summary_line(result)}")
    console.print(ranking_table(result, modules, args.gpus))
    best = result.ranked[0].candidate
    chosen = load_config(config, [*overrides, *best.overrides()], args.gpus)  # loom's own reading of it, again
    path = write_chosen(args.out or default_output(args.config), chosen_config_text(config, overrides, best, chosen))
    console.print(f"best layout written to {path}: loom train {path}")
    return 0


def _auto_layout(config: str, overrides: list[str], cfg, args, launched: bool):
    """--layout=auto: the search's best layout appended to the overrides (printed by one process: this one, or
    rank 0 of a launch, where every rank searches alike), and the config reloaded with it."""
    from loom.plan_search.auto import choose_layout, write_auto_config

    world = int(os.environ["WORLD_SIZE"]) if launched else (args.gpus or cfg.layout.world_size or 1)
    if args.calibration and not os.path.exists(args.calibration) and not launched:
        if _calibrate(world, args.calibration) != 0:
            raise ConfigError(f"--layout=auto: measuring this machine into {args.calibration} failed")
    auto = choose_layout(config, overrides, cfg, world, args.calibration, args.gpu_memory)
    overrides = [*overrides, *auto.overrides]
    cfg = load_config(config, overrides, world if launched else None)
    if int(os.environ.get("RANK", "0")) == 0:
        path = write_auto_config(config, overrides[: len(overrides) - len(auto.overrides)], auto, cfg)
        print("\n".join([*auto.lines, f"loom: the chosen layout as a config: {path}"]), file=sys.stderr, flush=True)
    args.auto_overrides = auto.overrides if launched else None
    return overrides, cfg


def _calibrate(gpus: int, out: str) -> int:
    """Measures on `gpus` local ranks (torchrun started here unless this is already a launched rank)."""
    if "WORLD_SIZE" in os.environ or gpus == 1:
        from loom.plan_search.calibrate import main as calibrate

        return calibrate(["--out", out])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
           "-m", "loom.plan_search.calibrate", "--out", out]
    print(f"loom: calibrating on {gpus} local ranks: {' '.join(cmd[2:])}", file=sys.stderr)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(cmd, env=env)


def _eval(checkpoint: str, device: str) -> int:
    from loom.checkpoint.folders import latest_checkpoint
    from loom.checkpoint.sharded import CheckpointError
    from loom.train.build import resolve_device
    from loom.train.checkpoint_eval import evaluate_checkpoint
    from loom.train.evaluate import heldout_report

    try:
        path = latest_checkpoint(checkpoint) or Path(checkpoint)  # a run's folder: the checkpoint `latest` names
        metrics, step = evaluate_checkpoint(path, resolve_device(device))
    except (CheckpointError, ConfigError, RuntimeError) as e:
        print(f"loom eval: {e}", file=sys.stderr)
        return CONFIG_ERROR
    except BadSample as e:  # the held-out conversations, read again (they may have changed since the run)
        if _traceback_asked():
            raise
        print(f"loom eval: data error: {e}", file=sys.stderr)
        return DATA_ERROR
    print(f"{path} (step {step}):")
    print(heldout_report(metrics))
    return 0


def _export(checkpoint: str, out_dir: str) -> int:
    from loom.models.hf import HFError, export_checkpoint

    try:
        written = export_checkpoint(checkpoint, out_dir)
    except HFError as e:
        print(f"loom: export error: {e}", file=sys.stderr)
        return 2
    skipped = written.pop("not_exported")
    for module, folder in written.items():
        print(f"{module:<8} → {folder}")
    if skipped:
        print(f"not exported (no Hugging Face counterpart): {', '.join(skipped)}")
    return 0


def _join_space_separated(items: list[str]) -> list[str]:
    """Accepts both `--a.b=1` and `--a.b 1` for dotted config keys (before argparse sees the value)."""
    out: list[str] = []
    for item in items:
        prev = out[-1] if out else ""
        if prev.startswith("--") and "." in prev and "=" not in prev and not item.startswith("--"):
            out[-1] = f"{out[-1]}={item}"
        else:
            out.append(item)
    return out
