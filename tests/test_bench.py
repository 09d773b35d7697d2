"""The GPU benchmarks' small CPU form, so they cannot rot: run as a user would, through torchrun; and their
FLOP and token accounting against numbers worked out by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import torch.nn as nn

from bench.flops import attention_flops, matmul_params, step_flops
from bench.mm_bench import flops_of
from bench.workload import SMALL, PackedSteps, ReplicaSweep
from loom.job import load_config
from loom.data.sample import Sample


def test_cp_long_small_runs_on_two_cpu_ranks():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "bench/cp_long.py", "--cp", "2", "--seq", "256", "--small", "--steps", "1", "--warmup", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(text for text in out.stdout.splitlines() if text.startswith("{"))
    result = json.loads(line)
    assert result["cp"] == 2 and result["dp"] == 1 and result["tokens_per_s_per_gpu"] > 0
    assert result["loss"] > 0


def test_loader_bench_small_writes_its_files_and_measures_every_worker_count(tmp_path):
    """bench/loader_bench.py --small: JPEG/WAV conversations written, each worker count pulls the same samples."""
    cmd = [sys.executable, "bench/loader_bench.py", str(tmp_path), "--small", "--steps", "2", "--global-batch", "4",
           "--conversations", "16", "--workers", "0", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["workers"] for r in rows] == [0, 1] and rows[0]["tokens_per_sample"] == rows[1]["tokens_per_sample"]
    assert len(list(tmp_path.glob("media/*.jpg"))) == 16 and len(list(tmp_path.glob("media/*.wav"))) == 4


def test_checkpoint_throughput_small_saves_and_loads_both_ways(tmp_path):
    """bench/ckpt_throughput.py --small: a sync and an async save of one checkpoint, each loaded back, then dd."""
    cmd = [sys.executable, "bench/ckpt_throughput.py", "--out", str(tmp_path), "--small"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r.get("async_save") for r in rows] == [False, True, None] and rows[0]["gib"] == rows[1]["gib"] > 0
    assert all(r["load_s"] > 0 for r in rows[:2]) and rows[2]["dd_write_gib_per_s"] > 0


def test_encoder_sp_bench_small_runs_both_rows_on_two_cpu_ranks():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "bench/encoder_sp.py",
           "--small", "--images", "3", "--side", "16", "--steps", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["sequence_parallel"], r["activation_checkpointing"]) for r in rows] == [
        (False, "none"), (True, "none"), (False, "full"), (True, "full")] and rows[0]["rows"] == 48


def test_flops_by_hand():
    layers = nn.Sequential(nn.Linear(3, 5), nn.Conv2d(2, 4, 3), nn.Conv1d(4, 6, 3), nn.Embedding(10, 7),
                           nn.LayerNorm(5))
    assert matmul_params(layers) == 3 * 5 + 4 * 2 * 3 * 3 + 6 * 4 * 3  # weights only: no bias, embedding, norm
    # samples of 3 and 5 tokens, 2 layers of width 8; training is 3× the forward's 2·L²·d (causal) or 4·L²·d
    assert attention_flops([3, 5], 2, 8, causal=True) == 3 * 2 * 2 * 8 * (3 * 3 + 5 * 5) == 3264
    assert attention_flops([3, 5], 2, 8, causal=False) == 3 * 4 * 2 * 8 * (3 * 3 + 5 * 5) == 6528
    llm = 6 * 100 * (3 + 5) + 3264  # 100 matmul params; 6 FLOPs per param per token
    encoder = 6 * 50 * (2 + 2) + 3 * 4 * 1 * 4 * (2 * 2 + 2 * 2)  # 50 params, 1 layer of width 4, items of 2 tokens
    assert step_flops(100, 2, 8, [3, 5], [(50, 1, 4, [2, 2])]) == llm + encoder == 9648


def test_flops_count_a_mixture_of_experts_at_its_active_share():
    """Each token meets the router and top_k of E experts: a block of 8 experts of width 6, 2 per token, costs a
    dense SwiGLU of width 2·6 plus the router's [8, hidden] — an oracle from another module, not the formula."""
    from loom.models.layers import SwiGLU
    from loom.models.moe import MoEBlock
    from loom.models.router import RouterSpec

    hidden, width, experts, k = 4, 6, 8, 2
    block = MoEBlock(hidden, RouterSpec(experts, k), width)
    assert matmul_params(block) == matmul_params(SwiGLU(hidden, k * width)) + experts * hidden
    shared = MoEBlock(hidden, RouterSpec(experts, k), width, n_shared=1)  # a shared expert runs on every token
    assert matmul_params(shared) == matmul_params(block) + matmul_params(SwiGLU(hidden, width))


def test_flops_of_samples_counts_patches_and_audio_frames():
    spec = {"patch": 4, "llm": (100, 2, 8), "vision": (50, 1, 4), "audio": (30, 3, 6), "llm_length": len}
    samples = [Sample([0] * 10, [False] * 10, [torch.zeros(3, 8, 12)], [torch.zeros(16, 7)]),
               Sample([0] * 5, [False] * 5, [torch.zeros(3, 4, 4)], [])]
    # (8/4)·(12/4) = 6 and 1 patches; 7 mel frames → (7 + 1) // 2 = 4 tokens after the stride-2 conv
    assert flops_of(samples, spec) == step_flops(100, 2, 8, [10, 5], [(50, 1, 4, [6, 1]), (30, 3, 6, [4])])
    # a fixed resize (the HF contender's) gives every image the same patch count
    fixed = {**spec, "patches_per_image": 64}
    assert flops_of(samples, fixed) == step_flops(100, 2, 8, [10, 5], [(50, 1, 4, [64, 64]), (30, 3, 6, [4])])


def test_workload_samples_are_prompt_plus_text_and_fit_the_sequence():
    steps = PackedSteps(SMALL, replicas=2, per_replica=3, seq=300)
    batch = steps.global_batch(0)
    assert len(batch) == 6 and any(s.audio for s in steps.global_batch(1) + batch)
    for s in batch:
        (h, w), clips = s.images[0].shape[1:], [c.shape[1] for c in s.audio]
        assert len(s) == 1 + (h // 4) * (w // 4) + sum((f + 1) // 2 for f in clips) + sum(s.supervised)
    assert all(sum(map(len, batch[r * 3 : r * 3 + 3])) <= 300 for r in range(2))


def test_replica_sweep_carries_the_n_gpu_rows_samples_one_group_a_step():
    """A one-GPU row's `--samples-of 4`: its steps 4s … 4s+3 are exactly step s of the 4-replica row, in order."""
    four, sweep = PackedSteps(SMALL, 4, 3, 300), ReplicaSweep(SMALL, 4, 3, 300)
    for s in (0, 2):
        swept = [x for k in range(4 * s, 4 * s + 4) for x in sweep.global_batch(k)]
        assert [(x.tokens, x.supervised) for x in swept] == [(x.tokens, x.supervised) for x in four.global_batch(s)]
        assert all(torch.equal(a, b) for x, y in zip(swept, four.global_batch(s)) for a, b in zip(x.images, y.images))
    one = PackedSteps(SMALL, 1, 3, 300)  # replica 0's groups alone: another set of samples
    assert [x.tokens for x in sweep.global_batch(1)] != [x.tokens for x in one.global_batch(1)]


def test_multimodal_table_small_runs_every_contender(tmp_path):
    """bench/run_mm.sh on 2 CPU ranks, --small: every row of the GPU table runs, and bench.table reads them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(), "EXTRA": "--small", "SEQ": "256",
           "STEPS": "1",
           "COMPILED": "",  # compile's own CPU tests are elsewhere; here only that every row still runs
           "WARMUP": "1"}
    out = tmp_path / "mm.jsonl"
    run = subprocess.run(["bash", "bench/run_mm.sh", str(out), "2"], capture_output=True, text=True, timeout=900,
                         env=env)
    assert run.returncode == 0 and "failed" not in run.stderr, run.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6  # COMPILED="": the compiled packed row is the eager one, run once
    assert {(r["system"], r["layout"], r["format"]) for r in rows} >= {
        ("loom", "homogeneous", "thd"), ("loom", "heterogeneous", "thd"), ("loom", "homogeneous", "bshd"),
        ("hf", "fsdp2", "bshd")}
    assert all(r["tokens_per_s_per_gpu"] > 0 and r["loss"] > 0 for r in rows)
    # 2 ranks, seq 256: max(1, 3·256 // 4096) = 1 sample per rank; warmup step 0, measured step 1
    steps = PackedSteps(SMALL, replicas=2, per_replica=1, seq=256)
    grid = load_config(None, []).model.vision.position_grid  # HF resizes every image to grid × grid patches
    real = {"loom": sum(len(s) for s in steps.global_batch(1)),
            "hf": sum(1 + grid * grid + sum(s.supervised) for s in steps.global_batch(1))}  # Llava drops the audio
    for r in rows:  # tokens/s is real tokens over the median step; both rounded in the JSON line
        tokens = r["tokens_per_s_per_gpu"] * r["step_s"] * r["gpus"]
        assert abs(tokens - real[r["system"]]) <= 0.01 * real[r["system"]], r
    loom = [r for r in rows if r["system"] == "loom"]
    assert max(r["loss"] for r in loom) - min(r["loss"] for r in loom) <= 1e-3  # same model, samples, any layout
    padded = {r["pad_to"]: r["padding_fraction"] for r in loom if r["format"] == "bshd"}
    rank0 = [len(s) for step in (0, 1) for s in steps.shard(step, 0, 2)]  # rank 0 prints; one row per step
    fixed = -(-SMALL.longest // 64) * 64  # "longest": every row the workload's longest sample, rounded up to 64
    assert padded == {"longest": round(1 - sum(rank0) / (2 * fixed), 4), "seq": round(1 - sum(rank0) / (2 * 256), 4)}
    table = subprocess.run([sys.executable, "-m", "bench.table", str(out)], capture_output=True, text=True, env=env)
    assert table.returncode == 0 and len(table.stdout.splitlines()) == 2 + len(rows)


def test_pipeline_grad_reduce_rows_small_run_on_four_cpu_ranks(tmp_path):
    """bench/run_pipeline.sh gradreduce, --small on 4 CPU ranks: both pp2·dp2 rows (FSDP2 reducing once per step,
    and after every microbatch) run, report step times and recompiles, and train the same model on the same
    samples to the same loss."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(), "EXTRA": "--small", "SEQ": "256",
           "STEPS": "1", "WARMUP": "1"}
    out = tmp_path / "pp.jsonl"
    run = subprocess.run(["bash", "bench/run_pipeline.sh", str(out), "gradreduce"], capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0 and "failed" not in run.stderr, run.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["overrides"][-1] for r in rows] == ["parallel.pp_grad_reduce=step", "parallel.pp_grad_reduce=microbatch"]
    for r in rows:
        assert "layout.language.pp=2" in r["overrides"] and "train.microbatches=8" in r["overrides"]
        assert r["gpus"] == 4 and r["recompiles"] == 0
        assert 0 < r["step_s_min"] <= r["step_s"] <= r["step_s_max"]
    assert abs(rows[0]["loss"] - rows[1]["loss"]) <= 1e-3  # one optimizer step behind each: the same numbers


def test_noncolocated_row_small_runs_on_two_cpu_ranks():
    """bench/mm_bench.py --small on 2 CPU ranks, non-colocated (encoders on rank 0, the LLM on rank 1), as
    bench/run_noncolocated.sh runs it: it trains and reports its placement, and --comm-report's gather over gloo
    runs. (That it trains the colocated row's
    numbers is tests/test_noncolocated.py's parity, not run here a second time.)"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "bench/mm_bench.py",
           "--small", "--seq", "256", "--per-gpu", "6", "--steps", "1", "--warmup", "1",
           "--set", "train.microbatches=2", "--set", "layout.vision.ranks=0-0", "--set", "layout.audio.ranks=0-0",
           "--set", "layout.language.ranks=1-1", "--comm-report"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(next(text for text in out.stdout.splitlines() if text.startswith("{")))
    assert row["placement"] == "non-colocated" and row["layouts"]["language"].endswith("on ranks 1-1")
    assert row["loss"] > 0 and row["tokens_per_s_per_gpu"] > 0
    # --comm-report gathered over gloo: no device kernels on CPU, so null, not a crash
    assert row["exposed_comm_share"] is None and row["rank_skew"] is None and row["compute_s_per_step"] is None


def test_overlap_of_busy_intervals_counted_by_hand():
    """bench/overlap.py: unions, intersections and the shares it reports, against sums done by hand."""
    from bench.overlap import intersect, merge_intervals, overlap_report
    assert merge_intervals([(20, 30), (0, 10), (5, 15)]) == [(0, 15), (20, 30)]
    assert intersect([(0, 15), (20, 30)], [(10, 25)]) == [(10, 15), (20, 25)]
    busy = {"encoders": [(0, 10), (5, 15), (20, 30)], "llm": [(10, 25)]}
    report = overlap_report(busy, [(0, 40)])
    assert report["encoders"] == {"busy_of_wall": 0.625, "busy_while_others_busy": 0.4}  # 25/40, 10/25
    assert report["llm"] == {"busy_of_wall": 0.375, "busy_while_others_busy": 0.6667}  # 15/40, 10/15
    clipped = overlap_report(busy, [(18, 40), (0, 12)])  # kernels outside the measured steps do not count
    assert clipped["wall_s"] == 34e-9
    assert clipped["encoders"]["busy_while_others_busy"] == round(7 / 22, 4)
    assert clipped["llm"]["busy_of_wall"] == round(9 / 34, 4)


def test_ckpt_bench_small_runs_both_modes_on_cpu(tmp_path):
    """bench/ckpt_bench.py --small: a synchronous and an async_save row, each saving twice."""
    cmd = [sys.executable, "bench/ckpt_bench.py", "--small", "--out", str(tmp_path), "--steps", "5",
           "--save-every", "2", "--batch", "4"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["async_save"] for r in rows] == [False, True]
    assert all(r["saved_steps"] == [2, 4] and r["checkpoint_gib"] > 0 for r in rows)
    assert (tmp_path / "async" / "step-4" / "state.json").is_file()


def test_startup_bench_small_runs_on_two_cpu_ranks():
    """bench/startup.py --small: the meta start-up measured on 2 ranks, one row with each rank's figures."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "bench/startup.py", "--small"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(next(text for text in out.stdout.splitlines() if text.startswith("{")))
    assert row["start_up"] == "meta, then shards" and len(row["per_rank"]) == 2
    assert row["max_host_peak_rss_gib"] > 0 and row["params_b"] > 0


def test_llm_bench_small_runs_a_text_only_job():
    """bench/llm_bench.py --small: the text-only row beside torchtitan, on CPU, with no recompile counted."""
    cmd = [sys.executable, "bench/llm_bench.py", "--small", "--seq", "128", "--tokens", "256", "--steps", "2",
           "--warmup", "1", "--profile", os.devnull]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(text for text in out.stdout.splitlines() if text.startswith("{")))
    assert result["tokens_per_step"] == 256 and result["tokens_per_s"] > 0 and result["recompiles"] == 0
    assert len(result["step_times"]) == 2 and result["loss"] > 0
    assert result["exposed_comm_share"] is None and result["rank_skew"] is None  # profiled, but no CUDA kernel


def test_score_bench_small_scores_every_target_chunked_or_whole():
    """bench/score_bench.py --small, chunks of 64 tokens and the whole batch: every target of the 4 documents is
    scored (255 each after <bos>), one timing per pass."""
    for chunk in ("64", "0"):
        cmd = [sys.executable, "bench/score_bench.py", "--small", "--seq", "256", "--tokens", "1024", "--chunk", chunk,
               "--passes", "2"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(next(text for text in out.stdout.splitlines() if text.startswith("{")))
        assert abs(result["scored_tokens_per_s"] * result["pass_s"] - 4 * 255) <= 0.02 * 4 * 255  # both rounded
        assert len(result["pass_times"]) == 2


def test_sample_bench_small_times_every_system_on_the_same_tokens():
    """bench/sample_bench.py --small: loom's sampler (eager and compiled decode) and HF generate each decode 2
    prompts × 2 rows × 16 tokens, timed, from loom's weights exported to a Hugging Face folder."""
    cmd = [sys.executable, "bench/sample_bench.py", "--small", "--prompts", "2", "--group", "2", "--repeats", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(text) for text in out.stdout.splitlines() if text.startswith("{")]
    assert [r["system"] for r in rows] == ["loom", "loom_compiled_decode", "hf_generate"]
    for r in rows:
        assert r["new_tokens"] == 16 and len(r["seconds"]) == 2
        assert abs(r["tokens_per_s"] * r["min_median_max"][1] - 2 * 2 * 16) <= 0.05 * 64  # both rounded


def test_model_flops_of_a_text_only_model_counts_the_llm_alone():
    """The trainer's count (loom/train/flops.py) is bench's: the same step_flops over the model's own sizes."""
    from loom.train.build import build_job
    from loom.train.flops import ModelFlops
    from conftest import TINY_MODEL_OVERRIDES

    cfg = load_config(None, TINY_MODEL_OVERRIDES + ["--model.encoders=[]", '--data.tasks=["sums"]',
                                                    "--train.device=cpu"])
    job = build_job(cfg)
    flops = ModelFlops.of(job.model)
    lm = cfg.model.language
    assert flops.encoders == {} and flops.llm == (matmul_params(job.model.language), lm.num_layers, lm.hidden_size)
    assert flops.step([10, 20], {}) == step_flops(*flops.llm, [10, 20], [])


def test_model_flops_of_latent_attention_average_the_key_and_value_widths():
    """Under MLA a pair's score reads the key width (nope 16 + rope 8 = 24) and its weighted sum the value width
    (12), per head: 4 heads give 2·4·24 + 2·4·12 = 288 FLOPs per pair forward, a dense width of 288 / 4 = 72."""
    from loom.train.build import build_job
    from loom.train.flops import ModelFlops
    from conftest import TINY_MODEL_OVERRIDES

    mla = ["--model.language.kv_lora_rank=32", "--model.language.qk_nope_head_dim=16",
           "--model.language.qk_rope_head_dim=8", "--model.language.v_head_dim=12", "--model.language.num_kv_heads=4"]
    cfg = load_config(None, TINY_MODEL_OVERRIDES + mla + ["--model.encoders=[]", '--data.tasks=["sums"]',
                                                          "--train.device=cpu"])
    assert cfg.model.language.num_heads == 4
    assert ModelFlops.of(build_job(cfg).model).llm[2] == 72


# torchtitan v0.2.2's metric lines as bench/results/2026-11-24-torchtitan-h200-8192.log holds them (run_train.sh
# tees rank 0); the last two as a colored terminal and a validation pass write them
TITAN = "[rank0]:[titan] 2026-11-24 06:30:27,363 - root - INFO - "
TITAN_LOG = "\n".join(TITAN + line for line in [
    "step:  1  loss: 12.37742  grad_norm: 80.6771  memory: 30.80GiB(22.03%)  tps: 490  tflops: 6.91  mfu: 0.70%",
    "step:  5  loss:  6.51925  grad_norm: 21.6020  memory: 43.63GiB(31.21%)  tps: 24,438  tflops: 344.42  mfu: 34.83%",
    "step: 10  loss:  6.38482  grad_norm: 15.3294  memory: 43.63GiB(31.21%)  tps: 36,165  tflops: 509.69  mfu: 51.54%",
    "step: 15  loss:  3.33786  grad_norm: 17.3097  memory: 43.63GiB(31.21%)  tps: 36,466  tflops: 513.93  mfu: 51.96%",
    "step: 20  loss:  2.65816  grad_norm:  5.8706  memory: 43.63GiB(31.21%)  tps: 36,078  tflops: 508.47  mfu: 51.41%",
    "\x1b[31mstep: 25  \x1b[32mloss:  2.52674  \x1b[38;2;180;60;0mgrad_norm:  5.2549  \x1b[38;2;54;234;195mmemory: "
    "43.63GiB(31.21%)  \x1b[34mtps: 36,163  \x1b[36mtflops: 509.67  \x1b[35mmfu: 51.53%\x1b[39m",
    "validate step: 25  loss:  2.6000  memory: 43.63GiB(31.21%)  tps: 99,999"])


def test_torchtitan_log_tps_read_from_step_10_on():
    """bench/titan_log.py: the per-GPU tps of steps 10–25 (the colored line too, the validation line not), median
    (36,163 + 36,165) / 2 by hand."""
    from bench.titan_log import titan_row, tps_by_step
    assert tps_by_step(TITAN_LOG) == {1: 490, 5: 24438, 10: 36165, 15: 36466, 20: 36078, 25: 36163}
    row = titan_row(TITAN_LOG, gpus=4, tokens_per_gpu=8192)
    assert row["tps"] == [36165, 36466, 36078, 36163] and row["tps_median"] == 36164
    assert row["gpus"] == 4 and row["tokens_per_gpu"] == 8192 and row["bench"] == "torchtitan"
    assert titan_row("Traceback (most recent call last):\n", 4, 8192)["tps_median"] is None


def test_run_tt_passes_the_anchor_command_and_prints_one_row_per_size(tmp_path):
    """bench/run_tt.sh against a stand-in torchtitan (a run_train.sh that logs its NGPU, batch and one tps line):
    local_batch_size = tokens per GPU / 8192, NVLink multicast off, one JSON row per size appended to OUT."""
    kit, site = tmp_path / "kit", tmp_path / "site"
    (kit / "tt").mkdir(parents=True)
    site.mkdir()
    (site / ".tt-wheels").touch()  # wheels taken as installed: pip is not what this tests
    stub = kit / "tt" / "run_train.sh"
    stub.write_text("#!/usr/bin/env bash\n"
                    'batch=$(echo "$@" | sed "s/.*--training.local_batch_size \\([0-9]*\\).*/\\1/")\n'
                    'echo "args: NGPU=$NGPU NVLS=$NCCL_NVLS_ENABLE $*"\n'
                    'echo "[rank0]:[titan] x - root - INFO - step: 10  loss: 1.0  tps: $((batch * 1000 + NGPU))"\n')
    stub.chmod(0o755)
    out = tmp_path / "tt.jsonl"
    env = {**os.environ, "TT_KIT": str(kit), "TT_SITE": str(site), "PYTHONPATH": os.getcwd()}
    run = subprocess.run(["bash", "bench/run_tt.sh", str(out), "4", "8192", "16384"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["tokens_per_gpu"], r["tps"]) for r in rows] == [(8192, [1004]), (16384, [2004])]
    log = (tmp_path / "tt.jsonl.tt-4-16384.log").read_text()
    assert "NGPU=4 NVLS=0" in log and "--training.steps 25 --metrics.log_freq 5" in log


def test_exposed_communication_and_rank_skew_counted_by_hand():
    """bench/overlap.py: two steps [0, 100) and [200, 300) (200 ns of wall); kernels outside them do not count.
    Communication inside: [30, 70) and [240, 290), 90 ns; under compute: [30, 40), [60, 70), [240, 250), 30 ns;
    so 60 ns ran alone, 0.3 of the wall. Compute inside: 40 + 40 + 50 = 130 ns, 65 per step."""
    from bench.overlap import comm_summary, exposed_comm, rank_skew
    compute = [(0, 40), (60, 100), (200, 250), (150, 180)]
    comm = [(30, 70), (240, 290), (120, 130), (35, 45)]  # (35, 45) overlaps another collective: counted once
    assert exposed_comm(compute, comm, [(0, 100), (200, 300)]) == (0.3, 65.0)
    assert exposed_comm(compute, [], [(0, 100)]) == (0.0, 80.0)  # no collective: nothing exposed
    assert rank_skew([0.5, 0.75, 0.25, 0.5]) == 0.5 and rank_skew([2.0, 2.0]) == 0  # mean 0.5, farthest 0.25 off
    summary = comm_summary([(0.3, 0.5), (0.1, 0.75), (0.2, 0.25), (0.2, 0.5)])
    assert summary == {"exposed_comm_share": 0.2, "exposed_comm_share_per_rank": [0.3, 0.1, 0.2, 0.2],
                       "compute_s_per_step": [0.5, 0.75, 0.25, 0.5], "rank_skew": 0.5}
    assert set(comm_summary([(0.3, 0.5), None]).values()) == {None}  # a rank without kernels (CPU): all null


def test_comm_report_sorts_nccl_kernels_from_compute():
    """bench/profiling.py on a stand-in kineto trace: NCCL's kernels (both namings) are communication, every other
    device activity compute, host events and GPU-side annotations neither; one rank, no process group."""
    from types import SimpleNamespace
    from torch.autograd import DeviceType
    from bench.profiling import comm_report, kernel_intervals

    def event(name, start, end, device=DeviceType.CUDA, annotation=False):  # start, end in us
        start, end = start * 1000, end * 1000
        return SimpleNamespace(name=lambda: name, start_ns=lambda: start, duration_ns=lambda: end - start,
                               device_type=lambda: device, is_user_annotation=lambda: annotation)

    events = [event("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 0, 400),
              event("ncclKernel_ReduceScatter_RING_LL_Sum_float(ncclWorkElem)", 1_500, 2_000),
              event("sm90_xmma_gemm_bf16bf16_bf16f32", 100, 1_000),
              event("Memcpy DtoD (Device -> Device)", 1_000, 1_100),
              event("aten::mm", 0, 2_000, device=DeviceType.CPU), event("## forward ##", 0, 2_000, annotation=True)]
    profiler = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))
    assert kernel_intervals(profiler) == ([(100_000, 1_000_000), (1_000_000, 1_100_000)],
                                          [(0, 400_000), (1_500_000, 2_000_000)])
    # one step [0, 2 ms): 0.1 + 0.5 ms of collectives alone; 1 ms of compute
    step = [(0, 2_000_000)]
    assert comm_report(profiler, step, torch.device("cpu")) == {
        "exposed_comm_share": 0.3, "exposed_comm_share_per_rank": [0.3], "compute_s_per_step": [0.001],
        "rank_skew": 0.0}
    assert comm_report(None, step, torch.device("cpu"))["exposed_comm_share"] is None  # CPU: no trace

