"""Configuration of LinearGPT, a causal language model with linear attention."""

from .configuration_linear_attention import LinearAttentionConfig


class LinearGPTConfig(LinearAttentionConfig):
    """Defaults: the LRPE paper's autoregressive language model (Appendix E, "ALM"): 6 layers x 512, 8 heads,
    FFN 2048 with ReLU, pre-norm, tied input/output embeddings, LRPE Type 2 (``lrpe_orthogonal``).

    Args:
        vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, hidden_act: the usual sizes.
        max_position_embeddings: the table size of ``learned`` absolute embeddings and FastRPB's longest span;
            relative encodings other than FastRPB work at any length.
        hidden_dropout_prob, layer_norm_eps, initializer_range, use_cache, tie_word_embeddings: as in Transformers.
        embedding_multiplier: token embeddings are multiplied by it (fairseq, and the LRPE authors' code, use
            sqrt(hidden_size) with embeddings initialised at std hidden_size^-1/2).
        The attention fields are documented in ``LinearAttentionConfig``.

    Example::

        >>> from lrpe_hf import LinearGPTConfig, LinearGPTForCausalLM
        >>> config = LinearGPTConfig(vocab_size=8192, positional_encoding="permute", feature_map="relu")
        >>> model = LinearGPTForCausalLM(config)
    """

    model_type = "linear_gpt"
    keys_to_ignore_at_inference = ["past_key_values"]
    is_causal_model = True

    vocab_size: int = 50257
    hidden_size: int = 512
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    intermediate_size: int = 2048
    hidden_act: str = "relu"
    max_position_embeddings: int = 2048
    hidden_dropout_prob: float = 0.1
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    use_cache: bool = True
    tie_word_embeddings: bool = True
    embedding_multiplier: float = 1.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
