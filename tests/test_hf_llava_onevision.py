"""LLaVA-OneVision folders (`model_type = "llava_onevision"`) load into loom with transformers' logits: anyres images
of several tiles (the grid's map cut to the image's aspect ratio, pooled when too large, a newline per row) and the
images of a sample with several (a base tile each and one newline), packed into one stream."""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
from llava_onevision_folders import FOLDERS, TILE  # noqa: E402

from loom.data.anyres import TiledImage  # noqa: E402
from loom.data.spans import TokenSpans  # noqa: E402
from loom.models.hf import build_pretrained  # noqa: E402

TOL = 1e-5
# (H, W) of each sample's images: alone, several tiles (rows cut and pooled; columns cut; rows cut, not pooled;
# pooled, nothing cut); none; two in one sample (a base tile each)
IMAGES = [[(33, 48)], [(16, 40)], [], [(20, 40)], [(30, 17), (50, 20)], [(40, 25)]]


def tiled(model, h: int, w: int, alone: bool, g: torch.Generator) -> TiledImage:
    n = 1 + math.prod(model.vision.tiles.anyres.grid(h, w)) if alone else 1
    return TiledImage(torch.randn(n, 3, TILE, TILE, generator=g), (h, w))


def samples_of(model, sizes: list[list[tuple[int, int]]], seed: int = 0):
    """[(ids, items)]: text around each image's placeholders, as many as loom counts for it."""
    g = torch.Generator().manual_seed(seed)
    image_id, out = model.placeholder_ids["vision"], []
    for k, of_sample in enumerate(sizes):
        items = [tiled(model, h, w, len(of_sample) == 1, g) for h, w in of_sample]
        ids = torch.randint(10, 290, (3 + k,), generator=g).tolist()
        for item in items:
            text = torch.randint(10, 290, (2,), generator=g).tolist()
            ids += [image_id] * model.encoder("vision").num_tokens(item) + text
        out.append((torch.tensor(ids), items))
    return out


def loom_logits(model, samples) -> torch.Tensor:
    lengths = [len(ids) for ids, _ in samples]
    with torch.no_grad():
        return model(torch.cat([ids for ids, _ in samples]), torch.cat([torch.arange(n) for n in lengths]),
                     TokenSpans.from_lengths(lengths), {"vision": [x for _, items in samples for x in items]})


def hf_logits(ref, samples) -> torch.Tensor:
    """Each sample alone through transformers: its images' tiles padded to the most any has, their sizes, and how
    many the sample has (an image among several is not tiled)."""
    out = []
    with torch.no_grad():
        for ids, items in samples:
            if not items:
                out.append(ref(input_ids=ids[None]).logits[0])
                continue
            most = max(x.tiles.shape[0] for x in items)
            pixels = torch.stack([torch.cat([x.tiles, x.tiles.new_zeros(most - len(x.tiles), 3, TILE, TILE)])
                                  for x in items])
            out.append(ref(input_ids=ids[None], pixel_values=pixels, image_sizes=torch.tensor([x.size for x in items]),
                           batch_num_images=torch.tensor([len(items)])).logits[0])
    return torch.cat(out)


def test_a_llava_onevision_folder_gives_transformers_logits_for_packed_samples(llava_onevision):
    ref, folder = llava_onevision()
    model = build_pretrained(folder).eval()
    vision, tiles = model.vision.encoder.cfg, model.vision.tiles
    assert (vision.num_layers, vision.final_norm, vision.drop_first_row, vision.max_tiles) == (3, False, False, 4)
    assert torch.equal(tiles.image_newline, ref.model.image_newline)
    assert model.placeholder_ids["vision"] == FOLDERS["ov"].image_token_index
    a = tiles.anyres
    assert a.pooled(12, 8) and a.kept(33, 48) == (2, 10, 0, 12)  # the shapes IMAGES means to cover
    assert a.kept(16, 40) == (0, 4, 1, 11) and a.kept(20, 40) == (1, 7, 0, 12) and a.pooled(6, 12) is None
    samples = samples_of(model, IMAGES)
    want = hf_logits(ref, samples)
    got = loom_logits(model, samples)
    assert want.abs().max() > 1.0
    assert (got - want).abs().max() <= TOL


@pytest.mark.parametrize("change,fragments", [
    ({"image_grid_pinpoints": [[16, 16], [16, 40]]}, ["image_grid_pinpoints", "16 × 40", "16 pixels", "1 × 2.5 tiles"]),
    ({"vision_aspect_ratio": "anyres"}, ["vision_aspect_ratio = 'anyres'", "anyres_max_N"]),
    ({"vision_feature_select_strategy": "default"}, ["vision_feature_select_strategy = 'default'", "'full'"]),
])
def test_an_anyres_key_loom_cannot_follow_is_named_when_the_config_loads(llava_onevision, tmp_path, change,
                                                                          fragments):
    import shutil

    from loom.job import load_config
    from loom.typed_config import ConfigError

    _, folder = llava_onevision()
    shutil.copytree(folder, tmp_path / "bad")
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"--model.hf={tmp_path / 'bad'}", "--data.tasks=[\"sums\"]"])
    assert all(f in str(err.value) for f in fragments), str(err.value)


@pytest.mark.parametrize("overrides,fragments", [
    (["--data.tasks=[\"digits\"]"], ["data.tasks ['digits']", "cut into tiles", "data.sources"]),
    # the tile layout and image_newline run after the projector, on the last stage's rows, which stages do not run
    (["--data.tasks=[\"sums\"]", '--layout.vision.ranks="0-1"', '--layout.language.ranks="2-3"',
      "--layout.vision.pp=2"], ["vision: pp = 2", "anyres", "layout.vision.pp = 1"]),
])
def test_a_layout_or_task_the_anyres_tower_cannot_take_is_named_when_the_config_loads(llava_onevision, overrides,
                                                                                       fragments):
    from loom.job import load_config
    from loom.typed_config import ConfigError

    _, folder = llava_onevision()
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"--model.hf={folder}", *overrides], world_size=4)
    assert all(f in str(err.value) for f in fragments), str(err.value)


def test_canvases_set_by_hand_that_are_not_whole_tiles_are_named_when_the_config_loads():
    from loom.job import load_config
    from loom.typed_config import ConfigError

    with pytest.raises(ConfigError, match=r"model.vision.grid_pinpoints = \[\[32, 40\]\].*32 × 40 is not whole tiles "
                                          r"of 32 pixels.*1 × 1.25 tiles"):
        load_config(None, ["--model.vision.grid_pinpoints=[[32, 40]]", "--data.tasks=[\"sums\"]"])
