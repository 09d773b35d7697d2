"""What the cost model is fed from a job: each module's sizes, counted on the model built on meta, and a few
steps' data drawn through loom's own data path (the same samples `loom train` would draw at those steps)."""

from __future__ import annotations

from dataclasses import dataclass

from loom.config import JobConfig
from loom.data.batch import supervised_count
from loom.data.format import TokenCounter
from loom.models.layers import RMSNorm, SwiGLU
from loom.plan_search.cost import ModuleSizes, Workload
from loom.train.flops import matmul_params
from loom.train.job_data import build_job_data, job_tokenizer, with_vocabulary
from loom.train.job_model import build_batches, build_job_model, token_counters


@dataclass(frozen=True)
class JobFacts:
    sizes: dict[str, ModuleSizes]
    steps: tuple[Workload, ...]  # the first few steps' data, each in its batch order (estimate_steps prices each)
    longest: dict[str, int]  # source → its longest sample (built-in tasks), for the T candidates


def step_workload(samples: list, counters: dict[str, TokenCounter]) -> Workload:
    """One step's samples (batch order) as the cost model reads them: lengths, every item's rows, which sample each
    item is of (to place them as loom does), and the tokens with a label (where the head runs)."""
    items = {n: tuple(c(item) for s in samples for item in s.items(n)) for n, c in counters.items()}
    counts = {n: tuple(len(s.items(n)) for s in samples) for n in counters}
    return Workload(tuple(len(s) for s in samples), items, sum(supervised_count(s) for s in samples), counts)


def job_facts(cfg: JobConfig, steps: int = 3) -> JobFacts:
    """Sizes and `steps` steps of data for `cfg` (no process, no weights: the model lives on meta)."""
    tok = job_tokenizer(cfg)
    cfg = with_vocabulary(cfg, tok)
    model = build_job_model(cfg, tok)
    counters = token_counters(model)
    data = build_job_data(cfg, tok, counters)
    batches = build_batches(cfg, data)
    drawn = []
    for step in range(steps):
        drawn.append(step_workload([s for i in batches.indices(step) for s in _sequences(data.train[i])], counters))
    return JobFacts(module_sizes(model), tuple(drawn), dict(data.longest))


def _sequences(item) -> list:
    return item.sequences if hasattr(item, "sequences") else [item]  # a DPO pair: its two sequences


def module_sizes(model) -> dict[str, ModuleSizes]:
    """Each module's ModuleSizes from the model (on meta or not), the projector counted with its encoder."""
    lm = model.language.cfg
    experts = sum(p.numel() for n, p in model.language.named_parameters() if ".experts." in n)
    sparse = sum(lm.is_sparse(i) for i in range(lm.num_layers))
    dense = lm.num_layers - sparse
    expert_width = (lm.moe_intermediate_size or lm.intermediate_size)
    active = (lm.num_experts_per_tok + lm.n_shared_experts) * expert_width
    mlp_width = (dense * lm.intermediate_size + sparse * active) // lm.num_layers
    d = (lm.key_dim + lm.value_dim) // 2  # a head's width, keys and values averaged (they differ under MLA)
    sizes = {"language": ModuleSizes(
        "language", sum(p.numel() for p in model.language.parameters()), experts, matmul_params(model.language),
        lm.num_layers, lm.hidden_size, lm.num_heads * d, lm.num_kv_heads * d, lm.num_kv_heads, mlp_width, 4, True,
        vocab=lm.vocab_size, sparse_layers=sparse, top_k=lm.num_experts_per_tok if sparse else 0,
        column_linears=3 + 2 * dense / lm.num_layers,  # q, k, v; gate and up where the MLP is split (not experts)
        norm_fp32=True, qk_norm=bool(lm.qk_norm))}
    for name in model.encoder_names:
        enc = model.encoder(name)
        ec = enc.encoder.cfg
        first = next(enc.encoder.layers.children())
        sizes[name] = ModuleSizes(
            name, sum(p.numel() for p in enc.parameters()), 0, matmul_params(enc), ec.num_layers, ec.hidden_size,
            ec.hidden_size, ec.hidden_size, ec.num_heads, ec.intermediate_size, 2, False, out_width=lm.hidden_size,
            # q, k, v; then gate and up (a SwiGLU tower's) or fc1
            column_linears=3 + (2 if isinstance(first.mlp, SwiGLU) else 1),
            norm_fp32=any(isinstance(x, RMSNorm) for x in first.modules()))
    return sizes
