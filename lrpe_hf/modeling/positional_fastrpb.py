"""FastRPB: a learnable Toeplitz positional bias added to the attention output, Y = Attention(Q, K, V) + W V
(FastRPB eq. 10-12; the 2D form of section 3.2.2 and Appendix B.3).

W[s, t] = w[p_s - p_t] per head, one weight per relative distance |p_s - p_t| < max_positions (the paper indexes
w by t - s: the same family of matrices with the weight vector mirrored). W V is a
convolution of the values along positions, computed with the FFT in O(N log N) time and O(N) memory: the
values are summed into one bin per position (so any integer positions work, padding included), convolved
with the lag weights, and read back at the query positions. Causal models zero every negative lag
(t after s). 2D uses the separable bias w_row(row_s - row_t) + w_col(col_s - col_t) = a row Toeplitz over
row sums plus a column Toeplitz over column sums. The paper shares one w between the two axes; here each axis
learns its own (a superset: equal weights recover the paper's form).
"""

import torch
from torch.nn import functional as F

from .positional_encoding import PositionalEncoding, token_blocks
from .positional_spe import fast_fft_size
from .positions import check_values


def toeplitz_apply(lag_weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Multiply by the Toeplitz matrix W[s, t] = w[s - t] via FFT.
    lag_weights (H, 2S - 1) for lags -(S-1)..(S-1); values (B, H, S, d) -> (B, H, S, d).
    """
    return ToeplitzProduct.apply(lag_weights, values)


TRANSPOSE_BLOCK = 256  # tokens per block of the transposing copy into the FFT's buffer


def spectrum(x: torch.Tensor, n: int) -> torch.Tensor:
    """The real FFT of length n along the sequence of x (B, H, S, d), zero-padded, in float32 at least (the FFT has
    no half-precision CPU kernels): (B, H, d, n // 2 + 1). x is copied once, transposed into the padded buffer a
    block of tokens at a time, so that each transform reads contiguous memory."""
    S, d = x.shape[-2:]
    padded = x.new_empty(*x.shape[:-2], d, n, dtype=torch.promote_types(x.dtype, torch.float32))
    for tokens in token_blocks(S, 1, TRANSPOSE_BLOCK):  # on a CPU a whole transposing copy runs several times slower
        padded[..., tokens] = x[..., tokens, :].transpose(-1, -2)
    padded[..., S:] = 0.0
    return torch.fft.rfft(padded, dim=-1)


def toeplitz_from_spectrum(lag_weights: torch.Tensor, values_spectrum: torch.Tensor, S: int, n: int) -> torch.Tensor:
    """W V from the spectrum of V (``spectrum(values, n)``, which this overwrites), n >= 2S - 1 so that the kept
    outputs are free of circular wrap-around: (B, H, S, d), in the spectrum's real dtype."""
    kernel = torch.fft.rfft(lag_weights.to(values_spectrum.real.dtype), n=n, dim=-1)
    full = torch.fft.irfft(values_spectrum.mul_(kernel[None, :, None, :]), n=n, dim=-1)
    return full[..., S - 1 : 2 * S - 1].transpose(-1, -2)


def toeplitz_fft(lag_weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The product of ``toeplitz_apply``, in float32 at least."""
    S = values.shape[-2]
    n = fast_fft_size(2 * S - 1)
    return toeplitz_from_spectrum(lag_weights, spectrum(values, n), S, n)


class ToeplitzProduct(torch.autograd.Function):
    """``toeplitz_apply`` saving its inputs only, where autograd through the FFTs kept two spectra of the
    values' size. Backward: grad_values = W^T grad, the same product with the lags mirrored; grad_w[lag] =
    sum over s - t = lag of grad_s . v_t, a cross-correlation, also by FFT; both from one spectrum of grad."""

    @staticmethod
    def forward(ctx, lag_weights, values):
        ctx.save_for_backward(lag_weights, values)
        return toeplitz_fft(lag_weights, values).to(values.dtype)

    @staticmethod
    def backward(ctx, grad):
        lag_weights, values = ctx.saved_tensors
        S = values.shape[-2]
        n = fast_fft_size(2 * S - 1)
        grad_spectrum = spectrum(grad, n)
        grad_values = grad_weights = None
        if ctx.needs_input_grad[0]:
            # c[lag] = sum_s grad_s v_{s - lag}, circular over n >= 2S - 1, so lags -(S-1)..(S-1) do not wrap
            cross = spectrum(values, n).conj_physical_().mul_(grad_spectrum).sum((0, 2))
            correlation = torch.fft.irfft(cross, n=n, dim=-1)
            grad_weights = torch.cat([correlation[:, n - S + 1 :], correlation[:, :S]], dim=-1).to(lag_weights.dtype)
        if ctx.needs_input_grad[1]:
            grad_values = toeplitz_from_spectrum(lag_weights.flip(-1), grad_spectrum, S, n).to(values.dtype)
        return grad_weights, grad_values


class FastRelativePositionBias(PositionalEncoding):
    """``value_bias`` adds W V (eq. 12), by FFT for long inputs and as an explicit matrix for short ones."""

    def __init__(self, num_heads: int, max_positions: int, position_dims: int = 1, init_std: float = 0.0):
        super().__init__()
        self.num_heads, self.max_positions, self.position_dims, self.init_std = (
            num_heads,
            max_positions,
            position_dims,
            init_std,
        )
        self.register_initial_values(trainable={"weights": True})  # [axis, head, max_positions - 1 + lag]

    def initial_values(self):
        weights = torch.zeros(self.position_dims, self.num_heads, 2 * self.max_positions - 1)
        return {"weights": weights.normal_(0.0, self.init_std) if self.init_std > 0 else weights}

    @classmethod
    def from_options(cls, options, num_heads, head_dim, feature_dim):
        return cls(num_heads, options.max_positions, options.position_dims, options.fastrpb_init_std)

    def lag_weights(self, axis: int, span: int, causal: bool) -> torch.Tensor:
        """(H, 2 span - 1) weights for lags -(span-1)..(span-1), zero beyond the table (|lag| >= max_positions,
        which only the gaps between packed documents reach); negative lags zeroed when causal."""
        reach = min(span, self.max_positions)
        center = self.max_positions - 1
        weights = self.weights[axis, :, center - reach + 1 : center + reach]
        if reach < span:
            weights = F.pad(weights, (span - reach, span - reach))
        if causal:
            weights = torch.cat([torch.zeros_like(weights[:, : span - 1]), weights[:, span - 1 :]], dim=-1)
        return weights

    def check_span(self, span: int):
        if span > self.max_positions:
            raise ValueError(
                f"fastrpb learns biases for relative distances below max_positions={self.max_positions}, but these "
                f"positions span {span}; use shorter inputs or a model with a larger max_positions"
            )

    def check_lags(self, lags: torch.Tensor):
        """``check_span`` for a tensor of lags, on the device where a read would wait for it (``check_values``)."""
        check_values(
            lags.abs() < self.max_positions,
            f"fastrpb learns biases for relative distances below max_positions={self.max_positions}, but these "
            "positions span more; use shorter inputs or a model with a larger max_positions",
        )

    def reference_value_bias(self, values, positions, mask, head, causal):
        """sum_t W[s, t] v_t with W[s, t] = sum over axes of w_a[p_s - p_t] (only lags >= 0 causal), over the real
        keys t, term by term."""
        out = torch.zeros_like(values)
        for s, query in enumerate(positions):
            for t, key in enumerate(positions):
                lags = [query[a] - key[a] for a in range(self.position_dims)]
                if not mask[t]:
                    continue
                bias = sum(
                    float(self.weights[a, head, self.max_positions - 1 + lag].detach())
                    for a, lag in enumerate(lags)
                    if not (causal and lag < 0)
                )
                out[s] += bias * values[t]
        return out

    def value_bias(self, values, key_positions, query_positions, causal, key_documents=None, query_documents=None):
        """values (B, H, T, d), zero where padded; key_positions (B, T, A); query_positions (B, N, A); the
        documents of keys (B, T) and queries (B, N) of packed rows, or None. Returns W V at the queries:
        (B, H, N, d); a query sees the values of its own document only."""
        if query_positions.shape[1] * key_positions.shape[1] <= 4096 * 64:
            return self.dense(values, key_positions, query_positions, causal, key_documents, query_documents)
        if key_documents is None:
            return self.fft(values, key_positions, query_positions, causal)
        # lay the documents out far apart: no learned lag reaches across (each one's span is checked)
        key_positions, query_positions, span = self.separate_documents(
            key_positions, query_positions, key_documents, query_documents
        )
        return self.fft(values, key_positions, query_positions, causal, span)

    def separate_documents(self, key_positions, query_positions, key_documents, query_documents):
        """1D positions (B, T, 1), (B, N, 1) moved so that documents are max_positions apart: document j of a
        row starts at j * (longest document span + max_positions). Returns them and the span they cover. The
        documents' count and spans are read on the host (two reads a layer, packed rows of over 512 tokens only)."""
        positions = torch.cat([key_positions[..., 0], query_positions[..., 0]], dim=1)
        documents = torch.cat([key_documents, query_documents], dim=1)
        documents = documents - documents.amin(1, keepdim=True)
        count = int(documents.max()) + 1
        low = positions.new_full((positions.shape[0], count), torch.iinfo(positions.dtype).max)
        high = positions.new_full((positions.shape[0], count), torch.iinfo(positions.dtype).min)
        low = low.scatter_reduce(1, documents, positions, "amin")
        high = high.scatter_reduce(1, documents, positions, "amax")
        span = int((high - low).clamp_min(0).max()) + 1
        self.check_span(span)
        moved = positions - low.gather(1, documents) + documents * (span + self.max_positions)
        total = (count - 1) * (span + self.max_positions) + span
        return moved[:, : key_positions.shape[1], None], moved[:, key_positions.shape[1] :, None], total

    def fft(self, values, key_positions, query_positions, causal, span=None):
        """The product by FFT over position bins: each key's value goes to the bin of its position less the row's
        lowest, and each query reads its own bin. The bins span the table's reach (``max_positions``, from the
        config), which any valid input's positions fit in (checked on the device), so that no span is read back to
        size them; ``span``: a larger one the caller has measured (documents laid apart)."""
        B, H, T, d = values.shape
        span = span or self.max_positions
        out = 0
        for axis in range(key_positions.shape[-1]):
            keys, queries = key_positions[..., axis], query_positions[..., axis]
            lo = torch.minimum(keys.amin(1), queries.amin(1))  # (B,)
            key_bins, query_bins = keys - lo[:, None], queries - lo[:, None]
            if span == self.max_positions:
                self.check_lags(torch.maximum(key_bins.amax(1), query_bins.amax(1)))
            bins = values.new_zeros(B, H, span, d)
            bins.scatter_add_(2, key_bins[:, None, :, None].expand(B, H, T, d), values)
            mixed = toeplitz_apply(self.lag_weights(axis, span, causal), bins)
            out = out + mixed.gather(2, query_bins[:, None, :, None].expand(B, H, queries.shape[1], d))
        return out

    def dense(self, values, key_positions, query_positions, causal, key_documents=None, query_documents=None):
        """The same product with an explicit (N x T) weight matrix; cheaper for short inputs and single steps."""
        out = None
        other_document = None
        if key_documents is not None:
            other_document = query_documents[:, :, None] != key_documents[:, None, :]  # (B, N, T)
        for axis in range(key_positions.shape[-1]):
            lags = query_positions[..., axis, None] - key_positions[:, None, :, axis]  # (B, N, T)
            if other_document is not None:
                lags = lags.masked_fill(other_document, 0)
            self.check_lags(lags)
            weights = self.weights[axis][:, self.max_positions - 1 + lags].transpose(0, 1)  # (B, H, N, T)
            if causal:
                weights = weights.masked_fill((lags < 0)[:, None], 0.0)
            if other_document is not None:
                weights = weights.masked_fill(other_document[:, None], 0.0)
            term = weights.to(values.dtype) @ values
            out = term if out is None else out + term
        return out
