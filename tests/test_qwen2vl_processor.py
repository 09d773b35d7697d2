"""A Qwen2-VL folder's images are prepared as Qwen2VLImageProcessor prepares them — smart_resize within its min / max
pixels to whole 28-pixel groups, rescaled and normalised with CLIP's mean and std, patches in merger order with two
temporal copies — and a conversation's ids equal Qwen2VLProcessor's: its chat template's <|vision_start|>
<|image_pad|> <|vision_end|> around each image, <|image_pad|> repeated per merged patch; its M-RoPE positions equal
get_rope_index's on those ids."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

transformers = pytest.importorskip("transformers")
from conftest import tiny_chat_tokenizer  # noqa: E402
from vlm_jobs import png_files  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessorPil, Qwen2VLProcessor  # noqa: E402

from loom.data.images import ImageRule, image_file, load_image  # noqa: E402
from loom.models.qwen2_vision import Qwen2VisionEncoder  # noqa: E402
from loom.models.vision import VisionConfig  # noqa: E402

# (H, W): portrait, landscape, odd, larger than a small max_pixels, thin (a side that rounds to 0 patch groups),
# smaller than min_pixels
SIZES = [(40, 25), (27, 40), (57, 61), (301, 230), (10, 400), (20, 20)]
PROCESSORS = {
    "defaults": dict(),  # min 56², max 28² · 1280 (transformers 5's size.shortest_edge / longest_edge)
    "small": dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16),
}
# Qwen2-VL-Instruct's chat template (its chat_template.json), vision ids off
QWEN2VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's tower sizes as loom reads them (14-pixel patches, 2×2 merger)
TOWER_CONFIG = VisionConfig(family="qwen2_vl", patch_size=14, hidden_size=32, num_heads=2)


def _rule(processor, folder) -> ImageRule:
    processor.save_pretrained(folder)
    return ImageRule.of(28, 28 * 28, 28 * 28 * 4, folder, processor_sizes=True)  # the file's sizes replace these


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_images_are_qwen2vl_processors_patches_and_grids(name, tmp_path):
    processor = Qwen2VLImageProcessorPil(**PROCESSORS[name])
    rule, tower = _rule(processor, tmp_path / "folder"), Qwen2VisionEncoder(TOWER_CONFIG)
    assert (rule.patch, rule.smart_resize) == (28, True)
    for path in png_files(tmp_path, SIZES):
        want = processor(Image.open(path), return_tensors="pt")
        image = load_image(path, rule)
        assert image_file(path, rule).shape == tuple(image.shape), path.name
        assert list(tower.grid(image)) == want["image_grid_thw"][0].tolist(), path.name
        assert (tower.patches(image) - want["pixel_values"]).abs().max() <= 1e-5, path.name


def _hf_tokenizer(root) -> PreTrainedTokenizerFast:
    root.mkdir()
    tiny_chat_tokenizer(root)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json"), eos_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.save_pretrained(root)
    (root / "chat_template.json").write_text(json.dumps({"chat_template": QWEN2VL_TEMPLATE}))
    return tok


def test_a_qwen2vl_conversation_gives_qwen2vl_processors_ids_and_rope_index(tmp_path, monkeypatch):
    """Two turns, three images of different sizes: loom's ids equal Qwen2VLProcessor's apply_chat_template + its
    call on the same images, and loom's M-RoPE positions of them equal Qwen2VLModel.get_rope_index's."""
    from qwen2vl_folders import qwen2vl_model

    from loom.data.chat import ChatTokenizer
    from loom.data.conversations import parse_conversation
    from loom.data.mrope import mrope_positions

    # without torchvision transformers cannot name the video processor's class, which this test passes as None
    checked = Qwen2VLProcessor.check_argument_for_proper_class
    monkeypatch.setattr(Qwen2VLProcessor, "check_argument_for_proper_class",
                        lambda self, name, arg: None if arg is None else checked(self, name, arg))
    tok = _hf_tokenizer(tmp_path / "tok")
    images = Qwen2VLImageProcessorPil(**PROCESSORS["small"])
    processor = Qwen2VLProcessor(image_processor=images, tokenizer=tok, chat_template=QWEN2VL_TEMPLATE)
    paths = png_files(tmp_path, SIZES[:3])
    messages = [{"role": "user", "content": [{"type": "image", "path": paths[0].name},
                                             {"type": "text", "text": "What is this?"},
                                             {"type": "image", "path": paths[1].name}]},
                {"role": "assistant", "content": "A cat."},
                {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                             {"type": "image", "path": paths[2].name}]},
                {"role": "assistant", "content": [{"type": "text", "text": "A dog."}]}]
    as_hf = [dict(m, content=m["content"] if isinstance(m["content"], list) else
                  [{"type": "text", "text": m["content"]}]) for m in messages]
    text = processor.apply_chat_template(as_hf, tokenize=False)
    want = processor(text=text, images=[Image.open(p) for p in paths], return_tensors="pt")

    chat = ChatTokenizer(tmp_path / "tok", {"vision": "<|image_pad|>"})
    assert chat.reads_parts and chat.added == []
    conv = parse_conversation(json.dumps({"messages": messages}), "data.jsonl:1", tmp_path)
    rule, tower = _rule(images, tmp_path / "folder"), Qwen2VisionEncoder(TOWER_CONFIG)
    loaded = [load_image(p, rule) for p in paths]
    ids, _ = chat.encode(conv, {"vision": [tower.num_tokens(im) for im in loaded]})
    assert ids == want["input_ids"][0].tolist()
    pad = chat.placeholder_ids["vision"]
    assert sum(i == pad for i in ids) == int(want["image_grid_thw"].prod(-1).sum()) // 4

    ref = qwen2vl_model()  # get_rope_index reads only the merge size of its config
    x = torch.tensor(ids)[None]
    hf_positions = ref.model.get_rope_index(x, (x == pad).int(), image_grid_thw=want["image_grid_thw"])[0][:, 0]
    got = mrope_positions(ids, pad, [tower.grid(im) for im in loaded], 2)
    assert torch.equal(torch.tensor(got).T, hf_positions)
