"""Fused projections: one layer computing several projections side by side, which the model then cuts apart.

GPT-2's `c_attn` and Phi-3's `qkv_proj` compute q|k|v in one matmul, Phi-3's `gate_up_proj`
gate|up; the model splits the output by the parts' *global* sizes (`qkv[..., :q_size]`,
`chunk(2)`). Such a layer is known by its name (the names models use for it).
`MegatronPlanner` splits these part by part (`FusedColwiseParallel`); a plain column split
with local outputs is refused (`ColwiseParallel.validate_at`), since each rank would then
cut its own contiguous slice of the whole as if it were the whole.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["FUSED_PARTS", "fused_parts"]

# layer name -> how many projections it fuses
# (GPT-NeoX's `query_key_value` interleaves q, k, v head by head: a column split keeps heads whole)
FUSED_PARTS = {"c_attn": 3, "qkv": 3, "qkv_proj": 3, "Wqkv": 3, "gate_up_proj": 2}


def fused_parts(path: str) -> Optional[int]:
    """How many projections the layer at `path` (a module path or name) fuses, or None."""
    return FUSED_PARTS.get(path.rpartition(".")[2])
