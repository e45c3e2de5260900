"""LinearViT: a pre-norm vision transformer with linear attention over a 2D patch grid.

Works with a standard ``ViTImageProcessor``. Each patch token carries its (row, column) for the 2D encodings;
the class token sits at (-1, -1) and is pooled for classification.
"""

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput
from transformers.utils import can_return_tuple

from .configuration_linear_vit import LinearViTConfig
from .forward_arguments import check_extra_arguments
from .positional_absolute import LearnedPositionEmbedding, SinusoidalPositionEmbedding
from .transformer_layer import Dropout
from .transformer_stack import LinearPreTrainedModel, LinearTransformerStack


class LinearViTPreTrainedModel(LinearPreTrainedModel):
    config: LinearViTConfig
    config_class = LinearViTConfig
    base_model_prefix = "model"
    main_input_name = "pixel_values"

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, LinearViTEmbeddings):  # as ViT: a zero class token would stay zero under phi(0) = 0
            init.trunc_normal_(module.cls_token, mean=0.0, std=self.config.initializer_range)


def patch_positions(rows: int, cols: int, device=None) -> torch.Tensor:
    """(1 + rows * cols, 2) integer positions: the class token at (-1, -1), then the patches row by row."""
    r, c = torch.meshgrid(torch.arange(rows, device=device), torch.arange(cols, device=device), indexing="ij")
    grid = torch.stack([r.flatten(), c.flatten()], dim=-1)
    return torch.cat([torch.full((1, 2), -1, dtype=torch.long, device=device), grid])


class LinearViTEmbeddings(nn.Module):
    """Patch projection, class token and the optional absolute embedding. Returns embeddings and positions.

    ``absolute_position_embedding="learned"`` is ViT's table: one row per token of an ``image_size`` image (the
    class token, then the patches row by row); ``sinusoidal`` encodes (row, col), half of the width each.
    """

    def __init__(self, config: LinearViTConfig):
        super().__init__()
        self.config = config
        self.patch_projection = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size))
        self.position_embedding = None
        if config.absolute_position_embedding == "sinusoidal":
            # at the scale of ViT's learned table and class token at initialisation
            self.position_embedding = SinusoidalPositionEmbedding(
                config.hidden_size, position_dims=2, scale=config.initializer_range
            )
        elif config.absolute_position_embedding == "learned":
            self.position_embedding = LearnedPositionEmbedding(config.hidden_size, 1 + config.grid_size**2)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, pixel_values):
        """pixel_values (B, C, H, W) -> embeddings (B, 1 + P, hidden), positions (B, 1 + P, 2)."""
        if pixel_values.dim() != 4 or pixel_values.shape[1] != self.config.num_channels:
            raise ValueError(
                f"pixel_values must have shape (batch, {self.config.num_channels}, height, width), got "
                f"{tuple(pixel_values.shape)}"
            )
        height, width = pixel_values.shape[-2:]
        p = self.config.patch_size
        if height % p or width % p:
            raise ValueError(f"image height and width must be multiples of patch_size={p}, got {height}x{width}")
        patches = self.patch_projection(pixel_values.to(self.patch_projection.weight.dtype)).flatten(2).transpose(1, 2)
        batch_size = patches.shape[0]
        embeddings = torch.cat([self.cls_token.expand(batch_size, -1, -1), patches], dim=1)
        positions = patch_positions(height // p, width // p, embeddings.device)[None].expand(batch_size, -1, -1)
        if isinstance(self.position_embedding, LearnedPositionEmbedding):
            if (height, width) != (self.config.image_size,) * 2:
                raise ValueError(
                    f"learned absolute position embeddings cover {self.config.image_size}x{self.config.image_size} "
                    f"images; got {height}x{width}. Resize the images or use a relative positional encoding"
                )
            token_index = torch.arange(embeddings.shape[1], device=embeddings.device)[None]
            embeddings = embeddings + self.position_embedding(token_index).to(embeddings.dtype)
        elif self.position_embedding is not None:
            embeddings = embeddings + self.position_embedding(positions).to(embeddings.dtype)
        return self.dropout(embeddings), positions


class LinearViTModel(LinearViTPreTrainedModel):
    def __init__(self, config: LinearViTConfig):
        super().__init__(config)
        self.embeddings = LinearViTEmbeddings(config)
        self.stack = LinearTransformerStack(config, pre_norm=True)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.patch_projection

    @can_return_tuple
    def forward(self, pixel_values=None, output_hidden_states=None, **kwargs) -> BaseModelOutputWithPooling:
        check_extra_arguments(self, kwargs)
        if pixel_values is None:
            raise ValueError("pixel_values is required")
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        hidden_states, positions = self.embeddings(pixel_values)
        hidden_states, all_hidden_states = self.stack(hidden_states, None, positions, None, output_hidden_states)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states = tuple(all_hidden_states) + (hidden_states,)
        return BaseModelOutputWithPooling(
            last_hidden_state=hidden_states, pooler_output=hidden_states[:, 0], hidden_states=all_hidden_states
        )


class LinearViTForImageClassification(LinearViTPreTrainedModel):
    def __init__(self, config: LinearViTConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = LinearViTModel(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(self, pixel_values=None, labels=None, output_hidden_states=None, **kwargs) -> ImageClassifierOutput:
        check_extra_arguments(self, kwargs)
        outputs = self.model(pixel_values=pixel_values, output_hidden_states=output_hidden_states)
        logits = self.classifier(outputs.pooler_output)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=self.config)
        return ImageClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states)
