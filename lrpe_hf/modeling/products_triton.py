"""The causal product on flash-linear-attention's Triton kernels (the ``fla-core`` package), for CUDA tensors.

``fla_causal_product`` computes what the torch path of ``attention_kernels.causal_linear_attention`` computes,
through fla's ``chunk_simple_gla`` (several tokens) and ``fused_recurrent_simple_gla`` (one decoding step). Both
run the recurrence S_t = exp(g_t) S_{t-1} + k_t v_t^T, out_t = scale q_t S_t, ours with scale 1. The mapping:

- layout: ours (B, H, N, width), fla's (B, N, H, width);
- per-token log gates (B, H, N) become ``g`` (B, N, H); one constant log decay per head, ``g_gamma`` (H,);
- the denominator: a ones column appended to the values (as the torch path's states keep it: the last column);
- packed documents (``resets``): each row, and each document inside a row, becomes one sequence of fla's
  ``cu_seqlens`` over the flattened batch; a row's initial state goes to its first document (unless that
  document starts the row afresh) and its final state comes from its last;
- initial and final states (B, H, m, dv) are fla's (sequences, H, K, V).

The encodings stay outside: they transform queries, keys and features before the product, and the divisions,
FastRPB's bias and SPE's codes happen around it. What the kernels cannot take (``can_run``), the torch path runs:
tensors off CUDA, and query or value widths above ``MAX_WIDTH``.
"""

import functools
import importlib.util

import torch
from torch.nn import functional as F

MAX_WIDTH = 256  # the widest queries and values (value columns include the denominator's) fla's kernels take


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


def can_run(q, v, with_denominator: bool) -> str | None:
    """None when the kernels can compute this product, otherwise why not."""
    if not q.is_cuda:
        return "its inputs are not on a CUDA device"
    if q.shape[-1] > MAX_WIDTH or v.shape[-1] + with_denominator > MAX_WIDTH:
        return f"query width {q.shape[-1]} or value width {v.shape[-1] + with_denominator} is above {MAX_WIDTH}"
    return load_fla()[1]


def fla_causal_product(
    q, k, v, log_gates, log_decay, initial_state, resets, with_denominator: bool, dtype, kernels=None
):
    """q, k (B, H, N, m); v (B, H, N, dv); log_gates (B, H, N) or None; log_decay (H,): one constant log gate per
    head, used instead of ``log_gates`` when given; initial_state (B, H, m, dv') or None; resets (B, N) bool or
    None; ``dtype``: the products' dtype. ``kernels``: (chunked, one-step) functions with fla's signatures (default
    ``fla_kernels()``). Returns out (B, H, N, dv), the denominator (B, H, N, 1) or None and the final state
    (B, H, m, dv'), as ``causal_linear_attention``."""
    chunked, one_step = kernels or fla_kernels()
    B, H, N, _ = q.shape
    if with_denominator:
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    q, k, v = (x.to(dtype).transpose(1, 2) for x in (q, k, v))  # (B, N, H, width)
    if log_decay is not None:
        gates = {"g_gamma": log_decay.float()}
    else:
        gates = {"g": log_gates.transpose(1, 2).float() if log_gates is not None else None}
    if initial_state is not None:
        initial_state = initial_state.float()
    if resets is None:
        kernel = one_step if N == 1 else chunked
        out, final = kernel(q, k, v, **gates, scale=1.0, initial_state=initial_state, output_final_state=True)
    else:
        out, final = packed_product(chunked, q, k, v, gates, initial_state, resets)
    out = out.to(dtype).transpose(1, 2)  # (B, H, N, dv')
    if with_denominator:
        return out[..., :-1], out[..., -1:], final
    return out, None, final


def packed_product(kernel, q, k, v, gates, initial_state, resets):
    """The product of rows holding several documents: every row and every document in it one sequence of
    ``cu_seqlens`` over the flattened batch. q, k, v (B, N, H, width); gates as ``fla_causal_product`` passes them;
    resets (B, N) bool. Returns out (B, N, H, dv') and each row's final state (B, H, m, dv')."""
    B, N = resets.shape
    starts = resets.clone()
    starts[:, 0] = True
    first_tokens = starts.reshape(-1).nonzero()[:, 0]  # each sequence's first token in the flattened batch
    cu_seqlens = F.pad(first_tokens, (0, 1), value=B * N)
    row_starts = torch.arange(B, device=resets.device) * N
    first_sequence = torch.searchsorted(first_tokens, row_starts)  # each row's first document
    last_sequence = torch.searchsorted(first_tokens, row_starts + N) - 1  # and its last
    if initial_state is not None:
        continued = (~resets[:, 0]).to(initial_state.dtype)[:, None, None, None]  # a reset drops the state
        sequence_states = initial_state.new_zeros(len(first_tokens), *initial_state.shape[1:])
        initial_state = sequence_states.index_copy(0, first_sequence, initial_state * continued)
    flat = [x.reshape(1, B * N, *x.shape[2:]) for x in (q, k, v)]
    if gates.get("g") is not None:
        gates = {"g": gates["g"].reshape(1, B * N, -1)}
    out, finals = kernel(
        *flat, **gates, scale=1.0, initial_state=initial_state, output_final_state=True, cu_seqlens=cu_seqlens
    )
    return out.view(B, N, *out.shape[2:]), finals[last_sequence]
