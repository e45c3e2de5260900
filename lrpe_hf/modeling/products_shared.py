"""What the chunked products share: chunk sizes, the products' dtype, blocks of rows and heads, scratch memory, and the
division of a product by its denominator.

Shapes: B batch, H heads, N tokens, m feature dim, dv value dim.
"""

import math

import torch

from .kept_tensors import kept_tensor

BLOCK_ELEMENTS = 1 << 20  # the C x C scores of one block of the chunked products: 4 MB in float32


def heads_per_block(num_heads: int, num_chunks: int, chunk_size: int) -> int:
    """How many heads the chunked products handle at once: as many as keep one block's C x C scores within
    ``BLOCK_ELEMENTS``. Small blocks stay in the CPU's caches and in the allocator's reused memory; a full-size
    temporary costs a fresh allocation (page faults) and a trip through main memory."""
    return max(1, min(num_heads, BLOCK_ELEMENTS // (num_chunks * chunk_size * chunk_size)))


def head_blocks(num_heads: int, num_chunks: int, chunk_size: int):
    """The slices of consecutive heads, ``heads_per_block`` at a time, that cover ``num_heads``."""
    step = heads_per_block(num_heads, num_chunks, chunk_size)
    return [slice(start, start + step) for start in range(0, num_heads, step)]


def batch_head_blocks(batch_size: int, num_heads: int, num_chunks: int, chunk_size: int):
    """(rows, heads) slices that cover a (B, H) grid in blocks within ``BLOCK_ELEMENTS``: every row and some heads,
    or one head and some rows. Either way the block of a tensor stored heads-first (``heads_first``) is
    contiguous."""
    heads = heads_per_block(num_heads, batch_size * num_chunks, chunk_size)
    rows = batch_size if heads > 1 else heads_per_block(batch_size, num_chunks, chunk_size)
    return [
        (slice(row, row + rows), slice(head, head + heads))
        for head in range(0, num_heads, heads)
        for row in range(0, batch_size, rows)
    ]


def heads_first(batch_size: int, num_heads: int, num_tokens: int, width: int, like, dtype=None):
    """A new (B, H, N, width) tensor stored as (H, B, N, width), where every block of ``batch_head_blocks`` is
    contiguous."""
    return like.new_empty(num_heads, batch_size, num_tokens, width, dtype=dtype).transpose(0, 1)


def block_of(x, rows, heads):
    """x[rows, heads] (b, h, ...) as (h, b, ...): the order in which a block's chunks are stacked."""
    return x[rows, heads].transpose(0, 1)


class Scratch:
    """Memory that the blocks of one chunked product reuse: one buffer per purpose, allocated once per call, not
    once per block. (Freed multi-MB temporaries go back to the system, and a fresh one is faulted in page by page:
    on a CPU that took about as long as the copy that fills it.)"""

    def __init__(self):
        self.buffers = {}

    def __call__(self, purpose: str, shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` on ``like``'s device (in ``dtype``, or like's): the memory last
        handed out for ``purpose``, where it is large enough."""
        dtype = dtype or like.dtype
        size = math.prod(shape)
        buffer = self.buffers.get(purpose)
        if buffer is None or buffer.numel() < size or buffer.dtype != dtype:
            buffer = self.buffers[purpose] = like.new_empty(size, dtype=dtype)
        return buffer[:size].view(shape)


def chunks_of(x, rows, heads, chunk_size: int, dtype, scratch: Scratch, purpose: str):
    """The block (rows, heads) of x (B, H, N, w) as contiguous chunks (h * b * nc, C, w) in ``dtype``: a view when
    x is laid out so already, otherwise a copy of the block into ``scratch``'s memory for ``purpose``."""
    block = block_of(x, rows, heads)
    if block.dtype == dtype and block.is_contiguous():
        return block.view(-1, chunk_size, block.shape[-1])
    chunks = scratch(purpose, block.shape, block, dtype).copy_(block)
    return chunks.view(-1, chunk_size, block.shape[-1])


def divide_rows(numerator: torch.Tensor, denominator: torch.Tensor, eps, guard=None):
    """numerator (B, H, N, d) / guard(denominator (B, H, N, 1) + eps), written in the memory order (B, N, H, d)
    that the output projection reads: the heads are merged by a view, not by one more copy. ``eps`` is a number
    or a tensor broadcastable to (B, H, N, 1); ``guard`` maps the denominator before it divides (``nonzero``), or is
    None. Returns the result and the divisor guard(denominator + eps) (B, H, N, 1), which backward takes. Compiled:
    plain differentiable ops, which the compiler fuses. In float16 the divisor is float32 (and so is the quotient,
    cast to float16 as it is written): a padded row's divisor 0 + eps (1e-6) would leave float16's range (its
    reciprocal, 1e6, is past the largest, 65504), and 0 x inf is NaN in its gradients."""
    if denominator.dtype == torch.float16:
        denominator = denominator.float()
    divisor = denominator + eps
    if guard:
        divisor = guard(divisor)
    if torch.compiler.is_compiling():  # the compiler chooses the layout (and takes no out= views)
        return (numerator / divisor).to(numerator.dtype), divisor
    B, H, N, d = numerator.shape
    return torch.div(numerator, divisor, out=numerator.new_empty(B, N, H, d).transpose(1, 2)), divisor


def default_chunk_size(num_tokens: int) -> int:
    """64 at every length: the fastest forward and forward+backward measured on a 2-core CPU, 4k to 16k tokens."""
    return 64


def chunk_length(num_tokens: int, chunk_size: int | None) -> int:
    """The chunk length for an input of ``num_tokens``: ``chunk_size`` (None: the default), at most the input."""
    return max(1, min(chunk_size or default_chunk_size(num_tokens), num_tokens))


def product_dtype(*tensors) -> torch.dtype:
    """The dtype the chunked products compute in: autocast's where it is on (as a matmul would), otherwise the
    inputs' promoted dtype."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(tensors[0].dtype, tensors[1].dtype)


def row_dot(x: torch.Tensor, y: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """alpha * sum_i x[..., i] y[..., i]: x, y (..., w) -> (..., 1). One batched product of the rows, in the order
    they lie in memory, where x and y share one layout in which each row's elements are adjacent and the rows follow
    one another (the layers' tensors are laid out so): one op and no full-size temporary, where the elementwise
    product and its sum take two (and the batched product was 2.5x faster on a CPU); otherwise those two. Compiled,
    the two, which the compiler fuses."""
    dense = x.shape == y.shape and x.stride() == y.stride() and x.dtype == y.dtype and x.stride(-1) == 1
    if dense and not torch.compiler.is_compiling():
        order = sorted(range(x.dim() - 1), key=x.stride, reverse=True)  # the rows' dims, outermost first
        rows_x, rows_y = x.permute(*order, -1), y.permute(*order, -1)
        if rows_x.is_contiguous():
            w = x.shape[-1]
            zero = kept_tensor("zero", x, lambda: torch.zeros((), dtype=x.dtype, device=x.device))
            dots = torch.baddbmm(zero, rows_x.view(-1, 1, w), rows_y.view(-1, w, 1), beta=0, alpha=alpha)
            inverse = sorted(range(len(order)), key=order.__getitem__)
            return dots.view(*rows_x.shape[:-1], 1).permute(*inverse, -1)
    dots = torch.linalg.vecdot(x, y).unsqueeze(-1)
    return dots if alpha == 1 else dots * alpha
