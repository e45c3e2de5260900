"""LinearRoberta: a post-norm bidirectional encoder with linear attention, and its task heads.

Heads: masked language modelling (tied decoder), sequence classification from the first real token (single-label,
multi-label or regression through ``problem_type``, as in Transformers), token classification and extractive
question answering.
"""

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
)
from transformers.utils import can_return_tuple

from .configuration_linear_roberta import LinearRobertaConfig
from .context_parallel import real_tokens_before, refuse_a_mean_over_one_rank, refuse_in_context_parallel
from .forward_arguments import LOSS_ARGUMENTS, check_extra_arguments
from .heads import PooledSequenceClassification, TextHead, TokenClassification, head_output
from .input_checks import token_embeddings
from .label_checks import check_token_labels
from .positional_absolute import build_absolute_position_embedding
from .positions import default_position_ids, given_position_ids, mask_as_bool
from .transformer_layer import Dropout
from .transformer_stack import LinearPreTrainedModel, LinearTransformerStack, base_model_output, check_segments


class LinearRobertaPreTrainedModel(LinearPreTrainedModel):
    config: LinearRobertaConfig
    config_class = LinearRobertaConfig
    base_model_prefix = "model"


class LinearRobertaModel(LinearRobertaPreTrainedModel):
    def __init__(self, config: LinearRobertaConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embedding = build_absolute_position_embedding(
            config.absolute_position_embedding,
            config.hidden_size,
            config.max_position_embeddings,
            token_std=config.initializer_range * config.embedding_multiplier,
        )
        # BERT's segment embedding; with one segment type (RoBERTa) there is none
        self.token_type_embeddings = (
            nn.Embedding(config.type_vocab_size, config.hidden_size) if config.type_vocab_size > 1 else None
        )
        self.embedding_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)
        self.stack = LinearTransformerStack(config, pre_norm=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        output_attentions=None,
        output_hidden_states=None,
        **kwargs,
    ) -> BaseModelOutput:
        """input_ids (B, N); attention_mask (B, N), 1 for tokens, 0 for padding. Positions count real tokens.
        ``output_attentions``: every layer's attention weights (B, H, N, N), computed by probing the layer (O(N^2),
        for analysis)."""
        check_extra_arguments(self, kwargs)
        check_segments(token_type_ids, self.config.type_vocab_size)
        hidden_states = token_embeddings(
            self.embed_tokens, input_ids, inputs_embeds, self.config.hidden_size, self.config.embedding_multiplier
        )
        batch_size, num_tokens = hidden_states.shape[:2]
        position_ids = given_position_ids(position_ids, batch_size, num_tokens)
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        mask = mask_as_bool(attention_mask, batch_size, num_tokens)
        given_positions = position_ids is not None
        if position_ids is None:
            past = real_tokens_before(mask, batch_size, num_tokens, hidden_states.device)  # 0 but in context_parallel
            position_ids = default_position_ids(mask, batch_size, num_tokens, hidden_states.device, past)
        if self.position_embedding is not None:
            hidden_states = hidden_states + self.position_embedding(position_ids).to(hidden_states.dtype)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros(batch_size, num_tokens, dtype=torch.long, device=hidden_states.device)
            hidden_states = hidden_states + self.token_type_embeddings(token_type_ids).to(hidden_states.dtype)
        hidden_states = self.dropout(self.embedding_norm(hidden_states))
        hidden_states, all_hidden_states, all_attentions = self.stack(
            hidden_states, mask, position_ids, None, output_hidden_states, given_positions, output_attentions
        )
        return base_model_output(BaseModelOutput, hidden_states, all_hidden_states, all_attentions)


class LinearRobertaForMaskedLM(TextHead, LinearRobertaPreTrainedModel):
    accepts_loss_kwargs = True  # the loss divides by the Trainer's num_items_in_batch
    _tied_weights_keys = {"lm_head.decoder.weight": "model.embed_tokens.weight"}
    loss_arguments = LOSS_ARGUMENTS

    def __init__(self, config: LinearRobertaConfig):
        super().__init__(config)
        self.model = LinearRobertaModel(config)
        self.lm_head = LinearRobertaLMHead(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head.decoder

    def set_output_embeddings(self, new_embeddings):
        self.lm_head.decoder = new_embeddings

    def refuse_split(self, labels, loss_arguments: dict):
        refuse_a_mean_over_one_rank(labels, loss_arguments.get("num_items_in_batch"), "the masked LM's loss")

    def head_outputs(self, outputs, labels, input_ids, attention_mask, **kwargs) -> MaskedLMOutput:
        """labels (B, N): token ids at masked positions, -100 elsewhere."""
        check_token_labels(labels, *outputs.last_hidden_state.shape[:2], type(self).__name__)
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return head_output(MaskedLMOutput, outputs, loss, logits=logits)


class LinearRobertaLMHead(nn.Module):
    """dense -> activation -> LayerNorm -> decoder tied to the input embeddings (+ bias)."""

    def __init__(self, config: LinearRobertaConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = ACT2FN[config.hidden_act]
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, hidden_states):
        return self.decoder(self.norm(self.activation(self.dense(hidden_states))))


class LinearRobertaClassificationHead(nn.Module):
    """RoBERTa's sentence head on the first real token: dropout, dense, tanh, dropout, out_proj.
    (B, hidden) -> (B, num_labels)."""

    def __init__(self, config: LinearRobertaConfig):
        super().__init__()
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, features):
        return self.out_proj(self.dropout(torch.tanh(self.dense(self.dropout(features)))))


class LinearRobertaForSequenceClassification(PooledSequenceClassification, LinearRobertaPreTrainedModel):
    """A RoBERTa-style head (dense, tanh, projection) on the first real token (``<s>``), wherever padding stands:
    left-padded batches classify as right-padded ones."""

    pooled = "first"

    def __init__(self, config: LinearRobertaConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = LinearRobertaModel(config)
        self.classifier = LinearRobertaClassificationHead(config)
        self.post_init()

    def classify(self, pooled):
        return self.classifier(pooled)


class LinearRobertaForTokenClassification(TokenClassification, LinearRobertaPreTrainedModel):
    def __init__(self, config: LinearRobertaConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = LinearRobertaModel(config)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def classify(self, hidden_states):
        return self.classifier(self.dropout(hidden_states))


class LinearRobertaForQuestionAnswering(TextHead, LinearRobertaPreTrainedModel):
    def __init__(self, config: LinearRobertaConfig):
        super().__init__(config)
        self.model = LinearRobertaModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        start_positions=None,
        end_positions=None,
        output_attentions=None,
        output_hidden_states=None,
        **kwargs,
    ) -> QuestionAnsweringModelOutput:
        """start_positions, end_positions (B,): the answer span's token indices."""
        check_extra_arguments(self, kwargs)
        refuse_in_context_parallel("question answering (its answer spans index the whole sequence)")
        outputs = self.base_outputs(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions,
            output_hidden_states,
        )  # fmt: skip
        start_logits, end_logits = self.qa_outputs(outputs.last_hidden_state).unbind(-1)
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = self.loss_function(start_logits, end_logits, start_positions, end_positions)
        return head_output(
            QuestionAnsweringModelOutput, outputs, loss, start_logits=start_logits, end_logits=end_logits
        )


LinearRobertaPreTrainedModel.auto_classes = {
    "AutoModel": LinearRobertaModel,
    "AutoModelForMaskedLM": LinearRobertaForMaskedLM,
    "AutoModelForSequenceClassification": LinearRobertaForSequenceClassification,
    "AutoModelForTokenClassification": LinearRobertaForTokenClassification,
    "AutoModelForQuestionAnswering": LinearRobertaForQuestionAnswering,
}
