"""The names a pipeline's tensors have in the model it was cut from.

`hf_sequential(model)` reuses a Hugging Face model's own modules under new names
(`layer3.layer.mlp.up_proj.weight` for `model.layers.3.mlp.up_proj.weight`), and
`DistributedPipe` renames them again (`partitions.1.layer3...`). A checkpoint of the
model (`model.safetensors`) is keyed by the model's names, so `checkpoint.load_pretrained`
asks `source_names(module)` how to translate. The record is made by looking modules up
by identity, so a tied weight keeps the name of the module that holds it (`lm_head.weight`,
not the embedding it is tied to).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

__all__: list[str] = []


@dataclass(frozen=True)
class SourceNames:
    """`names`: a state-dict key of the module -> the source model's key for the same tensor;
    `keys`: every state-dict key of the whole source model (what its checkpoint may hold);
    `model`: the source model, weakly (its tied weights, ignore lists and `_init_weights`)."""

    names: Mapping[str, str]
    keys: frozenset[str]
    model: "weakref.ReferenceType[nn.Module]"

    def source_model(self) -> Optional[nn.Module]:
        return self.model()

    def renamed(self, names: Mapping[str, str]) -> "SourceNames":
        return SourceNames(dict(names), self.keys, self.model)


_ATTRIBUTE = "_shardwise_source_names"


def record_source(module: nn.Module, model: nn.Module) -> None:
    """Record on `module` (made of `model`'s own modules) each of its state-dict keys' name in `model`."""
    where: dict[int, str] = {}
    for name, sub in model.named_modules(remove_duplicate=False):
        where.setdefault(id(sub), name)
    names: dict[str, str] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        home = where.get(id(sub))
        if home is None:
            continue
        for leaf in sub.state_dict(keep_vars=True):
            key = f"{prefix}.{leaf}" if prefix else leaf
            names.setdefault(key, f"{home}.{leaf}" if home else leaf)
    object.__setattr__(module, _ATTRIBUTE, SourceNames(names, frozenset(model.state_dict(keep_vars=True)),
                                                       weakref.ref(model)))


def carry_source(module: nn.Module, to: nn.Module, prefix_of: Mapping[str, str]) -> None:
    """Give `to` the record of `module` with `to`'s keys: `prefix_of` maps a prefix in `to`'s
    state dict (`partitions.1.`) to the prefix of the same tensors in `module` (``)."""
    source = source_names(module)
    if source is None:
        return
    names: dict[str, str] = {}
    for key in to.state_dict(keep_vars=True):
        for mine, theirs in prefix_of.items():
            if key.startswith(mine) and theirs + key[len(mine):] in source.names:
                names[key] = source.names[theirs + key[len(mine):]]
                break
    object.__setattr__(to, _ATTRIBUTE, source.renamed(names))


def source_names(module: Any) -> Optional[SourceNames]:
    found = getattr(module, _ATTRIBUTE, None)
    return found if isinstance(found, SourceNames) else None
