"""The stack of layers shared by the three families, and the weight initialisation they share.

The stack owns what its layers share: the codes an encoding shares across layers (SPE's kernels: one set for
every layer, one draw per forward) and the redraw of random features (once per training step, before any layer
runs, so that gradient checkpointing replays the same features). The attention options are built once here.
"""

import re
from dataclasses import replace

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init

from .attention_inputs import LayerCall
from .context_parallel import active_group, incoming_counters, refuse_packed_bidirectional_rows
from .positions import check_values, find_documents
from .registry import build_shared_codes
from .reinitialisable import Reinitialisable
from .softmax_attention import IMPLEMENTATIONS
from .transformer_layer import LinearTransformerLayer


class LinearTransformerStack(nn.Module):
    def __init__(self, config, pre_norm: bool):
        super().__init__()
        options = config.attention_options()
        self.layers = nn.ModuleList(
            [
                LinearTransformerLayer(config, replace(options, layer_index=index), pre_norm)
                for index in range(config.num_hidden_layers)
            ]
        )
        head_dim = config.hidden_size // config.num_attention_heads
        self.shared_codes = build_shared_codes(options, config.num_attention_heads, head_dim)

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        cache=None,
        output_hidden_states=False,
        given_positions=True,
        output_attentions=False,
    ):
        """hidden_states (B, N, hidden); attention_mask (B, N) bool or None; position_ids (B, N) or (B, N, 2);
        ``given_positions``: the caller's own position_ids, which may restart (packed rows), not the defaults, which
        only grow (``find_documents``). Returns the last hidden states and, if asked, the input of every layer and
        every layer's attention weights (B, H, N, N)."""
        if self.training:
            for layer in self.layers:
                layer.self_attn.redraw_random_features()
        positions = (position_ids[..., None] if position_ids.dim() == 2 else position_ids).expand(
            hidden_states.shape[0], -1, -1
        )  # (B, N, A)
        consecutive = not given_positions and attention_mask is None and position_ids.dim() == 2
        cp = active_group()
        shared_draw = self.draw_shared_codes(positions, cache, given_positions, consecutive, hidden_states.device)
        # The shared tables go to every layer as positional tensors too, so that gradient checkpointing (reentrant
        # included) sees them as inputs of each layer.
        shared_tables = shared_draw.tables() if shared_draw is not None and hasattr(shared_draw, "tables") else []
        documents, counters = self.documents_and_counters(positions, attention_mask, cache, given_positions)
        softmax_implementation = self.layers[0].config._attn_implementation  # read now: it can change after building
        plain = self.is_plain_call(positions, cache, given_positions, output_attentions)
        call = LayerCall(documents, consecutive, counters, False, softmax_implementation, positions if plain else None)
        all_hidden_states = [] if output_hidden_states else None
        all_attentions = [] if output_attentions else None
        short_steps = self.is_short_step(hidden_states, attention_mask, cache, given_positions, output_attentions)
        for index, layer in enumerate(self.layers):
            if output_hidden_states:
                all_hidden_states.append(hidden_states)
            if output_attentions:
                all_attentions.append(layer.attention_weights(hidden_states, attention_mask, position_ids, shared_draw))
            state = cache.states[index] if cache is not None else None
            if short_steps and layer.takes_short_steps():
                hidden_states = layer.decoding_step(hidden_states, state, positions)
                continue
            hidden_states = layer(
                hidden_states,
                *shared_tables,
                attention_mask=attention_mask,
                position_ids=position_ids,
                state=state,
                shared_draw=shared_draw,
                call=call,
                context_group=cp,
            )
        if cache is not None:  # every layer saw these tokens: their counters advance once, after all have read them
            if documents is None:
                raise ValueError("A recurrent cache continues 1D positions: position_ids of shape (batch, tokens)")
            cache.count(positions.long(), attention_mask, documents[1])
        return hidden_states, all_hidden_states, all_attentions

    @staticmethod
    def is_plain_call(positions, cache, given_positions: bool, output_attentions) -> bool:
        """Whether this call is a plain one, decided once for every layer: no cache, default 1D positions (a row is
        one document), no attention weights, no context parallelism and no global module hooks (which the plain road
        would pass by on the attention path), and a batch of rows (an empty one has nothing to attend: the general
        road says so). Its layers then attend by their plain road where they can (``LinearAttention.takes_plain_road``),
        with or without padding, in training as in evaluation."""
        return (
            cache is None
            and positions.shape[0] > 0
            and not given_positions
            and not output_attentions
            and positions.shape[-1] == 1
            and active_group() is None
            and not (nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)
        )

    def is_short_step(self, hidden_states, attention_mask, cache, given_positions: bool, output_attentions) -> bool:
        """Whether this call is the common decoding step, decided once for every layer: one token after a cache that
        has seen a call, at the default positions, without a mask (``generate``'s steps), attention weights,
        gradient, training, context parallelism or global module hooks (compiled too: its graph is then the short
        step's). Its layers then take their short step where they can (``LinearTransformerLayer.takes_short_steps``);
        the others their forward."""
        return (
            cache is not None
            and hidden_states.shape[1] == 1
            and attention_mask is None
            and not given_positions
            and not output_attentions
            and not self.training
            and not torch.is_grad_enabled()
            and cache.is_initialized
            and active_group() is None
            and not (nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)
        )

    def draw_shared_codes(self, positions, cache, given_positions: bool, consecutive: bool, device):
        """This forward's draw of the codes every layer shares (SPE), prepared for positions (B, N, A), or None."""
        if self.shared_codes is None:
            return None
        shared_draw = self.shared_codes.draw(device)
        fresh = cache is None or not cache.is_initialized
        if not given_positions and fresh and active_group() is None and positions.shape[-1] == 1:  # defaults from 0
            shared_draw.default_positions = (positions.shape[1], consecutive)
        if positions.shape[0]:  # an empty batch has no positions to prepare codes for
            self.shared_codes.prepare(shared_draw, positions.long())
        return shared_draw

    def documents_and_counters(self, positions, attention_mask, cache, given_positions: bool):
        """What every layer reads alike, found once: packed rows' documents ((starts, documents) (B, N) each, or None
        for 2D positions) and, inside ``context_parallel``, the earlier ranks' position counters (or None)."""
        if positions.shape[-1] != 1:
            return None, None
        cp = active_group()
        counters = None
        if cp is not None:
            B, N = positions.shape[:2]
            given = positions if given_positions else None
            counters = incoming_counters(given, attention_mask, B, N, positions.device, cp)
        first_state = counters if counters is not None else cache.states[0] if cache is not None else None
        documents = find_documents(positions, attention_mask, first_state, given_positions)
        if counters is not None and given_positions and not self.layers[0].self_attn.options.causal:
            refuse_packed_bidirectional_rows(documents[0], positions.device, cp)
        return documents, counters


def base_model_output(output_type, hidden_states, all_hidden_states, all_attentions, **fields):
    """A base model's ``output_type`` record: the last hidden states (B, N, hidden); every layer's input and the last
    hidden states where they were asked for (``all_hidden_states``, the stack's, None otherwise); every layer's
    attention weights where they were asked for; and ``fields`` (the pooled output, the cache)."""
    if all_hidden_states is not None:
        all_hidden_states = tuple(all_hidden_states) + (hidden_states,)
    attentions = tuple(all_attentions) if all_attentions is not None else None
    return output_type(
        last_hidden_state=hidden_states, hidden_states=all_hidden_states, attentions=attentions, **fields
    )


def check_segments(token_type_ids, type_vocab_size: int = 1):
    """token_type_ids (B, N) must name one of the model's ``type_vocab_size`` segment types. With one (RoBERTa,
    LinearGPT) the model has no segment embedding: all-zero token_type_ids are accepted, others refused."""
    if token_type_ids is None:
        return
    if type_vocab_size == 1 and bool(token_type_ids.ne(0).any()):
        raise ValueError(
            "This model has no token type embeddings (one segment type, as RoBERTa): token_type_ids must be all zeros "
            "or left out; sentence pairs are told apart by the separator tokens. A tokenizer that gives the second "
            "sentence token type 1 (BERT's) needs a model with type_vocab_size=2 (as linearize makes from BERT)"
        )
    check_values(
        (token_type_ids >= 0) & (token_type_ids < type_vocab_size),
        f"token_type_ids must lie in [0, {type_vocab_size}) (the model's type_vocab_size)",
    )


SEPARATE_PROJECTION = re.compile(r"self_attn\.[qkv]_proj\.")


class LinearPreTrainedModel(PreTrainedModel):
    """Weight initialisation and capabilities shared by the three families."""

    supports_gradient_checkpointing = True
    # The Trainer passes num_items_in_batch only to a model that says it divides its loss by it (the LM heads), and
    # divides the other losses by the gradient-accumulation steps itself.
    accepts_loss_kwargs = False
    _no_split_modules = ["LinearTransformerLayer"]
    # Auto class name -> model class, set by each family after its models: registered on ``import lrpe_hf``, and
    # listed in every saved checkpoint's auto_map, so that a checkpoint of any head loads as any other where lrpe_hf
    # is not installed.
    auto_classes: dict = {}

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' ``save_pretrained``; a model registered for remote code (``register_for_auto_class``)
        writes an ``auto_map`` that names every Auto class of its family, not only its own, so that a checkpoint
        saved as one head (masked LM, say) loads as the others (``AutoModel``, a classifier) with
        ``trust_remote_code=True``."""
        if self._auto_class is not None:
            family = {
                name: f"{cls.__module__.split('.')[-1]}.{cls.__name__}" for name, cls in self.auto_classes.items()
            }
            self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **family}
        return super().save_pretrained(save_directory, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, *args, output_loading_info: bool = False, **kwargs):
        """transformers' ``from_pretrained``, refusing a checkpoint whose attention has q, k and v projections of
        their own (``q_proj``, ``k_proj``, ``v_proj``: how checkpoints were saved before they were joined into
        ``qkv_proj``), which would otherwise load with ``qkv_proj`` drawn at random."""
        model, loading_info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        separate = sorted({key for key in loading_info["unexpected_keys"] if SEPARATE_PROJECTION.search(key)})
        if separate:
            raise ValueError(
                f"This checkpoint keeps q, k and v in projections of their own ({', '.join(separate[:3])}, ...): it "
                "was saved before they were joined into one, qkv_proj. Load it with the model code saved beside it "
                "(trust_remote_code=True), or join each layer's q_proj, k_proj and v_proj weights (and biases) in "
                "that order along dim 0 into qkv_proj in its state dict, then load that"
            )
        return (model, loading_info) if output_loading_info else model

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        """What transformers' ``attn_implementation`` means here (``from_pretrained(..., attn_implementation=...)``,
        ``set_attn_implementation``). Linear attention (``attention="linear"``) forms no softmax: its one
        implementation is the layer's own, "eager"; the kernels of its causal product are the config's
        ``kernel_backend``. The softmax baseline (``attention="softmax"``) runs "sdpa" (the default) or "eager".
        Anything else raises, saying so."""
        valid = ("eager",) if self.config.attention == "linear" else IMPLEMENTATIONS
        if attn_implementation is None:
            return valid[0]
        if attn_implementation in valid:
            return attn_implementation
        if self.config.attention == "linear":
            raise ValueError(
                f"attn_implementation={attn_implementation!r} does not apply to linear attention (attention='linear'), "
                "which forms no softmax: its one implementation is the model's own, 'eager' (the default). The "
                "kernels of its causal product are chosen by the config field kernel_backend: 'auto' (fla's Triton "
                "kernels for CUDA tensors where fla-core is installed, torch otherwise), 'torch' or 'triton'. For "
                "softmax attention, build the model with attention='softmax', which runs 'sdpa' or 'eager'."
            )
        raise ValueError(
            f"attn_implementation={attn_implementation!r} is not available here: the softmax attention of these models "
            f"runs {' or '.join(map(repr, IMPLEMENTATIONS))} ('sdpa', the default, picks PyTorch's flash or "
            "memory-efficient kernels on a GPU)"
        )

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            if module.weight is not None:
                init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Conv2d):  # LinearViT's patch projection
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, Reinitialisable):  # encodings, feature maps, P matrices, SPE kernels
            module.reset_parameters()
