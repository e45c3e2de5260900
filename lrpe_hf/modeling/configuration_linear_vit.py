"""Configuration of LinearViT, a vision transformer with linear attention and 2D positional encodings."""

from .configuration_linear_attention import LinearAttentionConfig


class LinearViTConfig(LinearAttentionConfig):
    """Defaults: DeiT-small (12 layers x 384, 6 heads, FFN 1536, GELU, patch 16, 224 px), the LRPE paper's image
    model (Appendix E, "IM"), with 2D LRPE Type 2 (``lrpe_orthogonal``) over the patch grid.

    Patches carry their (row, column); the class token sits at (-1, -1), one step before the first row and
    column. Relative encodings other than FastRPB (whose bias table spans ``image_size / patch_size + 1``
    positions per axis) accept images of any size that is a multiple of ``patch_size``.

    Args:
        image_size, patch_size, num_channels: the input geometry.
        hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, hidden_act: the usual sizes.
        hidden_dropout_prob, layer_norm_eps, initializer_range: as in ViT.
        The attention fields are documented in ``LinearAttentionConfig``; ``absolute_position_embedding="learned"``
        is ViT's table over the class token and the patches of ``image_size`` images.
    """

    model_type = "linear_vit"
    position_dims = 2

    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    hidden_size: int = 384
    num_hidden_layers: int = 12
    num_attention_heads: int = 6
    intermediate_size: int = 1536
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.0
    layer_norm_eps: float = 1e-6
    initializer_range: float = 0.02

    def __post_init__(self, **kwargs):
        self._check_sizes()  # before the multiple check divides by patch_size
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size ({self.image_size}) must be a multiple of patch_size ({self.patch_size})")
        super().__post_init__(**kwargs)

    @property
    def grid_size(self) -> int:
        return self.image_size // self.patch_size

    @property
    def max_relative_positions(self) -> int:
        return self.grid_size + 1  # the class token at -1 widens each axis by one
