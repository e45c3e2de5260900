"""LinearViT: a pre-norm vision transformer with linear attention over a 2D patch grid.

Works with a standard ``ViTImageProcessor``. Each patch token carries its (row, column) for the 2D encodings;
the class token sits at (-1, -1) and is pooled for classification.
"""

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput
from transformers.utils import can_return_tuple

from .configuration_linear_vit import LinearViTConfig
from .context_parallel import refuse_in_context_parallel
from .forward_arguments import check_extra_arguments
from .heads import classification_loss, head_output
from .input_checks import check_pixel_values
from .label_checks import check_sequence_labels
from .positional_absolute import LearnedPositionEmbedding, SinusoidalPositionEmbedding
from .registry import positional_encoding_entry
from .transformer_layer import Dropout
from .transformer_stack import LinearPreTrainedModel, LinearTransformerStack, base_model_output


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
    class token, then the patches row by row); for images of another size, ``interpolate_pos_encoding=True``
    resizes its patch grid bicubically, as ViT does. ``sinusoidal`` encodes (row, col), half of the width each.
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

    def forward(self, pixel_values, interpolate_pos_encoding=False):
        """pixel_values (B, C, H, W) -> embeddings (B, 1 + P, hidden), positions (B, 1 + P, 2)."""
        check_pixel_values(pixel_values, self.config.num_channels, self.config.patch_size)
        height, width = pixel_values.shape[-2:]
        p = self.config.patch_size
        self.check_bias_table_covers(height, width)
        patches = self.patch_projection(pixel_values.to(self.patch_projection.weight.dtype)).flatten(2).transpose(1, 2)
        batch_size = patches.shape[0]
        embeddings = torch.cat([self.cls_token.expand(batch_size, -1, -1), patches], dim=1)
        positions = patch_positions(height // p, width // p, embeddings.device)[None].expand(batch_size, -1, -1)
        if isinstance(self.position_embedding, LearnedPositionEmbedding):
            table = self.learned_table(height // p, width // p, interpolate_pos_encoding)
            embeddings = embeddings + table.to(embeddings.dtype)
        elif self.position_embedding is not None:
            embeddings = embeddings + self.position_embedding(positions).to(embeddings.dtype)
        return self.dropout(embeddings), positions

    def learned_table(self, rows: int, cols: int, interpolate: bool) -> torch.Tensor:
        """(1, 1 + rows * cols, hidden) ViT's learned table for a rows x cols patch grid: as trained, or, with
        ``interpolate``, its grid resized bicubically (the class token's row unchanged)."""
        size = self.config.image_size
        table = self.position_embedding.tables[0].weight[None]  # (1, 1 + G * G, hidden)
        grid = self.config.grid_size
        if (rows, cols) == (grid, grid):
            return table
        if not interpolate:
            p = self.config.patch_size
            raise ValueError(
                f"learned absolute position embeddings cover {size}x{size} images; got {rows * p}x{cols * p}. Pass "
                "interpolate_pos_encoding=True to resize the table (as ViT does), resize the images, or use a "
                "relative positional encoding, which needs neither"
            )
        patches = table[:, 1:].reshape(1, grid, grid, -1).permute(0, 3, 1, 2)
        resized = F.interpolate(patches.float(), size=(rows, cols), mode="bicubic", align_corners=False)
        resized = resized.to(table.dtype).permute(0, 2, 3, 1).reshape(1, rows * cols, -1)
        return torch.cat([table[:, :1], resized], dim=1)

    def check_bias_table_covers(self, height: int, width: int):
        """An encoding that learns one weight per distance (FastRPB: a bias per patch distance) covers those of an
        ``image_size`` image."""
        encoding = self.config.positional_encoding
        if not positional_encoding_entry(encoding).needs_max_positions:
            return
        size, p = self.config.image_size, self.config.patch_size
        if max(height, width) > size:
            raise ValueError(
                f"{encoding} learns one weight per distance between patches, up to those of {size}x{size} images "
                f"(image_size={size}); got {height}x{width}. Resize the images to at most {size} pixels a side, or "
                f"build the model with image_size >= {max(height, width)} (a multiple of patch_size={p})"
            )


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
    def forward(
        self,
        pixel_values=None,
        output_attentions=None,
        output_hidden_states=None,
        interpolate_pos_encoding=None,
        **kwargs,
    ) -> BaseModelOutputWithPooling:
        """pixel_values (B, C, H, W), H and W multiples of patch_size; ``interpolate_pos_encoding``: resize a learned
        absolute table to the image's patch grid (relative encodings need nothing: they read the grid's positions);
        ``output_attentions``: every layer's attention weights (B, H, 1 + P, 1 + P), probed (O(P^2))."""
        check_extra_arguments(self, kwargs)
        refuse_in_context_parallel("LinearViT (its class token and patch grid are one image's)")
        if pixel_values is None:
            raise ValueError("pixel_values is required")
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        hidden_states, positions = self.embeddings(pixel_values, bool(interpolate_pos_encoding))
        hidden_states, all_hidden_states, all_attentions = self.stack(
            hidden_states, None, positions, None, output_hidden_states, output_attentions=output_attentions
        )
        hidden_states = self.norm(hidden_states)
        return base_model_output(
            BaseModelOutputWithPooling,
            hidden_states,
            all_hidden_states,
            all_attentions,
            pooler_output=hidden_states[:, 0],
        )


class LinearViTForImageClassification(LinearViTPreTrainedModel):
    def __init__(self, config: LinearViTConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = LinearViTModel(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        pixel_values=None,
        labels=None,
        output_attentions=None,
        output_hidden_states=None,
        interpolate_pos_encoding=None,
        **kwargs,
    ) -> ImageClassifierOutput:
        """labels (B,) class ids (or (B, num_labels) multi-hot floats); the rest as ``LinearViTModel``."""
        check_extra_arguments(self, kwargs)
        outputs = self.model(
            pixel_values=pixel_values,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            interpolate_pos_encoding=interpolate_pos_encoding,
        )
        logits = self.classifier(outputs.pooler_output)
        check_sequence_labels(labels, logits.shape[0], type(self).__name__)
        return head_output(ImageClassifierOutput, outputs, classification_loss(self, logits, labels), logits=logits)


LinearViTPreTrainedModel.auto_classes = {
    "AutoModel": LinearViTModel,
    "AutoModelForImageClassification": LinearViTForImageClassification,
}
