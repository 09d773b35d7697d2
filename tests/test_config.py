"""Config errors name the key, the value and what is allowed; overrides parse as TOML; the CLI exits 2."""

from __future__ import annotations

from pathlib import Path

import pytest

import loom.cli
from loom.config import ConfigError, JobConfig, parse_override
from loom.job import load_config

REPO = Path(__file__).resolve().parents[1]


def _error(*overrides: str, path=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides))
    return str(e.value)


def _has_all(msg: str, *parts: str) -> None:
    missing = [p for p in parts if p not in msg]
    assert not missing, f"{missing} not in message: {msg}"


# ---------------------------------------------------------------- loading and overrides


def test_defaults_load_and_validate():
    cfg = load_config()
    assert isinstance(cfg, JobConfig)
    assert cfg.data.tasks == ["digits", "shapes", "tones"] and cfg.model.encoders == ["vision", "audio"]


def test_overrides_are_toml_literals():
    cfg = load_config(None, ['--data.tasks=["digits"]', "--train.lr=1e-3", "--train.steps=7", "--run.tensorboard=false",
                             "--run.out_dir=/tmp/some where",
                             "--model.language.rope_scaling={rope_type='linear', factor=2.0}"])
    assert cfg.data.tasks == ["digits"]
    assert cfg.train.lr == 1e-3 and isinstance(cfg.train.lr, float)
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.run.tensorboard is False
    assert cfg.run.out_dir == "/tmp/some where"  # not a TOML literal: kept as text
    assert cfg.model.language.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_parse_override_forms():
    assert parse_override("--train.steps=50") == ("train.steps", 50)
    assert parse_override("train.lr=2e-4") == ("train.lr", 2e-4)
    assert parse_override('--data.tasks=["digits", "tones"]') == ("data.tasks", ["digits", "tones"])
    assert parse_override("--run.out_dir=a=b") == ("run.out_dir", "a=b")  # split at the first '=' only
    assert parse_override("--run.tensorboard=true") == ("run.tensorboard", True)


def test_int_is_accepted_for_float():
    cfg = load_config(None, ["--train.lr=1", "--train.grad_clip=0"])
    assert cfg.train.lr == 1.0 and type(cfg.train.lr) is float
    assert cfg.train.grad_clip == 0.0 and type(cfg.train.grad_clip) is float


def test_toml_file_then_overrides(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(
        '[model]\nencoders = ["vision"]\n[model.language]\nnum_layers = 3\n'
        '[data]\ntasks = ["digits", "shapes"]\nformat = "bshd"\n[train]\nsteps = 11\nlr = 5e-4\n'
    )
    cfg = load_config(path)
    assert cfg.model.encoders == ["vision"] and cfg.model.language.num_layers == 3
    assert cfg.data.tasks == ["digits", "shapes"] and cfg.data.format == "bshd"
    assert cfg.train.steps == 11 and cfg.train.lr == 5e-4
    assert cfg.model.language.hidden_size == 128  # untouched keys keep their defaults
    cfg = load_config(path, ["--train.steps=4", "--model.language.num_layers=1"])
    assert cfg.train.steps == 4 and cfg.model.language.num_layers == 1 and cfg.train.lr == 5e-4


def test_config_round_trips_through_to_dict():
    cfg = load_config(None, ["--train.steps=9", '--data.tasks=["tones"]'])
    d = cfg.to_dict()
    assert d["train"]["steps"] == 9 and d["data"]["tasks"] == ["tones"]
    assert d["model"]["language"]["num_kv_heads"] == cfg.model.language.num_kv_heads


CONFIG_FILES = sorted((REPO / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_repo_configs_load(path):
    cfg = load_config(path)
    assert isinstance(cfg, JobConfig)


# ---------------------------------------------------------------- errors


def test_unknown_section():
    _has_all(_error("--trainer.steps=5"), "'trainer'", "did you mean 'train'", "data", "model", "run")


def test_unknown_key_suggests_the_closest():
    _has_all(_error("--train.stpes=5"), "'train.stpes'", "did you mean 'steps'", "warmup_steps", "lr")


def test_unknown_nested_key_is_dotted():
    _has_all(_error("--model.language.hiden_size=64"), "model.language.hiden_size", "did you mean 'hidden_size'")


def test_unknown_key_without_a_close_match_lists_the_allowed_ones():
    msg = _error("--run.zzzzzz=1")
    _has_all(msg, "run.zzzzzz", "out_dir", "resume", "tensorboard")
    assert "did you mean" not in msg


def test_unknown_key_in_a_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[train]\nlearning_rate = 0.1\n")
    _has_all(_error(path=path), "train.learning_rate", "lr")


def test_string_for_int():
    _has_all(_error("--train.steps=abc"), "train.steps", "'abc'", "int", "str")


def test_bool_for_int():
    _has_all(_error("--train.steps=true"), "train.steps", "True", "int", "bool")


def test_float_for_int():
    _has_all(_error("--train.global_batch_size=2.5"), "train.global_batch_size", "2.5", "int", "float")


def test_int_for_bool():
    _has_all(_error("--run.tensorboard=1"), "run.tensorboard", "bool", "int")


def test_bool_for_float():
    _has_all(_error("--train.lr=true"), "train.lr", "float", "bool")


def test_list_element_type():
    _has_all(_error("--data.tasks=[1]"), "data.tasks[0]", "str", "int")


def test_not_a_list():
    _has_all(_error('--data.tasks="digits"'), "data.tasks", "list")


def test_section_given_a_value():
    _has_all(_error("--train=5"), "train", "table", "5")


def test_optional_dict_wrong_type():
    _has_all(_error("--model.language.rope_scaling=5"), "model.language.rope_scaling", "5", "dict")


@pytest.mark.parametrize(
    "override, key, value, allowed",
    [
        ("--data.format=sbhd", "data.format", "'sbhd'", ["'thd'", "'bshd'"]),
        ("--train.dtype=fp16", "train.dtype", "'fp16'", ["'fp32'", "'bf16'"]),
        ("--model.attention=flash", "model.attention", "'flash'", ["'auto'", "'sdpa'", "'varlen'"]),
        ("--train.device=tpu", "train.device", "'tpu'", ["'auto'", "'cpu'", "'cuda'"]),
    ],
)
def test_choice_violations(override, key, value, allowed):
    _has_all(_error(override), key, value, *allowed)


@pytest.mark.parametrize(
    "override, key, rule",
    [
        ("--train.steps=0", "train.steps = 0", "> 0"),
        ("--train.steps=-3", "train.steps = -3", "> 0"),
        ("--train.eps=0", "train.eps = 0.0", "> 0"),
        ("--train.global_batch_size=0", "train.global_batch_size = 0", "> 0"),
        ("--data.pad_to_multiple=0", "data.pad_to_multiple = 0", "> 0"),
        ("--data.heldout_size=0", "data.heldout_size = 0", "> 0"),
        ("--model.language.num_layers=0", "model.language.num_layers = 0", "> 0"),
        ("--model.language.num_kv_heads=0", "model.language.num_kv_heads = 0", "> 0"),
        ("--train.lr=-1e-3", "train.lr = -0.001", "≥ 0"),
        ("--train.warmup_steps=-1", "train.warmup_steps = -1", "≥ 0"),
        ("--train.grad_clip=-1", "train.grad_clip = -1", "≥ 0"),
        ("--run.save_every=-2", "run.save_every = -2", "≥ 0"),
    ],
)
def test_negative_or_zero(override, key, rule):
    _has_all(_error(override), key, rule)


def test_adams_betas_and_eps_reach_the_optimizer():
    import torch

    from loom.train.optim import build_optimizer

    cfg = load_config(None, ["--train.beta1=0.8", "--train.beta2=0.99", "--train.eps=1e-3"]).train
    group = build_optimizer(torch.nn.Linear(2, 2), cfg).param_groups[0]
    assert group["betas"] == (0.8, 0.99) and group["eps"] == 1e-3


def test_zero_is_fine_where_documented():
    cfg = load_config(None, ["--train.warmup_steps=0", "--train.grad_clip=0", "--train.eval_every=0", "--train.lr=0"])
    assert cfg.train.warmup_steps == 0 and cfg.train.grad_clip == 0.0


@pytest.mark.parametrize(
    "override, parts",
    [
        ("--train.min_lr_ratio=1.5", ["train.min_lr_ratio", "1.5", "[0, 1]"]),
        ("--train.beta1=-0.1", ["train.beta1", "-0.1", "[0, 1)"]),
        ("--train.beta2=1", ["train.beta2", "1.0", "[0, 1)"]),
    ],
)
def test_ranges(override, parts):
    _has_all(_error(override), *parts)


def test_heads_not_divisible_by_kv_heads():
    msg = _error("--model.language.num_heads=4", "--model.language.num_kv_heads=3")
    _has_all(msg, "model.language.num_heads = 4", "num_kv_heads = 3", "divisible")


def test_hidden_not_divisible_by_heads():
    _has_all(_error("--model.language.hidden_size=30"), "model.language.hidden_size = 30", "num_heads = 4", "head_dim")
    _has_all(_error("--model.vision.hidden_size=30"), "model.vision.hidden_size = 30", "model.vision.num_heads = 4")


def test_odd_head_dim():
    _has_all(_error("--model.language.head_dim=5"), "head dim = 5", "even")


def test_vocab_smaller_than_tokenizer():
    from loom.data.tokenizer import ByteTokenizer

    n = ByteTokenizer().vocab_size
    assert n == 256 + 5  # bytes + <pad> <bos> <eos> <image> <audio>
    _has_all(_error(f"--model.language.vocab_size={n - 1}"), "model.language.vocab_size", str(n - 1), str(n))
    assert load_config(None, [f"--model.language.vocab_size={n}"]).model.language.vocab_size == n


def test_unknown_task():
    _has_all(_error('--data.tasks=["digits", "mnist"]'), "data.tasks", "'mnist'", "digits", "shapes", "tones")


def test_no_task():
    _has_all(_error("--data.tasks=[]"), "data.tasks", "empty", "digits")


def test_unknown_encoder():
    _has_all(_error('--model.encoders=["vision", "text"]'), "model.encoders", "'text'", "vision", "audio")


def test_task_needs_a_missing_encoder():
    msg = _error('--model.encoders=["vision"]')  # default tasks include tones
    _has_all(msg, "'tones'", "audio", "model.encoders")
    msg = _error('--model.encoders=["audio"]', '--data.tasks=["tones", "shapes"]')
    _has_all(msg, "'shapes'", "vision", "model.encoders")
    cfg = load_config(None, ['--model.encoders=["audio"]', '--data.tasks=["tones"]'])
    assert cfg.model.encoders == ["audio"]


def test_batch_larger_than_dataset():
    _has_all(_error("--train.global_batch_size=64", "--data.train_size=50"), "64", "50", "data.train_size")


def test_varlen_needs_cuda_and_thd():
    _has_all(_error("--model.attention=varlen", "--train.device=cpu"), "varlen", "CUDA", "auto")
    _has_all(_error("--model.attention=varlen", "--data.format=bshd"), "varlen", "thd")


def test_malformed_override():
    _has_all(_error("--train.steps"), "'--train.steps'", "--section.key=value")
    _has_all(_error("train.steps"), "'train.steps'", "--section.key=value")


def test_nonexistent_file(tmp_path):
    missing = tmp_path / "nope.toml"
    _has_all(_error(path=missing), str(missing), "does not exist")


def test_invalid_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train\nsteps = 3\n")
    _has_all(_error(path=path), str(path), "not valid TOML", "line 1")


# Model sizes must be positive: caught by validate(), not by a failing forward or a silently degenerate model.
@pytest.mark.parametrize("name", ["vision", "audio"])
def test_encoder_zero_heads(name):
    _has_all(_error(f"--model.{name}.num_heads=0"), f"model.{name}.num_heads", "0")


@pytest.mark.parametrize(
    "override",
    [
        "--model.language.hidden_size=0",  # fails in the first forward (unflatten of 0 elements)
        "--model.language.head_dim=-2",  # fails building nn.Linear with a negative dim
        "--model.language.intermediate_size=0",  # trains silently with an empty MLP
        "--model.vision.num_layers=-1",  # trains silently with no vision layers
        "--model.audio.num_features=0",  # fails in the data pipeline with a ValueError
    ],
)
def test_model_sizes_must_be_positive(override):
    key = override[2:].split("=")[0]
    _has_all(_error(override), key)


# ---------------------------------------------------------------- the CLI


@pytest.fixture
def no_trainer(monkeypatch):
    """Makes building a Trainer an error, so a test proves the CLI stopped before building a model."""
    import loom.train.trainer

    def refuse(*a, **k):
        raise AssertionError("the CLI built a Trainer despite a config error")

    monkeypatch.setattr(loom.train.trainer, "Trainer", refuse)


@pytest.mark.parametrize(
    "argv, parts",
    [
        (["train", "--train.steps=abc"], ["train.steps", "'abc'", "int"]),
        (["train", "--train.stpes=3"], ["train.stpes", "did you mean 'steps'"]),
        (["train", "--train.steps"], ["--train.steps", "--section.key=value"]),
        (["train", "--data.format=sbhd"], ["data.format", "thd", "bshd"]),
        (["train", "/nonexistent/job.toml"], ["/nonexistent/job.toml", "does not exist"]),
    ],
)
def test_cli_config_error_exits_2(argv, parts, capsys, no_trainer):
    assert loom.cli.main(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("loom: config error:")
    _has_all(out.err, *parts)


def test_cli_stray_argument_is_a_usage_error(capsys, no_trainer):
    with pytest.raises(SystemExit) as e:
        loom.cli.main(["train", "job.toml", "extra"])
    assert e.value.code == 2
    assert "extra" in capsys.readouterr().err


class _FakeTrainer:
    seen: dict = {}

    def __init__(self, cfg, device=None):
        _FakeTrainer.seen = {"cfg": cfg}

    def run(self):
        _FakeTrainer.seen["ran"] = True


def test_cli_space_separated_override_after_a_config_file(tmp_path, monkeypatch):
    import loom.train.trainer

    monkeypatch.setattr(loom.train.trainer, "Trainer", _FakeTrainer)
    path = tmp_path / "job.toml"
    path.write_text("[train]\nsteps = 5\nlr = 1e-2\n")
    assert loom.cli.main(["train", str(path), "--train.steps", "12", "--train.dtype", "bf16"]) == 0
    cfg = _FakeTrainer.seen["cfg"]
    assert _FakeTrainer.seen["ran"] and cfg.train.steps == 12 and cfg.train.dtype == "bf16" and cfg.train.lr == 1e-2


def test_cli_without_a_config_launches_the_default_job_on_its_ranks(monkeypatch, capsys):
    """No CONFIG: the default job (4 ranks) is validated here, then started with torchrun; space-separated
    overrides reach the ranks joined; after them the launcher evaluates the checkpoint."""
    launched, evaluated = {}, []
    monkeypatch.setattr(loom.cli, "launch_local", lambda n, args: launched.update(n=n, args=args) or 0)
    monkeypatch.setattr(loom.cli, "_eval", lambda out, device: evaluated.append(out) or 0)
    code = loom.cli.main(["train", "--train.steps", "12", "--train.lr=3e-4"])
    assert code == 0, capsys.readouterr().err
    assert launched["n"] == 4
    assert launched["args"] == ["train", str(loom.cli.DEFAULT_CONFIG), "--train.steps=12", "--train.lr=3e-4"]
    assert evaluated == ["runs/default"]  # then `loom eval` of the run's latest checkpoint, on one process


def test_tiny_config_spells_out_the_built_in_defaults():
    assert load_config("configs/tiny.toml") == JobConfig()


def test_default_job_is_a_heterogeneous_colocated_layout_on_four_ranks():
    from loom.topology import Topology

    cfg = load_config(str(loom.cli.DEFAULT_CONFIG))
    assert cfg.layout.world_size == 4
    placement = Topology.plan(cfg, 4).placement
    assert placement.colocated
    degrees = {name: (lay.tp, lay.dp) for name, lay in placement.layouts.items()}
    assert degrees == {"vision": (2, 2), "audio": (1, 4), "language": (1, 4)}


@pytest.mark.parametrize("scaling, parts", [
    ('{rope_type="ntk"}', ["model.language.rope_scaling", "'ntk' is not supported", "yarn"]),
    ('{rope_type="yarn", factor=4.0}', ["yarn scaling needs ['original_max_position_embeddings']"]),
    ('{type="llama3", factor=8.0, low_freq_factor=1.0}', ["llama3", "'high_freq_factor'"]),
])
def test_rope_scaling_is_checked_before_the_model_is_built(scaling, parts):
    _has_all(_error(f"--model.language.rope_scaling={scaling}"), *parts)


def test_partial_rotary_factor_is_a_share_with_an_even_count_of_rotated_dims():
    _has_all(_error("--model.language.partial_rotary_factor=0"), "partial_rotary_factor = 0", "(0, 1]")
    # head dim 32 × 0.25 = 8 rotated dims is fine; × 0.125 = 4 too; 32 × 0.1875 = 6; 32 × 0.15625 = 5 is odd
    assert load_config(None, ["--model.language.partial_rotary_factor=0.25"]).model.language.rope_dim == 8
    _has_all(_error("--model.language.partial_rotary_factor=0.15625"), "rotated dims", "= 5", "even")


def test_projector_activation_names_are_the_projectors():
    """[model.vision] projector_act's choices (model_config.py, no torch) are the activations the projector has."""
    from loom.model_config import PROJECTOR_ACT_NAMES
    from loom.models.projector import PROJECTOR_ACTS

    assert tuple(PROJECTOR_ACTS) == PROJECTOR_ACT_NAMES
