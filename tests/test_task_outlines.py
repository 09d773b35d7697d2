"""data/task_outlines.py: a built-in task's outline (its media as meta tensors of the drawn sizes) gives the shape its
example gives, for every task and both splits, so a step planned from outlines renders as planned."""

from __future__ import annotations

import pytest

from loom.data.format import to_sample
from loom.data.shapes import shape_of
from loom.data.task_outlines import example_outline
from loom.data.tasks import SPLITS, TASKS, make_example
from loom.data.tokenizer import ByteTokenizer

COUNTERS = {"vision": lambda image: (image.shape[-2] // 14) * (image.shape[-1] // 14),
            "audio": lambda clip: (clip.shape[-1] + 1) // 2}


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("split", SPLITS)
def test_outline_has_the_example_s_shape(task, split):
    tok = ByteTokenizer()
    for index in range(40):
        kwargs = {"seed": 1234 + index % 3, "patch_size": 14, "n_audio_features": 80}
        example, outline = make_example(task, split, index, **kwargs), example_outline(task, split, index, **kwargs)
        assert outline.answer == example.answer and outline.prompt == example.prompt, (task, index)
        assert [x.shape for x in outline.images + outline.audio] == [x.shape for x in example.images + example.audio]
        assert shape_of(to_sample(outline, tok, COUNTERS), COUNTERS).same_as(
            shape_of(to_sample(example, tok, COUNTERS), COUNTERS)), (task, index)
