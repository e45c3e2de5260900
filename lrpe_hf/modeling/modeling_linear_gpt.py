"""LinearGPT: a pre-norm decoder with causal linear attention, for language modelling and generation.

Generation keeps one recurrent state per layer (``LinearAttentionCache``): each new token costs the same
whatever the context length. Left-padded batches generate the same text as each prompt alone.
"""

import torch
from torch import nn
from transformers.generation import GenerationMixin
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
)
from transformers.utils import can_return_tuple

from .cache import LinearAttentionCache
from .configuration_linear_gpt import LinearGPTConfig
from .context_parallel import (
    active_group,
    real_tokens_before,
    refuse_a_mean_over_one_rank,
    refuse_in_context_parallel,
    tokens_through,
)
from .forward_arguments import CACHE_ARGUMENTS, CACHE_OUTPUT_FIELD, LOSS_ARGUMENTS, check_extra_arguments, take_cache
from .heads import PooledSequenceClassification
from .input_checks import token_embeddings
from .label_checks import check_token_labels
from .lm_loss import causal_lm_loss
from .positional_absolute import build_absolute_position_embedding
from .positions import (
    check_mask_against_cache,
    default_position_ids,
    given_position_ids,
    mask_as_bool,
)
from .transformer_layer import Dropout
from .transformer_stack import LinearPreTrainedModel, LinearTransformerStack, base_model_output, check_segments
from .weight_layout import lay_out_for_one_row_products


def default_positions(attention_mask, mask, real_past, hidden_states):
    """(B, N) positions counting each row's real tokens, from the cache's count (``real_past`` (B,)) or, for a
    slice of a sequence split over ranks, from the earlier slices' real tokens (else from 0); hidden_states
    (B, N, hidden) give the shape and device."""
    (batch_size, num_tokens), device = hidden_states.shape[:2], hidden_states.device
    if real_past is None:
        real_past = real_tokens_before(mask, batch_size, num_tokens, device)
    return default_position_ids(attention_mask, batch_size, num_tokens, device, real_past)


class LinearGPTPreTrainedModel(LinearPreTrainedModel):
    config: LinearGPTConfig
    config_class = LinearGPTConfig
    base_model_prefix = "model"
    _is_stateful = True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model builds its own recurrent cache


class LinearGPTModel(LinearGPTPreTrainedModel):
    def __init__(self, config: LinearGPTConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = build_absolute_position_embedding(
            config.absolute_position_embedding,
            config.hidden_size,
            config.max_position_embeddings,
            token_std=config.initializer_range * config.embedding_multiplier,
        )
        self.dropout = Dropout(config.hidden_dropout_prob)
        self.stack = LinearTransformerStack(config, pre_norm=True)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoding_layout = None  # the (device, dtype) the stack's weights were last laid out for
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def lay_out_for_decoding(self):
        """Lays the stack's projection weights out for one-row products on their device and dtype
        (``weight_layout``), once per device and dtype the model is on."""
        weight = self.embed_tokens.weight
        if self.decoding_layout != (weight.device, weight.dtype):
            lay_out_for_one_row_products(self.stack)
            self.decoding_layout = (weight.device, weight.dtype)

    def cache_for_call(self, past_key_values, use_cache, output_attentions):
        """The ``LinearAttentionCache`` this call reads and writes (the given one, or a new one where ``use_cache``
        asks), or None; refuses what cannot continue from it."""
        if use_cache is None:  # a slice of a sequence split over ranks (context_parallel) keeps a cache when asked
            use_cache = self.config.use_cache and not self.training and active_group() is None
        if isinstance(past_key_values, LinearAttentionCache) and past_key_values.is_initialized:
            refuse_in_context_parallel("a cache that has seen tokens (a split prefill starts from a new cache)")
        if past_key_values is not None and not isinstance(past_key_values, LinearAttentionCache):
            raise ValueError(
                f"LinearGPT keeps recurrent states in a LinearAttentionCache, got "
                f"{type(past_key_values).__name__}; pass past_key_values=None to start one"
            )
        if use_cache and past_key_values is None:
            past_key_values = LinearAttentionCache(self.config.num_hidden_layers)
        cache = past_key_values if use_cache else None
        if output_attentions and cache is not None and cache.is_initialized:
            raise ValueError(
                "output_attentions=True weighs every key for every query, and a recurrent cache keeps no past tokens "
                "to weigh: call the model on the whole sequence (use_cache=False or a new cache)"
            )
        return cache

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        past_key_values=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """input_ids (B, N); attention_mask (B, past + N) or (B, N), 1 for tokens, 0 for padding. The cache comes
        as ``past_key_values`` or, from transformers 5.24 on, ``cache``. ``output_attentions``: every layer's
        attention weights (B, H, N, N), computed by probing the layer (O(N^2), for analysis), in a call that
        starts from an empty cache."""
        past_key_values = take_cache(kwargs, past_key_values=past_key_values, cache=cache)
        check_extra_arguments(self, kwargs)
        check_segments(token_type_ids)
        hidden_states = token_embeddings(
            self.embed_tokens, input_ids, inputs_embeds, self.config.hidden_size, self.config.embedding_multiplier
        )
        batch_size, num_tokens = hidden_states.shape[:2]
        position_ids = given_position_ids(position_ids, batch_size, num_tokens)
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        cache = self.cache_for_call(past_key_values, use_cache, output_attentions)
        # Compiled, a step reads no Python count (the graph would be specialised on it, one per token): a mask's past
        # is checked against the first layer's per-row counters instead, from which default positions continue.
        past = 0 if cache is None else None if torch.compiler.is_compiling() else cache.seen_tokens
        real_past = cache.states[0].num_tokens if cache is not None else None  # (B,) real tokens seen per row
        if past and not torch.is_grad_enabled():  # eager decoding (a compiled step keeps its graph's layout)
            self.lay_out_for_decoding()
        mask = mask_as_bool(attention_mask, batch_size, num_tokens, past)
        if past is None:
            check_mask_against_cache(attention_mask, num_tokens, real_past)
        given_positions = position_ids is not None
        if position_ids is None:
            position_ids = default_positions(attention_mask, mask, real_past, hidden_states)
        if self.position_embedding is not None:
            hidden_states = hidden_states + self.position_embedding(position_ids).to(hidden_states.dtype)
        hidden_states = self.dropout(hidden_states)
        hidden_states, all_hidden_states, all_attentions = self.stack(
            hidden_states, mask, position_ids, cache, output_hidden_states, given_positions, output_attentions
        )
        hidden_states = self.norm(hidden_states)
        if cache is not None:  # split over ranks: the tokens of the slices up to this rank's
            cp = active_group()
            seen = num_tokens if cp is None else tokens_through(num_tokens, hidden_states.device, cp)
            cache.advance(seen, hidden_states.device)
        fields = {CACHE_OUTPUT_FIELD: cache}
        return base_model_output(BaseModelOutputWithPast, hidden_states, all_hidden_states, all_attentions, **fields)


# A recurrent state summarises every past token and cannot forget the last ones: the strategies that try tokens and
# roll back the rejected (assisted and prompt-lookup decoding, contrastive search) are refused by generate itself.
ROLLBACK_MODES = (GenerationMode.ASSISTED_GENERATION, GenerationMode.CONTRASTIVE_SEARCH)


class LinearGPTForCausalLM(LinearGPTPreTrainedModel, GenerationMixin):
    accepts_loss_kwargs = True  # the loss divides by the Trainer's num_items_in_batch
    _supported_generation_modes = tuple(mode.value for mode in GenerationMode if mode not in ROLLBACK_MODES)
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: LinearGPTConfig):
        super().__init__(config)
        self.model = LinearGPTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _prepare_position_ids_for_generation(self, inputs_tensor, model_kwargs):
        """None: ``generate`` leaves the positions to the model, whose defaults give every real token the position
        it would build (counted from the attention mask, or continued from the cache; padding, whose outputs are
        zero, may differ). Default positions only grow, so each step skips the search for packed documents, a
        data-dependent branch that would break a compiled step's graph. Positions passed to ``generate`` are still
        used."""
        return None

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        """transformers' preparation, less the positions it derives from the mask where the caller gave none
        (releases before ``_prepare_position_ids_for_generation`` derive them here), and one check of it: a step
        that feeds the model only the newest tokens must carry the cache that summarises the others. Without it the
        model would start afresh from those tokens and decode text with no context, silently (as a forward that
        misses a renamed cache argument would).

        A decoding step, one that feeds tokens ``generate`` itself appended (it then passes ``next_sequence_length``,
        and no ``is_first_iteration``, which its prompt's calls pass, continuing a cache or not) after a cache has
        taken the prompt, goes without the attention mask: generate's mask is ones for every token it appends, the
        prompt's padding is already summarised in the cache's state, and each row's positions continue from the
        real tokens the cache counted, as the mask would give them. The layers then take their every-token-real
        path, the one the benchmarks time (a mask, even of ones, takes the masked path: more ops per layer and
        step)."""
        given_positions = kwargs.get("position_ids") is not None
        uncached = kwargs.get("next_sequence_length")
        if kwargs.get("is_first_iteration") and uncached is not None and uncached <= 0:
            if input_ids.shape[1] == uncached:  # nothing cached: the prompt itself is empty
                raise ValueError(
                    f"generate got a prompt of {input_ids.shape[1]} tokens: generate needs a prompt of at least one "
                    "token (e.g. the bos_token_id) to start from"
                )
            raise ValueError(
                f"generate got {input_ids.shape[1]} tokens with a cache that has seen {input_ids.shape[1] - uncached}: "
                "to continue from a cache, pass the whole sequence it was built from followed by new tokens (the "
                "returned `sequences`), or only the new tokens with an attention mask over the whole sequence"
            )
        model_inputs = super().prepare_inputs_for_generation(input_ids, **kwargs)
        if not given_positions:
            model_inputs.pop("position_ids", None)
        step_ids = model_inputs.get("input_ids")
        cache = next((model_inputs[name] for name in CACHE_ARGUMENTS if model_inputs.get(name) is not None), None)
        if step_ids is not None and step_ids.shape[1] < input_ids.shape[1] and cache is None:
            raise RuntimeError(
                f"generate passed {step_ids.shape[1]} of the sequence's {input_ids.shape[1]} tokens without the cache "
                f"of the others (looked for {', '.join(CACHE_ARGUMENTS)}): this transformers release hands the cache "
                "over in a way this model does not know. Please report it with your transformers version."
            )
        appended = kwargs.get("next_sequence_length") is not None and not kwargs.get("is_first_iteration")
        if appended and isinstance(cache, LinearAttentionCache) and cache.has_seen_tokens:
            model_inputs.pop("attention_mask", None)
        if isinstance(cache, LinearAttentionCache) and cache.is_initialized:
            compiled = cache.steps_compiled or getattr(self.forward, "_torchdynamo_orig_callable", None) is not None
            if compiled:  # generate compiles the steps, or the user compiled the forward (torch.compile's wrapper)
                cache.make_static()  # states made or reordered outside the graph: static inputs (CUDA graphs hold)
        return model_inputs

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """transformers' checks of a given cache, then a new ``LinearAttentionCache`` where none was given and the
        cache is used: made before the prompt, so that ``generate`` sees the cache it may compile decoding for."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if model_kwargs.get(CACHE_OUTPUT_FIELD) is None and generation_config.use_cache is not False:
            model_kwargs[CACHE_OUTPUT_FIELD] = LinearAttentionCache(self.config.num_hidden_layers)

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        """Whether ``generate`` compiles the decoding steps (its prompt runs eagerly): only where asked, with a
        ``compile_config`` (``model.generation_config.compile_config = CompileConfig()``, or ``compile_config=`` to
        ``generate``), on the devices transformers compiles on, unless ``disable_compile``. The default stays eager
        (transformers would compile on every GPU) until compiled decoding has been measured on one. When it
        compiles, the cache makes its states static inputs before every step (``LinearAttentionCache.make_static``),
        so that CUDA graphs replay each step."""
        if generation_config.compile_config is None:
            return False
        compiles = super()._valid_auto_compile_criteria(model_kwargs, generation_config)
        cache = model_kwargs.get(CACHE_OUTPUT_FIELD)
        if compiles and isinstance(cache, LinearAttentionCache):
            cache.steps_compiled = True
        return compiles

    def create_masks_for_generate(self, attention_mask=None, **kwargs):
        """The 2D mask as given: ``generate`` asks a model with a compileable cache for the masks its layers read,
        and these layers read which tokens are real (B, past + N), not a 4D causal mask (a recurrent state has no
        key slots to mask)."""
        return attention_mask

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        past_key_values=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        logits_to_keep=0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """labels (B, N): the input ids (shifted inside the loss); -100 is ignored."""
        past_key_values = take_cache(kwargs, past_key_values=past_key_values, cache=cache)
        check_extra_arguments(self, kwargs, accepted=LOSS_ARGUMENTS)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        check_token_labels(labels, *outputs.last_hidden_state.shape[:2], type(self).__name__)
        if labels is not None and kwargs.get("shift_labels") is None:
            refuse_in_context_parallel("labels shifted here: pass shift_labels, shifted over the whole sequence")
        refuse_a_mean_over_one_rank(labels, kwargs.get("num_items_in_batch"), "the causal LM's loss")
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        hidden = outputs.last_hidden_state[:, keep]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            # Transformers' hook when the user set one (model.loss_function = fn, or another config.loss_type);
            # otherwise the same loss as its ForCausalLMLoss, without full-size temporaries: from a plain linear
            # head, backward recomputes the logits in blocks, so a caller who drops them frees them before backward
            custom = hasattr(self, "_loss_function") or getattr(self, "loss_type", None) != "ForCausalLM"
            if custom:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            else:
                head = self.lm_head
                plain_head = type(head) is nn.Linear and head.bias is None
                head_input = dict(hidden=hidden, weight=head.weight) if plain_head else {}
                loss = causal_lm_loss(logits, labels, self.config.vocab_size, **head_input, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{CACHE_OUTPUT_FIELD: getattr(outputs, CACHE_OUTPUT_FIELD)},
        )


class LinearGPTForSequenceClassification(PooledSequenceClassification, LinearGPTPreTrainedModel):
    """Classifies from the last real token (the last position of the attention mask, or the last non-pad token)."""

    pooled = "last"
    output_type = SequenceClassifierOutputWithPast
    base_model_keywords = {"use_cache": False}

    def __init__(self, config: LinearGPTConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = LinearGPTModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def classify(self, pooled):
        return self.score(pooled)


LinearGPTPreTrainedModel.auto_classes = {
    "AutoModel": LinearGPTModel,
    "AutoModelForCausalLM": LinearGPTForCausalLM,
    "AutoModelForSequenceClassification": LinearGPTForSequenceClassification,
}
