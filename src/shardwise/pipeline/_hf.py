"""Hugging Face models as layers for a pipeline: `hf_sequential(model)` and `hf_loss(model)`.

A pipeline cuts an `nn.Sequential`, but an HF model's forward is one function that makes
position ids, attention masks (causal, sliding-window per layer, padding) and rotary
tables once and hands them to every layer. `hf_sequential` returns the model's own
modules (the same parameters, nothing copied) as a sequence of layers that each rebuild
what their block needs from what travels between stages, the way the model's forward
builds it:

- decoder-only language models (Llama, Mistral, Mixtral, Phi-3, Qwen2, Qwen3; GPT-2):
  `[embeddings, block 0, ..., block n-1, head]`. The input is `input_ids` or
  `(input_ids, attention_mask)`; between layers travels the hidden state (with the 2-D
  padding mask when one was given); each block makes its position ids, its mask (with
  the sliding window its layer type or config gives) and its rotary table; the head
  applies the final norm and the LM head, giving the logits.
- T5 (`T5ForConditionalGeneration`): `[encoder embeddings, encoder blocks..., bridge,
  decoder blocks..., head]`. The input is `(input_ids, decoder_input_ids)` or
  `(input_ids, decoder_input_ids, attention_mask)` (`decoder_input_ids =
  model.prepare_decoder_input_ids_from_labels(labels)`); the relative position bias made
  by the first block of each stack travels with the hidden state to the later blocks, and
  the bridge turns the encoder's output into the decoder's input while the encoder output
  travels on to every decoder block's cross-attention.

Rebuilding a mask or a rotary table per block costs a little compute and saves sending
it; the relative position bias is sent because it carries a gradient. Embeddings tied to
the LM head (GPT-2, T5) end up on two stages; `DistributedPipe` sums such a shared
parameter's gradient over the stages holding it, so every copy steps alike.

`hf_loss(model)` is the model's own loss on `(logits, labels)`: its `loss_function` for
causal LMs (labels shifted inside, -100 ignored, a mean over the micro-batch's tokens;
under context parallelism the pipe shifts them over the whole sequence first, as the
function's `shifts_labels` asks),
cross-entropy over every position for T5. Other architectures raise `TypeError`: a
hand-written cut that misses part of a model's forward is silently wrong, so only the
forwards mirrored here (and tested against the whole model) are offered.
"""

from __future__ import annotations

import functools
import inspect
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor, nn

from .._describe import describe
from .._source_names import record_source
from ..parallel._context_parallel import current_cp_attention

__all__ = ["hf_loss", "hf_sequential"]

# how each decoder-only family picks a layer's mask, as its model's forward does
_BY_LAYER_TYPE = {"qwen2", "qwen3"}  # config.layer_types[i]: "full_attention" or "sliding_attention"
_BY_SLIDING_WINDOW = {"mistral", "mixtral", "phi3"}  # every layer sliding when config.sliding_window is set
_CAUSAL_ONLY = {"llama"}
_DECODERS = _BY_LAYER_TYPE | _BY_SLIDING_WINDOW | _CAUSAL_ONLY


def _masks() -> Any:
    from transformers import masking_utils  # the model is an HF model, so transformers is installed
    return masking_utils


def _model_type(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", "")) if config is not None else ""


def hf_sequential(model: nn.Module) -> nn.Sequential:
    """`model` (an HF causal LM or `T5ForConditionalGeneration`) as an `nn.Sequential` of its
    own modules for `DistributedPipe` / `Pipe`; see the module docstring for what each layer
    takes and gives. Its output is the logits, as `model(...).logits`. It remembers each
    tensor's name in `model`, so `checkpoint.load_pretrained(pipe, path)` fills a pipeline's
    stages from the model's checkpoint."""
    layers = _cut(model)
    record_source(layers, model)
    return layers


def _cut(model: nn.Module) -> nn.Sequential:
    kind = _model_type(model)
    model_: Any = model  # an HF model: its parts are found by name
    if kind in _DECODERS and hasattr(model, "model") and hasattr(model, "lm_head"):
        base = model_.model
        layers: list[tuple[str, nn.Module]] = [("embed", _Embed(base.embed_tokens))]
        for i, layer in enumerate(base.layers[: base.config.num_hidden_layers]):
            layers.append((f"layer{i}", _DecoderLayer(layer, i, base, kind)))
        layers.append(("head", _Head(base.norm, model_.lm_head)))
        return nn.Sequential(OrderedDict(layers))
    if kind == "gpt2" and hasattr(model, "transformer") and hasattr(model, "lm_head"):
        body = model_.transformer
        layers = [("embed", _GPT2Embed(body))]
        layers += [(f"block{i}", _GPT2Block(block, body.config)) for i, block in enumerate(body.h)]
        layers.append(("head", _Head(body.ln_f, model_.lm_head)))
        return nn.Sequential(OrderedDict(layers))
    if kind == "t5" and hasattr(model, "encoder") and hasattr(model, "decoder") and hasattr(model, "lm_head"):
        enc, dec = model_.encoder, model_.decoder
        layers = [("embed", _T5Embed(enc))]
        layers += [(f"encoder{i}", _T5EncoderBlock(block, enc.config)) for i, block in enumerate(enc.block)]
        layers.append(("bridge", _T5Bridge(enc, dec)))
        layers += [(f"decoder{i}", _T5DecoderBlock(block, dec.config)) for i, block in enumerate(dec.block)]
        layers.append(("head", _T5Head(dec, model_.lm_head, model_.config)))
        return nn.Sequential(OrderedDict(layers))
    raise TypeError(
        f"hf_sequential cuts causal LMs of the {sorted(_DECODERS | {'gpt2'})} families and T5ForConditionalGeneration, "
        f"whose forwards it mirrors; got {describe(model)} (model_type {kind!r}). Write the layers yourself "
        "as an nn.Sequential (checking them against the whole model), or ask for this architecture")


def hf_loss(model: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    """`loss_fn(logits, labels)` for `DistributedPipe`: the loss `model(..., labels=labels)` computes."""
    kind = _model_type(model)
    if kind == "t5":
        def seq2seq_loss(logits: Tensor, labels: Tensor) -> Tensor:
            return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)
        return seq2seq_loss
    if kind in _DECODERS or kind == "gpt2":
        vocab_size = model.config.vocab_size  # type: ignore[union-attr]
        loss_function: Callable[..., Tensor] = model.loss_function  # type: ignore[assignment]

        def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
            if current_cp_attention() is not None:  # the pipe shifted the labels over the whole sequence
                return loss_function(logits=logits, labels=labels, vocab_size=vocab_size, shift_labels=labels)
            return loss_function(logits=logits, labels=labels, vocab_size=vocab_size)
        causal_lm_loss.shifts_labels = True  # type: ignore[attr-defined]
        return causal_lm_loss
    raise TypeError(f"hf_loss knows the losses of the models hf_sequential cuts; got {describe(model)} "
                    f"(model_type {kind!r})")


# -- decoder-only -------------------------------------------------------------------------------

def _split(value: Any) -> tuple[Tensor, Optional[Tensor]]:
    """(tensor, 2-D padding mask or None) from what travels between layers."""
    if isinstance(value, Tensor):
        return value, None
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], Tensor):
        return value[0], value[1]
    raise TypeError(f"expected input_ids (or the hidden state) or a pair with the attention mask, got "
                    f"{type(value).__name__} of {len(value) if isinstance(value, tuple) else 1}")


def _join(hidden: Tensor, mask: Optional[Tensor], like: Any) -> Any:
    return hidden if isinstance(like, Tensor) else (hidden, mask)


def _positions(hidden: Tensor) -> Tensor:
    """(1, tokens) positions of the tokens `hidden` holds: under context parallelism
    (`DistributedPipe(..., cp_dim=)`), this rank's tokens' places in the whole sequence."""
    cp = current_cp_attention()
    if cp is not None:
        return cp.layout.index(cp.cp.rank, hidden.device).unsqueeze(0)
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


@functools.lru_cache(maxsize=None)
def _no_cache(make: Callable[..., Any]) -> dict[str, None]:
    """`make`'s argument for "no cache": `cache=None` (transformers 5.2x) or `past_key_values=None` (before)."""
    return {"cache": None} if "cache" in inspect.signature(make).parameters else {"past_key_values": None}


def _causal_mask(make: Callable[..., Any], config: Any, hidden: Tensor, padding: Optional[Tensor],
                 positions: Tensor) -> Any:
    """The mask the model's forward would make; under context parallelism none: causal
    attention, which context-parallel attention applies by global position (with the layer's
    sliding window, which it reads from the attention module)."""
    if current_cp_attention() is None:
        return make(config=config, inputs_embeds=hidden, attention_mask=padding, position_ids=positions,
                    **_no_cache(make))
    if padding is not None:
        raise ValueError("a context-parallel pipeline runs causal attention over whole sequences: an "
                         "attention_mask (padding) cannot be split with the sequence; pack documents without padding")
    return None


class _Embed(nn.Module):
    embed_tokens: Any

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, value: Any) -> Any:
        ids, mask = _split(value)
        return _join(self.embed_tokens(ids), mask, value)


class _DecoderLayer(nn.Module):
    """One decoder layer with the mask and rotary table the model's forward would give it."""

    layer: Any
    rotary_emb: Any

    def __init__(self, layer: nn.Module, index: int, base: Any, kind: str) -> None:
        super().__init__()
        self.layer, self.rotary_emb = layer, base.rotary_emb
        self.index, self.config = index, base.config
        if kind in _BY_LAYER_TYPE:
            self.sliding = self.config.layer_types[index] == "sliding_attention"
        else:
            self.sliding = kind in _BY_SLIDING_WINDOW and getattr(self.config, "sliding_window", None) is not None

    def forward(self, value: Any) -> Any:
        hidden, padding = _split(value)
        positions = _positions(hidden)
        masks = _masks()
        make = masks.create_sliding_window_causal_mask if self.sliding else masks.create_causal_mask
        mask = _causal_mask(make, self.config, hidden, padding, positions)
        out = self.layer(hidden, attention_mask=mask, position_ids=positions, use_cache=False,
                         position_embeddings=self.rotary_emb(hidden, position_ids=positions))
        return _join(out[0] if isinstance(out, tuple) else out, padding, value)

    def extra_repr(self) -> str:
        return f"index={self.index}, sliding={self.sliding}"


class _Head(nn.Module):
    norm: Any
    lm_head: Any

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, value: Any) -> Tensor:
        logits: Tensor = self.lm_head(self.norm(_split(value)[0]))
        return logits


class _GPT2Embed(nn.Module):
    wte: Any
    wpe: Any
    drop: Any

    def __init__(self, body: Any) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = body.wte, body.wpe, body.drop

    def forward(self, value: Any) -> Any:
        ids, mask = _split(value)
        embeds = self.wte(ids)
        return _join(self.drop(embeds + self.wpe(_positions(embeds))), mask, value)


class _GPT2Block(nn.Module):
    block: Any

    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__()
        self.block, self.config = block, config

    def forward(self, value: Any) -> Any:
        hidden, padding = _split(value)
        positions = _positions(hidden)
        mask = _causal_mask(_masks().create_causal_mask, self.config, hidden, padding, positions)
        out = self.block(hidden, None, mask, None, encoder_attention_mask=None, use_cache=False,
                         position_ids=positions)
        return _join(out[0] if isinstance(out, tuple) else out, padding, value)


# -- T5 -----------------------------------------------------------------------------------------
# encoder layers carry (hidden, position bias or None, decoder_input_ids, padding or None);
# decoder layers (hidden, position bias, cross position bias, encoder output, padding)

def _t5_input(value: Any) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    if isinstance(value, tuple) and len(value) in (2, 3) and all(isinstance(v, Tensor) for v in value[:2]):
        return value[0], value[1], value[2] if len(value) == 3 else None
    raise TypeError("a T5 pipeline takes (input_ids, decoder_input_ids) or (input_ids, decoder_input_ids, "
                    "attention_mask), with decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels); "
                    f"got {type(value).__name__}")


class _T5Embed(nn.Module):
    embed_tokens: Any
    dropout: Any

    def __init__(self, encoder: Any) -> None:
        super().__init__()
        self.embed_tokens, self.dropout = encoder.embed_tokens, encoder.dropout

    def forward(self, value: Any) -> tuple[Any, ...]:
        ids, decoder_ids, padding = _t5_input(value)
        return self.dropout(self.embed_tokens(ids)), None, decoder_ids, padding


class _T5EncoderBlock(nn.Module):
    block: Any

    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__()
        self.block, self.config = block, config

    def forward(self, value: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden, bias, decoder_ids, padding = value
        mask = _masks().create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=padding)
        hidden, bias, _ = self.block(hidden, mask, bias, None, None, None)
        return hidden, bias, decoder_ids, padding


class _T5Bridge(nn.Module):
    """The encoder's final norm and dropout, then the decoder's embeddings."""

    final_layer_norm: Any
    dropout: Any
    embed_tokens: Any
    decoder_dropout: Any

    def __init__(self, encoder: Any, decoder: Any) -> None:
        super().__init__()
        self.final_layer_norm, self.dropout = encoder.final_layer_norm, encoder.dropout
        self.embed_tokens, self.decoder_dropout = decoder.embed_tokens, decoder.dropout

    def forward(self, value: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden, _, decoder_ids, padding = value
        encoded = self.dropout(self.final_layer_norm(hidden))
        return self.decoder_dropout(self.embed_tokens(decoder_ids)), None, None, encoded, padding


class _T5DecoderBlock(nn.Module):
    block: Any

    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__()
        self.block, self.config = block, config

    def forward(self, value: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden, bias, cross_bias, encoded, padding = value
        masks = _masks()
        mask = masks.create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                        **_no_cache(masks.create_causal_mask))
        cross_mask = masks.create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=padding,
                                                     encoder_hidden_states=encoded)
        hidden, bias, cross_bias = self.block(hidden, mask, bias, encoded, cross_mask, cross_bias)
        return hidden, bias, cross_bias, encoded, padding


class _T5Head(nn.Module):
    final_layer_norm: Any
    dropout: Any
    lm_head: Any

    def __init__(self, decoder: Any, lm_head: nn.Module, config: Any) -> None:
        super().__init__()
        self.final_layer_norm, self.dropout, self.lm_head = decoder.final_layer_norm, decoder.dropout, lm_head
        self.scale = config.d_model ** -0.5 if getattr(config, "scale_decoder_outputs", False) else None

    def forward(self, value: tuple[Any, ...]) -> Tensor:
        hidden = self.dropout(self.final_layer_norm(value[0]))
        logits: Tensor = self.lm_head(hidden * self.scale if self.scale is not None else hidden)
        return logits
