"""What a user would build instead: Hugging Face's Llava (SigLIP tower + Qwen2 LLM, same shapes, random
init) wrapped in FSDP2 the usual way (each decoder / encoder layer, then the root), fed padded batches.
Images are resized to the tower's native resolution (one size per batch, as Llava needs); audio is
dropped (Llava has no audio path) — both as such a user would do."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from bench.flops import flops_of, matmul_params
from loom.data.batch import IGNORE_INDEX
from loom.data.tokenizer import ByteTokenizer


class HFContender:
    def __init__(self, cfg, device: torch.device, workload) -> None:
        from transformers import LlavaConfig, LlavaForConditionalGeneration, Qwen2Config, SiglipVisionConfig

        self.device, self.workload, self.tok = device, workload, ByteTokenizer()
        lm, vc = cfg.model.language, cfg.model.vision
        self.side = vc.position_grid * vc.patch_size
        text = Qwen2Config(hidden_size=lm.hidden_size, intermediate_size=lm.intermediate_size,
                           num_hidden_layers=lm.num_layers, num_attention_heads=lm.num_heads,
                           num_key_value_heads=lm.num_kv_heads, vocab_size=lm.vocab_size,
                           rope_theta=lm.rope_theta, tie_word_embeddings=lm.tie_embeddings)
        vision = SiglipVisionConfig(hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size,
                                    num_hidden_layers=vc.num_layers, num_attention_heads=vc.num_heads,
                                    image_size=self.side, patch_size=vc.patch_size)
        config = LlavaConfig(vision_config=vision, text_config=text, vision_feature_layer=-1,
                             image_token_index=self.tok.placeholder_ids["vision"],
                             vision_feature_select_strategy="full")
        config.text_config._attn_implementation = config.vision_config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        with torch.device(device):
            self.model = LlavaForConditionalGeneration(config)
        inner = self.model.model
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.patches = (self.side // vc.patch_size) ** 2
        self.spec = {
            "patch": vc.patch_size, "patches_per_image": self.patches,
            "llm": (matmul_params(inner.language_model) + self.model.lm_head.weight.numel(), lm.num_layers,
                    lm.num_heads * lm.dim_per_head),
            "vision": (matmul_params(inner.vision_tower) + matmul_params(inner.multi_modal_projector),
                       vc.num_layers, vc.hidden_size),
            "llm_length": self._length,
        }
        dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for m in self.model.modules():
            if type(m).__name__.endswith(("DecoderLayer", "EncoderLayer")):
                fully_shard(m, mp_policy=mp)
        fully_shard(self.model, mp_policy=mp)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.train.lr,
                                           betas=(cfg.train.beta1, cfg.train.beta2),
                                           weight_decay=cfg.train.weight_decay,
                                           fused=device.type == "cuda" or None)  # as loom: fused on GPU
        self.grad_clip = cfg.train.grad_clip
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._computed = self._real = 0

    def _text(self, sample) -> list[int]:
        ph = set(self.tok.placeholder_ids.values())
        return [t for t in sample.tokens[1:] if t not in ph]

    def _length(self, sample) -> int:
        return 1 + self.patches + len(self._text(sample))

    def inputs(self, step: int) -> dict:
        samples = self.workload.shard(step, self.rank, self.world)
        image = [self.tok.placeholder_ids["vision"]] * self.patches
        rows = [[self.tok.bos_id] + image + self._text(s) for s in samples]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self.tok.pad_id)
        labels = torch.full((len(rows), width), IGNORE_INDEX)
        for i, (row, s) in enumerate(zip(rows, samples)):
            ids[i, : len(row)] = torch.tensor(row)
            n_text = len(row) - 1 - self.patches
            labels[i, len(row) - n_text : len(row)] = torch.tensor(row[-n_text:])
        pixels = torch.stack([F.interpolate(s.images[0][None], size=(self.side, self.side), mode="bilinear")[0]
                              for s in samples])
        self._computed += ids.numel()
        self._real += sum(map(len, rows))
        return {"input_ids": ids.to(self.device), "attention_mask": (ids != self.tok.pad_id).to(self.device),
                "labels": labels.to(self.device), "pixel_values": pixels.to(self.device)}

    def step(self, inputs: dict, step: int) -> float:
        loss = self.model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def llm_tokens(self, step: int) -> int:
        return sum(self._length(s) for s in self.workload.global_batch(step))

    def flops(self, step: int) -> float:
        return flops_of(self.workload.global_batch(step), self.spec)

    def padding_fraction(self) -> float:
        return 1 - self._real / max(1, self._computed)
