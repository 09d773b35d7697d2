"""`loom rl` (loom/rl/loop.py): rewards and group advantages; a user's reward that raises or returns NaN is
named and counted, never fatal; the loop runs two iterations on one process and on 4 ranks (a heterogeneous
layout, and pp2), and a resumed run continues bit for bit."""

from __future__ import annotations

import json
import math
import sys
import types

import pytest
import torch
from conftest import tiny_job_overrides

from loom.config import ConfigError
from loom.job import load_config
from loom.data.sample import Sample
from loom.rl.rewards import all_equal, exact_match, group_advantages, load_reward, reward_of
from loom.rl.rollouts import Prompt, Rollout
from loom.rl.sampler import Completion


def test_group_advantages_and_exact_match():
    assert group_advantages([1.0, 0.0, 0.0, 1.0], "mean") == [0.5, -0.5, -0.5, 0.5]
    std = math.sqrt(sum((r - 0.25) ** 2 for r in [1.0, 0.0, 0.0, 0.0]) / 3)
    assert group_advantages([1.0, 0.0, 0.0, 0.0], "group") == pytest.approx(
        [0.75 / (std + 1e-6), -0.25 / (std + 1e-6), -0.25 / (std + 1e-6), -0.25 / (std + 1e-6)])
    assert all_equal([0.5, 0.5]) and not all_equal([0.5, 0.4])
    assert exact_match({"answer": "12"}, " 12 ") == 1.0 and exact_match({"answer": "12"}, "21") == 0.0


def test_a_failing_reward_is_named_and_not_fatal(monkeypatch):
    module = types.ModuleType("user_rewards")
    module.raises = lambda record, text: 1 / 0
    module.nan = lambda record, text: float("nan")
    module.not_a_function = 3
    monkeypatch.setitem(sys.modules, "user_rewards", module)
    assert reward_of(load_reward("user_rewards:raises"), {}, "x", "data.jsonl:7") == (
        None, "data.jsonl:7: the reward function raised ZeroDivisionError: division by zero")
    assert reward_of(load_reward("user_rewards:nan"), {}, "x", "data.jsonl:8") == (
        None, "data.jsonl:8: the reward function returned nan, not a finite number")
    with pytest.raises(ConfigError, match="rl.reward = 'user_rewards:not_a_function' is a int"):
        load_reward("user_rewards:not_a_function")
    with pytest.raises(ConfigError, match="rl.reward = 'user_rewards:missing'"):
        load_reward("user_rewards:missing")


@pytest.mark.parametrize("sampled, scored, named", [("0.5", "1.0", "rl.temperature = 0.5 samples"),
                                                    ("0", "0.5", "greedy: its logprobs are recorded at temperature 1")])
def test_the_sampling_and_scoring_temperatures_must_agree(tmp_path, sampled, scored, named):
    with pytest.raises(ConfigError, match=named):
        _loop(tmp_path, f"--rl.temperature={sampled}", f"--train.grpo.temperature={scored}")


def varied_reward(record: dict, completion: str) -> float:
    """A reward an untrained model's completions already vary in (exact match would be 0 everywhere)."""
    return float(len(completion) % 3)


RL = ["--rl.reward=test_rl_loop:varied_reward", "--train.objective=grpo", "--rl.iterations=2",
      "--rl.prompts_per_iteration=4", "--rl.group_size=2", "--rl.max_new_tokens=6", "--rl.steps_per_iteration=2",
      "--train.reference=initial", "--train.grpo.kl_beta=0.1", "--data.train_size=64", "--data.heldout_size=4",
      "--train.eval_max_new_tokens=4"]


def _loop(root, *extra):
    from loom.rl.loop import RLLoop

    return RLLoop(load_config("configs/tiny.toml", tiny_job_overrides(root, *RL, *extra)))


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def test_two_iterations_train_and_a_resume_continues_bit_for_bit(tmp_path):
    """Two iterations straight, against one iteration, a checkpoint, and a resumed second: the same weights."""
    straight = _loop(tmp_path / "straight")
    initial = _weights(straight.trainer.model)
    metrics = [straight.iterate() for _ in range(2)]
    assert straight.trainer.step == 4  # K = 2 steps per iteration
    for m in metrics:
        assert m["rl/trained_rollouts"] > 0
        assert m["rl/trained_rollouts"] + 2 * m["rl/equal_reward_groups"] == 8  # 4 prompts × G = 2
        assert m["rl/logprob_mismatch"] < 1e-5  # the sampler's fp32 copy and the trainer agree
    assert any(not torch.equal(initial[n], w) for n, w in _weights(straight.trainer.model).items())
    first = _loop(tmp_path / "resumed", "--rl.save_every=1")
    first.iterate()
    first.trainer.checkpoint()
    again = _loop(tmp_path / "resumed", "--run.resume=auto")
    assert again.iteration == 1 and again.trainer.step == 2
    again.iterate()
    want, got = _weights(straight.trainer.model), _weights(again.trainer.model)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_the_loop_resumes_an_sft_run_with_its_optimizer(tmp_path):
    """docs/rl.md's route from SFT to GRPO: `--run.resume=` an SFT checkpoint carries AdamW's moments and step count
    (a fresh optimizer's first steps cost the first GRPO runs points at once: bench/RESULTS.md, rounds 3–4)."""
    from loom.train.trainer import Trainer

    sft = Trainer(load_config("configs/tiny.toml", tiny_job_overrides(tmp_path / "sft", "--train.steps=2")))
    sft.run()
    loop = _loop(tmp_path / "rl", f"--run.resume={tmp_path / 'sft' / 'step-2'}")
    assert loop.iteration == 1 and loop.trainer.step == 2  # K = 2 steps per iteration
    names = {p: n for n, p in sft.model.named_parameters()}
    carried = {n: p for n, p in loop.trainer.model.named_parameters()}
    for param, state in sft.optimizer.state.items():
        mine = loop.trainer.optimizer.state[carried[names[param]]]
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], mine[key]), (names[param], key)


def _first_iterations(root: str, overrides: list[str]) -> list[dict[str, float]]:
    import torch.distributed as dist

    from loom.rl.loop import RLLoop

    world = dist.get_world_size() if dist.is_initialized() else None
    cfg = load_config("configs/tiny.toml", tiny_job_overrides(root, *RL, *overrides), world_size=world)
    loop = RLLoop(cfg)
    return [loop.iterate() for _ in range(2)]


LAYOUTS = {  # (ranks, overrides): loom's default heterogeneous layout, the LLM pipelined, and the encoders on a
    # rank of their own (the LLM's ranks then sample with encoders they received by the stream)
    "heterogeneous": (4, ["--layout.vision.tp=2", "--layout.audio.tp=1", "--layout.language.tp=1"]),
    "llm-pp2": (4, ["--layout.language.pp=2", "--train.microbatches=2", "--data.tokens_per_microbatch=256"]),
    "noncolocated": (3, ["--layout.vision.ranks=0-0", "--layout.audio.ranks=0-0", "--layout.language.ranks=1-2",
                         "--data.tokens_per_microbatch=256"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_loop_under_a_layout_starts_as_one_process_does(worlds, tmp_path, name):
    """The first iteration samples from the same weights on every layout, so its completions, rewards and
    trained rollouts are the one process's exactly, and its GRPO loss equal to rounding; the second runs too."""
    ranks, overrides = LAYOUTS[name]
    per_rank = worlds.run(ranks, _first_iterations, str(tmp_path / "layout"), overrides, timeout=300)
    alone = _first_iterations(str(tmp_path / "alone"), [o for o in overrides if "layout." not in o])
    def measured(iterations):  # all but the speeds, which each rank times itself
        return [{k: v for k, v in m.items() if not k.endswith("_per_s")} for m in iterations]

    for rank, iterations in enumerate(per_rank):
        assert measured(iterations) == measured(per_rank[0]), f"rank {rank} reported other metrics than rank 0"
    first, want = per_rank[0][0], alone[0]
    for key in ("rl/reward_mean", "rl/response_length", "rl/trained_rollouts", "rl/equal_reward_groups"):
        assert first[key] == want[key], key
    assert first["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert per_rank[0][1]["rl/trained_rollouts"] > 0


def _prompt_lines(jsonl, edit=lambda i, line: None):
    """The user's lines as RL prompts: the first user turn alone, its answer as the reward's field."""
    import json

    lines = []
    for i, raw in enumerate(jsonl.read_text().splitlines()):
        messages = json.loads(raw)["messages"]
        line = {"messages": messages[:1], "answer": messages[1]["content"]}
        edit(i, line)
        lines.append(json.dumps(line))
    path = jsonl.with_name("prompts.jsonl")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_users_jsonl_prompts_are_sampled_to_their_generation_prompt(tmp_path):
    from conftest import user_data_overrides, write_user_data

    from loom.data.conversations import BadSample

    data = write_user_data(tmp_path / "data", n=12, seed=2)
    prompts = _prompt_lines(data)
    overrides = user_data_overrides(tmp_path, "--data.workers=0")
    loop = _loop(tmp_path / "run", *overrides, f"--rl.prompts={prompts}", "--rl.steps_per_iteration=1")
    first = loop.prompts[0]
    chat = loop.trainer.tok
    # the template's generation prompt closes the prompt: the answer is the sampler's to write
    assert chat.tokenizer.decode(first.sample.tokens).endswith("assistant\n")
    assert first.record["answer"] and first.where.endswith("prompts.jsonl:1") and first.sample.images
    metrics = loop.iterate()
    assert metrics["rl/response_length"] > 0 and metrics["rl/reward_errors"] == 0
    # one step per iteration: no scoring pass; the step compares the sampler's logprobs with its own
    assert metrics["rl/logprob_mismatch"] < 1e-5 and "grpo/sampler_mismatch" not in metrics
    bad = _prompt_lines(data, lambda i, line: line["messages"].append({"role": "assistant", "content": "x"})
                        if i == 2 else None)
    with pytest.raises(BadSample, match=r"prompts\.jsonl:3: a prompt ends with an assistant turn"):
        _loop(tmp_path / "bad", *overrides, f"--rl.prompts={bad}")


def test_dpo_on_the_policys_own_pairs(tmp_path):
    """Under train.objective = "dpo" each group's best and worst completions become a pair (their rewards differ);
    held-out pairs come from the reference's completions, where every margin is exactly 0 (accuracy 0), and
    training on the policy's pairs moves them."""
    from loom.rl.pairs import preference_pairs

    loop = _loop(tmp_path / "dpo", "--train.objective=dpo", "--train.dpo.beta=0.5", "--rl.steps_per_iteration=1",
                 "--data.heldout_size=8", "--rl.group_size=4", "--train.lr=1e-2")
    assert loop.heldout_pairs and len(loop.heldout_pairs) % 2 == 0
    before = loop.evaluate()
    assert before["pairs/margin"] == 0.0 and before["pairs/accuracy"] == 0.0
    after = loop.run()  # the command's loop: two iterations, a checkpoint, the final evaluation
    first = json.loads((tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["rl/trained_rollouts"] > 0 and first["rl/trained_rollouts"] % 2 == 0
    assert first["dpo/accuracy"] == 0.0  # the step's pairs, scored on the weights that sampled them
    assert after["pairs/margin"] != 0.0 and (tmp_path / "dpo" / "step-2").is_dir()
    rollouts = [Rollout(0, Completion([5, 2], [0.0, 0.0]), 1.0), Rollout(0, Completion([7], [0.0]), 0.0),
                Rollout(1, Completion([5], [0.0]), 1.0), Rollout(1, Completion([6], [0.0]), 1.0)]
    prompts = [Prompt(Sample([1, 3], [False, False], [], []), {}, f"p{i}") for i in range(2)]
    pairs, equal = preference_pairs(prompts, rollouts)
    assert equal == 1 and [[s.tokens for s in pair] for pair in pairs] == [[[1, 3, 5, 2], [1, 3, 7]]]
    assert pairs[0][0].supervised == [False, False, True, True]


def test_too_long_prompts_and_empty_completions_are_named_and_counted(tmp_path, capsys):
    """A prompt whose rollout (prompt + rl.max_new_tokens) exceeds the token budget is skipped, named and counted;
    an empty completion (the end of sequence at once) is named and counted, and still trained on."""
    loop = _loop(tmp_path / "bad", "--data.tokens_per_microbatch=256", "--rl.max_new_tokens=226")
    prompts = [loop.prompts[i] for i in range(8)]  # 19 to 37 tokens: those over 30 do not fit with 226 more
    kept, too_long = loop._fitting(prompts)
    assert too_long == sum(len(p.sample) + 226 > 256 for p in prompts) > 0 and len(kept) == 8 - too_long
    long = next(p for p in prompts if len(p.sample) + 226 > 256)
    assert f"{long.where}: {len(long.sample)} prompt tokens + rl.max_new_tokens = 226 exceed " \
           f"data.tokens_per_microbatch = 256" in capsys.readouterr().out
    eos = loop.trainer.tok.eos_id
    rollouts = [Rollout(0, Completion([eos], [0.0])), Rollout(0, Completion([ord("a"), eos], [0.0, 0.0]))]
    counts = loop._rewarded(prompts[:1], rollouts)
    assert counts == {"rl/reward_errors": 0.0, "rl/empty_completions": 1.0}
    assert f"1 empty completions, e.g. of {prompts[0].where}" in capsys.readouterr().out
