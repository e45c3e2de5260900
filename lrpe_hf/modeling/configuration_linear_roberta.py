"""Configuration of LinearRoberta, a bidirectional encoder with linear attention."""

from .configuration_linear_attention import LinearAttentionConfig


class LinearRobertaConfig(LinearAttentionConfig):
    """Defaults: RoBERTa-base (12 layers x 768, 12 heads, FFN 3072, GELU, post-norm, vocabulary 50265), the LRPE
    paper's bidirectional language model (Appendix E, "BLM"), with LRPE Type 2 (``lrpe_orthogonal``).

    Args:
        vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, hidden_act: the usual sizes.
        max_position_embeddings: the table size of ``learned`` absolute embeddings and FastRPB's longest span.
        hidden_dropout_prob, layer_norm_eps, initializer_range: as in RoBERTa.
        embedding_multiplier: token embeddings are multiplied by it (1 in RoBERTa; fairseq uses sqrt(hidden_size)).
        classifier_dropout: dropout of the classification heads (default: hidden_dropout_prob).
        type_vocab_size: segment types. 1 (RoBERTa): no segment embedding, token_type_ids all zeros or left out, the
            sentences of a pair told apart by separators; 2 or more (BERT, and a BERT linearized by ``linearize``):
            a learned embedding per segment type, added to the tokens'.
        The attention fields are documented in ``LinearAttentionConfig``.
    """

    model_type = "linear_roberta"

    vocab_size: int = 50265
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    hidden_dropout_prob: float = 0.1
    classifier_dropout: float | None = None
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True
    embedding_multiplier: float = 1.0
    type_vocab_size: int = 1
    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | None = 2

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if not isinstance(self.type_vocab_size, int) or self.type_vocab_size < 1:
            raise ValueError(
                f"type_vocab_size must be a positive integer (1: no segment embedding), got {self.type_vocab_size!r}"
            )
