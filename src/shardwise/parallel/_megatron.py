r"""`MegatronPlanner`: derive the Megatron tensor-parallel plan of a transformer from its module structure.

Megatron-LM splits each transformer block into column-parallel layers followed by
row-parallel ones, so the only communication in a block is one all-reduce after the
attention output projection and one after the MLP down projection (Megatron's `g`); the
vocab is split across the token embedding and the LM head. This planner finds those
layers by name across the common model families, and by shape where names say nothing:

| role | names (tests/models.py, GPT-2 (HF), Llama, others) | style |
|---|---|---|
| q / k / v | q k v, q_proj k_proj v_proj, query key value, wq wk wv | Colwise |
| fused q\|k\|v (out = 3 x in), gate\|up | c_attn, qkv, qkv_proj, Wqkv; gate_up_proj | FusedColwise (each part split: no gather at the model's split) |
| attention output | proj, c_proj, o_proj, out_proj, wo, dense | Rowwise |
| MLP up / gate | up, c_fc, up_proj gate_proj, fc1, w1 w3, fc_in | Colwise |
| MLP down | down, c_proj, down_proj, fc2, w2, fc_out | Rowwise |
| token embedding | tok, wte, embed_tokens, tok_embeddings, word_embeddings | Rowwise (vocab) |
| LM head | head, lm_head, output | Colwise (vocab), output left S(-1) |
| experts (parameters stacking `num_experts` along dim 0) | any (Mixtral's `experts`) | ExpertParallel |

Column / row layers are only taken in pairs: a module whose children include both kinds.
A module with exactly two linear children, the first expanding d -> k*d and the second
contracting back, is an MLP whatever the names. Where a block keeps them in separate
submodules (BERT's `attention.self.query`, `attention.output.dense`, `intermediate.dense`,
`output.dense`), each block of a ModuleList is read in order: q/k/v then the output
projection, and an expanding layer followed by a contracting one. The plan carries its
`coverage` (every parameter's layout and bytes), and a large parameter left replicated
is warned about. Every style keeps DTensor outputs
(`use_local_output=False`), so model code that views activations with global head counts
runs unchanged; the LM head's logits stay vocab-sharded for a vocab-parallel loss.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Optional

from torch import nn

from .._describe import describe
from .._placement import Replicate, Shard
from ._coverage import coverage
from ._experts import ExpertParallel, expert_parameters
from ._plan import Sharder, ShardingPlan, ShardingPlanner
from ._fused import fused_parts
from ._style import ColwiseParallel, FusedColwiseParallel, RowwiseParallel, module_kind

__all__ = ["MegatronPlanner"]

_COLWISE = frozenset({
    "q", "k", "v", "qkv", "c_attn", "q_proj", "k_proj", "v_proj", "qkv_proj", "query", "key", "value",
    "query_key_value", "Wqkv", "wq", "wk", "wv",
    "up", "gate", "c_fc", "up_proj", "gate_proj", "gate_up_proj", "fc1", "w1", "w3", "fc_in", "dense_h_to_4h",
})
_ROWWISE = frozenset({
    "proj", "c_proj", "o_proj", "out_proj", "wo", "o", "dense",
    "down", "down_proj", "fc2", "w2", "fc_out", "dense_4h_to_h",
})
_EMBEDDING = frozenset({"tok", "wte", "embed_tokens", "tok_embeddings", "word_embeddings", "embed_in"})
_HEAD = frozenset({"head", "lm_head", "output", "embed_out"})


def _features(module: nn.Module) -> Optional[tuple[int, int]]:
    """(in, out) features of a linear-like module, else None."""
    kind = module_kind(module)
    if kind == "linear":
        assert isinstance(module, nn.Linear)
        return module.in_features, module.out_features
    if kind == "conv1d":
        w = getattr(module, "weight")
        return int(w.shape[0]), int(w.shape[1])
    return None




def _fused(name: str, module: nn.Module) -> Optional[FusedColwiseParallel]:
    """The style of a fused q|k|v (out = 3 x in) or gate|up layer, split part by part."""
    parts = fused_parts(name)
    features = _features(module)
    if parts is None or features is None:
        return None
    d, out = features
    if parts == 3 and out != 3 * d:  # grouped-query q|k|v: parts of unequal size, split as a whole
        return None
    return FusedColwiseParallel(parts=parts, use_local_output=False)


def _expands_then_contracts(first: tuple[int, int], second: tuple[int, int]) -> bool:
    (d, hidden), (hidden2, d2) = first, second
    return hidden == hidden2 and d == d2 and hidden % d == 0 and hidden // d >= 2


@dataclass(frozen=True)
class MegatronPlanner(ShardingPlanner):
    """The built-in planner: Megatron tensor parallelism for standard transformer blocks.

    >>> class MLP(nn.Module):
    ...     def __init__(self) -> None:
    ...         super().__init__()
    ...         self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 8)
    >>> sorted(MegatronPlanner().build_plan(MLP()).plan.items())  # doctest: +NORMALIZE_WHITESPACE
    [('a', ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(dim=-1), use_local_output=False,
                           src_data_rank=0)),
     ('b', RowwiseParallel(input_layouts=None, output_layouts=Replicate(), use_local_output=False,
                           src_data_rank=0))]
    """

    def build_plan(self, module: nn.Module) -> ShardingPlan:
        if not isinstance(module, nn.Module):
            raise TypeError(f"MegatronPlanner.build_plan takes the nn.Module to plan, got {describe(module)}")
        colwise = ColwiseParallel(use_local_output=False)
        rowwise = RowwiseParallel(use_local_output=False)
        embedding = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=False)
        head = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)

        vocab = {m.num_embeddings for n, m in module.named_modules() if isinstance(m, nn.Embedding) and n.rsplit(".", 1)[-1] in _EMBEDDING}
        plan: dict[str, Sharder] = {}
        for path, m in module.named_modules():
            name = path.rsplit(".", 1)[-1]
            kind = module_kind(m)
            if kind == "embedding" and name in _EMBEDDING:
                plan[path] = embedding
            elif kind == "linear" and name in _HEAD and path not in plan:
                assert isinstance(m, nn.Linear)
                if not vocab or m.out_features in vocab:
                    plan[path] = head
            if kind is not None:
                continue
            if expert_parameters(m):  # a mixture of experts: split by whole experts
                plan[path] = ExpertParallel()
                continue
            prefix = f"{path}." if path else ""
            linears = [(n, c) for n, c in m.named_children() if _features(c) is not None]
            cols = [n for n, _ in linears if n in _COLWISE]
            rows = [n for n, _ in linears if n in _ROWWISE]
            if cols and rows:
                plan.update({prefix + n: _fused(n, c) or colwise for n, c in linears if n in cols})
                plan.update({prefix + n: rowwise for n in rows})
            elif len(linears) == 2:
                (n1, c1), (n2, c2) = linears
                f1, f2 = _features(c1), _features(c2)
                if f1 is not None and f2 is not None and _expands_then_contracts(f1, f2):
                    plan[prefix + n1] = colwise
                    plan[prefix + n2] = rowwise
        _plan_split_blocks(module, plan, colwise, rowwise)
        order = {path: i for i, (path, _) in enumerate(module.named_modules())}
        built = ShardingPlan(dict(sorted(plan.items(), key=lambda kv: order[kv[0]])))
        found = coverage(module, built)
        big = found.large_replicated()
        if found.replicated_matrix_share() > WARN_SHARE:
            names = ", ".join(f"{r.name} {list(r.shape)}" for r in big[:5]) + (f" and {len(big) - 5} more" if len(big) > 5 else "")
            warnings.warn(
                f"MegatronPlanner left {len(big)} large parameter(s) of {type(module).__name__} replicated on every "
                f"rank: {names} ({found.summary()}). Name them in a plan of your own (plan.coverage lists every "
                f"parameter) if they should be split", stacklevel=2)
        return dataclasses.replace(built, coverage=found)


# warn when replicated matrices (2+ dims) hold more than this share of the parameter bytes:
# a family whose layers were not recognised, not a position table
WARN_SHARE = 0.10

_ATTENTION_IN = frozenset({"q", "k", "v", "query", "key", "value", "q_proj", "k_proj", "v_proj", "wq", "wk", "wv"})


def _plan_split_blocks(module: nn.Module, plan: dict[str, Sharder], colwise: Sharder, rowwise: Sharder) -> None:
    """Blocks whose column and row layers sit in different submodules (BERT: attention.self.query/
    key/value, attention.output.dense, intermediate.dense, output.dense): in each element of a
    ModuleList that the pass by parent did not touch, read the linear layers in order as
    q/k/v (by name) then the attention output (same input width), and any layer expanding
    d -> k*d followed by one contracting back."""
    for path, m in module.named_modules():
        if not isinstance(m, nn.ModuleList):
            continue
        for i, block in enumerate(m):
            base = f"{path}.{i}" if path else str(i)
            linears = [(f"{base}.{n}", c, _features(c)) for n, c in block.named_modules() if n and _features(c) is not None]
            if not linears or any(p in plan for p, _, _ in linears):
                continue
            k = 0
            while k < len(linears):
                run = k
                while run < len(linears) and linears[run][0].rsplit(".", 1)[-1] in _ATTENTION_IN:
                    run += 1
                if run - k >= 2 and run < len(linears):
                    f_q, f_o = linears[k][2], linears[run][2]
                    if f_q is not None and f_o is not None and f_o[0] == f_q[1]:  # o reads what q writes
                        plan.update({p: colwise for p, _, _ in linears[k:run]})
                        plan[linears[run][0]] = rowwise
                        k = run + 1
                        continue
                if k + 1 < len(linears):
                    f1, f2 = linears[k][2], linears[k + 1][2]
                    if f1 is not None and f2 is not None and _expands_then_contracts(f1, f2):
                        plan[linears[k][0]] = colwise
                        plan[linears[k + 1][0]] = rowwise
                        k += 2
                        continue
                k += 1
