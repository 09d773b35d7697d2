"""The model's configuration as data: each module's sizes ([model.language], [model.vision], [model.audio]),
the [model] table that holds them, and the router's view of the LLM's (RouterSpec).

A leaf: it imports no model code and no torch, so loom/config.py (the job as data), data/ and topology/ read
a model's sizes without importing the model; loom/models builds from these and re-exports them where they
were defined before (`from loom.models.llm import LLMConfig` still works).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.typed_config import choice

# the projector's activations by their Hugging Face names (LLaVA's `projector_hidden_act`); models/projector.py
# maps each to its function (tests/test_structure.py checks the two agree)
PROJECTOR_ACT_NAMES = ("gelu", "gelu_pytorch_tanh", "quick_gelu", "silu", "relu")


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    score: str = "softmax"  # "softmax" | "sigmoid"
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    choice_bias: bool = False  # a selection-only bias buffer (`e_score_correction_bias`)
    group_score: str = "top2_sum"  # "top2_sum" (DeepSeek-V3) | "max" (DeepSeek-V2)


@dataclass
class LLMConfig:
    vocab_size: int = 320  # token ids the embedding and LM head hold (a tokenizer's size sets it)
    hidden_size: int = 128  # the residual stream's width
    num_layers: int = 4  # decoder layers
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention: a divisor of num_heads)
    head_dim: int = 0  # 0: hidden_size // num_heads
    intermediate_size: int = 384  # a dense layer's SwiGLU width
    rms_norm_eps: float = 1e-6  # RMSNorm's epsilon
    rope_theta: float = 10000.0  # the rotary embedding's base
    rope_scaling: dict | None = None  # as in HF configs: {"rope_type": "llama3", "factor": 8.0, ...}
    partial_rotary_factor: float = 1.0  # the share of each head's dims rotated, the first ones (GLM-4.5: 0.5)
    tie_embeddings: bool = True  # the LM head shares the embedding's weight
    attention_bias: bool = False  # bias on q/k/v (Qwen2, GLM-4.5); latent attention: its down-projections and o_proj
    qk_norm: bool = False  # Qwen3: RMSNorm on each query/key head before RoPE
    init_std: float = 0.02  # initial weights' standard deviation (a folder's weights replace them)
    hf: str = ""  # Hugging Face folder to load this module from: its config.json replaces all but TRAINING_KEYS
    # mixture of experts (0 experts: every layer dense). Names as in Hugging Face's Qwen3-MoE / DeepSeek-V3 configs
    num_experts: int = 0
    num_experts_per_tok: int = 2  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # each routed expert's width (0: intermediate_size)
    norm_topk_prob: bool = True  # renormalise the chosen experts' weights to sum 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here ...
    first_k_dense_replace: int = 0  # ... and i ≥ this (DeepSeek-V3's first dense layers)
    router_score: str = choice("softmax", "softmax", "sigmoid")  # softmax: Qwen3-MoE; sigmoid: DeepSeek-V3
    n_group: int = 1  # group-limited routing (DeepSeek-V2/V3): experts in n_group groups, the topk_group best kept
    topk_group: int = 1
    router_group_score: str = choice("top2_sum", "top2_sum", "max")  # a group: the sum of its best two (V3) or max (V2)
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0  # shared experts every token goes through (one SwiGLU n × moe_intermediate_size)
    router_bias: bool = False  # a selection-only bias per expert (DeepSeek-V3's e_score_correction_bias)
    router_bias_update_rate: float = 0.0  # aux-loss-free balancing: the bias moves by this once per step
    router_z_loss_coef: float = 0.0  # router z-loss weight (mean over tokens of logsumexp(logits)²)
    router_seq_aux_loss_coef: float = 0.0  # DeepSeek-V3's sequence-wise balance loss weight (mean over samples)
    expert_kernel: str = choice("auto", "auto", "loop", "grouped")  # auto: grouped GEMM on CUDA in bf16, else loop
    # multi-head latent attention (DeepSeek-V3's MLA; kv_lora_rank 0: standard attention), names as in its config
    kv_lora_rank: int = 0  # the latent every head's key and value are expanded from
    q_lora_rank: int = 0  # the queries' bottleneck (0: one projection)
    qk_nope_head_dim: int = 0  # a head's query/key dims without rotary embedding ...
    qk_rope_head_dim: int = 0  # ... and with it (one rotary key shared by every head)
    v_head_dim: int = 0  # a head's value dims
    rope_interleave: bool = False  # rotary pairs interleaved (DeepSeek's checkpoints), not split in halves

    # how to train, not what the model is: a Hugging Face folder does not say these, so a job's values stand
    TRAINING_KEYS = ("init_std", "expert_kernel", "router_bias_update_rate", "router_z_loss_coef",
                     "router_seq_aux_loss_coef")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def latent(self) -> bool:
        """Whether attention is multi-head latent attention."""
        return self.kv_lora_rank > 0

    @property
    def key_dim(self) -> int:
        """A head's query and key width."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.latent else self.dim_per_head

    @property
    def value_dim(self) -> int:
        return self.v_head_dim if self.latent else self.dim_per_head

    @property
    def rope_dim(self) -> int:
        """The rotated dims of a head's query and key."""
        return self.qk_rope_head_dim if self.latent else int(self.dim_per_head * self.partial_rotary_factor)

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) has a mixture-of-experts MLP: Qwen3-MoE's and DeepSeek-V3's rules."""
        return (self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0
                and layer not in self.mlp_only_layers and layer >= self.first_k_dense_replace)

    @property
    def sparse_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_sparse(i)]

    def router_spec(self) -> RouterSpec:
        return RouterSpec(self.num_experts, self.num_experts_per_tok, self.router_score, self.norm_topk_prob,
                          self.n_group, self.topk_group, self.routed_scaling_factor,
                          self.router_bias or self.router_bias_update_rate > 0, self.router_group_score)


@dataclass
class VisionConfig:
    channels: int = 3  # image channels
    patch_size: int = 4  # pixels a side of one patch
    hidden_size: int = 96  # the tower's width
    num_layers: int = 2  # encoder layers
    num_heads: int = 4  # attention heads
    intermediate_size: int = 256  # an encoder layer's MLP width
    layer_norm_eps: float = 1e-6  # LayerNorm's epsilon
    position_grid: int = 8  # learned positions for a grid×grid patch image, interpolated for other sizes
    act: str = "tanh"  # gelu approximation: "tanh" (SigLIP), "none" (exact) or "quick" (CLIP's quick_gelu)
    class_token: bool = False  # CLIP: a learned [CLS] row before each image's patches, position row 0 its own
    patch_bias: bool = True  # CLIP's patch embedding has none
    pre_norm: bool = False  # CLIP's LayerNorm of the embeddings before the first layer (`pre_layrnorm`)
    final_norm: bool = True  # post_layernorm on the last layer's output; a LLaVA tower's LLM reads a layer's output
    drop_first_row: bool = False  # LLaVA's "default" feature strategy: each image's first output row ([CLS]) dropped
    projector_act: str = choice("gelu", *PROJECTOR_ACT_NAMES)  # the projector's activation, between its two matmuls
    # which tower: "vit" (SigLIP / CLIP, models/vision.py) or "qwen2_vl" (models/qwen2_vision.py: 2-D rotary
    # positions and a 2×2 patch merger, whose MLP is the projector; the keys below are its)
    # (qwen2_5_vl: RMSNorm, a SwiGLU MLP and windowed attention)
    family: str = choice("vit", "vit", "qwen2_vl", "qwen2_5_vl")  # the tower's architecture
    temporal_patch_size: int = 2  # frames per patch; a still image is repeated to fill them
    merge_size: int = 2  # the merger joins merge_size × merge_size neighbouring patches into one LLM token
    rope_theta: float = 10000.0  # the tower's 2-D rotary base
    window_size: int = 0  # Qwen2.5-VL: layers attend within windows this many pixels a side (0: whole images) …
    full_attention_layers: list[int] = field(default_factory=list)  # … but these, over whole images
    # LLaVA-OneVision's anyres: the (H, W) canvases an image may be tiled to in tiles of the tower's size, plus a
    # base tile of the whole image (empty: no tiling) …
    grid_pinpoints: list[list[int]] = field(default_factory=list)
    max_tiles: int = 9  # … and the tile grid's rows pooled down to about this many tiles' worth (anyres_max_N)
    hf: str = ""  # Hugging Face folder to load this module from; its config.json then replaces the sizes here


@dataclass
class AudioConfig:
    num_features: int = 32  # mel bins of the input features
    hidden_size: int = 96  # the encoder's width
    num_layers: int = 2  # encoder layers
    num_heads: int = 4  # attention heads
    intermediate_size: int = 256  # an encoder layer's MLP width
    layer_norm_eps: float = 1e-5  # LayerNorm's epsilon
    max_positions: int = 1500  # frames after subsampling
    # which tower: "whisper" (models/audio.py) or "qwen2_audio" (models/qwen2_audio.py: each clip two mel frames
    # longer than its own, the processor's padding its convolutions read; output rows pooled in pairs; one-matmul
    # projector)
    family: str = choice("whisper", "whisper", "qwen2_audio")  # the tower's architecture
    hf: str = ""  # Hugging Face folder to load this module from; its config.json then replaces the sizes here


@dataclass
class ModelConfig:
    """[model]: which encoders feed the LLM, each module's sizes, the tokenizer and attention backend. Here, not
    in loom/config.py, so that loom/models never imports the job's config and the job's config no model code."""

    # the encoder modules that feed the LLM ([]: text only)
    encoders: list[str] = field(default_factory=lambda: ["vision", "audio"])
    # a Hugging Face folder holding the whole model (LLaVA, Qwen2-Audio): it sets the encoders, every module's sizes
    # and `hf`
    hf: str = ""
    # a Hugging Face tokenizer folder (tokenizer.json + chat template) for data.sources; empty: loom's byte
    # tokenizer, which the built-in tasks use
    tokenizer: str = ""
    attention: str = choice("auto", "auto", "sdpa", "varlen")  # auto: varlen on CUDA in bf16/fp16, SDPA elsewhere
    language: LLMConfig = field(default_factory=LLMConfig)  # [model.language]
    vision: VisionConfig = field(default_factory=VisionConfig)  # [model.vision]
    audio: AudioConfig = field(default_factory=AudioConfig)  # [model.audio]
