"""The model shapes the benches train, as config overrides: each LLM by name, the ViT and audio encoder beside it.

`LLMS` is what `--llm` chooses in bench/mm_bench.py (with the encoders) and bench/llm_bench.py (text only).
"""

from __future__ import annotations

_QWEN2 = ["--model.language.vocab_size=151936", "--model.language.attention_bias=true",
          "--model.language.rope_theta=1000000.0"]
_QWEN3 = ["--model.language.vocab_size=151936", "--model.language.qk_norm=true",
          "--model.language.rope_theta=1000000.0"]
# Qwen2-1.5B-shaped: the 2B multimodal job's LLM
LLM = ["--model.language.hidden_size=1536", "--model.language.num_layers=28", "--model.language.num_heads=12",
       "--model.language.num_kv_heads=2", "--model.language.intermediate_size=8960", *_QWEN2]
# an encoder-heavy pairing: a Qwen2.5-0.5B-shaped LLM after the same ViT (its matmuls about the ViT's size)
LLM_SMALL = ["--model.language.hidden_size=896", "--model.language.num_layers=24", "--model.language.num_heads=14",
             "--model.language.num_kv_heads=2", "--model.language.intermediate_size=4864", *_QWEN2]
QWEN3_1_7B = ["--model.language.hidden_size=2048", "--model.language.num_layers=28",
              "--model.language.num_heads=16", "--model.language.num_kv_heads=8", "--model.language.head_dim=128",
              "--model.language.intermediate_size=6144", "--model.language.tie_embeddings=true", *_QWEN3]
# a Qwen3-MoE-shaped LLM that fits one H200 with the ViT: 24 layers of width 2048 (16 heads of 128, 4 K/V heads,
# QK-norm), 16 experts of width 1408, 2 per token, in every layer: 0.98B active matmul parameters (the LM head's
# 0.31B among them), 3.9B in all (4.3B with the ViT and audio encoder)
LLM_MOE = ["--model.language.hidden_size=2048", "--model.language.num_layers=24", "--model.language.num_heads=16",
           "--model.language.num_kv_heads=4", "--model.language.intermediate_size=5632",
           "--model.language.num_experts=16", "--model.language.num_experts_per_tok=2",
           "--model.language.moe_intermediate_size=1408", *_QWEN3]
# Qwen3-30B-A3B's layer (128 experts of width 768, 8 per token, 32 heads of 128, 4 K/V heads, QK-norm) cut to the
# 8 layers whose fp32 weights and AdamW state fit one GPU beside the ViT: 5.4B parameters, 0.77B active
LLM_MOE128 = ["--model.language.hidden_size=2048", "--model.language.num_layers=8",
              "--model.language.num_heads=32", "--model.language.num_kv_heads=4", "--model.language.head_dim=128",
              "--model.language.intermediate_size=6144", "--model.language.num_experts=128",
              "--model.language.num_experts_per_tok=8", "--model.language.moe_intermediate_size=768",
              "--model.language.tie_embeddings=false", *_QWEN3]
LLMS = {"1.5b": LLM, "0.5b": LLM_SMALL, "qwen3-1.7b": QWEN3_1_7B, "moe": LLM_MOE, "moe128": LLM_MOE128}

VIT = ["--model.vision.hidden_size=1152", "--model.vision.num_layers=27", "--model.vision.num_heads=16",
       "--model.vision.intermediate_size=4304", "--model.vision.patch_size=14", "--model.vision.position_grid=27"]
AUDIO = ["--model.audio.num_features=80", "--model.audio.hidden_size=384", "--model.audio.num_layers=4",
         "--model.audio.num_heads=6", "--model.audio.intermediate_size=1536"]
