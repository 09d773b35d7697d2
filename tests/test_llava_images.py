"""A LLaVA folder's images are prepared as its processor prepares them: CLIP's shorter side resized and a centred
crop (or SigLIP's straight resize), rescaled and normalised with the folder's preprocessor_config.json — the same
pixels as transformers' PIL processors built from their defaults — and each image expands to as many
placeholder tokens as LlavaProcessor writes for it."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

transformers = pytest.importorskip("transformers")
from conftest import tiny_chat_tokenizer  # noqa: E402
from vlm_jobs import png_files  # noqa: E402
from transformers import LlavaProcessor, PreTrainedTokenizerFast  # noqa: E402
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # noqa: E402
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil  # noqa: E402

from loom.data.images import ImageRule, PreprocessorConfigError, image_file, load_image  # noqa: E402

SIZES = [(40, 25), (27, 40), (17, 17), (301, 230), (16, 64)]  # (H, W): portrait, landscape, odd, large, thin


def _rule(processor, folder) -> ImageRule:
    processor.save_pretrained(folder)
    return ImageRule.of(4, 16, 64 * 64, folder, processor_sizes=True)


@pytest.mark.parametrize("processor", [
    CLIPImageProcessorPil(),  # every default: shorter side 224, a 224 × 224 crop, CLIP's mean and std
    CLIPImageProcessorPil(size={"shortest_edge": 20}, crop_size={"height": 16, "width": 12}),
    SiglipImageProcessorPil(size={"height": 16, "width": 16}),  # straight to 16 × 16, mean and std 0.5
], ids=["clip-defaults", "clip-20-crop-16x12", "siglip-16"])
def test_images_are_the_processors_pixels(processor, tmp_path):
    rule = _rule(processor, tmp_path / "folder")
    for path in png_files(tmp_path, SIZES):
        want = torch.from_numpy(processor(Image.open(path), return_tensors="np")["pixel_values"][0])
        got = load_image(path, rule)
        assert image_file(path, rule).shape == tuple(got.shape) == tuple(want.shape), path.name
        assert (got - want).abs().max() <= 1e-5, path.name


def _hf_tokenizer(root, bos: bool = False) -> PreTrainedTokenizerFast:
    """The tiny chat tokenizer with <image> added; `bos`: with Llama's <s> put before every text by its
    post-processor."""
    root.mkdir()
    tiny_chat_tokenizer(root)
    if bos:
        from tokenizers import AddedToken, Tokenizer, processors

        raw = Tokenizer.from_file(str(root / "tokenizer.json"))
        raw.add_special_tokens([AddedToken("<s>", special=True, normalized=False)])
        raw.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", raw.token_to_id("<s>"))])
        raw.save(str(root / "tokenizer.json"))
        config = json.loads((root / "tokenizer_config.json").read_text())
        (root / "tokenizer_config.json").write_text(json.dumps(dict(config, bos_token="<s>")))
    tok = PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json"), bos_token="<s>" if bos else None)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    return tok


@pytest.mark.parametrize("name", ["clip-llama", "siglip-qwen2"])
def test_each_image_has_as_many_placeholders_as_llava_processor_writes(llava, name, tmp_path):
    from llava_folders import FOLDERS, image_processor

    from loom.models.hf import build_pretrained

    _, folder = llava(name)
    cfg, clip, images = FOLDERS[name], name == "clip-llama", image_processor(name)
    processor = LlavaProcessor(image_processor=images, tokenizer=_hf_tokenizer(tmp_path / "tok"), patch_size=4,
                               vision_feature_select_strategy=cfg.vision_feature_select_strategy,
                               num_additional_image_tokens=1 if clip else 0)
    rule, model = _rule(images, tmp_path / "folder"), build_pretrained(folder)
    for path in png_files(tmp_path, SIZES):
        ids = processor(text="<image> what is it", images=[Image.open(path)])["input_ids"][0]
        want = sum(i == processor.image_token_id for i in ids)
        assert model.encoder("vision").num_tokens(load_image(path, rule)) == want == 16, path.name


def test_a_processor_config_loom_cannot_follow_is_named(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 12},
                                                                   "crop_size": {"height": 16, "width": 16}}))
    with pytest.raises(PreprocessorConfigError, match=r"shortest_edge = 12 is smaller than crop_size \(16, 16\)"):
        ImageRule.of(4, 16, 1024, tmp_path, processor_sizes=True)
    with pytest.raises(PreprocessorConfigError, match="no preprocessor_config.json"):
        ImageRule.of(4, 16, 1024, tmp_path / "absent", processor_sizes=True)


# llava-hf's LLaVA 1.5 chat template (its processor's chat_template.json): images first, then text, parts by type
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


@pytest.mark.parametrize("bos", [False, True], ids=["no-bos", "llama-bos"])
def test_a_llava_conversation_gives_llava_processors_ids(llava, tmp_path, bos):
    """Two turns, three images: loom's ids (the template in the processor's chat_template.json, each <image>
    repeated per the tower's rows) equal LlavaProcessor's apply_chat_template + its call on the same images — with
    the <s> a Llama tokenizer puts first, which the processor's call adds and the template does not write."""
    from llava_folders import image_processor

    from loom.data.chat import ChatTokenizer
    from loom.data.conversations import parse_conversation
    from loom.models.hf import build_pretrained

    _, folder = llava("clip-llama")
    tok = _hf_tokenizer(tmp_path / "tok", bos)
    (tmp_path / "tok" / "chat_template.json").write_text(json.dumps({"chat_template": LLAVA_TEMPLATE}))
    processor = LlavaProcessor(image_processor=image_processor("clip-llama"), tokenizer=tok, patch_size=4,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=LLAVA_TEMPLATE)
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
    want = processor(text=text, images=[Image.open(p) for p in paths])["input_ids"][0]

    chat = ChatTokenizer(tmp_path / "tok", {"vision": "<image>"})
    assert chat.reads_parts and chat.added == ["<image>"]  # added as the HF tokenizer above added it
    conv = parse_conversation(json.dumps({"messages": messages}), "data.jsonl:1", tmp_path)
    rows = build_pretrained(folder).encoder("vision").num_tokens(torch.zeros(3, 16, 16))
    ids, targets = chat.encode(conv, {"vision": [rows] * 3})
    assert ids == list(want) and sum(i == processor.image_token_id for i in ids) == 3 * 16
    assert (ids[0] == tok.bos_token_id) == bos
    # each answer from where the generation prompt 'ASSISTANT:' ends (this template writes no end-of-turn token)
    assert chat.tokenizer.decode([i for i, t in zip(ids, targets) if t]) == " A cat.  A dog. "
