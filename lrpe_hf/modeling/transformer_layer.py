"""One transformer layer shared by the three families: attention and MLP, each with a residual connection.

``pre_norm=True`` (GPT, ViT): x + Attn(LN(x)), then x + MLP(LN(x)).
``pre_norm=False`` (RoBERTa, post-norm as in BERT): LN(x + Attn(x)), then LN(x + MLP(x)).

Weight names follow transformers' decoder conventions (``self_attn.{q,k,v,o}_proj``, ``self_attn_layer_norm``,
``mlp.fc1``/``mlp.fc2``, ``final_layer_norm``, as in OPT, BART and Whisper), so that tools recognise them: peft's
default ``target_modules`` for q/v, and conversion scripts.
"""

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer

from .attention_inputs import LayerCall
from .context_parallel import active_group, rejoined
from .linear_attention import LinearAttention


class ActivationThenLinear(torch.autograd.Function):
    """linear(activation(h), weight, bias), saving h only: backward recomputes activation(h) (elementwise) instead
    of keeping the intermediate-width activation alive, which halves the MLP's saved activations."""

    @staticmethod
    def forward(ctx, h, weight, bias, activation):
        ctx.activation = activation
        ctx.save_for_backward(h, weight)
        return F.linear(activation(h), weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        h, weight = ctx.saved_tensors
        with torch.enable_grad():
            h = h.detach().requires_grad_()
            activated = ctx.activation(h)
        grad_h = torch.autograd.grad(activated, h, grad_out @ weight)[0] if ctx.needs_input_grad[0] else None
        flat_grad, flat_activated = grad_out.flatten(0, -2), activated.detach().flatten(0, -2)
        grad_weight = flat_grad.T @ flat_activated if ctx.needs_input_grad[1] else None
        grad_bias = flat_grad.sum(0) if ctx.needs_input_grad[2] else None
        return grad_h, grad_weight, grad_bias, None


class Dropout(nn.Dropout):
    """``nn.Dropout`` that keeps a one-byte mask for backward (``torch.native_dropout``): on a CPU, ``F.dropout``
    keeps a float mask of the input's size, as large as the activation itself."""

    def forward(self, x):
        if not self.training or self.p == 0:
            return x  # as F.dropout returns it, without its checks
        if self.p < 1:
            return torch.native_dropout(x, self.p, True)[0]
        return super().forward(x)


# Activations whose backward reads their output only (relu's threshold_backward): fc2 keeps that output for its own
# backward anyway, so autograd keeps one intermediate-width tensor, as ``ActivationThenLinear`` would.
OUTPUT_ONLY_BACKWARD = frozenset({"relu"})


class MLP(nn.Module):
    """fc1 -> activation -> fc2: (B, N, hidden) -> (B, N, hidden). In training, an activation whose backward reads
    its input (gelu, silu...) goes through ``ActivationThenLinear``, which keeps h alone where autograd would keep h
    and activation(h); relu keeps its output alone either way, and takes autograd's path."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, intermediate_size)
        self.activation = ACT2FN[activation]
        self.recomputes_activation = activation not in OUTPUT_ONLY_BACKWARD
        self.fc2 = nn.Linear(intermediate_size, hidden_size)

    def forward(self, hidden_states):
        h = self.fc1(hidden_states)
        if not self.recomputes_activation:
            return self.fc2(self.activation(h))
        plain = type(self.fc2) is not nn.Linear or self.fc2._forward_hooks or self.fc2._forward_pre_hooks
        custom = torch.is_grad_enabled() and not torch.is_autocast_enabled(h.device.type)
        if custom and not plain and not torch.compiler.is_compiling():
            return ActivationThenLinear.apply(h, self.fc2.weight, self.fc2.bias, self.activation)
        return self.fc2(self.activation(h))  # adapters or hooks on fc2, autocast, compiled (fused): the plain path


class LinearTransformerLayer(GradientCheckpointingLayer):
    def __init__(self, config, options, pre_norm: bool):
        super().__init__()
        self.config = config  # read at each forward: its attn_implementation can change after the model is built
        self.pre_norm = pre_norm
        self.self_attn = LinearAttention(config.hidden_size, config.num_attention_heads, options, standalone=False)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(
        self,
        hidden_states,
        *shared_tables,
        attention_mask=None,
        position_ids=None,
        state=None,
        shared_draw=None,
        call=None,
        context_group=None,
    ):
        """hidden_states (B, N, hidden) -> (B, N, hidden). ``shared_tables``: the shared draw's tables, passed as
        tensors so that gradient checkpointing sees them (see ``SPEDraw.with_tables``); ``call``: the model's
        ``LayerCall``, as ``LinearAttention.forward`` takes it; ``context_group``: the ``context_parallel`` group the
        call runs in, or None, kept so that gradient checkpointing's recomputation in backward, outside the block,
        splits the sequence as the call did."""
        if shared_tables:
            shared_draw = shared_draw.with_tables(shared_tables)
        call = call if call is not None else LayerCall(softmax_implementation=self.config._attn_implementation)
        attend = dict(
            attention_mask=attention_mask, position_ids=position_ids, state=state, shared_draw=shared_draw, call=call
        )
        if context_group is not None and active_group() is not context_group:
            with rejoined(context_group):
                return self.attend_then_mix(hidden_states, attend)
        return self.attend_then_mix(hidden_states, attend)

    def attend_then_mix(self, hidden_states, attend: dict):
        """The residual blocks: attention (``attend``: its keyword arguments), then the MLP, each normed before
        (pre-norm) or after. hidden_states (B, N, hidden)."""
        if self.pre_norm:
            hidden_states = hidden_states + self.dropout(
                self.self_attn(self.self_attn_layer_norm(hidden_states), **attend)
            )
            return hidden_states + self.dropout(self.mlp(self.final_layer_norm(hidden_states)))
        hidden_states = self.self_attn_layer_norm(hidden_states + self.dropout(self.self_attn(hidden_states, **attend)))
        return self.final_layer_norm(hidden_states + self.dropout(self.mlp(hidden_states)))

    def takes_short_steps(self) -> bool:
        """Whether the stack may call ``decoding_step`` for a common decoding step: where the attention can
        (``LinearAttention.takes_short_steps``) and no hook on this layer or its attention would be passed by."""
        attention = self.self_attn
        hooked = self._forward_hooks or self._forward_pre_hooks or attention._forward_hooks
        return attention.takes_short_steps and not (hooked or attention._forward_pre_hooks)

    def decoding_step(self, hidden_states, state, positions):
        """``forward`` for a model's common decoding call (see ``LinearAttention.decoding_step``; eval mode, so no
        dropout): hidden_states (B, 1, hidden), the layer's ``LinearAttentionState``, positions (B, 1, 1)."""
        attention = self.self_attn
        if self.pre_norm:
            hidden_states = hidden_states + attention.decoding_step(
                self.self_attn_layer_norm(hidden_states), state, positions
            )
            return hidden_states + self.mlp(self.final_layer_norm(hidden_states))
        hidden_states = self.self_attn_layer_norm(
            hidden_states + attention.decoding_step(hidden_states, state, positions)
        )
        return self.final_layer_norm(hidden_states + self.mlp(hidden_states))

    def attention_weights(self, hidden_states, attention_mask=None, position_ids=None, shared_draw=None):
        """(B, H, N, N) the weights the layer's attention gives each key for each query, on the layer's input
        (``LinearAttention.attention_weights``; O(N^2), for ``output_attentions``)."""
        normed = self.self_attn_layer_norm(hidden_states) if self.pre_norm else hidden_states
        return self.self_attn.attention_weights(normed, attention_mask, position_ids, shared_draw)
