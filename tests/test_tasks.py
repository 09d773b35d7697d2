"""The embedded default tasks: deterministic, well-shaped, split cleanly, and actually learnable."""

from __future__ import annotations

import pytest
import torch

from loom.data import tasks as T
from loom.data.tasks import CHANCE, TASKS, TaskDataset, make_example

SIZES = dict(patch_size=4, n_audio_features=32)
MEDIA_TASKS = [t for t in TASKS if t != "sums"]  # sums is text only: no tensor to compare


def _examples(task: str, n: int, split: str = "train", seed: int = 0, **sizes: int) -> list:
    return [make_example(task, split, i, seed=seed, **(sizes or SIZES)) for i in range(n)]


def _tensors(example) -> list[torch.Tensor]:
    return example.images + example.audio


@pytest.mark.parametrize("task", TASKS)
def test_same_arguments_give_identical_tensors(task):
    a = make_example(task, "train", 7, seed=3, **SIZES)
    b = make_example(task, "train", 7, seed=3, **SIZES)
    assert (a.prompt, a.answer, a.task) == (b.prompt, b.answer, task)
    assert all(torch.equal(x, y) for x, y in zip(_tensors(a), _tensors(b), strict=True))


@pytest.mark.parametrize("task", MEDIA_TASKS)
def test_different_index_or_seed_gives_different_tensors(task):
    base = _tensors(make_example(task, "train", 7, seed=3, **SIZES))[0]
    for other in (make_example(task, "train", 8, seed=3, **SIZES), make_example(task, "train", 7, seed=4, **SIZES)):
        x = _tensors(other)[0]
        assert x.shape != base.shape or not torch.equal(x, base)


def test_heldout_digits_are_disjoint_from_train():
    train = {T.digit_source_index("train", i) for i in range(1500)}
    heldout = {T.digit_source_index("heldout", i) for i in range(T.N_HELDOUT_DIGITS)}
    assert len(heldout) == T.N_HELDOUT_DIGITS
    assert len(train) + len(heldout) == 1797 and not train & heldout
    # indices wrap within their own subset
    assert T.digit_source_index("heldout", 5) == T.digit_source_index("heldout", 5 + T.N_HELDOUT_DIGITS)


@pytest.mark.parametrize("task", ["digits", "shapes"])
@pytest.mark.parametrize("patch_size", [4, 7])
def test_image_sizes_are_patch_multiples_and_vary(task, patch_size):
    shapes = set()
    for ex in _examples(task, 50, patch_size=patch_size, n_audio_features=32):
        assert len(ex.images) == 1 and ex.audio == []
        image = ex.images[0]
        assert image.dtype == torch.float32 and image.shape[0] == 3
        assert image.shape[1] % patch_size == 0 and image.shape[2] % patch_size == 0
        assert torch.isfinite(image).all()
        shapes.add(tuple(image.shape[1:]))
    assert len(shapes) >= 3
    assert any(h != w for h, w in shapes)


def test_images_are_roughly_normalised():
    for task in ("digits", "shapes"):
        pixels = torch.cat([ex.images[0].flatten() for ex in _examples(task, 50)])
        assert abs(pixels.mean().item()) < 0.5 and 0.5 < pixels.std().item() < 1.5


@pytest.mark.parametrize("n_mels", [32, 80])
def test_audio_features_shape_and_varying_length(n_mels):
    frames = set()
    for ex in _examples("tones", 50, patch_size=4, n_audio_features=n_mels):
        assert ex.images == [] and len(ex.audio) == 1
        features = ex.audio[0]
        assert features.dtype == torch.float32 and features.shape[0] == n_mels
        assert 8 <= features.shape[1] <= 64 and torch.isfinite(features).all()
        assert features.abs().max() < 10  # the fixed normalisation keeps values O(1)
        frames.add(features.shape[1])
    assert len(frames) >= 5


def test_answers_come_from_the_documented_vocabulary():
    for ex in _examples("digits", 30):
        assert ex.prompt == "digit:" and ex.answer in T.DIGIT_WORDS
    for ex in _examples("shapes", 30):
        colour, shape = ex.answer.split(" ")
        assert ex.prompt == "shape:" and colour in T.COLOUR_NAMES and shape in T.SHAPE_NAMES
    counts = set()
    for ex in _examples("tones", 60):
        words = ex.answer.split(" ")
        assert ex.prompt == "tones:" and all(w in T.TONE_NAMES for w in words)
        counts.add(len(words))
    assert counts == {1, 2, 3}


def test_all_classes_appear():
    assert {ex.answer for ex in _examples("digits", 200)} == set(T.DIGIT_WORDS)
    assert len({ex.answer for ex in _examples("shapes", 200)}) == 9


def test_chance_levels():
    assert CHANCE == pytest.approx({"digits": 0.1, "shapes": 1 / 9, "tones": 1 / 39, "sums": 1 / 199})


def test_sums_are_text_only_and_right():
    examples = _examples("sums", 200)
    assert all(ex.images == [] and ex.audio == [] for ex in examples)
    for ex in examples:
        a, b = ex.prompt.removeprefix("sum:").removesuffix("=").split("+")
        assert int(ex.answer) == int(a) + int(b)
    assert len({ex.prompt for ex in examples}) > 150  # drawn, not one example repeated
    longest = T.longest_example("sums", **SIZES)
    assert max(len(ex.prompt + ex.answer) for ex in examples) <= len(longest.prompt + longest.answer)


def _peak_bin(features: torch.Tensor) -> int:
    return int(features.mean(dim=1).argmax())


def test_tone_features_separate_classes():
    peaks = {name: set() for name in T.TONE_NAMES}
    for ex in _examples("tones", 200):
        if " " not in ex.answer:  # single tones only
            peaks[ex.answer].add(_peak_bin(ex.audio[0]))
    assert all(peaks.values())
    assert max(peaks["low"]) < min(peaks["mid"]) and max(peaks["mid"]) < min(peaks["high"])


def test_mel_filterbank_has_no_empty_filters():
    for n_mels in (8, 32, 128):
        bank = T.mel_filterbank(n_mels)
        assert bank.shape == (n_mels, T.N_FFT // 2 + 1)
        assert torch.allclose(bank.sum(dim=1), torch.ones(n_mels))


def test_invalid_split_and_task_name_the_allowed_values():
    with pytest.raises(ValueError, match="heldout"):
        make_example("digits", "test", 0, seed=0, **SIZES)
    with pytest.raises(ValueError, match="shapes"):
        make_example("mnist", "train", 0, seed=0, **SIZES)
    with pytest.raises(ValueError, match="train"):
        TaskDataset(["digits"], "valid", 10, seed=0, **SIZES)
    with pytest.raises(ValueError, match="tones"):
        TaskDataset(["digits", "speech"], "train", 10, seed=0, **SIZES)


def test_dataset_round_robin_and_len():
    data = TaskDataset(MEDIA_TASKS, "heldout", 10, seed=5, **SIZES)
    assert len(data) == 10
    assert [data[i].task for i in range(6)] == ["digits", "shapes", "tones"] * 2
    # item i is example i // len(tasks) of its task
    direct = make_example("tones", "heldout", 2, seed=5, **SIZES)
    assert data[8].answer == direct.answer and torch.equal(data[8].audio[0], direct.audio[0])
    assert data[-1].task == data[9].task == "digits"
    with pytest.raises(IndexError):
        data[10]
    assert len(list(data)) == 10  # plain iteration stops at the end


def test_tone_wave_is_the_waveform_behind_a_tones_example():
    wave, rate, answer = T.tone_wave("heldout", 3, seed=5)
    example = make_example("tones", "heldout", 3, seed=5, **SIZES)
    assert rate == T.SAMPLE_RATE and answer == example.answer
    features = T.log_mel(torch.from_numpy(wave.astype("float32")), SIZES["n_audio_features"])
    assert torch.equal(features, example.audio[0])  # the same draws: its log-mel is the example's, bit for bit
