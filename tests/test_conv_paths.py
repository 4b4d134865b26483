"""Every code path convolution can take, against onnxruntime: implicit GEMM (over the output
plane; tall tiles stay within output rows of 3 pixels and more), im2col (rows of 1, or 2
against big weights), pointwise (weights as rows, input read in place; or packed weights past
256 channels or below 64 pixels), grouped, depthwise, transposed, run-time weights, 1-D / 3-D,
dilation, stride, asymmetric and auto padding. These are the GEMM and direct paths: Winograd,
which the rule takes for many 3x3 stride-1 convs, is kept off here (`no_winograd`) and
tested in tests/test_winograd.py."""
import re

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests import model_zoo
from tests.conftest import build_and_compare, build_and_compare_for, kernel_statements
from tests.isa import X86_TARGETS, lanes

pytestmark = pytest.mark.usefixtures("no_winograd")  # (the shapes here are chosen for other paths)

CASES = {
    # name: (input shape, weight shape, attrs)
    "implicit_3x3_pad": ((1, 8, 40, 40), (16, 8, 3, 3), {"pads": [1, 1, 1, 1]}),
    "implicit_stride2_dilated": ((1, 4, 64, 64), (8, 4, 3, 3), {"strides": [2, 2], "dilations": [2, 2],
                                                                 "pads": [2, 1, 0, 2]}),
    "implicit_same_upper": ((2, 3, 33, 47), (40, 3, 5, 3), {"auto_pad": "SAME_UPPER"}),
    "implicit_no_pad_7x7_s2": ((1, 3, 70, 70), (64, 3, 7, 7), {"strides": [2, 2]}),
    # At most 16 output channels: weights as rows, the input row read in place as B (Gemm.b_ktab).
    "implicit_few_channels": ((1, 12, 40, 37), (16, 12, 3, 3), {"pads": [1, 1, 1, 1]}),  # 37 = 32 + 5 masked
    "implicit_few_channels_grouped": ((2, 8, 20, 33), (12, 4, 3, 3), {"group": 2, "strides": [2, 1],
                                                                      "dilations": [1, 2], "pads": [1, 2, 0, 2]}),
    # Rows narrower than a register tile (AVX-512's 14) are one shorter tile each: SqueezeNet's
    # 13x13 layers, Inception's 7x1 convs at 17x17 (tiles of 9 and 8 rows), ResNet's 7x7.
    # More output channels as rows where the window holds few values (a stem's 3 x 3 x 3),
    # or at most 8 channels; a column stride reads a copy split by column phase.
    "rows_stem_stride2": ((1, 3, 67, 71), (32, 3, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "rows_stride2_no_pad": ((2, 16, 40, 70), (8, 16, 3, 3), {"strides": [2, 2]}),
    "rows_stride3_asymmetric": ((1, 5, 30, 100), (24, 5, 3, 3), {"strides": [1, 3], "pads": [0, 1, 2, 2]}),
    "rows_stride2_grouped": ((1, 8, 20, 70), (8, 4, 3, 3), {"group": 2, "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "rows_16_channels_wide_window": ((1, 16, 20, 40), (16, 16, 3, 3), {"pads": [1, 1, 1, 1]}),  # (k 144: AVX-512's)
    "implicit_13_wide": ((1, 48, 13, 13), (64, 48, 3, 3), {"pads": [1, 1, 1, 1]}),
    "implicit_17_wide_7x1": ((1, 32, 17, 17), (128, 32, 7, 1), {"pads": [3, 0, 3, 0]}),
    "implicit_7x7_many_channels": ((1, 64, 7, 7), (128, 64, 3, 3), {"pads": [1, 1, 1, 1]}),
    # On AVX-512, weights past the L2 chunk (384 KiB): two chunks of two panels, then the fifth
    # panel, each chunk over every row; threads divide the 9 rows. Then 7 rows of 8 panels (a
    # chunk of 5, then 3), which threads divide by panels.
    "implicit_rows_panel_chunks": ((1, 128, 9, 9), (160, 128, 3, 3), {"pads": [1, 1, 1, 1]}),
    "implicit_rows_split_by_panels": ((1, 64, 7, 7), (256, 64, 3, 3), {"pads": [1, 1, 1, 1]}),
    # Rows of 1 pixel, or of 2 against weights past L2: im2col on AVX-512 (a GEMM per row would
    # stream all the weights per pixel or two); one implicit GEMM over the plane on AVX2.
    "im2col_one_pixel_rows": ((1, 64, 9, 1), (48, 64, 3, 1), {"pads": [1, 0, 1, 0]}),
    "im2col_two_pixel_rows_big_weights": ((1, 128, 20, 2), (256, 128, 3, 3), {"pads": [0, 1, 0, 1]}),
    "pointwise": ((2, 24, 17, 19), (36, 24, 1, 1), {}),  # weights as rows: a partial pixel panel, 3 row blocks
    "pointwise_grouped": ((1, 32, 9, 9), (64, 16, 1, 1), {"group": 2}),
    "pointwise_wide_k": ((1, 320, 9, 9), (40, 320, 1, 1), {}),  # past POINTWISE_MAX_K: packed weights
    "pointwise_few_pixels": ((1, 40, 7, 7), (48, 40, 1, 1), {}),  # below POINTWISE_MIN_PIXELS: packed
    "grouped": ((1, 12, 30, 30), (18, 4, 3, 3), {"group": 3, "pads": [1, 1, 1, 1]}),
    "depthwise_multiplier": ((1, 6, 31, 29), (12, 1, 3, 3), {"group": 6, "strides": [2, 1], "pads": [1, 0, 1, 2]}),
    # Column strides copy the input split by column phase; every phase's inside slots share a loop.
    "depthwise_stride2_odd": ((2, 5, 23, 57), (5, 1, 3, 3), {"group": 5, "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "depthwise_stride2_no_pad": ((1, 4, 16, 16), (4, 1, 3, 3), {"group": 4, "strides": [2, 2]}),
    "depthwise_stride3_5x5": ((1, 3, 20, 31), (6, 1, 5, 5), {"group": 3, "strides": [3, 3], "pads": [2, 0, 1, 2]}),
    "depthwise_stride2_dilated": ((1, 4, 19, 40), (4, 1, 3, 3), {"group": 4, "strides": [2, 2], "dilations": [2, 2],
                                                                  "pads": [2, 2, 2, 2]}),
    "depthwise_7_wide": ((1, 24, 7, 7), (24, 1, 3, 3), {"group": 24, "pads": [1, 1, 1, 1]}),  # one masked vector a row
    # 49 weights: three passes over each output row (3, 3 and 1 window rows), rows of 37 (two
    # vectors and a masked one), a channel multiplier of 2.
    "depthwise_7x7_passes": ((1, 4, 12, 37), (8, 1, 7, 7), {"group": 4, "pads": [3, 3, 3, 3]}),
    # (two images, each its own planes of partial sums; 14 wide: one masked vector a row)
    "depthwise_7x7_passes_batch": ((2, 6, 14, 14), (6, 1, 7, 7), {"group": 6, "pads": [3, 3, 3, 3]}),
    "conv1d_wide": ((1, 5, 100), (7, 5, 5), {"pads": [2, 2], "dilations": [2]}),
    "conv3d": ((1, 2, 6, 20, 20), (4, 2, 3, 3, 3), {"pads": [1, 1, 1, 1, 1, 1]}),
}


def _conv_model(op, xshape, wshape, attrs, runtime_weights=False, bias=True):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(wshape) / np.sqrt(np.prod(wshape[1:]))).astype(np.float32)
    cout = wshape[1] * attrs.get("group", 1) if op == "ConvTranspose" else wshape[0]
    inits = [numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), "b")] if bias else []
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(xshape))]
    if runtime_weights:
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, list(wshape)))
    else:
        inits.append(numpy_helper.from_array(w, "w"))
    node = helper.make_node(op, ["x", "w"] + (["b"] if bias else []), ["c"], **attrs)
    relu = helper.make_node("Relu", ["c"], ["y"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    return helper.make_model(helper.make_graph([node, relu], "conv", inputs, [y], inits),
                             opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


# Which convs read their input in place, weights as the broadcast operand (Gemm.b_sk for 1x1,
# on every target; Gemm.b_ktab for wider windows where the weights as rows pay: a window of
# few values or few output channels on both widths, up to 16 channels on 16 lanes only).
IN_PLACE_EVERYWHERE = {"pointwise": True, "pointwise_grouped": True, "pointwise_wide_k": False,
                       "pointwise_few_pixels": False, "implicit_no_pad_7x7_s2": False,
                       **{name: True for name in ("implicit_3x3_pad", "implicit_few_channels", "implicit_same_upper",
                                                  "implicit_few_channels_grouped", "implicit_stride2_dilated",
                                                  "rows_stem_stride2", "rows_stride3_asymmetric",
                                                  "rows_stride2_grouped")}}
IN_PLACE_ON_16_LANES = {"rows_stride2_no_pad", "rows_16_channels_wide_window"}


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_conv_path(name, target, executor):
    """Each case on an AVX2 and an AVX-512 target: run against onnxruntime where this host
    runs the target, its assembly checked elsewhere (tests/isa.py); the path lowering took
    asserted on both."""
    from modelkiln.ir.loop import Gemm
    from modelkiln.ir.lower.gemm import implicit_over_plane
    xshape, wshape, attrs = CASES[name]
    result = build_and_compare_for(_conv_model("Conv", xshape, wshape, attrs), executor, target)
    expected = IN_PLACE_EVERYWHERE.get(name, lanes(target) == 16 if name in IN_PLACE_ON_16_LANES else None)
    # (batch 2, or groups: the Gemm sits in loops)
    gemms = [s for c in result.lowered.calls for s in kernel_statements(c.kernel.body) if isinstance(s, Gemm)]
    if expected is not None:
        assert gemms and all(g.in_place_b == expected for g in gemms)
    if name.startswith("implicit") and not expected:  # the input read in place as A, through a table of k offsets
        out_width = result.graph.types["c"].shape[-1]
        assert gemms and all(g.a_ktab and g.a_mtab for g in gemms)
        # one GEMM over the plane: a table of pixels for few-row tiles (AVX2's 6), of output
        # rows for taller ones (AVX-512's 14), which stay within a row
        assert all(g.a_rows == (0 if implicit_over_plane(g.mr) else out_width) for g in gemms)
    if name.startswith("im2col"):
        [gemm] = gemms
        if lanes(target) == 16:  # col is written in row blocks, each one's A contiguous
            assert (gemm.a_sb, gemm.a_sm, gemm.a_sk) == (gemm.k, 1, gemm.mr) and gemm.m % gemm.mr
        else:  # AVX2's 6-row tiles run the input in place, over the whole output plane
            assert gemm.a_ktab and gemm.a_mtab and gemm.m == np.prod(result.graph.types["c"].shape[2:])


# Convs whose top or bottom output rows have window rows wholly in the zero border: the
# implicit GEMM's tiles skip them (Gemm.a_kspan), k ordered window row first.
WINDOW_ROWS_IN_THE_BORDER = {
    "resnet_7x7": ((1, 64, 7, 7), (96, 64, 3, 3), {"pads": [1, 1, 1, 1]}),
    "inception_7x1": ((1, 32, 17, 17), (64, 32, 7, 1), {"pads": [3, 0, 3, 0]}),
    "fcn_dilated_4": ((1, 16, 12, 12), (32, 16, 3, 3), {"pads": [4, 4, 4, 4], "dilations": [4, 4]}),
    "stride2_asymmetric": ((1, 16, 64, 64), (24, 16, 3, 3), {"strides": [2, 2], "dilations": [2, 2],
                                                             "pads": [2, 1, 0, 2]}),
    "grouped": ((1, 32, 14, 14), (64, 8, 3, 3), {"group": 4, "pads": [1, 1, 1, 1]}),
    "conv3d_depth": ((1, 6, 4, 9, 9), (40, 6, 3, 3, 3), {"pads": [1, 1, 1, 1, 1, 1]}),
}


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("name", sorted(WINDOW_ROWS_IN_THE_BORDER))
def test_window_rows_in_the_border_are_skipped(name, target, executor):
    """Against onnxruntime on both vector widths (over the plane on AVX2, within rows on
    AVX-512), the implicit GEMM carrying a k range per table entry."""
    from modelkiln.ir.loop import Gemm
    xshape, wshape, attrs = WINDOW_ROWS_IN_THE_BORDER[name]
    result = build_and_compare_for(_conv_model("Conv", xshape, wshape, attrs), executor, target)
    gemms = [s for c in result.lowered.calls for s in kernel_statements(c.kernel.body) if isinstance(s, Gemm)]
    assert gemms and all(g.a_ktab and g.a_mtab and g.a_kspan for g in gemms)


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("pads", [[1, 1, 1, 1], [0, 0, 0, 0]])
def test_avx2_counts_the_border_it_skips_toward_the_implicit_gemm(pads, target, executor):
    """448 output channels at 7x7: AVX2's 6-pixel tiles leave 9% of the plane's last block
    empty, past what im2col's copy costs, but with a zero border they skip more than that
    (their first and last tiles' top and bottom window rows): implicit. Without a border,
    im2col. AVX-512's tiles within rows take the implicit GEMM either way."""
    from modelkiln.ir.loop import Gemm
    size = 7 if any(pads) else 9
    result = build_and_compare_for(_conv_model("Conv", (1, 32, size, size), (448, 32, 3, 3), {"pads": pads}),
                                   executor, target)
    [gemm] = [s for c in result.lowered.calls for s in kernel_statements(c.kernel.body) if isinstance(s, Gemm)]
    implicit = lanes(target) == 16 or any(pads)
    assert bool(gemm.a_ktab) == implicit and bool(gemm.a_kspan) == (implicit and any(pads))


@pytest.mark.parametrize("target", X86_TARGETS)
def test_a_1x1_conv_over_a_7x7_plane_copies_its_input_on_avx2(target, executor):
    """im2col_copies_1x1: AVX2 writes the 49 pixels' input in row blocks (Gemm.a_sb), each
    6-pixel block's A contiguous; AVX-512 reads it in place, k steps a plane apart."""
    from modelkiln.ir.loop import Gemm
    result = build_and_compare_for(_conv_model("Conv", (1, 96, 7, 7), (40, 96, 1, 1), {}), executor, target)
    [gemm] = [s for c in result.lowered.calls for s in kernel_statements(c.kernel.body) if isinstance(s, Gemm)]
    if lanes(target) == 8:
        assert (gemm.a_sb, gemm.a_sm, gemm.a_sk) == (gemm.k, 1, gemm.mr)
    else:
        assert (gemm.a_sb, gemm.a_sm, gemm.a_sk) == (0, 1, 49)


@pytest.mark.parametrize("xshape, wshape, attrs", [
    ((1, 48, 30, 30), (40, 48, 1, 1), {"strides": [2, 2]}),  # ResNet's projection shortcut, 15x15 out
    ((1, 24, 16, 17), (32, 24, 1, 1), {"strides": [2, 3], "pads": [1, 0, 0, 1]}),  # border pixels, ragged
])
@pytest.mark.parametrize("target", X86_TARGETS)
def test_a_strided_1x1_conv_copies_its_input_on_avx2(xshape, wshape, attrs, target, executor):
    """A one-position window: AVX2's few-row tiles take im2col (A copied, no table of k
    offsets); AVX-512's tall tiles read the input in place within each output row."""
    from modelkiln.ir.loop import Gemm
    result = build_and_compare_for(_conv_model("Conv", xshape, wshape, attrs), executor, target)
    [gemm] = [s for c in result.lowered.calls for s in kernel_statements(c.kernel.body) if isinstance(s, Gemm)]
    if lanes(target) == 8:
        assert not gemm.a_ktab and not gemm.a_mtab
    else:
        assert gemm.a_ktab and gemm.a_rows == result.graph.types["c"].shape[-1]


# 1x1 convs over large planes with many input and output channels: AVX2 packs the input in
# 16-pixel panels (pointwise_packs_input); AVX-512 reads it in place as B, or, past 256
# input channels, as A (im2col in place). 28 x 30 = 840 pixels: a partial last panel.
POINTWISE_PACKED_ON_AVX2 = {
    "resnet_reduce": ((1, 64, 28, 30), (64, 64, 1, 1), {}),
    "past_256_channels": ((1, 320, 28, 28), (64, 320, 1, 1), {}),
    "grouped_batch_2": ((2, 128, 28, 28), (128, 64, 1, 1), {"group": 2}),
    "batch_3": ((3, 64, 28, 30), (64, 64, 1, 1), {}),  # (images on threads of their own, each its packed slice)
}


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("name", sorted(POINTWISE_PACKED_ON_AVX2))
def test_a_large_pointwise_conv_packs_its_input_on_avx2(name, target, executor):
    from modelkiln.ir.loop import Gemm
    xshape, wshape, attrs = POINTWISE_PACKED_ON_AVX2[name]
    result = build_and_compare_for(_conv_model("Conv", xshape, wshape, attrs), executor, target)
    gemms = [s for c in result.lowered.calls for s in kernel_statements(c.kernel.body) if isinstance(s, Gemm)]
    assert gemms
    for g in gemms:
        if lanes(target) == 8:  # the weights as A, C stored [channel][pixel], B packed
            assert g.stores_along == "n" and not g.in_place_b and not g.a_ktab
        elif wshape[1] <= 256:
            assert g.stores_along == "n" and g.b_sk
        else:
            assert g.stores_along == "m"


@pytest.mark.parametrize("xshape, wshape, attrs", [
    ((1, 16, 8, 8), (32, 16, 3, 3), {"pads": [3, 1, 3, 1]}),  # output rows 0 and 9: every window row in the border
    ((1, 16, 8, 8), (32, 16, 3, 3), {"pads": [0, 1, 0, 1]}),  # no window row in the border
])
@pytest.mark.parametrize("target", X86_TARGETS)
def test_a_conv_with_no_window_row_to_skip_runs_every_k(xshape, wshape, attrs, target, executor):
    from modelkiln.ir.loop import Gemm
    result = build_and_compare_for(_conv_model("Conv", xshape, wshape, attrs), executor, target)
    gemms = [s for c in result.lowered.calls for s in kernel_statements(c.kernel.body) if isinstance(s, Gemm)]
    assert gemms and all(g.a_ktab and not g.a_kspan for g in gemms)


def test_window_row_spans_follow_the_border():
    """The k range of each output position: a 3-row window over 5 rows, padding 1 each side
    (the first position's window starts in the top border, the last one's ends in the
    bottom); dilation 2 with padding 2 over 6 rows, stride 2; 4 k per window row."""
    from modelkiln.ir.lower.gemm import window_row_spans
    assert window_row_spans(5, 1, 1, 1, 5, 3, 4).tolist() == [[4, 12], [0, 12], [0, 12], [0, 12], [0, 8]]
    # positions 0, 2, 4 (input rows -2, 0, 2 first): taps -2/0/2, 0/2/4, 2/4/6 (6 is border)
    assert window_row_spans(3, 2, 2, 2, 6, 3, 4).tolist() == [[4, 12], [0, 12], [0, 8]]
    assert window_row_spans(5, 1, 1, 0, 7, 3, 4) is None


# Implicit GEMMs whose panels are past K_CHUNK_FROM_BYTES run k in chunks, each adding into a
# workspace of partial sums (here with the limits lowered, so that small convs have them).
K_CHUNK_CASES = {
    # FCN's dilation 4 at 12x12: a chunk's window row wholly in the border for 4 rows each side
    "dilated_border_rows": ((1, 64, 12, 12), (32, 64, 3, 3), {"pads": [4, 4, 4, 4], "dilations": [4, 4]}),
    "batch_2_stride_2": ((2, 48, 17, 15), (40, 48, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "no_border": ((1, 32, 10, 11), (24, 32, 3, 3), {}),
    "conv1d": ((1, 96, 30), (16, 96, 5), {"pads": [2, 2]}),  # (one window row: k in equal parts)
}


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("name", sorted(K_CHUNK_CASES))
def test_a_conv_past_l2_sums_its_k_in_chunks(name, target, executor, monkeypatch):
    """Against onnxruntime (or the assembly) on both vector widths: more than one GEMM, their
    k together the conv's, each within a window row and its panel within the limit; a conv with window rows in
    the border skips them in every chunk."""
    from modelkiln.ir.loop import Gemm
    from modelkiln.ir.lower import gemm as lower_gemm
    monkeypatch.setattr(lower_gemm, "K_CHUNK_FROM_BYTES", 16 * 1024)
    monkeypatch.setattr(lower_gemm, "K_CHUNK_PANEL_BYTES", 8 * 1024)
    xshape, wshape, attrs = K_CHUNK_CASES[name]
    result = build_and_compare_for(_conv_model("Conv", xshape, wshape, attrs), executor, target)
    gemms = [s for c in result.lowered.calls for s in kernel_statements(c.kernel.body) if isinstance(s, Gemm)]
    k, window_rows = int(np.prod(wshape[1:])), wshape[2] if len(wshape) > 3 else 1
    assert len(gemms) > 1 and sum(g.k for g in gemms) == k and all(g.k <= k // window_rows for g in gemms)
    assert all(g.k * g.nr * 4 <= 8 * 1024 for g in gemms)
    assert all(bool(g.a_kspan) == (name in ("dilated_border_rows", "batch_2_stride_2")) for g in gemms)


def test_k_chunks_keep_to_window_rows_and_their_spans_to_the_chunk(monkeypatch):
    """A 3-row window of 100 k a row, panels of 8 columns (3.2 KB a row): two chunks a row
    at 2 KB. A span is clipped to its chunk; one that misses the chunk runs one k step."""
    from modelkiln.ir.lower import gemm as lower_gemm
    monkeypatch.setattr(lower_gemm, "K_CHUNK_FROM_BYTES", 4096)
    monkeypatch.setattr(lower_gemm, "K_CHUNK_PANEL_BYTES", 2048)
    assert lower_gemm.k_chunks(300, 8, 3) == [(0, 50), (50, 100), (100, 150), (150, 200), (200, 250), (250, 300)]
    assert lower_gemm.k_chunks(120, 8, 3) == [(0, 120)]  # (3.8 KB: whole)
    spans = np.array([[100, 300], [0, 300], [0, 200]])  # (top row: window row 0 in the border)
    assert lower_gemm.chunk_spans(spans, 0, 50).tolist() == [[49, 50], [0, 50], [0, 50]]
    assert lower_gemm.chunk_spans(spans, 250, 300).tolist() == [[0, 50], [0, 50], [0, 1]]
    assert lower_gemm.chunk_spans(spans, 100, 150).tolist() == [[0, 50], [0, 50], [0, 50]]


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("xshape, wshape, attrs", [
    ((1, 64, 14, 14), (64, 8, 3, 3), {"group": 8, "pads": [1, 1, 1, 1]}),  # RegNet's groups of 8
    ((1, 48, 31, 30), (48, 8, 3, 3), {"group": 6, "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((1, 12, 30, 30), (18, 4, 3, 3), {"group": 3, "pads": [0, 1, 1, 0]}),
    ((1, 160, 9, 9), (40, 32, 3, 3), {"group": 5}),  # no padding: no bordered copy
])
def test_a_batch_1_grouped_conv_divides_its_groups_across_threads(xshape, wshape, attrs, target, executor):
    """One group's GEMM is too small to split among threads, so the groups are the parallel
    loop, each with its own slice of the workspaces (its bordered input, its im2col):
    against onnxruntime at 3 threads too, which divide the groups unevenly."""
    from modelkiln.ir.loop import For, phases
    from tests.isa import host_runs
    model = _conv_model("Conv", xshape, wshape, attrs)
    result = build_and_compare_for(model, executor, target)
    [call] = [c for c in result.lowered.calls if "Conv" in c.ops]
    loops = [p for p in phases(call.kernel.body)[1] if isinstance(p, For) and p.parallel]
    assert loops and loops[-1].extent == attrs["group"], call.kernel.body
    if host_runs(target):
        module = result.load(threads=3)
        inputs = model_zoo.random_inputs(model, 1)
        np.testing.assert_allclose(module.run(inputs)["y"], model_zoo.onnxruntime_outputs(model, inputs)["y"],
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["implicit_3x3_pad", "grouped", "pointwise", "im2col_one_pixel_rows"])
def test_conv_with_runtime_weights(name, executor):
    xshape, wshape, attrs = CASES[name]
    build_and_compare(_conv_model("Conv", xshape, wshape, attrs, runtime_weights=True), executor)


@pytest.mark.parametrize("xshape,wshape,attrs", [
    ((1, 8, 10, 12), (8, 4, 2, 2), {"strides": [2, 2]}),
    ((1, 6, 9, 9), (6, 2, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1], "group": 3}),
    ((1, 4, 7, 5), (4, 3, 3, 3), {"dilations": [2, 1], "pads": [0, 1, 2, 0]}),
])
def test_conv_transpose(xshape, wshape, attrs, executor):
    build_and_compare(_conv_model("ConvTranspose", xshape, wshape, attrs), executor)


@pytest.mark.parametrize("m,k,n", [(37, 512, 1000), (5, 4096, 200), (30, 2560, 200), (600, 512, 300)])
def test_gemm_whose_weights_outgrow_l2(m, k, n, executor):
    """B larger than the L2 chunk: every row block runs over one chunk of panels, then the
    next (whole chunks, a remainder, and a last partial panel). Past L2, B is prefetched a
    panel ahead (37x512x1000), or within a panel too big for that (30x2560x200), and the
    prefetches reach past B's end from the last panel; a GEMV-sized A (5 rows) prefetches
    nothing, and nor does an A of more row blocks than PREFETCH_MAX_ROW_BLOCKS (600 rows),
    whose later blocks find B in L2."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w")])
    result, _ = build_and_compare(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
                                  executor)
    from modelkiln.codegen_worker.gemm_emit import PREFETCH_MAX_ROW_BLOCKS
    from modelkiln.codegen_worker.llvm_emit import kernel_to_llvm_ir
    from modelkiln.ir.loop import Gemm
    from modelkiln.orchestrator.target import parse_target
    t = parse_target("llvm")
    [call] = result.lowered.calls
    [gemm] = [s for s in kernel_statements(call.kernel.body) if isinstance(s, Gemm)]
    assert m // gemm.mr > PREFETCH_MAX_ROW_BLOCKS if m == 600 else m // gemm.mr <= PREFETCH_MAX_ROW_BLOCKS
    prefetches = "@llvm.prefetch" in kernel_to_llvm_ir(call.kernel, "k", t.triple, t.cpu, t.features)
    assert prefetches == (5 < m < 600)


@pytest.mark.parametrize("target", X86_TARGETS)
def test_a_1x1_conv_over_planes_past_l2_prefetches_them(target, executor):
    """A projection to few channels reads, at each k step, a line of another input plane: past
    L2 its micro-kernel prefetches the lines of a panel a few ahead (here past the input's end
    from its last panels: 47 x 48 pixels end in a partial panel); within L2 it does not."""
    from modelkiln.codegen_worker.gemm_emit import PREFETCH_B_BYTES
    from modelkiln.codegen_worker.llvm_emit import kernel_to_llvm_ir
    from modelkiln.ir.loop import Gemm
    from modelkiln.orchestrator.target import parse_target
    t = parse_target(target)
    for xshape, prefetches in (((1, 96, 47, 48), True), ((1, 96, 20, 20), False)):
        result = build_and_compare_for(_conv_model("Conv", xshape, (24, 96, 1, 1), {}), executor, target)
        [call] = result.lowered.calls
        [gemm] = [s for s in kernel_statements(call.kernel.body) if isinstance(s, Gemm)]
        assert gemm.b_sk and (gemm.k * gemm.n * 4 > PREFETCH_B_BYTES) == prefetches
        assert ("@llvm.prefetch" in kernel_to_llvm_ir(call.kernel, "k", t.triple, t.cpu, t.features)) == prefetches


def test_a_7x7_depthwise_window_runs_in_passes(executor):
    """49 weights do not fit the registers with the row's taps: the window runs as passes of
    at most 21 weights (3 + 3 + 1 window rows), each over every output row of a plane that
    fits L1 (one loop over the 12 rows around each pass's loop along a row), summing into a
    plane of partial sums; a 5x5 window (25) stays one pass, all in one loop over the rows."""
    for kernel, passes in ((7, 3), (5, 1)):
        model = _conv_model("Conv", (1, 4, 12, 37), (4, 1, kernel, kernel), {"group": 4, "pads": [kernel // 2] * 4})
        result, _ = build_and_compare(model, executor)
        [call] = result.lowered.calls
        loops = [s for s in kernel_statements(call.kernel.body) if type(s).__name__ == "For"]
        row_loops = [s for s in loops if s.extent == 37 and s.kind == "vector_masked"
                     and any(type(x).__name__ == "Local" for x in s.body)]
        assert len(row_loops) == passes
        over_rows = [s for s in loops if s.extent == 12 and any(x in row_loops for x in s.body)]
        assert len(over_rows) == passes


@pytest.mark.parametrize("output", ["float32", "float16"])
def test_a_7x7_depthwise_sums_its_passes_in_its_own_output(output, executor):
    """ConvMixer's block: a 7x7 depthwise conv, ReLU and a BatchNorm's multiply and add, over
    planes whose partial sums for every channel would outgrow DEPTHWISE_PLANES_FLOATS. Its
    passes sum into the kernel's float32 output, each plane's last pass reading its partial
    sum back: the bordered copy is its only workspace. A float16 output cannot hold partial
    sums, so that kernel keeps a workspace of them. Against onnxruntime."""
    from modelkiln.ir.loop import Store
    g = model_zoo.GraphMaker(0)
    y = g.op("Relu", [g.conv("x", 300, 300, 7, group=300)])
    y = g.op("Add", [g.op("Mul", [y, g.const(np.full((300, 1, 1), 0.5, np.float32))]),
                     g.const(np.full((300, 1, 1), 0.25, np.float32))])
    if output == "float16":
        y = g.op("Cast", [y], to=TensorProto.FLOAT16)
    model = g.model({"x": [1, 300, 32, 32]}, [y])
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT16 if output == "float16" else TensorProto.FLOAT
    result, _ = build_and_compare(model, executor)
    [call] = result.lowered.calls
    stored = {s.buf for s in kernel_statements(call.kernel.body) if isinstance(s, Store)}
    assert len({buf for buf in stored if buf.startswith("w")}) == (1 if output == "float32" else 2)


def test_depthwise_window_rows_are_separate_sums(executor):
    """A depthwise window sums each of its rows into its own accumulator, and its kernel is
    emitted without reassociation so LLVM keeps them apart (one chain of 25 dependent FMAs
    for a 5x5 window waited on FMA latency); other kernels keep reassociation."""
    from modelkiln.codegen_worker.llvm_emit import kernel_to_llvm_ir
    from modelkiln.orchestrator.target import parse_target
    model = _conv_model("Conv", (1, 16, 7, 7), (16, 1, 5, 5), {"group": 16, "pads": [2, 2, 2, 2]})
    result, _ = build_and_compare(model, executor)
    t = parse_target("llvm")
    [call] = result.lowered.calls
    ir = kernel_to_llvm_ir(call.kernel, "k", t.triple, t.cpu, t.features)
    assert call.kernel.option("reassociate") is False and " reassoc " not in ir
    locals_ = [s for s in kernel_statements(call.kernel.body) if type(s).__name__ == "Local"]
    assert len(locals_) == 5  # one per window row
    dense, _ = build_and_compare(_conv_model("Conv", (1, 8, 12, 12), (8, 8, 3, 3), {"pads": [1, 1, 1, 1]}), executor)
    assert all(c.kernel.option("reassociate", True) for c in dense.lowered.calls)


def _fenced_build(model, target, executor):
    """`model` built for `target`; where this host runs it, run on random inputs into arrays of
    guard bytes (a row left unwritten, or a write past the output, shows) against onnxruntime,
    elsewhere its assembly checked (tests/isa.py). Returns the build."""
    from modelkiln.orchestrator.api import build
    from tests.fenced import FencedOutputs
    from tests.isa import run_or_inspect
    result = build(model, target=target, executor=executor, cache=None, progress=False)

    def run():
        inputs = model_zoo.random_inputs(model, 1)
        want = model_zoo.onnxruntime_outputs(model, inputs)
        fenced = FencedOutputs(want)
        result.load().run(inputs, out=fenced.arrays)
        np.testing.assert_allclose(fenced.arrays["y"], want["y"], rtol=1e-4, atol=1e-5)
        assert not fenced.trespassed()
    run_or_inspect(result, run)
    return result


def _output_rows_a_loop(kernel) -> int:
    """The most output rows one loop along them stores (each row's store is one Store)."""
    from modelkiln.ir.loop import For, Store
    return max(sum(1 for t in s.body if isinstance(t, Store) and t.buf.startswith("o"))
               for s in kernel_statements(kernel.body) if isinstance(s, For) and s.kind == "vector_masked")


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("height", [1, 2, 5, 8])
def test_a_3x3_depthwise_conv_computes_its_rows_in_pairs_on_16_lanes(height, target, executor):
    """On AVX-512 a 3x3 stride-1 depthwise conv computes two output rows a loop (their windows
    share two input rows), then an odd last row alone; on AVX2 one row a loop (16 registers:
    slower in pairs). Heights 2, 5 and 8: one pair, two and a last row alone, four; at height
    1 the border leaves a 1 x 3 window, one row."""
    model = _conv_model("Conv", (1, 8, height, 21), (8, 1, 3, 3), {"group": 8, "pads": [1, 1, 1, 1]})
    [call] = _fenced_build(model, target, executor).lowered.calls
    assert _output_rows_a_loop(call.kernel) == (2 if lanes(target) == 16 and height > 1 else 1)


def test_a_depthwise_conv_keeps_one_row_a_loop_where_pairs_were_slower(executor):
    """Stride 2 (one shared input row), a 5x5 window (50 weights live) and an epilogue
    calling exp (a SiLU: its constants twice over) keep one output row a loop on AVX-512."""
    from modelkiln.orchestrator.api import build
    silu = _conv_model("Conv", (1, 8, 9, 21), (8, 1, 3, 3), {"group": 8, "pads": [1, 1, 1, 1]})
    silu.graph.node[1].op_type = "Sigmoid"
    silu.graph.node[1].output[0] = "s"
    silu.graph.node.append(helper.make_node("Mul", ["c", "s"], ["y"]))
    models = [_conv_model("Conv", (1, 8, 9, 21), (8, 1, 3, 3), {"group": 8, "strides": [2, 2], "pads": [1, 1, 1, 1]}),
              _conv_model("Conv", (1, 8, 9, 21), (8, 1, 5, 5), {"group": 8, "pads": [2, 2, 2, 2]}), silu]
    for model in models:
        result = build(model, target="cascadelake", executor=executor, cache=None, progress=False)
        [call] = result.lowered.calls
        assert _output_rows_a_loop(call.kernel) == 1, [n.op_type for n in model.graph.node]


def _with_epilogue(model, activation: str):
    """The conv model with its Relu replaced: "silu" (Sigmoid and Mul), "gelu" (erf's
    GELU, opset 20) or "hardswish" (no costly call)."""
    assert model.graph.node[0].op_type == "Conv"
    del model.graph.node[1:]
    if activation == "silu":
        model.graph.node.extend([helper.make_node("Sigmoid", ["c"], ["s"]), helper.make_node("Mul", ["c", "s"], ["y"])])
    elif activation == "gelu":
        model.graph.node.append(helper.make_node("Gelu", ["c"], ["y"]))
        model.opset_import[0].version = 20
    else:
        model.graph.node.append(helper.make_node("HardSwish", ["c"], ["y"]))
    return model


def _epilogue_loops_apart(kernel) -> int:
    """Loops along an output row that store the output with no window sum of their own (no
    accumulator): a costly epilogue run apart from the window's sums."""
    from modelkiln.ir.loop import For, Local, Store
    return sum(1 for s in kernel_statements(kernel.body) if isinstance(s, For) and s.kind == "vector_masked"
               and any(isinstance(t, Store) and t.buf.startswith("o") for t in s.body)
               and not any(isinstance(t, Local) for t in s.body))


@pytest.mark.parametrize("xshape,wshape,attrs,activation,apart", [
    ((1, 4, 9, 40), (4, 1, 3, 3), {"pads": [1, 1, 1, 1]}, "silu", True),  # EfficientNet's 3x3
    ((1, 3, 11, 57), (6, 1, 5, 5), {"strides": [2, 2], "pads": [2, 2, 2, 2]}, "silu", True),  # 29 wide, 2 a channel
    ((1, 3, 96, 120), (3, 1, 3, 3), {"pads": [1, 1, 1, 1]}, "silu", True),  # a plane past L1: a ring of rows
    ((1, 4, 12, 30), (4, 1, 7, 7), {"pads": [3, 3, 3, 3]}, "gelu", True),  # passes summed in the output
    ((1, 8, 9, 14), (8, 1, 3, 3), {"pads": [1, 1, 1, 1]}, "silu", False),  # rows of two vectors: one loop
    ((1, 4, 9, 40), (4, 1, 3, 3), {"pads": [1, 1, 1, 1]}, "hardswish", False),  # nothing costly
], ids=["3x3", "5x5_stride2_mult2", "ring", "7x7_passes", "14_wide", "hardswish"])
def test_a_costly_depthwise_epilogue_runs_along_each_row_apart_on_avx2(xshape, wshape, attrs, activation, apart,
                                                                      executor):
    """On AVX2 a depthwise conv whose epilogue calls exp or erf (SiLU, GELU) writes each
    output row's sums to a row of its own, then applies the epilogue in a loop along it
    (depthwise_epilogue_apart_pays); rows narrower than three vectors, and epilogues of a few
    instructions, keep one loop, and so does AVX-512 (not measured there). Against
    onnxruntime, into guarded outputs."""
    from tests.isa import AVX2, AVX512
    model = _with_epilogue(_conv_model("Conv", xshape, wshape, {"group": xshape[1], **attrs}), activation)
    for target in (AVX2, AVX512):
        [call] = _fenced_build(model, target, executor).lowered.calls
        assert _epilogue_loops_apart(call.kernel) == (1 if apart and target == AVX2 else 0), target


@pytest.mark.parametrize("width,kernel,stride,pads", [
    (14, 5, 2, [2, 2, 2, 2]),  # MobileNetV3's 14x14 stride 2: a row shorter than two vectors
    (15, 3, 2, [1, 0, 1, 1]),  # an odd row, asymmetric pads
    (113, 3, 2, [1, 1, 1, 1]),  # whole vectors and a ragged last one
    (22, 3, 3, [1, 1, 1, 1]),  # three phases
    (7, 3, 2, [0, 0, 0, 0]),
], ids=str)
@pytest.mark.parametrize("target", X86_TARGETS)
def test_a_strided_depthwise_copies_its_column_phases_as_vectors(width, kernel, stride, pads, target, executor):
    """A strided depthwise conv's copy deals each input row out to its column phases with
    one Deinterleave (whole vectors, shuffles, a masked last one): left to LLVM, a row shorter
    than two vectors became scalar moves (672x14x14 5x5 at stride 2 took 2.8x OpenVINO's time)."""
    model = _conv_model("Conv", (1, 8, 9, width), (8, 1, kernel, kernel),
                        {"group": 8, "strides": [stride, stride], "pads": pads})
    result = build_and_compare_for(model, executor, target)
    [call] = result.lowered.calls
    [copy] = [s for s in kernel_statements(call.kernel.body) if type(s).__name__ == "Deinterleave"]
    assert copy.phases == stride and copy.count >= (width - kernel) // stride


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("cout", [256, 16])
def test_rows_narrower_than_a_tile_read_the_input_in_place(cout, target, executor):
    """On AVX-512 a 14-wide output row is one 14-row block for 256 channels, and one shorter
    tile of the 28-row tiles 16 channels use: both implicit (16 channels had taken im2col,
    the rows counted as half-empty blocks: 1.6x onnxruntime's time, 0.9x implicit), one GEMM
    whose tiles stay within a row (Gemm.a_rows). AVX2's 6-row tiles run over the whole
    196-pixel plane, one ragged block in 33 (Gemm.a_mtab of pixels)."""
    from modelkiln.ir.loop import Gemm
    model = _conv_model("Conv", (1, 32, 14, 14), (cout, 32, 3, 3), {"pads": [1, 1, 1, 1]})
    result = build_and_compare_for(model, executor, target)
    [gemm] = [s for c in result.lowered.calls for s in kernel_statements(c.kernel.body) if isinstance(s, Gemm)]
    assert gemm.a_ktab and gemm.a_mtab and not gemm.a_sb and gemm.m == 196
    assert gemm.a_rows == (14 if lanes(target) == 16 else 0)


@pytest.mark.parametrize("target", X86_TARGETS)
def test_ragged_rows_mask_only_their_remainder(target, executor):
    """A 30-wide depthwise row: its whole vectors with plain loads, then on AVX-512 one masked
    remainder under a constant mask, on AVX2 (no mask registers) one whole vector ending at
    the row's end, overlapping the one before: no masked load or store, no scalar code. A
    loop predicated throughout recomputed its mask from 64-bit compares every iteration: on
    AVX2 it also loaded every tap through it (a 14-wide row ran 2.6x its AVX-512 time); on
    AVX-512 the compares alone cost a 56-wide row 7%. Matches onnxruntime."""
    from tests.isa import kernel_assembly
    model = _conv_model("Conv", (1, 8, 30, 30), (8, 1, 3, 3), {"group": 8, "pads": [1, 1, 1, 1]})
    asm = kernel_assembly(build_and_compare_for(model, executor, target))
    assert not re.search(r"vpcmp\w*q\b", asm)
    if lanes(target) == 8:
        assert "vmaskmov" not in asm and not re.search(r"vfmadd\w*ss|vmulss|vaddss", asm)
    else:
        assert re.search(r"\{%k[1-7]\}", asm)


@pytest.mark.parametrize("target", X86_TARGETS)
def test_a_strided_1x1_conv_keeps_its_tiles_of_pixels(target, executor):
    """A strided 1x1 conv of many channels over rows wide enough for the weights-as-rows tile
    (64 -> 128, stride 2, 40-wide output rows): not weights as rows, which read one column
    phase of a copy of the whole input (1.7x the implicit GEMM's time at 224 x 224), built
    for the size or over run-time sizes. Against onnxruntime."""
    from modelkiln.ir.loop import Gemm
    from modelkiln.orchestrator.api import build
    from tests.isa import run_or_inspect
    model = _conv_model("Conv", (1, 64, 80, 80), (128, 64, 1, 1), {"strides": [2, 2]})
    static = build_and_compare_for(model, executor, target)
    assert static.lowered.calls[0].space["conv_path"][1] != "weights_rows"
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_param, dims[3].dim_param = "h", "w"
    dynamic = build(model, target=target, dims={"h": (8, 200), "w": (8, 200)}, executor=executor, cache=None,
                    progress=False)
    [gemm] = [s for s in kernel_statements(dynamic.lowered.calls[0].kernel.body) if isinstance(s, Gemm)]
    assert gemm.a_mtab  # (pixels x channels through a table of pixels; weights as rows have none)

    def compare():
        x = {"x": np.random.default_rng(1).standard_normal((1, 64, 80, 75)).astype(np.float32)}
        np.testing.assert_allclose(dynamic.load().run(x)["y"], model_zoo.onnxruntime_outputs(model, x)["y"],
                                   rtol=1e-4, atol=1e-4)
    run_or_inspect(dynamic, compare)


def test_only_bodies_without_carried_state_are_recomputable():
    """A loop body may run an iteration twice (the emitter's overlapping last vector) only
    where it stores to buffers it does not read and carries no sum across iterations."""
    from modelkiln.ir.loop import Assign, Const, For, Let, Load, Local, Store, Var, add, fbin, recomputable
    i = Var("i")
    copy = (Store("out", i, fbin("mul", Load("x", i), Load("x", add(i, 1)))),)
    assert recomputable(copy)
    assert recomputable((Let("t", Load("x", i)), Store("out", i, Var("t", "f32"))))
    assert recomputable((Local("acc", "f32", Const(0.0, "f32")),  # (a sum within the iteration)
                         For("k", 3, (Assign("acc", fbin("add", Var("acc", "f32"), Load("x", add(i, Var("k"))))),)),
                         Store("out", i, Var("acc", "f32"))))
    assert not recomputable((Store("x", i, fbin("add", Load("x", i), Const(1.0, "f32"))),))  # (in place)
    assert not recomputable((Store("out", i, Load("x", i)), Store("x", i, Const(0.0, "f32"))))
    assert not recomputable((Assign("total", fbin("add", Var("total", "f32"), Load("x", i))),))  # (carried)


@pytest.mark.parametrize("target", X86_TARGETS)
def test_run_time_rows_of_any_width(target, executor):
    """Depthwise convs (stride 1 and 2) and a max pool over run-time sizes, at widths shorter
    than a vector, whole vectors and ragged ones: AVX2's rows end in a whole vector
    overlapping the one before, AVX-512's in a masked one. Against onnxruntime (or the
    kernels' instructions where this host cannot run the target)."""
    from modelkiln.orchestrator.api import build
    from tests.isa import run_or_inspect
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal((8, 1, 3, 3)) / 3).astype(np.float32), f"w{k}")
             for k in (1, 2)]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], group=8, pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["x", "w2"], ["b"], group=8, pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("MaxPool", ["x"], ["c"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "rows", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, "h", "w"])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "abc"], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    result = build(model, target=target, dims={"h": (1, 80), "w": (1, 80)}, executor=executor, cache=None,
                   progress=False)

    def compare():
        module = result.load()
        for h, w in ((5, 3), (4, 8), (7, 13), (3, 16), (6, 30), (2, 33), (9, 80)):
            x = {"x": rng.standard_normal((1, 8, h, w)).astype(np.float32)}
            want, got = model_zoo.onnxruntime_outputs(model, x), module.run(x)
            for name in "abc":
                np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=f"{name} at {h}x{w}")
    run_or_inspect(result, compare)


@pytest.mark.parametrize("const_shape", [[], [9], [1, 1, 1, 9], [7, 9], [1, 8, 1, 1], [1, 8, 7, 1], [8, 1, 9],
                                         [1, 8, 7, 9], [1, 1, 7, 1]], ids=str)
@pytest.mark.parametrize("pads", [[0, 0, 0, 0], [1, 1, 1, 1]], ids=["valid", "padded"])
def test_conv_epilogue_broadcasts_along_any_axis(const_shape, pads, executor):
    """Conv -> Add of a constant broadcast along any subset of (C, H, W), then Relu. The
    epilogue indexes a merged pixel only where every operand lets H and W merge; a constant
    along W alone (or H alone) once took that path anyway and failed with an IndexError."""
    h, w_ = (7, 9) if pads[0] else (9, 11)  # a 7x9 output either way
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=pads), helper.make_node("Add", ["c", "k"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, h, w_])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(rng.standard_normal((8, 4, 3, 3)).astype(np.float32), "w"),
                               numpy_helper.from_array(rng.standard_normal(const_shape).astype(np.float32), "k")])
    build_and_compare(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), executor)


def test_conv_to_a_single_pixel_with_an_epilogue(executor):
    """A conv whose output is 1x1 (its spatial dims all vanish in the merge) with a bias-like
    constant and a Relu after it."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Add", ["c", "k"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16, 3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(rng.standard_normal((24, 16, 3, 3)).astype(np.float32), "w"),
                               numpy_helper.from_array(rng.standard_normal((1, 24, 1, 1)).astype(np.float32), "k")])
    build_and_compare(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), executor)


def test_a_float16_stem_takes_the_float32_path(executor):
    """A float16 3 -> 32 stride-2 conv, weights as rows on AVX-512: the conv computes on
    float32 operands (passes/widen_half_products.py), by the statements of the float32
    model's conv, the copy split by column phase included. Against onnxruntime in float32 on
    the same float16 values where the host runs AVX-512."""
    from modelkiln.ir.loop import Gemm
    from modelkiln.orchestrator.api import build
    from onnxconverter_common import float16
    from tests.isa import AVX512, run_or_inspect
    model = _conv_model("Conv", (1, 3, 45, 77), (32, 3, 3, 3), {"strides": [2, 2], "pads": [1, 0, 1, 1]})
    half = float16.convert_float_to_float16(model, keep_io_types=False)
    result = build(half, target=AVX512, executor=executor, cache=None, progress=False)

    def conv_statements(built):
        conv = next(c for c in built.lowered.calls if "Conv" in c.ops)
        return [type(s).__name__ for s in kernel_statements(conv.kernel.body)]
    statements = [s for c in result.lowered.calls for s in kernel_statements(c.kernel.body)]
    assert [g.b_ktab != "" for g in statements if isinstance(g, Gemm)] == [True]
    assert conv_statements(result) == conv_statements(build(model, target=AVX512, executor=executor, cache=None,
                                                            progress=False))

    def run():
        x = np.random.default_rng(3).standard_normal((1, 3, 45, 77)).astype(np.float16)
        got = result.load().run({"x": x})["y"]
        widened = {i.name: numpy_helper.to_array(i).astype(np.float32) for i in half.graph.initializer}
        for init in model.graph.initializer:
            init.CopyFrom(numpy_helper.from_array(widened[init.name], init.name))
        want = model_zoo.onnxruntime_outputs(model, {"x": x.astype(np.float32)})["y"]
        np.testing.assert_allclose(got.astype(np.float32), want, rtol=1e-2, atol=1e-2)
    run_or_inspect(result, run)
