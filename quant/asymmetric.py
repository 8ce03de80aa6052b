"""Asymmetric min/max quantization as ALISA stores its KV (https://arxiv.org/abs/2403.17312, §V).

x_q = round(x / lambda + z), lambda = (max - min) / (2^b - 1), z = round(-min / lambda), per group
of ``group_size`` consecutive values along the last dimension (default: the whole last dimension,
i.e. per token per KV head over head_dim for a (B, H, S, D) cache). Dequantization is
x = lambda * (x_q - z). Every value comes back within lambda / 2 of the original.

Scales and zero points are stored in ``scale_dtype`` (float16 by default, the cache's choice)
unless that cannot hold them exactly enough (a zero point that is not an exact integer, a scale
that under- or overflows, a constant group's value); then the whole tensor uses float32, or
float64 as a last resort, so the error bound always holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial, wraps

import torch

from quant.packing import pack_nibbles, unpack_nibbles

SUPPORTED_BITS = (4, 8)
FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)
# Input shapes a region may be compiled for in one traced step before torch.compile raises: a
# layer's at most, so a model whose layers all differ in shape still compiles (each its own).
_REGION_SHAPES = 256


def _compiled_once(function: Callable) -> Callable:
    """``function``, marked for ``torch.compile`` as a nested compile region: traced and
    compiled once per input shape, and that code called again at every later call of a traced
    step (hierarchical compilation,
    https://docs.pytorch.org/docs/stable/generated/torch.compiler.nested_compile_region.html).
    Outside a trace it is a plain call.

    A static decode step codes and decodes with the same shapes in every layer; inlined, the
    compiler traced, lowered and generated the code of these scale-dtype checks thirty times
    (SmolLM2-135M's INT8 step, a cold compile of 504 s against 210 s as regions:
    docs/compile.md).
    """
    region = torch.compiler.nested_compile_region(function, max_reuse_entries=_REGION_SHAPES)
    return wraps(function)(region)


@dataclass(frozen=True)
class QuantizedTensor:
    """Codes plus per-group scale and zero point.

    Attributes
    ----------
    data
        uint8 codes, shape ``shape`` (8 bits) or ``shape[:-1] + (shape[-1] // 2,)`` (4 bits,
        two codes per byte).
    scale, zero_point
        (..., shape[-1] // group_size) per-group lambda and z.
    shape, dtype
        Shape and dtype of the original tensor (what ``dequantize`` returns).
    bits, group_size
        Code width and values per group along the last dimension.
    """

    data: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    bits: int
    group_size: int

    @property
    def nbytes(self) -> int:
        """Bytes stored: codes, scales and zero points."""
        return self.data.nbytes + self.scale.nbytes + self.zero_point.nbytes


def check_options(bits: int, group_size: int, last_dim: int) -> None:
    """``ValueError`` for unsupported bits or a group size that does not divide ``last_dim``."""
    if bits not in SUPPORTED_BITS or isinstance(bits, bool):
        raise ValueError(f"bits={bits!r} is not supported; use one of {SUPPORTED_BITS}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive integer")
    if last_dim % group_size:
        raise ValueError(f"group_size={group_size} does not divide the last dimension {last_dim}")
    if bits == 4 and group_size % 2:
        raise ValueError(f"group_size={group_size} must be even for 4-bit packing")


def quantize(
    x: torch.Tensor,
    bits: int = 8,
    group_size: int | None = None,
    *,
    scale_dtype: torch.dtype = torch.float16,
    check_finite: bool = True,
) -> QuantizedTensor:
    """Quantize a float tensor to ``bits``-bit codes, per group along the last dimension.

    Parameters
    ----------
    x
        (..., D) float32, float16 or bfloat16 tensor; no NaN or infinity.
    bits
        8 or 4 (4-bit codes are packed two per byte).
    group_size
        Values per group along the last dimension; must divide D. Default: D.
    scale_dtype
        Preferred storage dtype of scales and zero points (promoted when it cannot hold them).
    check_finite
        Reject NaN/infinity (default). A caller that already knows its input is finite, such as
        a KV cache quantizing each new token, can skip the check.

    Returns
    -------
    QuantizedTensor
    """
    if x.dtype not in FLOAT_INPUTS:
        raise ValueError(f"dtype={x.dtype} is not supported; quantize float32/float16/bfloat16")
    if x.dim() == 0:
        raise ValueError("cannot quantize a 0-dimensional tensor")
    group = x.shape[-1] if group_size is None else group_size
    check_options(bits, group, x.shape[-1])
    if check_finite and not bool(torch.isfinite(x).all()):
        raise ValueError("cannot quantize a tensor with NaN or infinite values")
    levels = 2**bits - 1
    grouped = x.double().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    low, constant, scale = _span(grouped, levels)
    stored_scale, stored_zero = _storable(scale, low, constant, scale_dtype)
    codes = _codes(grouped, stored_scale, stored_zero, levels).reshape(x.shape)
    if bits == 4:
        codes = pack_nibbles(codes)
    return QuantizedTensor(
        data=codes,
        scale=stored_scale,
        zero_point=stored_zero,
        shape=tuple(x.shape),
        dtype=x.dtype,
        bits=bits,
        group_size=group,
    )


def dequantize(q: QuantizedTensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Float tensor of the original shape and dtype: lambda * (x_q - z) per group.

    Computed in the output dtype when that is exact (float32, or float16 with float16 scales:
    codes, zero points and their difference are small integers, so only the product rounds, as
    it would in float32 before the cast), else in float32/float64 and cast; in place either way.

    Parameters
    ----------
    q
        The codes, (..., D * bits / 8) with their scales and zero points (..., D / group).
    out
        Optional tensor of ``q.shape`` and ``q.dtype`` to write into (a view is fine, e.g. part
        of a larger buffer): the same values, without allocating the result.
    """
    compute = _compute_dtype(q)
    if out is None:
        return _decoded(q.data, q.scale, q.zero_point, compute=compute, dtype=q.dtype, bits=q.bits)
    if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
        raise ValueError(
            f"out has shape {tuple(out.shape)} and dtype {out.dtype}; "
            f"expected {tuple(q.shape)} and {q.dtype}"
        )
    if compute != q.dtype:
        return out.copy_(dequantize(q))
    codes = unpack_nibbles(q.data) if q.bits == 4 else q.data
    # The codes are small integers: exact in the output dtype.
    return _scaled(out.copy_(codes), q.scale, q.zero_point)


def _compute_dtype(q: QuantizedTensor) -> torch.dtype:
    return _compute_for(q.dtype, q.scale.dtype)


def _compute_for(dtype: torch.dtype, scale_dtype: torch.dtype) -> torch.dtype:
    """The dtype :func:`dequantize` computes values of ``dtype`` in under ``scale_dtype`` scales:
    one where the product rounds once, as it would before the cast."""
    if scale_dtype == torch.float64:
        return torch.float64
    if dtype == torch.float32 or (dtype == torch.float16 and scale_dtype == torch.float16):
        return dtype
    return torch.float32


#: The scale dtypes :func:`quantize` tries, narrowest first (:func:`quantize_fixed`'s levels).
SCALE_LEVELS = (torch.float16, torch.float32, torch.float64)


def _span(grouped: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each float64 group's (..., groups, size) minimum, whether it is constant, and its
    scale before storage: the range over ``levels`` steps, a constant group's value (1 for
    zeros)."""
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    constant = high == low
    scale = torch.where(constant, low, (high - low) / levels)
    return low, constant, torch.where(constant & (low == 0), torch.ones_like(scale), scale)


def _codes(
    grouped: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: int
) -> torch.Tensor:
    """uint8 codes of float64 groups under their stored scales and zero points (any dtype)."""
    codes = torch.round(grouped / scale.double().unsqueeze(-1) + zero.double().unsqueeze(-1))
    return codes.clamp_(0, levels).to(torch.uint8)


def _storable(
    scale: torch.Tensor, low: torch.Tensor, constant: torch.Tensor, preferred: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point in the first of (preferred, float32, float64) that holds them.

    Scales are rounded up, never down, so the codes still span [min, max]; the zero point is
    then derived from the stored scale (z = round(-min / lambda)) and must be an exact integer in
    that dtype; a constant group's value (its scale, with z = 0) must be exact.
    """
    for dtype in dict.fromkeys((preferred, *SCALE_LEVELS[1:])):
        stored_scale, stored_zero, fits = _stored_as(scale, low, constant, dtype)
        if bool(fits.all()):  # one reduction, one host sync
            return stored_scale, stored_zero
    raise AssertionError("float64 always holds float64 values")


def _stored_as(
    scale: torch.Tensor, low: torch.Tensor, constant: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scale and zero point stored as ``dtype`` (see :func:`_storable`), and where they hold."""
    stored_scale = scale.to(dtype)
    below = stored_scale.double().abs() < scale.abs()
    stored_scale = torch.where(
        below & ~constant,
        torch.nextafter(stored_scale, torch.full_like(stored_scale, torch.inf)),
        stored_scale,
    )
    zero = torch.where(constant, torch.zeros_like(low), torch.round(-low / stored_scale.double()))
    stored_zero = zero.to(dtype)
    wide = stored_scale.double()
    fits = (
        torch.isfinite(stored_scale)
        & (stored_scale != 0)
        & (stored_zero.double() == zero)
        & ((wide == scale) | ~constant)
    )
    return stored_scale, stored_zero, fits


@_compiled_once
def quantize_fixed(
    x: torch.Tensor,
    valid: torch.Tensor | None,
    level: torch.Tensor,
    *,
    bits: int = 8,
    group_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize` of (..., m, D) rows with one shape and no host read (for a compiled
    step): the same codes, scales and zero points.

    :func:`quantize` stores the scales of one call in the first dtype of
    :data:`SCALE_LEVELS`, from the preferred one on, that holds every group's (a host read);
    here each dtype is tried at once and the first that holds every ``valid`` row's, from
    ``level`` on, is taken on the device.

    Parameters
    ----------
    x
        (..., m, D) float rows, finite.
    valid
        (m,) bool: the rows that count (the others are coded too, and ignored); None: all.
    level
        (1,) int64 on ``x``'s device: the index in :data:`SCALE_LEVELS` of the preferred dtype.
    bits, group_size
        As :func:`quantize` (checked there; default one group per row).

    Returns
    -------
    tuple
        (..., m, D * bits / 8) uint8 codes; (..., m, D / group) float64 scales and zero points,
        whose values are those of the chosen dtype; the chosen (1,) int64 level.
    """
    group = x.shape[-1] if group_size is None else group_size
    grouped = x.double().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    levels = 2**bits - 1
    low, constant, scale = _span(grouped, levels)
    stored = [_stored_as(scale, low, constant, dtype) for dtype in SCALE_LEVELS]
    ignored = False if valid is None else ~valid.view(-1, 1)
    holds = torch.stack([(fits | ignored).all() for _, _, fits in stored])  # (levels,)
    candidates = torch.arange(len(SCALE_LEVELS), device=x.device)
    usable = holds & (candidates >= level)
    # The first usable level (float64 always is): a minimum, not an argmax of a mask.
    chosen = torch.where(usable, candidates, len(SCALE_LEVELS)).min().view(1)
    stored_scale = torch.stack([s.double() for s, _, _ in stored]).index_select(0, chosen)[0]
    stored_zero = torch.stack([z.double() for _, z, _ in stored]).index_select(0, chosen)[0]
    codes = _codes(grouped, stored_scale, stored_zero, levels).reshape(x.shape)
    if bits == 4:
        codes = pack_nibbles(codes)
    return codes, stored_scale, stored_zero, chosen


@_compiled_once
def dequantize_fixed(
    data: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    level: torch.Tensor,
    dtype: torch.dtype,
    *,
    bits: int = 8,
    branch: bool = False,
) -> torch.Tensor:
    """:func:`dequantize` of codes whose scales and zero points :func:`quantize_fixed` keeps
    as float64 values of the dtype ``level`` names, with one shape and no host read: the same
    values, bit for bit.

    :func:`dequantize` computes in a dtype that depends on the scales' (float64 scales in
    float64, others in the output dtype or float32). Here the dtype of ``level`` is taken on
    the device: by ``torch.cond`` with ``branch`` (only the chosen dtype is computed; the
    branch reads ``level`` on the host, free on a CPU), else by computing each such dtype and
    selecting (what a CUDA graph can replay; a fused kernel reads the codes once for all).

    Parameters
    ----------
    data
        (..., D * bits / 8) uint8 codes.
    scale, zero
        (..., D / group) float64 scales and zero points.
    level
        (1,) int64: the index in :data:`SCALE_LEVELS` of the dtype their values are of.
    dtype
        The dtype of the tensor that was quantized (the result's).
    bits
        8 or 4.
    branch
        Compute only the dtype ``level`` picks (``torch.cond``).

    Returns
    -------
    torch.Tensor
        (..., D) values in ``dtype``.
    """
    # Each compute dtype serves consecutive levels (the scales' dtypes only widen).
    spans: dict[torch.dtype, list[int]] = {}
    for index, scale_dtype in enumerate(SCALE_LEVELS):
        spans.setdefault(_compute_for(dtype, scale_dtype), []).append(index)
    variants = [
        (indices[0], indices[-1], partial(_decoded, compute=compute, dtype=dtype, bits=bits))
        for compute, indices in spans.items()
    ]
    operands = (data, scale, zero)
    if branch:
        return _branches(variants, level, operands)
    result = variants[0][2](*operands)
    for low, high, decode in variants[1:]:
        result = torch.where((level >= low) & (level <= high), decode(*operands), result)
    return result


def _decoded(
    data: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    *,
    compute: torch.dtype,
    dtype: torch.dtype,
    bits: int,
) -> torch.Tensor:
    """:func:`dequantize`'s arithmetic in ``compute``, cast to ``dtype``: (..., D) values."""
    codes = unpack_nibbles(data) if bits == 4 else data
    return _scaled(codes.to(compute), scale, zero).to(dtype)


def _scaled(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(..., D) ``values`` (codes in the compute dtype) made lambda * (x_q - z) per group, in
    place; (..., D / group) ``scale`` and ``zero`` are cast to ``values``' dtype."""
    # Splitting the last (unit-stride) dimension is a view whatever the outer strides.
    grouped = values.view(*values.shape[:-1], scale.shape[-1], -1)
    compute = values.dtype
    grouped.sub_(zero.to(compute).unsqueeze(-1)).mul_(scale.to(compute).unsqueeze(-1))
    return values


def _branches(variants: list, level: torch.Tensor, operands: tuple) -> torch.Tensor:
    """The variant whose levels hold ``level``, by nested ``torch.cond``: only it runs.
    Outside a trace the branch is Python's (``level`` read on the host: a CPU's number)."""
    if not torch.compiler.is_compiling():
        index = int(level)
        decode = next(decode for low, high, decode in variants if low <= index <= high)
        return decode(*operands)
    (low, high, decode), rest = variants[0], variants[1:]
    if not rest:
        return decode(*operands)
    return torch.cond(
        (level[0] >= low) & (level[0] <= high),
        decode,
        lambda *tensors: _branches(rest, level, tensors),
        operands,
    )
