"""The causal product on flash-linear-attention's Triton kernels (the ``fla-core`` package), for CUDA tensors.

``fla_causal_product`` computes what the torch path of ``attention_kernels.causal_linear_attention`` computes,
through fla's ``chunk_simple_gla`` (several tokens) and ``fused_recurrent_simple_gla`` (one decoding step). Both
run the recurrence S_t = exp(g_t) S_{t-1} + k_t v_t^T, out_t = scale q_t S_t, ours with scale 1. The mapping:

- layout: ours (B, H, N, width), fla's (B, N, H, width);
- per-token log gates (B, H, N) become ``g`` (B, N, H); one constant log decay per head, ``g_gamma`` (H,);
- widths: every width handed to fla is even, by construction (``even_width``): fla's chunked backward asserts
  even key and value widths in half precision. An odd width gets a zero column (a zero key column adds nothing
  to q . k; a zero value column is dropped from the outputs and the states);
- the denominator q_s . z_s, z_s = sum_{t<=s} exp(G_s - G_t) k_t, comes from the same call as the product: a ones
  column appended to the values (and a zero column to an even width), so that every causal product is one call of
  fla's kernels (2 launches forward, 4 backward), gated, decayed or packed alike. The price is in fla's value
  tiles: 66 columns for heads of 64 take two tiles of 64 where 64 took one, so the kernels' value-side work doubles;
  at GPT-2 small's shape that work is about 4 MFLOP a token against the rest of the model's 247, while the
  alternatives cost a step in launches and host work: the keys' prefix sums beside the product (7 ops a layer with
  their backward) or, with gates or documents, a second fla call of width 2;
- packed documents (``resets``): each row, and each document inside a row, becomes one sequence of fla's
  ``cu_seqlens`` over the flattened batch; a row's initial state goes to its first document (unless that
  document starts the row afresh) and its final state comes from its last;
- initial and final states (B, H, m, dv') are fla's (sequences, H, K, V); with the denominator, their last
  column is the key sum, as the torch path's states.

The encodings stay outside: they transform queries, keys and features before the product, and the divisions,
FastRPB's bias and SPE's codes happen around it. What the kernels cannot take (``can_run``: tensors off CUDA,
float64, widths above ``MAX_WIDTH``, an fla that does not import, and the gated backward fla refuses on some Hopper
setups), the torch path runs.
"""

import functools
import importlib.util

import torch
from torch.nn import functional as F

from .kept_tensors import kept_tensor

MAX_WIDTH = 256  # the widest queries and values fla's kernels take


def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


@functools.cache
def load_fla():
    """fla's chunked and one-step kernels and None, or None and why they cannot be had. Imported on first use, on a
    machine with a GPU: fla's package needs a GPU driver to import."""
    if not fla_installed():
        return None, "fla-core is not installed (pip install 'lrpe-hf[gpu]')"
    try:
        from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
    except Exception as error:  # an fla that does not import here (say, against this Triton) leaves the torch path
        return None, f"fla-core does not import: {error}"
    return (chunk_simple_gla, fused_recurrent_simple_gla), None


def fla_kernels():
    """fla's (chunked, one-step) kernels."""
    kernels, why_not = load_fla()
    if kernels is None:
        raise ImportError(why_not)
    return kernels


def on_kernel_device(x) -> bool:
    """Whether x is on a device fla's kernels run on (CUDA)."""
    return x.is_cuda


def gated_backward_fails(dtype) -> bool:
    """Whether fla's backward with per-token gates raises here: fla 0.6 refuses it on Hopper GPUs with
    Triton >= 3.4, < 3.7.1, which miscompiles it (``ops/common/chunk_o.py``, ``chunk_bwd_dqkwg``), unless its
    TileLang backend takes the call, which it does only for float32 inputs (it wants the states in the inputs'
    dtype, and simple_gla's backward keeps them in float32) where tilelang and nvcc are installed. fla's modules are
    imported by name: transformers asks every user of a Hub checkpoint for each package an import statement of its
    code files names outside a ``try``, and fla is optional."""
    chunk_o = importlib.import_module("fla.ops.common.chunk_o")
    CommonTileLangBackend = importlib.import_module("fla.ops.common.backends.tilelang").CommonTileLangBackend
    if not (chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1):
        return False
    return dtype != torch.float32 or not CommonTileLangBackend.can_use()


def can_run(q, v, dtype, gated_backward: bool) -> str | None:
    """None when the kernels can compute this product, otherwise why not. q (B, H, N, m), v (B, H, N, dv);
    ``dtype``: the product's; ``gated_backward``: per-token gates (not one constant decay per head) and a gradient
    will be wanted."""
    if not on_kernel_device(q):
        return "its inputs are not on a CUDA device"
    if dtype == torch.float64:
        return "fla's kernels compute in float32 at most (float64 inputs would come back wrong)"
    if dtype == torch.float32 and q.is_cuda and torch.get_float32_matmul_precision() == "highest":
        return (
            "fla's kernels multiply float32 inputs in TF32 on a GPU, which torch's float32 matmul precision "
            "'highest' (its default) does not allow; torch.set_float32_matmul_precision('high') allows it"
        )
    if max(q.shape[-1], v.shape[-1]) > MAX_WIDTH:
        return f"query width {q.shape[-1]} or value width {v.shape[-1]} is above {MAX_WIDTH}"
    why_not = load_fla()[1]
    if why_not is None and gated_backward and gated_backward_fails(dtype):
        return (
            "fla's gated backward raises on Hopper GPUs with Triton >= 3.4, < 3.7.1 (fla issue #640) unless its "
            "TileLang backend takes it (float32 inputs, tilelang and nvcc installed); Triton >= 3.7.1 runs it"
        )
    return why_not


def even_width(x):
    """x (..., w) with a zero column appended where w is odd: fla's chunked backward in half precision asserts
    even key and value widths (``ops/common/chunk_o.py``, ``chunk_bwd_dv``)."""
    return F.pad(x, (0, 1)) if x.shape[-1] % 2 else x


def with_ones_column(v):
    """v (..., dv) with a ones column appended, and a zero column after it where dv + 1 is odd (fla wants even
    widths): one concatenation, where a pad with ones and a pad to an even width were two."""
    width = 1 if v.shape[-1] % 2 else 2
    tail = kept_tensor(
        f"ones column {width}", v, lambda: torch.tensor([1.0, 0.0][:width], dtype=v.dtype, device=v.device)
    )
    return torch.cat([v, tail.expand(*v.shape[:-1], width)], dim=-1)


def fla_causal_product(
    q, k, v, log_gates, log_decay, initial_state, resets, with_denominator: bool, dtype, kernels=None,
    final_state: bool = True,
):  # fmt: skip
    """q, k (B, H, N, m); v (B, H, N, dv); log_gates (B, H, N) or None; log_decay (H,): one constant log gate per
    head, used instead of ``log_gates`` when given; initial_state (B, H, m, dv') or None; resets (B, N) bool or
    None; ``dtype``: the products' dtype. ``kernels``: (chunked, one-step) functions with fla's signatures (default
    ``fla_kernels()``). Returns out (B, H, N, dv), the denominator (B, H, N, 1) or None and the final state
    (B, H, m, dv'), or None where ``final_state`` is False (fla then neither writes it nor is given its gradient),
    as ``causal_linear_attention``."""
    kernels = kernels or fla_kernels()
    dv = v.shape[-1]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if log_decay is not None:
        gates = {"g_gamma": log_decay.float()}
    else:
        gates = {"g": log_gates.transpose(1, 2).float().contiguous() if log_gates is not None else None}
    # fla's layout, once for both products (fla would copy a transposed view at each call)
    fq, fk = even_width(q).transpose(1, 2).contiguous(), even_width(k).transpose(1, 2).contiguous()  # (B, N, H, m')

    def product(values, state):
        return fla_product(kernels, fq, fk, values, gates, state, resets, q.shape[-1], final_state)

    if not with_denominator:
        out, final = product(v, initial_state)
        return out, None, final
    out, final = product(with_ones_column(v), initial_state)  # the denominator in the same call
    return out[..., :dv], out[..., dv : dv + 1], None if final is None else final[..., : dv + 1]


def fla_product(kernels, q, k, v, gates, initial_state, resets, m: int, final_state: bool = True):
    """One product on fla's kernels: q, k (B, N, H, m') in fla's layout, m' even (m of them the keys' own);
    v (B, H, N, dv); gates as ``fla_causal_product`` passes them; initial_state (B, H, m, dv) or None (fewer
    columns are filled with zeros to v's width); resets (B, N) bool or None. Returns out (B, H, N, dv) and the final
    state (B, H, m, dv) in float32, or None where ``final_state`` is False."""
    chunked, one_step = kernels
    dv = v.shape[-1]
    v = even_width(v).transpose(1, 2).contiguous()  # (B, N, H, dv'), dv' even: fla would copy a strided view
    if initial_state is not None:  # fla only reads it: padded, or as it is (a copy would cost a launch a step)
        padding = (0, v.shape[-1] - initial_state.shape[-1], 0, q.shape[-1] - m)  # zero rows and columns
        initial_state = F.pad(initial_state.float(), padding) if any(padding) else initial_state.float().contiguous()
    if resets is None:
        kernel = one_step if q.shape[1] == 1 else chunked
        out, final = kernel(q, k, v, **gates, scale=1.0, initial_state=initial_state, output_final_state=final_state)
    else:
        out, final = packed_product(chunked, q, k, v, gates, initial_state, resets, final_state)
    return out.transpose(1, 2)[..., :dv], None if final is None else final[..., :m, :dv]


def packed_product(kernel, q, k, v, gates, initial_state, resets, final_state: bool = True):
    """The product of rows holding several documents: every row and every document in it one sequence of
    ``cu_seqlens`` over the flattened batch. q, k, v (B, N, H, width); gates as ``fla_causal_product`` passes them;
    resets (B, N) bool. Returns out (B, N, H, dv') and each row's final state (B, H, m, dv'), or None where
    ``final_state`` is False."""
    B, N = resets.shape
    starts = resets.clone()
    starts[:, 0] = True
    first_tokens = starts.reshape(-1).nonzero()[:, 0]  # each sequence's first token in the flattened batch
    cu_seqlens = F.pad(first_tokens, (0, 1), value=B * N)
    row_starts = torch.arange(B, device=resets.device) * N
    first_sequence = torch.searchsorted(first_tokens, row_starts)  # each row's first document
    if initial_state is not None:
        continued = (~resets[:, 0]).to(initial_state.dtype)[:, None, None, None]  # a reset drops the state
        sequence_states = initial_state.new_zeros(len(first_tokens), *initial_state.shape[1:])
        initial_state = sequence_states.index_copy(0, first_sequence, initial_state * continued)
    flat = [x.reshape(1, B * N, *x.shape[2:]) for x in (q, k, v)]
    if gates.get("g") is not None:
        gates = {"g": gates["g"].reshape(1, B * N, -1)}
    out, finals = kernel(
        *flat, **gates, scale=1.0, initial_state=initial_state, output_final_state=final_state, cu_seqlens=cu_seqlens
    )
    if finals is None:
        return out.view(B, N, *out.shape[2:]), None
    last_sequence = torch.searchsorted(first_tokens, row_starts + N) - 1  # each row's last document
    return out.view(B, N, *out.shape[2:]), finals[last_sequence]
