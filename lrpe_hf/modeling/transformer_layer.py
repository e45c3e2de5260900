"""One transformer layer shared by the three families: attention and MLP, each with a residual connection.

``pre_norm=True`` (GPT, ViT): x + Attn(LN(x)), then x + MLP(LN(x)).
``pre_norm=False`` (RoBERTa, post-norm as in BERT): LN(x + Attn(x)), then LN(x + MLP(x)).
"""

from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer

from .linear_attention import LinearAttention


class LinearTransformerLayer(GradientCheckpointingLayer):
    def __init__(self, config, pre_norm: bool):
        super().__init__()
        self.pre_norm = pre_norm
        self.attention = LinearAttention(
            config.hidden_size, config.num_attention_heads, standalone=False, **config.attention_options().to_dict()
        )
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden_size, config.intermediate_size),
            ACT2FN[config.hidden_act],
            nn.Linear(config.intermediate_size, config.hidden_size),
        )
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, state=None, spe_draw=None):
        """hidden_states (B, N, hidden) -> (B, N, hidden)."""
        attend = dict(attention_mask=attention_mask, position_ids=position_ids, state=state, spe_draw=spe_draw)
        if self.pre_norm:
            hidden_states = hidden_states + self.dropout(self.attention(self.attention_norm(hidden_states), **attend))
            return hidden_states + self.dropout(self.mlp(self.mlp_norm(hidden_states)))
        hidden_states = self.attention_norm(hidden_states + self.dropout(self.attention(hidden_states, **attend)))
        return self.mlp_norm(hidden_states + self.dropout(self.mlp(hidden_states)))
