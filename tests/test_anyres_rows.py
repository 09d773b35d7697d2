"""LLaVA-OneVision's anyres images are weighed by the rows their tower runs: every tile's, the base tile's included,
not the LLM rows the tiles become (the grid's map cut, pooled, with newlines). The prescan measures them from the
file's header (data/shapes.py), and the step planner balances encoder replicas by them (train/inputs.py), while the
bridges still carry the LLM rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loom.data.shapes import SampleShape
from loom.job import load_config
from loom.train.inputs import Share, plan_shapes

# (H, W): cut in rows and pooled, cut in columns, one tile, large, thin, tall
SIZES = [(33, 48), (16, 40), (16, 16), (301, 230), (12, 70), (70, 12)]
# canvases in 16-pixel tiles: the tiny folder's 1–3 × 1–3 (pooled above anyres_max_4), 2-tile ones, 4-tile strips
PINPOINTS = {"folder's": None, "2-tile": [[16, 32], [32, 16], [32, 32]], "strips": [[16, 64], [64, 16], [48, 48]]}


@pytest.mark.parametrize("pins", list(PINPOINTS))
def test_the_prescan_counts_the_rows_the_onevision_tower_receives(llava_onevision, tmp_path, pins):
    pytest.importorskip("transformers")
    from vlm_jobs import png_files

    from loom.data.anyres_images import tiled_file
    from loom.data.sample import Sample
    from loom.data.shapes import shape_of
    from loom.models.multimodal import build_model
    from loom.train.job_data import media_rules
    from loom.train.job_model import token_counters

    _, folder = llava_onevision()
    cfg = load_config(None, [f"--model.hf={folder}", "--data.tasks=[\"sums\"]"])
    vision = dataclasses.replace(cfg.model.vision, grid_pinpoints=PINPOINTS[pins] or cfg.model.vision.grid_pinpoints)
    model = build_model(cfg.model.language, vision, None, {"vision": 7})
    rule = dataclasses.replace(media_rules(cfg).image, anyres=model.vision.tiles.anyres)  # cut for these canvases
    received = []
    model.vision.encoder.register_forward_hook(lambda m, args, out: received.append(out.shape[0]))
    counters, paths = token_counters(model), png_files(tmp_path, SIZES)
    counted, differ = [], 0
    for group in [[p] for p in paths] + [paths[:3]]:  # each alone (tiled), then three in one sample (a base tile each)
        items = [tiled_file(p, rule, alone=len(group) == 1) for p in group]
        shape = shape_of(Sample([0], [False], items, []), counters)  # from the headers, as the prescan measures
        with torch.no_grad():
            model.vision([x.load() for x in items])
        counted.append(sum(shape.tower_rows("vision")))
        differ += shape.tower_rows("vision") != shape.item_rows("vision")
    assert counted == received and received[-1] == 3 * 16  # three base tiles of 4 × 4 patches
    assert differ == len(SIZES) + 1  # the LLM rows are never the tower's here: the count the planner had


def _cfg(*extra: str):
    from conftest import TINY_MODEL_OVERRIDES

    return load_config(None, [*TINY_MODEL_OVERRIDES, "--data.train_size=64", "--train.global_batch_size=7", *extra])


def _never(p: int):
    raise AssertionError("nothing is rendered: this rank holds no LLM part and decodes no media")


def test_fan_in_balances_the_towers_rows_not_the_llm_s(tok):
    """One LLM replica's samples cut over 2 tower replicas: a 3 × 3-tile image alone (10 tiles of 16 rows; 88 LLM
    rows, its map pooled) then six one-tile images alone (2 tiles: 32 rows; 36 LLM rows). By the tower's rows the
    cut is [A] | [six]: 160 | 192; by the LLM's it was [A and two] | [four]: 224 | 128 rows through the towers."""
    heavy = SampleShape(100, 5, {"vision": (88,)}, tower={"vision": (160,)})
    light = SampleShape(50, 5, {"vision": (36,)}, tower={"vision": (32,)})
    shapes = [heavy, *[light] * 6]

    for encoder_rank in range(2):
        inputs = plan_shapes(shapes, list(range(7)), _never, _cfg(), tok, {"vision": None},
                             {"language": Share(None, 1), "vision": Share(encoder_rank, 2, False)}, 1,
                             torch.device("cpu"))
        counts = inputs.microbatches[0].rows["vision"]
        assert counts.encoder == [88, 216] and counts.llm == [304]  # the bridges carry LLM rows: [A] | [six]
        assert inputs.microbatches[0].item_rows["vision"] == ([88], [36] * 6)[encoder_rank]


def test_bins_weigh_the_towers_rows(tok):
    """Two LLM replicas, samples of equal tokens: rows break the ties, and the bins' row balance is the towers'."""
    shapes = [SampleShape(50, 5, {"vision": (88,)}, tower={"vision": (160,)}),
              *[SampleShape(50, 5, {"vision": (36,)}, tower={"vision": (32,)})] * 5,
              SampleShape(50, 5, {"vision": (100,)}, tower={"vision": (96,)})]
    cfg = _cfg("--data.tokens_per_microbatch=256")

    inputs = plan_shapes(shapes, list(range(7)), _never, cfg, tok, {"vision": None},
                         {"language": Share(None, 2), "vision": Share(None, 2)}, 1, torch.device("cpu"))
    # by the towers' rows: 160 + 2 · 32 = 224 | 96 + 3 · 32 = 192; by the LLM's it was 96 + 2 · 32 | 160 + 3 · 32
    assert inputs.stats["row_imbalance_vision"] == pytest.approx(224 / 208)  # was 256 / 208
    per_replica = sorted(inputs.microbatches[0].rows["vision"].llm)
    assert per_replica == [88 + 2 * 36, 100 + 3 * 36]  # the bridges' LLM rows of those bins

