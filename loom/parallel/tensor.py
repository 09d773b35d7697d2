"""Tensor (+ sequence) parallel plans, applied from outside with DTensor's `parallelize_module`.

LLM: attention heads and KV heads split (q/k/v column-wise, o row-wise; under multi-head latent attention the
per-head up-projections column-wise, the latent down-projections whole), SwiGLU column/row, vocab-parallel
embedding, and a vocab-sharded LM head whose logits stay a DTensor for loss parallel. With sequence
parallel the residual stream between blocks is sharded over tokens (dim 0 packed, dim 1 padded): norms
run on their token shard, each attention/MLP input is all-gathered, each output reduce-scattered.
Encoders (ViT, Whisper, Qwen2-VL's and Qwen2.5-VL's towers) and projectors: attention heads and MLPs split the
same way (Qwen2-VL's fused qkv is three Linears in loom, its SwiGLU like the LLM's; a one-matmul projector stays
whole). With sequence parallel
(`[layout.vision] sequence_parallel = true`) the packed patch / frame stream between the layers is sharded
over tp like the LLM's: it is already padded to 64 rows with a filler item (encoder_layer.run_packed), so it
splits evenly for tp | 64; attention still sees every row of its image (the projections' input is gathered),
and the last layer's output is gathered whole again, for the filler's removal and the projector (Qwen2-VL's tower
pads its own stream so; its windows, 2-D rotary and merger groups thus see every row as on one process). So what
follows the last layer — Qwen2-Audio's pooling of a clip's rows in pairs, LLaVA-OneVision's per-image tile layout
with its image_newline — sees whole rows on every tp rank, as without SP (row-parallel outputs are replicated).
KV heads: split like the query heads when tp divides num_kv_heads; when tp is a multiple of it (more ranks
than KV heads, e.g. Qwen2.5-1.5B's 2 at tp 4) each rank's query heads all read one KV head, so k/v_proj stay
whole on every rank (replicated: they are small) and each rank keeps the output columns of its head; the
kept columns' gradient is partial on each rank, so DTensor sums the weights' gradients over the tp ranks —
the ranks sharing a head add their parts, the others add zeros (Megatron's KV-head replication).
Parameters no plan names (norms without SP, conv stems, position tables) stay plain tensors and get equal
gradients on every tp rank because every column-parallel input all-reduces its gradient.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from loom.models.encoder_layer import EncoderLayer
from loom.models.layers import SwiGLU
from loom.models.multimodal import ModalityEncoder
from loom.models.projector import Projector
from loom.models.qwen2_vision import VisionBlock
from loom.parallel.encoder_pipeline import EncoderStage


def apply_llm_tp(llm: nn.Module, mesh: DeviceMesh, sequence_parallel: bool, seq_dim: int) -> None:
    """`llm`: a DecoderLM or one pipeline stage of it (embedding on the first, norm and head on the last);
    `seq_dim`: the token dim of the residual stream (0 for packed [T, D], 1 for padded [B, S, D])."""
    act = Shard(seq_dim) if sequence_parallel else Replicate()
    plan = {}
    first_stage, last_stage = llm.embed_tokens is not None, llm.lm_head is not None
    if first_stage:
        plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if last_stage:
        plan["lm_head"] = ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False)
        if sequence_parallel:
            plan["norm"] = SequenceParallel(sequence_dim=seq_dim)
    for name, layer in llm.layers.items():
        block = f"layers.{name}"
        plan.update(_latent_attention_plan(llm.cfg, block) if llm.cfg.latent else _attention_plan(llm.cfg, block, mesh))
        plan[f"{block}.self_attn.o_proj"] = RowwiseParallel(output_layouts=act)
        if layer.sparse:
            # experts stay whole on every tp rank (FSDP shards them): the block computes on every token there,
            # under SP on the gathered tokens, and keeps this rank's token shard of its output
            if sequence_parallel:
                plan[f"{block}.mlp"] = _ReplicatedMoE(act)
        else:
            plan.update({
                f"{block}.mlp.gate_proj": ColwiseParallel(),
                f"{block}.mlp.up_proj": ColwiseParallel(),
                f"{block}.mlp.down_proj": RowwiseParallel(output_layouts=act),
            })
        if llm.cfg.qk_norm:
            # Qwen3's q/k norms weigh head_dim, shared by every head: on a rank's heads (sharded on the heads
            # dim, one after the token dim) the weight's gradient is a partial sum, reduced over tp by DTensor
            plan.update({f"{block}.self_attn.{norm}": SequenceParallel(sequence_dim=seq_dim + 1, use_local_output=True)
                         for norm in ("q_norm", "k_norm")})
        if sequence_parallel:
            plan.update({
                f"{block}.input_layernorm": SequenceParallel(sequence_dim=seq_dim),
                f"{block}.post_attention_layernorm": SequenceParallel(sequence_dim=seq_dim),
                # (h, rope, layout): gather the token shards of h before the projections (a plain tensor for
                # latent attention's down-projections, which stay plain)
                f"{block}.self_attn": PrepareModuleInput(
                    input_layouts=(act, None, None), desired_input_layouts=(Replicate(), None, None),
                    use_local_output=llm.cfg.latent,
                ),
            })
            if not layer.sparse:
                plan[f"{block}.mlp"] = PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),))
    if sequence_parallel and first_stage:
        # the merged (text + modality) embeddings are replicated; the first block takes this rank's token shard
        # (a later pipeline stage receives the shard itself)
        first = f"layers.{next(iter(llm.layers))}"
        plan[first] = PrepareModuleInput(
            input_layouts=(Replicate(), None, None), desired_input_layouts=(act, None, None), use_local_output=True
        )
    parallelize_module(llm, mesh, plan)
    # distributing replaced both parameters; tie them again (same Shard(0) layout)
    if llm.cfg.tie_embeddings and first_stage and last_stage:
        llm.lm_head.weight = llm.embed_tokens.weight


def _attention_plan(cfg, block: str, mesh: DeviceMesh) -> dict:
    tp, kv_heads = mesh.size(), cfg.num_kv_heads
    kv = ColwiseParallel if kv_heads % tp == 0 else lambda: KVHeadOfRank(cfg.dim_per_head, tp // kv_heads)
    return {f"{block}.self_attn.q_proj": ColwiseParallel(), f"{block}.self_attn.k_proj": kv(),
            f"{block}.self_attn.v_proj": kv()}


def _latent_attention_plan(cfg, block: str) -> dict:
    """Multi-head latent attention: the per-head up-projections split by heads; the down-projections and their
    norms stay whole on every rank (small, and their outputs feed every head)."""
    attn = f"{block}.self_attn"
    return {f"{attn}.{'q_b_proj' if cfg.q_lora_rank else 'q_proj'}": ColwiseParallel(),
            f"{attn}.kv_b_proj": ColwiseParallel(),
            f"{attn}.kv_a_proj_with_mqa": SharedRotaryKey(cfg.kv_lora_rank)}


class SharedRotaryKey(ParallelStyle):
    """`kv_a_proj_with_mqa` under tp: it stays whole, but the rotary key in its last columns is read by every
    head, so by each rank's heads only: its gradient there is partial per rank and is summed over tp (declared
    Partial, as KVHeadOfRank does). The latent's columns feed `kv_b_proj`, whose column-parallel input already
    sums its gradient. Without this the down-projection and the layer's input would get a rank's share only."""

    def __init__(self, latent_width: int) -> None:
        super().__init__()
        self.latent_width = latent_width

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def shared_key(mod, inputs, out):
            latent, key = out.split([self.latent_width, out.shape[-1] - self.latent_width], -1)
            key = DTensor.from_local(key, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
            return torch.cat([latent, key], -1)

        # a hook, not distribute_module, which would make the weights DTensors: they stay plain, like the norms
        module.register_forward_hook(shared_key)
        return module


class _ReplicatedMoE(ParallelStyle):
    """A mixture-of-experts block under sequence parallel: its input (tokens sharded over tp) gathered whole,
    its output cut back to this rank's shard. Both ends are DTensor redistributions, so the backward gathers
    the output's gradient and keeps the input gradient's shard (each rank computed the same whole gradient)."""

    def __init__(self, act) -> None:
        super().__init__()
        self.act = act

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        gather = PrepareModuleInput(input_layouts=(self.act, None), desired_input_layouts=(Replicate(), None),
                                    use_local_output=True)
        cut = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=self.act, use_local_output=True)
        return cut._apply(gather._apply(module, mesh), mesh)


class KVHeadOfRank(ParallelStyle):
    """k_proj / v_proj when tp is a multiple of the KV heads: weight (and bias) replicated over tp, every KV
    head computed, and the columns of rank r's head kept — head r // `ranks_per_head`, the one its query heads
    read. The kept columns' gradient is declared partial, which makes DTensor sum the weight's gradient and
    the input's over the tp ranks."""

    def __init__(self, head_dim: int, ranks_per_head: int) -> None:
        super().__init__()
        self.head_dim, self.ranks_per_head = head_dim, ranks_per_head

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def replicate(name, mod, mesh):
            for key, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))

        def to_dtensor(mod, inputs, mesh):
            x = inputs[0]
            return DTensor.from_local(x, mesh, [Replicate()], run_check=False) if not isinstance(x, DTensor) else x

        def own_head(mod, out, mesh):
            head = mesh.get_local_rank() // self.ranks_per_head
            local = out.to_local(grad_placements=[Partial()])  # other ranks' heads get no gradient from here
            return local[..., head * self.head_dim : (head + 1) * self.head_dim]

        return distribute_module(module, mesh, replicate, input_fn=to_dtensor, output_fn=own_head)


def apply_encoder_tp(encoder: ModalityEncoder | EncoderStage, mesh: DeviceMesh, sequence_parallel: bool = False
                     ) -> None:
    """`encoder`: a whole ModalityEncoder or one pipeline stage of it (its layers; the projector on the last)."""
    rows = Shard(0) if sequence_parallel else Replicate()  # the packed stream between layers: [rows, hidden]
    plan = {}
    if isinstance(encoder.projector, Projector):
        plan["projector.linear_1"] = ColwiseParallel()
        plan["projector.linear_2"] = RowwiseParallel()  # output replicated: full LLM-width embeddings
    # a LinearProjector (Qwen2-Audio's one matmul) stays whole: its input and output are whole rows on every tp rank
    # a stage's layers keep their one-process indices as names (a ModuleDict), the whole encoder's a ModuleList
    named = list(encoder.encoder.layers.named_children())
    layers = [f"encoder.layers.{i}" for i, _ in named]
    args = (None,) * (_LAYER_ARGS[type(named[0][1])] - 1)  # the layer's inputs after the stream: spans (and rope)
    for (_, module), layer in zip(named, layers):
        attn, out, norm1, norm2 = _NAMES[type(module)]
        plan.update({f"{layer}.{attn}.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")})
        plan[f"{layer}.{attn}.{out}"] = RowwiseParallel(output_layouts=rows)
        if isinstance(module.mlp, SwiGLU):  # Qwen2.5-VL's, with biases: sharded like the LLM's
            plan.update({f"{layer}.mlp.gate_proj": ColwiseParallel(), f"{layer}.mlp.up_proj": ColwiseParallel(),
                         f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=rows)})
        else:
            plan.update({f"{layer}.mlp.fc1": ColwiseParallel(),
                         f"{layer}.mlp.fc2": RowwiseParallel(output_layouts=rows)})
        if sequence_parallel:
            plan.update({
                f"{layer}.{norm1}": SequenceParallel(sequence_dim=0),
                f"{layer}.{norm2}": SequenceParallel(sequence_dim=0),
                # (h, spans[, rope]): every row of the stream before the projections, so attention sees whole
                # images and whole Qwen2.5-VL windows, and the 2-D rotary every row's (row, column)
                f"{layer}.{attn}": PrepareModuleInput(input_layouts=(rows, *args),
                                                      desired_input_layouts=(Replicate(), *args)),
                f"{layer}.mlp": PrepareModuleInput(input_layouts=(rows,), desired_input_layouts=(Replicate(),)),
            })
    if sequence_parallel:
        # the stream enters the first layer whole (embeddings are computed, or a stage's input received, on every tp
        # rank) and leaves the last whole: Qwen2-VL's merger then takes its 2×2 groups from every row, in order
        plan[layers[0]] = PrepareModuleInput(input_layouts=(Replicate(), *args), desired_input_layouts=(rows, *args),
                                             use_local_output=True)
    parallelize_module(encoder, mesh, plan)
    if sequence_parallel:  # a second call: with one layer, the first is the last
        parallelize_module(encoder, mesh, {layers[-1]: PrepareModuleOutput(
            output_layouts=rows, desired_output_layouts=Replicate(), use_local_output=True)})


# each encoder layer's (attention, its output projection, the norms before attention and MLP); Qwen2-VL's q/k/v are
# its fused qkv's row blocks (models/qwen2_vision.py), so every tower's attention shards alike
_NAMES = {EncoderLayer: ("self_attn", "out_proj", "layer_norm1", "layer_norm2"),
          VisionBlock: ("attn", "proj", "norm1", "norm2")}
_LAYER_ARGS = {EncoderLayer: 2, VisionBlock: 3}  # (h, spans) and Qwen2-VL's (h, spans, rope)
