"""What the families' task heads share, written once (as transformers' generic heads are).

- ``TextHead``: the forward of a text head (the inputs' checks, the base model's call), which hands the base
  model's outputs to the head's own ``head_outputs``.
- ``PooledSequenceClassification``: the whole forward of a head that classifies one real token per row; LinearGPT
  pools the last real token, LinearRoberta the first (``pooled``), each with its own classifier (``classify``).
- ``TokenClassification``: the whole forward of a head that classifies every token (``classify``), its loss over
  the Trainer's ``num_items_in_batch``.
- ``classification_loss`` and ``head_output``: the loss transformers picks by ``problem_type`` (single-label,
  multi-label or regression) and the output record with the base model's hidden states and attentions, which
  LinearViT's image classification shares.
"""

import torch
from transformers.modeling_outputs import SequenceClassifierOutput, TokenClassifierOutput
from transformers.utils import can_return_tuple

from .context_parallel import refuse_a_mean_over_one_rank, refuse_in_context_parallel
from .forward_arguments import check_extra_arguments
from .label_checks import check_sequence_labels, check_token_labels
from .positions import first_real_tokens, last_real_tokens


def classification_loss(model, logits, labels):
    """transformers' sequence-classification loss of logits (B, num_labels) against labels (B,) or (B, num_labels),
    by ``config.problem_type``; None without labels."""
    if labels is None:
        return None
    return model.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=model.config)


def head_output(output_type, outputs, loss, **fields):
    """A head's ``output_type`` record: its loss and ``fields`` (logits...), with the base model's ``outputs``'
    hidden states and attentions."""
    return output_type(loss=loss, hidden_states=outputs.hidden_states, attentions=outputs.attentions, **fields)


class TextHead:
    """A task head on a text family's base model (``self.model``, called without a cache: a head reads a whole call).

    ``forward`` takes the text inputs and ``labels`` (the names the Trainer and the pipelines pass), checks the
    keyword arguments (``loss_arguments``: those the head's loss takes), lets the head refuse a context-parallel
    call it cannot split (``refuse_split``), runs the base model and hands its outputs to the head's
    ``head_outputs``. ``base_model_keywords``: what the base model is told besides the inputs.
    """

    base_model_keywords: dict = {}
    loss_arguments: frozenset = frozenset()

    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        output_attentions=None,
        output_hidden_states=None,
        **kwargs,
    ):
        """input_ids (B, N), attention_mask (B, N) (1 for tokens, 0 for padding) and the rest as the base model takes
        them; labels as the head's ``head_outputs`` says."""
        check_extra_arguments(self, kwargs, accepted=self.loss_arguments)
        loss_arguments = {name: value for name, value in kwargs.items() if name in self.loss_arguments}
        self.refuse_split(labels, loss_arguments)
        outputs = self.base_outputs(
            input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions,
            output_hidden_states,
        )  # fmt: skip
        return self.head_outputs(outputs, labels, input_ids, attention_mask, **loss_arguments)

    def refuse_split(self, labels, loss_arguments: dict):
        """Raise inside ``context_parallel`` where the head cannot be split over the ranks (nothing by default)."""

    def head_outputs(self, outputs, labels, input_ids, attention_mask, **loss_arguments):
        """The head's output record from the base model's ``outputs``."""
        raise NotImplementedError(f"{type(self).__name__} must say what its head makes of the base model's outputs")

    def base_outputs(
        self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, output_attentions,
        output_hidden_states,
    ):  # fmt: skip
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            **self.base_model_keywords,
        )


class PooledSequenceClassification(TextHead):
    """Sequence classification from one real token of each row, wherever padding stands: ``pooled`` "first" (the
    first real token) or "last" (the last position of the attention mask, else the last token that is not padding).
    A family gives ``classify``: pooled hidden states (B, hidden) -> logits (B, num_labels). labels (B,) class ids,
    (B, num_labels) multi-hot floats, or (B,) floats for regression (num_labels=1)."""

    pooled = "first"
    output_type = SequenceClassifierOutput

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must say how it classifies its pooled tokens")

    def refuse_split(self, labels, loss_arguments: dict):
        refuse_in_context_parallel(f"sequence classification (it pools the {self.pooled} real token, on one rank)")

    def head_outputs(self, outputs, labels, input_ids, attention_mask):
        hidden_states = outputs.last_hidden_state
        (batch_size, num_tokens), device = hidden_states.shape[:2], hidden_states.device
        check_sequence_labels(labels, batch_size, type(self).__name__)
        if self.pooled == "first":
            pooled = first_real_tokens(attention_mask, batch_size, num_tokens, device)
        else:
            pad_token_id = self.config.pad_token_id
            pooled = last_real_tokens(attention_mask, input_ids, pad_token_id, batch_size, num_tokens, device)
        logits = self.classify(hidden_states[torch.arange(batch_size, device=device), pooled])
        return head_output(self.output_type, outputs, classification_loss(self, logits, labels), logits=logits)


class TokenClassification(TextHead):
    """Classification of every token: a family gives ``classify``, hidden states (B, N, hidden) -> logits
    (B, N, num_labels). labels (B, N) class ids, -100 ignored."""

    accepts_loss_kwargs = True  # the loss divides by the Trainer's num_items_in_batch
    loss_arguments = frozenset({"num_items_in_batch"})

    def classify(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must say how it classifies its tokens")

    def refuse_split(self, labels, loss_arguments: dict):
        refuse_a_mean_over_one_rank(labels, loss_arguments.get("num_items_in_batch"), "token classification's loss")

    def head_outputs(self, outputs, labels, input_ids, attention_mask, num_items_in_batch=None):
        """The loss is the labels' mean, or their sum over ``num_items_in_batch`` (a keyword argument: the labelled
        tokens of every batch a gradient step accumulates, or, inside ``context_parallel``, of the whole sequence,
        so that the ranks' losses add up to one process's)."""
        check_token_labels(labels, *outputs.last_hidden_state.shape[:2], type(self).__name__, what="class ids")
        logits = self.classify(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, config=self.config, num_items_in_batch=num_items_in_batch
            )
        return head_output(TokenClassifierOutput, outputs, loss, logits=logits)
