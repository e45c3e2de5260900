"""Turn a pretrained softmax checkpoint (GPT-2, RoBERTa, BERT or ViT) into its linear-attention counterpart.

``linearize(model_or_path, **config_fields)`` returns the matching LinearGPT / LinearRoberta / LinearViT model with
every weight carried over: embeddings, absolute positions (as a ``learned`` table), norms, q/k/v/o, MLP and heads.
The config fields choose the attention (default: the family's, ``lrpe_orthogonal`` with linear attention); with
``attention="softmax"`` and ``positional_encoding="none"`` the converted model computes what the original does.

- GPT-2: the fused ``c_attn`` is split into q, k and v; ``Conv1D`` weights are transposed into ``nn.Linear``.
- RoBERTa: positions start at ``padding_idx + 1``, so row p + padding_idx + 1 of the table becomes row p; the
  single token-type vector is folded into the position table (or, without absolute positions, into the token
  embeddings, with the masked-LM decoder untied so that it keeps the original word embeddings).
- BERT: as RoBERTa without the offset, but its segment embeddings (two types: the sentences of a pair) carry over
  as they are (``type_vocab_size``), so its tokenizer's token_type_ids keep their meaning; the pooler (dense +
  tanh) becomes the sentence head's ``dense``.
- ViT: the class token and the position table over the class token and the patches carry over.
"""

import math

import torch
import transformers
from transformers import AutoConfig

from .modeling.configuration_linear_gpt import LinearGPTConfig
from .modeling.configuration_linear_roberta import LinearRobertaConfig
from .modeling.configuration_linear_vit import LinearViTConfig
from .modeling.modeling_linear_gpt import LinearGPTForCausalLM, LinearGPTForSequenceClassification, LinearGPTModel
from .modeling.modeling_linear_roberta import (
    LinearRobertaForMaskedLM,
    LinearRobertaForQuestionAnswering,
    LinearRobertaForSequenceClassification,
    LinearRobertaForTokenClassification,
    LinearRobertaModel,
)
from .modeling.modeling_linear_vit import LinearViTForImageClassification, LinearViTModel, patch_positions

TARGETS = {
    "GPT2Model": LinearGPTModel,
    "GPT2LMHeadModel": LinearGPTForCausalLM,
    "GPT2ForSequenceClassification": LinearGPTForSequenceClassification,
    "ViTModel": LinearViTModel,
    "ViTForImageClassification": LinearViTForImageClassification,
}
for _prefix in ("Roberta", "Bert"):
    TARGETS.update(
        {
            f"{_prefix}Model": LinearRobertaModel,
            f"{_prefix}ForMaskedLM": LinearRobertaForMaskedLM,
            f"{_prefix}ForSequenceClassification": LinearRobertaForSequenceClassification,
            f"{_prefix}ForTokenClassification": LinearRobertaForTokenClassification,
            f"{_prefix}ForQuestionAnswering": LinearRobertaForQuestionAnswering,
        }
    )


# Source config fields that change the attention's maths, with the value the converted model computes: any other
# value is refused by name rather than converted into a model that computes something else.
ATTENTION_FIELDS = {
    "GPT2": {
        "scale_attn_weights": True,  # False: logits not divided by sqrt(head_dim)
        "scale_attn_by_inverse_layer_idx": False,  # logits further divided by layer index + 1
        "reorder_and_upcast_attn": False,  # the product reordered and upcast
        "add_cross_attention": False,
    },
    "text": {
        "position_embedding_type": "absolute",  # relative_key(_query): learned relative terms in the logits
        "is_decoder": False,  # causal BERT/RoBERTa
        "add_cross_attention": False,
    },
    "vit": {},
}


def check_attention_fields(config, family: str):
    """Raise, naming each field, if the source config sets a field of ``ATTENTION_FIELDS`` to another value."""
    changed = {
        name: getattr(config, name)
        for name, faithful in ATTENTION_FIELDS[family].items()
        if getattr(config, name, faithful) != faithful
    }
    if changed:
        settings = ", ".join(f"{name}={value!r}" for name, value in changed.items())
        raise ValueError(
            f"Cannot linearize a {config.model_type} model with {settings}: the converted model would compute other "
            f"attention ({', '.join(f'{n}={ATTENTION_FIELDS[family][n]!r}' for n in changed)} is what it computes)"
        )


def linearize(model_or_path, table_extension: str | None = None, **config_fields):
    """A LinearGPT / LinearRoberta / LinearViT model holding the weights of ``model_or_path`` (a transformers
    model, or a checkpoint folder or Hub name whose config names its architecture). ``config_fields`` set the
    attention (``positional_encoding``, ``feature_map``, ``attention``, ...) and may override any field.

    Longer inputs than the teacher's position table (``max_position_embeddings``) take one of:
    - ``absolute_position_embedding="none"``: the table is dropped and the relative encoding alone orders the
      tokens; no length limit;
    - a larger ``max_position_embeddings`` with ``table_extension`` (text models): ``"copy"`` fills rows T, T+1, ...
      of the longer table with rows 0, 1, ... of the teacher's T rows again (Longformer's initialisation: until
      trained, position p reads row p mod T), ``"interpolate"`` stretches the T rows linearly over the new length.
    """
    source = load_source(model_or_path)
    name = type(source).__name__
    if name not in TARGETS:
        raise ValueError(f"Cannot linearize {name}; supported architectures: {', '.join(TARGETS)}")
    family = name[:4] if name.startswith("GPT2") else ("vit" if name.startswith("ViT") else "text")
    convert = {"GPT2": gpt2, "vit": vit, "text": roberta_or_bert}[family]
    check_attention_fields(source.config, family)
    config, weights = convert(source, config_fields)
    target = TARGETS[name](config)
    if config.absolute_position_embedding != "learned":  # the relative encoding replaces the pretrained table
        if table_extension is not None:
            raise ValueError(
                f"table_extension={table_extension!r} extends a learned table, and "
                f"absolute_position_embedding={config.absolute_position_embedding!r} keeps none: drop one of the two"
            )
        weights = {k: v for k, v in weights.items() if "position_embedding.tables" not in k}
    else:
        weights = fit_position_table(weights, config, table_extension, family)
    missing, unexpected = target.load_state_dict(weights, strict=False)
    derived = {name for name, _ in target.named_parameters() if ".self_attn.positional_encoding." in name}
    derived |= {name for name, _ in target.named_parameters() if ".self_attn.attention." in name}
    derived |= {name for name, _ in target.named_parameters() if ".shared_codes." in name}
    missing = [key for key in missing if key not in derived and not is_tied(target, key)]
    if missing or unexpected:
        raise ValueError(
            f"Weights did not map onto {type(target).__name__}: missing {missing}, unexpected {unexpected}"
        )
    return target.to(next(source.parameters()).dtype)


TABLE_EXTENSIONS = ("copy", "interpolate")


def extended_table(table: torch.Tensor, rows: int, how: str) -> torch.Tensor:
    """The teacher's (T, hidden) table grown to (rows, hidden): ``copy`` repeats it, ``interpolate`` samples it
    linearly at positions p (T - 1) / (rows - 1)."""
    if how == "copy":
        return table.repeat(math.ceil(rows / table.shape[0]), 1)[:rows].clone()
    where = torch.linspace(0, table.shape[0] - 1, rows, dtype=torch.float64)
    below = where.floor().long().clamp(max=table.shape[0] - 2)
    weight = (where - below).to(table.dtype)[:, None]
    return torch.lerp(table[below], table[below + 1], weight)


def fit_position_table(weights: dict, config, table_extension: str | None, family: str) -> dict:
    """``weights`` with the learned table sized to ``config.max_position_embeddings``: as it is, or extended by
    ``table_extension``; any other mismatch is refused (never truncated, clamped or wrapped at run time)."""
    keys = [k for k in weights if k.endswith("position_embedding.tables.0.weight")]
    if table_extension is not None and table_extension not in TABLE_EXTENSIONS:
        raise ValueError(f"Unknown table_extension {table_extension!r}; valid values: {', '.join(TABLE_EXTENSIONS)}")
    if family == "vit":
        if table_extension is not None:
            raise ValueError(
                "A LinearViT keeps the teacher's position table; for other image sizes use "
                "interpolate_pos_encoding=True, or a relative encoding with absolute_position_embedding='none'"
            )
        return weights
    if not keys:
        return weights
    table, rows = weights[keys[0]], config.max_position_embeddings
    if rows == table.shape[0]:
        if table_extension is not None:
            raise ValueError(
                f"table_extension={table_extension!r} needs max_position_embeddings above the teacher's "
                f"{table.shape[0]} positions"
            )
        return weights
    if rows < table.shape[0] or table_extension is None:
        raise ValueError(
            f"The teacher's position table has {table.shape[0]} rows and max_position_embeddings={rows} was asked: "
            f"for longer inputs pass table_extension ({' or '.join(map(repr, TABLE_EXTENSIONS))}), or "
            "absolute_position_embedding='none' to rely on the relative encoding; a shorter table is not made"
        )
    return {**weights, keys[0]: extended_table(table, rows, table_extension)}


def load_source(model_or_path):
    if isinstance(model_or_path, torch.nn.Module):
        return model_or_path
    config = AutoConfig.from_pretrained(model_or_path)
    architectures = config.architectures or []
    supported = [name for name in architectures if name in TARGETS]
    if not supported:
        raise ValueError(
            f"{model_or_path}: architecture {architectures or config.model_type} cannot be linearized; supported "
            f"architectures: {', '.join(TARGETS)}"
        )
    return getattr(transformers, supported[0]).from_pretrained(model_or_path)


def is_tied(model, key: str) -> bool:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return key in tied and model.config.tie_word_embeddings


def token_and_label_fields(c) -> dict:
    """The fields a converted text model keeps as they are: special tokens, tying and the labels."""
    names = ("tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id", "id2label", "label2id")
    return {name: getattr(c, name) for name in names} | {"num_labels": c.num_labels, "problem_type": c.problem_type}


def linear(weights: dict, target: str, weight, bias):
    weights[f"{target}.weight"], weights[f"{target}.bias"] = weight, bias


def layer_norm(weights: dict, target: str, state: dict, source: str):
    linear(weights, target, state[f"{source}.weight"], state[f"{source}.bias"])


# ---------------------------------------------------------------- GPT-2
def gpt2(source, fields):
    c = source.config
    config = LinearGPTConfig(
        **{
            "vocab_size": c.vocab_size,
            "hidden_size": c.n_embd,
            "num_hidden_layers": c.n_layer,
            "num_attention_heads": c.n_head,
            "intermediate_size": c.n_inner or 4 * c.n_embd,
            "hidden_act": c.activation_function,
            "max_position_embeddings": c.n_positions,
            "layer_norm_eps": c.layer_norm_epsilon,
            "hidden_dropout_prob": c.resid_pdrop,
            "initializer_range": c.initializer_range,
            "absolute_position_embedding": "learned",
            **token_and_label_fields(c),
            **fields,
        }
    )
    state = {k.removeprefix("transformer."): v for k, v in source.state_dict().items()}
    weights = {
        "model.embed_tokens.weight": state["wte.weight"],
        "model.position_embedding.tables.0.weight": state["wpe.weight"],
    }
    for i in range(c.n_layer):
        s, t = f"h.{i}", f"model.stack.layers.{i}"
        # c_attn holds q, k and v side by side as qkv_proj does; Conv1D stores (in, out)
        linear(weights, f"{t}.self_attn.qkv_proj", state[f"{s}.attn.c_attn.weight"].T, state[f"{s}.attn.c_attn.bias"])
        linear(weights, f"{t}.self_attn.o_proj", state[f"{s}.attn.c_proj.weight"].T, state[f"{s}.attn.c_proj.bias"])
        linear(weights, f"{t}.mlp.fc1", state[f"{s}.mlp.c_fc.weight"].T, state[f"{s}.mlp.c_fc.bias"])
        linear(weights, f"{t}.mlp.fc2", state[f"{s}.mlp.c_proj.weight"].T, state[f"{s}.mlp.c_proj.bias"])
        layer_norm(weights, f"{t}.self_attn_layer_norm", state, f"{s}.ln_1")
        layer_norm(weights, f"{t}.final_layer_norm", state, f"{s}.ln_2")
    layer_norm(weights, "model.norm", state, "ln_f")
    if "lm_head.weight" in state:
        weights["lm_head.weight"] = state["lm_head.weight"]
    if "score.weight" in state:
        weights["score.weight"] = state["score.weight"]
    return config, strip_base_prefix(weights, source)


def strip_base_prefix(weights: dict, source) -> dict:
    """A bare base model (GPT2Model, RobertaModel, ViTModel) converts to a bare base model: drop ``model.``."""
    if (
        type(source).__name__.endswith("Model")
        and "For" not in type(source).__name__
        and "LMHead" not in type(source).__name__
    ):
        return {k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.")}
    return weights


# ---------------------------------------------------------------- RoBERTa and BERT
def roberta_or_bert(source, fields):
    c = source.config
    is_roberta = c.model_type in ("roberta", "xlm-roberta", "camembert")
    offset = c.pad_token_id + 1 if is_roberta else 0
    base = {k: v for k, v in source.state_dict().items()}
    prefix = source.base_model_prefix + "."
    state = {k.removeprefix(prefix): v for k, v in base.items()}
    table = state["embeddings.position_embeddings.weight"][offset:]
    segments = state["embeddings.token_type_embeddings.weight"]
    # one segment type (RoBERTa): its vector is folded into the positions or the words; more (BERT): kept as a table
    segment = segments[0] if segments.shape[0] == 1 else 0
    config = roberta_config(c, table.shape[0], segments.shape[0], fields)
    words = state["embeddings.word_embeddings.weight"]
    weights = {}
    if config.absolute_position_embedding == "learned":
        weights["model.position_embedding.tables.0.weight"] = table + segment
        weights["model.embed_tokens.weight"] = words
    elif segments.shape[0] == 1:  # no table to fold the segment vector into: the words take it, the decoder not
        weights["model.embed_tokens.weight"] = words + segment
        config.tie_word_embeddings = False
    else:
        weights["model.embed_tokens.weight"] = words
    if segments.shape[0] > 1:
        weights["model.token_type_embeddings.weight"] = segments
    layer_norm(weights, "model.embedding_norm", state, "embeddings.LayerNorm")
    for i in range(c.num_hidden_layers):
        s, t = f"encoder.layer.{i}", f"model.stack.layers.{i}"
        joined = [f"{s}.attention.self.{name}" for name in ("query", "key", "value")]
        linear(
            weights,
            f"{t}.self_attn.qkv_proj",
            torch.cat([state[f"{name}.weight"] for name in joined]),
            torch.cat([state[f"{name}.bias"] for name in joined]),
        )
        linear(
            weights,
            f"{t}.self_attn.o_proj",
            state[f"{s}.attention.output.dense.weight"],
            state[f"{s}.attention.output.dense.bias"],
        )
        layer_norm(weights, f"{t}.self_attn_layer_norm", state, f"{s}.attention.output.LayerNorm")
        linear(weights, f"{t}.mlp.fc1", state[f"{s}.intermediate.dense.weight"], state[f"{s}.intermediate.dense.bias"])
        linear(weights, f"{t}.mlp.fc2", state[f"{s}.output.dense.weight"], state[f"{s}.output.dense.bias"])
        layer_norm(weights, f"{t}.final_layer_norm", state, f"{s}.output.LayerNorm")
    heads(weights, base, words)
    return config, strip_base_prefix(weights, source)


def roberta_config(c, positions: int, segment_types: int, fields: dict) -> LinearRobertaConfig:
    """The LinearRoberta config of a RoBERTa or BERT config ``c``: its sizes, a learned table of ``positions`` rows
    and ``segment_types`` segment types; ``fields`` override any of them."""
    return LinearRobertaConfig(
        **{
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "intermediate_size": c.intermediate_size,
            "hidden_act": c.hidden_act,
            "max_position_embeddings": positions,
            "layer_norm_eps": c.layer_norm_eps,
            "hidden_dropout_prob": c.hidden_dropout_prob,
            "classifier_dropout": getattr(c, "classifier_dropout", None),
            "initializer_range": c.initializer_range,
            "absolute_position_embedding": "learned",
            "type_vocab_size": segment_types,
            **token_and_label_fields(c),
            **fields,
        }
    )


def heads(weights: dict, state: dict, words):
    """The task heads of RoBERTa and BERT, renamed to LinearRoberta's."""
    if "lm_head.dense.weight" in state:  # RoBERTa's masked-LM head
        linear(weights, "lm_head.dense", state["lm_head.dense.weight"], state["lm_head.dense.bias"])
        layer_norm(weights, "lm_head.norm", state, "lm_head.layer_norm")
        linear(weights, "lm_head.decoder", words, state["lm_head.bias"])
    if "cls.predictions.transform.dense.weight" in state:  # BERT's
        p = "cls.predictions"
        linear(weights, "lm_head.dense", state[f"{p}.transform.dense.weight"], state[f"{p}.transform.dense.bias"])
        layer_norm(weights, "lm_head.norm", state, f"{p}.transform.LayerNorm")
        linear(weights, "lm_head.decoder", words, state[f"{p}.bias"])
    if "classifier.dense.weight" in state:  # RoBERTa's sentence head
        linear(weights, "classifier.dense", state["classifier.dense.weight"], state["classifier.dense.bias"])
        linear(weights, "classifier.out_proj", state["classifier.out_proj.weight"], state["classifier.out_proj.bias"])
    elif "bert.pooler.dense.weight" in state and "classifier.weight" in state:  # BERT: pooler, then classifier
        linear(weights, "classifier.dense", state["bert.pooler.dense.weight"], state["bert.pooler.dense.bias"])
        linear(weights, "classifier.out_proj", state["classifier.weight"], state["classifier.bias"])
    elif "classifier.weight" in state:  # token classification
        linear(weights, "classifier", state["classifier.weight"], state["classifier.bias"])
    if "qa_outputs.weight" in state:
        linear(weights, "qa_outputs", state["qa_outputs.weight"], state["qa_outputs.bias"])


# ---------------------------------------------------------------- ViT
def vit(source, fields):
    c = source.config
    config = LinearViTConfig(
        **{
            "image_size": c.image_size,
            "patch_size": c.patch_size,
            "num_channels": c.num_channels,
            "hidden_size": c.hidden_size,
            "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "intermediate_size": c.intermediate_size,
            "hidden_act": c.hidden_act,
            "layer_norm_eps": c.layer_norm_eps,
            "hidden_dropout_prob": c.hidden_dropout_prob,
            "initializer_range": c.initializer_range,
            "absolute_position_embedding": "learned",
            "num_labels": c.num_labels,
            "id2label": c.id2label,
            "label2id": c.label2id,
            **fields,
        }
    )
    state = {k.removeprefix("vit."): v for k, v in source.state_dict().items()}
    weights = {
        "model.embeddings.cls_token": state["embeddings.cls_token"],
        "model.embeddings.position_embedding.tables.0.weight": state["embeddings.position_embeddings"][0],
    }
    linear(
        weights,
        "model.embeddings.patch_projection",
        state["embeddings.patch_embeddings.projection.weight"],
        state["embeddings.patch_embeddings.projection.bias"],
    )
    for i in range(c.num_hidden_layers):
        s, t = f"layers.{i}", f"model.stack.layers.{i}"
        projections = {}
        for proj in ("q", "k", "v", "o"):
            weight = state[f"{s}.attention.{proj}_proj.weight"]
            bias = state.get(f"{s}.attention.{proj}_proj.bias", weight.new_zeros(weight.shape[0]))  # qkv_bias=False
            projections[proj] = weight, bias
        joined = [projections[proj] for proj in ("q", "k", "v")]
        linear(weights, f"{t}.self_attn.qkv_proj", *(torch.cat(parts) for parts in zip(*joined)))
        linear(weights, f"{t}.self_attn.o_proj", *projections["o"])
        layer_norm(weights, f"{t}.self_attn_layer_norm", state, f"{s}.layernorm_before")
        layer_norm(weights, f"{t}.final_layer_norm", state, f"{s}.layernorm_after")
        for fc in ("fc1", "fc2"):
            linear(weights, f"{t}.mlp.{fc}", state[f"{s}.mlp.{fc}.weight"], state[f"{s}.mlp.{fc}.bias"])
    layer_norm(weights, "model.norm", state, "layernorm")
    if "classifier.weight" in state:
        linear(weights, "classifier", state["classifier.weight"], state["classifier.bias"])
    return config, strip_base_prefix(weights, source)


# ---------------------------------------------------------------- attention transfer (stage 1 of linearizing)
def transfer_parameters(student) -> list:
    """The parameters attention transfer trains: the feature maps', the encodings' and their shared codes', and
    with a ``local_window`` its factor between the two parts (and the window's own encoding, where it has one).
    Everything else keeps the teacher's weights."""
    names = (".feature_map.", ".positional_encoding.", "shared_codes.", ".local_window.")
    return [p for name, p in student.named_parameters() if p.requires_grad and any(part in name for part in names)]


def attention_transfer_loss(student, hidden_states, attention_mask=None, loss: str = "output_mse", position_ids=None):
    """How far each student layer's linear attention is from the teacher's softmax attention on the same inputs.

    ``hidden_states``: the teacher's inputs to each layer (``output_hidden_states``: one per layer, the last
    entry ignored), (B, N, hidden); the teacher's attention is softmax(q k^T / sqrt(D)) v with the student's own
    q/k/v/o projections, which linearize copied from it. ``loss``:
    - ``output_mse`` (LoLCATs): the mean squared difference of the two attention outputs;
    - ``attention_ce`` (Hedgehog): the cross-entropy from the teacher's attention rows to the weights the student
      layer really applies (``LinearAttention.attention_weights``: stabiliser, decay and denominator included;
      only for the plain denominator, whose weights are non-negative).
    Padded queries enter neither loss: the student's output there is zero by construction, and a causal teacher's
    row there has no key.
    ``position_ids``: as the student model takes them; by default the tokens' order (1D) or, for a LinearViT
    student, the class token then a square grid of patches.
    Returns the mean over layers (a scalar).
    """
    if loss not in ("output_mse", "attention_ce"):
        raise ValueError(f"Unknown attention transfer loss {loss!r}; valid values: output_mse, attention_ce")
    stack = student.model.stack if hasattr(student, "model") else student.stack
    layers = stack.layers
    B, N, _ = hidden_states[0].shape
    device = hidden_states[0].device
    real = torch.ones(B, N, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.bool()
    draw = stack.shared_codes.draw(device) if stack.shared_codes is not None else None
    if position_ids is None and student.config.position_dims == 2:
        position_ids = square_patch_positions(hidden_states[0])
    total = 0.0
    for layer, hidden in zip(layers, hidden_states):
        attention = layer.self_attn
        x = layer.self_attn_layer_norm(hidden) if layer.pre_norm else hidden
        q, k, v = attention.heads(x, None)
        allowed = real[:, None, None, :].expand(B, 1, N, N)
        if attention.options.causal:
            allowed = allowed & torch.ones(N, N, dtype=torch.bool, device=device).tril()
        allowed = allowed | ~allowed.any(-1, keepdim=True)  # a query with no key (left padding): kept finite, unused
        logits = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~allowed, float("-inf"))
        teacher = logits.softmax(-1)
        if loss == "output_mse":
            target = attention.o_proj((teacher @ v).transpose(1, 2).reshape(B, N, -1))
            output = attention(x, attention_mask=attention_mask, position_ids=position_ids, shared_draw=draw)
            total = total + (output - target.detach()).pow(2).mean(-1).masked_select(real).mean()
            continue
        if attention.options.normalization != "denominator":
            raise ValueError("attention_ce needs non-negative weights: an encoding with the plain denominator")
        student_rows = attention.attention_weights(x, attention_mask, position_ids, draw)
        cross_entropy = -(teacher.detach() * student_rows.clamp_min(1e-12).log()).masked_fill(~allowed, 0.0).sum(-1)
        total = total + cross_entropy.masked_select(real[:, None].expand_as(cross_entropy)).mean()
    return total / len(layers)


def square_patch_positions(hidden) -> torch.Tensor:
    """(B, N, 2) positions of a ViT's tokens, (B, N, hidden): the class token, then a square grid of patches."""
    B, N, _ = hidden.shape
    side = math.isqrt(N - 1)
    if side * side != N - 1:
        raise ValueError(f"{N - 1} patches do not form a square grid: pass position_ids (batch, tokens, 2)")
    return patch_positions(side, side, hidden.device)[None].expand(B, -1, -1)
