"""quant/: error bound (property-based), exact byte accounting, edge cases, bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from quant import dequantize, pack_nibbles, quantize, quantize_rows, unpack_nibbles
from quant.asymmetric import SCALE_LEVELS, dequantize_fixed, quantize_fixed

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def bound(q, x: torch.Tensor) -> torch.Tensor:
    """lambda / 2 per element, plus half an ulp of the output dtype (the final rounding)."""
    # abs(): a constant group stores its value as the scale (and round-trips exactly).
    scale = q.scale.double().abs().repeat_interleave(q.group_size, dim=-1).reshape(x.shape)
    ulp = torch.finfo(x.dtype).eps * x.double().abs()
    return scale / 2 + ulp + 1e-12


finite = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=200, deadline=None)
@given(
    values=arrays(
        "float32", st.tuples(st.integers(1, 3), st.sampled_from([4, 8, 16])), elements=finite
    ),
    bits=st.sampled_from([8, 4]),
    group=st.sampled_from([2, 4]),
    dtype=st.sampled_from(DTYPES),
)
def test_error_is_at_most_half_a_step(values, bits, group, dtype):
    x = torch.from_numpy(values).to(dtype)
    q = quantize(x, bits=bits, group_size=group)
    restored = dequantize(q)
    assert restored.dtype == dtype and restored.shape == x.shape
    assert ((restored.double() - x.double()).abs() <= bound(q, x)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
def test_constant_groups_round_trip_exactly(dtype, bits):
    x = torch.tensor([[0.1234567] * 8, [0.0] * 8, [-3.5] * 8, [60000.0] * 8]).to(dtype)
    assert torch.equal(dequantize(quantize(x, bits=bits, group_size=4)), x)


@pytest.mark.parametrize("bits", [8, 4])
def test_byte_accounting_is_exact(bits):
    x = torch.randn(2, 3, 10, 64)
    q = quantize(x, bits=bits, group_size=32)
    codes = 2 * 3 * 10 * 64 * bits // 8
    groups = 2 * 3 * 10 * 2
    assert q.data.nbytes == codes
    assert q.scale.dtype == torch.float16 and q.zero_point.dtype == torch.float16
    assert q.nbytes == codes + 2 * groups * 2


def test_int8_is_close_on_gaussian_data():
    torch.manual_seed(0)
    x = torch.randn(4, 64)
    error = (dequantize(quantize(x)) - x).abs().max()
    assert error < (x.max() - x.min()) / 255


def test_scales_are_promoted_when_float16_cannot_hold_them():
    x = torch.tensor([[1e6, 1e6 + 1.0, 1e6 + 2.0, 1e6 + 3.0]])  # zero point far beyond 2048
    q = quantize(x)
    assert q.zero_point.dtype != torch.float16
    assert ((dequantize(q) - x).abs() <= bound(q, x)).all()


def test_nibble_packing_round_trips():
    codes = torch.randint(0, 16, (3, 8), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 4)
    assert torch.equal(unpack_nibbles(packed), codes)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"bits": 3}, "bits=3"),
        ({"bits": 16}, "bits=16"),
        ({"group_size": 5}, "group_size=5"),
        ({"group_size": 0}, "group_size=0"),
        ({"bits": 4, "group_size": 1}, "group_size=1"),
    ],
)
def test_bad_options_are_rejected(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        quantize(torch.randn(2, 8), **kwargs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_rejected(bad):
    x = torch.randn(2, 8)
    x[1, 3] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize(x)


def test_integer_input_is_rejected():
    with pytest.raises(ValueError, match="dtype"):
        quantize(torch.ones(2, 8, dtype=torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
def test_dequantize_into_a_view_gives_the_same_values(dtype, bits):
    x = torch.randn(2, 3, 5, 16).to(dtype)
    q = quantize(x, bits=bits, group_size=8)
    buffer = torch.full((2, 3, 7, 16), 7.0, dtype=dtype)
    result = dequantize(q, out=buffer[:, :, :5])
    assert torch.equal(result, dequantize(q))
    assert torch.equal(buffer[:, :, :5], dequantize(q))
    assert (buffer[:, :, 5:] == 7).all()  # nothing written past the view


def test_dequantize_refuses_an_out_of_another_shape_or_dtype():
    q = quantize(torch.randn(4, 16), bits=8)
    with pytest.raises(ValueError, match="out has shape"):
        dequantize(q, out=torch.empty(4, 8))
    with pytest.raises(ValueError, match="float64"):
        dequantize(q, out=torch.empty(4, 16, dtype=torch.float64))


@settings(max_examples=40, deadline=None)
@given(
    values=arrays("float32", (3, 5, 16), elements=finite),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_row_codes_are_within_half_a_step_and_symmetric(values, dtype):
    """Absmax INT8 per row: code * scale within scale / 2 of each value, codes in [-127, 127]
    (the row's largest magnitude exactly +-127), a row of zeros all zero."""
    x = torch.from_numpy(values).to(dtype)
    codes, scales = quantize_rows(x)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert codes.shape == x.shape and scales.shape == x.shape[:-1]
    assert int(codes.abs().max()) <= 127
    wide = x.float()
    error = (codes.float() * scales.unsqueeze(-1) - wide).abs()
    assert (error <= scales.unsqueeze(-1) / 2 + wide.abs() * 1e-6 + 1e-30).all()  # + fp32 rounding
    # A row's largest magnitude codes as +-127 where its scale is a normal float32. A subnormal
    # scale is rounded to a multiple of 2^-149 (4.4e-42 / 127 codes as 125: found by hypothesis),
    # within the bound's 1e-30 above; one that underflows to 0 (max |x| below 127 smallest
    # subnormals) codes the row as zeros.
    normal = scales >= torch.finfo(torch.float32).smallest_normal
    assert (codes.abs().amax(-1)[normal] == 127).all()
    coded = scales > 0
    tiny = 127 * torch.finfo(torch.float32).smallest_normal * 2.0**-23
    assert (wide.abs().amax(-1)[~coded] < tiny).all()
    zeros = torch.zeros(2, 4, dtype=dtype)
    assert not quantize_rows(zeros)[0].any() and not quantize_rows(zeros)[1].any()


def test_row_quantization_refuses_integers_and_scalars():
    with pytest.raises(ValueError, match="dtype=torch.int64"):
        quantize_rows(torch.arange(4))
    with pytest.raises(ValueError, match="0-dimensional"):
        quantize_rows(torch.tensor(1.0))


@settings(max_examples=150, deadline=None)
@given(
    values=arrays(
        "float32", st.tuples(st.integers(1, 3), st.sampled_from([4, 8, 16])), elements=finite
    ),
    bits=st.sampled_from([8, 4]),
    group=st.sampled_from([2, 4, None]),
    dtype=st.sampled_from(DTYPES),
    level=st.integers(0, 2),
    widen=st.sampled_from(["none", "constant", "offset"]),
)
def test_the_fixed_shape_coder_is_quantize_and_dequantize_bit_for_bit(
    values, bits, group, dtype, level, widen
):
    """A compiled step's coder (issue 65): the codes, scales and zero points quantize stores,
    in the dtype it chooses from a preferred one on (rows that float16, or float32, cannot
    hold included), and the values dequantize decodes from them in every output dtype."""
    x = torch.from_numpy(values).to(dtype)
    if widen == "constant":  # a constant group keeps its value as the scale
        x[0] = 0.1234567
    elif widen == "offset":  # a zero point past float16's (and float32's) integers
        x[-1] = 1e4 + torch.arange(x.shape[-1]) * 1e-3
    q = quantize(x, bits, group, scale_dtype=SCALE_LEVELS[level])
    codes, scale, zero, chosen = quantize_fixed(
        x, None, torch.tensor([level]), bits=bits, group_size=group
    )
    assert SCALE_LEVELS[int(chosen)] == q.scale.dtype
    assert torch.equal(codes, q.data)
    assert torch.equal(scale, q.scale.double()) and torch.equal(zero, q.zero_point.double())
    decoded = dequantize_fixed(codes, scale, zero, chosen, dtype, bits=bits)
    assert decoded.dtype == dtype and torch.equal(decoded, dequantize(q))


def test_a_traced_step_compiles_the_fixed_coder_once_for_every_layer():
    """Layers of a compiled step code and decode with the same shapes: ``quantize_fixed`` and
    ``dequantize_fixed`` are regions the compiler traces once each and calls again (a
    30-layer INT8 step, inlined, took minutes more to compile: docs/compile.md), and the traced
    step gives the eager values. Branching (``torch.cond``) inside a region included."""
    graphs = []

    def capture(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    def layers(first, second, level):
        decoded = []
        for rows in (first, second):
            codes, scale, zero, chosen = quantize_fixed(rows, None, level)
            decoded.append(dequantize_fixed(codes, scale, zero, chosen, rows.dtype, branch=True))
        return decoded

    generator = torch.Generator().manual_seed(0)
    first, second = torch.randn(2, 2, 3, 5, 16, generator=generator)
    second[0, 0, 0] = 1e4 + torch.arange(16) * 1e-3  # a row float16's scales cannot hold
    level = torch.tensor([SCALE_LEVELS.index(torch.float16)])
    torch._dynamo.reset()
    traced = torch.compile(layers, backend=capture, fullgraph=True)(first, second, level)
    assert all(map(torch.equal, traced, layers(first, second, level)))
    (graph,) = graphs
    calls = [n for n in graph.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) == 4  # two functions, two layers
    assert len({call.args[0].target for call in calls}) == 2  # one traced body per function
