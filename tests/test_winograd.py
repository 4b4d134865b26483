"""Winograd's F(2x2, 3x3) and F(4x4, 3x3) (ir/lower/winograd.py), the rule's path for 3x3
stride-1 convs of enough channels: each tile size against onnxruntime on both x86 widths, its
float error against float64, a run-time batch and run-time image sizes, the same bits on any
number of threads, and which tile size the rule takes."""
import re

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests import model_zoo
from tests.conftest import build_and_compare_for
from tests.isa import X86_TARGETS


def conv_model(xshape, cout, pads=(1, 1, 1, 1), bias=True, residual=False, batch=None, seed=0):
    """A 3x3 Conv, then Relu (and a residual Add before it): the epilogue Winograd's output
    transform applies. `batch`: the input's first dim as a symbol of that name."""
    rng = np.random.default_rng(seed)
    cin = xshape[1]
    w = (rng.standard_normal((cout, cin, 3, 3)) / np.sqrt(9 * cin)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w")]
    if bias:
        inits.append(numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), "b"))
    first = [batch] if batch else [xshape[0]]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, first + list(xshape[1:]))]
    nodes = [helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["c"], kernel_shape=[3, 3],
                              pads=list(pads))]
    if residual:
        out_hw = [xshape[2] + pads[0] + pads[2] - 2, xshape[3] + pads[1] + pads[3] - 2]
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, first + [cout] + out_hw))
        nodes.append(helper.make_node("Add", ["c", "r"], ["s"]))
    nodes.append(helper.make_node("Relu", ["s" if residual else "c"], ["y"]))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    return helper.make_model(helper.make_graph(nodes, "conv", inputs, [y], inits),
                             opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture(params=[2, 4], ids=["F2", "F4"])
def tile(request, monkeypatch):
    """m of F(m x m, 3x3), wherever the rule takes Winograd (which m it takes is tested below)."""
    from modelkiln.ir.lower import conv
    monkeypatch.setattr(conv, "winograd_tile", lambda *args: request.param)
    return request.param


def winograd_path(m: int) -> str:
    from modelkiln.ir.lower.winograd import WINOGRAD_PATHS
    return {tile: path for path, tile in WINOGRAD_PATHS.items()}[m]


def conv_path(result) -> str:
    """The path the rule took for the build's conv."""
    [path] = [c.space["conv_path"][1] for c in result.lowered.calls if "conv_path" in c.space]
    return path


# name: (input shape, output channels, pads, bias, residual). Each is taken by the rule on
# both widths; together they cover one block run as phases, blocks of tile rows with a last
# tile row of one output row, units that do not fill the slots evenly, a batch's images in
# slots, asymmetric pads, no bias and a residual in the epilogue; and with 4x4 tiles a last
# tile row and column of 0 to 3 output rows and columns (outputs 9x9, 45x23, 18x18, 40x36,
# 16x30, 23x26).
CASES = {
    "one_block_odd": ((1, 128, 9, 9), 128, (1, 1, 1, 1), True, False),
    "blocks_odd_rows_uneven_slots": ((1, 32, 45, 23), 64, (1, 1, 1, 1), True, False),
    "batch_one_block_each": ((3, 48, 20, 20), 48, (0, 0, 0, 0), True, False),
    "batch_of_blocks": ((2, 16, 40, 36), 128, (1, 1, 1, 1), False, True),
    "asymmetric_pads": ((1, 40, 17, 30), 56, (0, 2, 1, 0), False, False),
    "last_rows_three": ((1, 32, 23, 26), 64, (1, 1, 1, 1), True, True),
}


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_rule_takes_winograd_and_matches_onnxruntime(name, target, tile, executor):
    xshape, cout, pads, bias, residual = CASES[name]
    result = build_and_compare_for(conv_model(xshape, cout, pads, bias, residual), executor, target)
    assert conv_path(result) == winograd_path(tile)


@pytest.mark.parametrize("width", [8, 16])
def test_the_rule_takes_4x4_tiles_where_tiles_and_channels_are_many(width):
    """F(4x4, 3x3) where 32 input channels or more, 4x4 tiles that waste little (at 7x7, not
    9x9 nor 2x2), and 16 tiles or more or filters of at most 256 x 256 channels (ResNet's
    14x14 stage, not its 512-channel 7x7); F(2x2, 3x3) otherwise, and over run-time sizes
    where the least picture is such (as builds do: below)."""
    from modelkiln.ir.lower.winograd import winograd_pays, winograd_tile
    assert winograd_tile(width, 256, 256, [14, 14]) == 4
    assert winograd_tile(width, 32, 64, [56, 56]) == 4
    assert winograd_tile(width, 256, 256, [7, 7]) == 4
    assert winograd_tile(width, 512, 512, [7, 7]) == 2
    assert winograd_tile(width, 512, 512, [14, 14]) == 4
    assert winograd_tile(width, 64, 64, [9, 9]) == 2
    assert winograd_tile(width, 64, 64, [2, 2]) == 2
    assert winograd_tile(width, 16, 64, [56, 56]) == 2
    assert winograd_tile(width, 48, 16, [64, 64]) == 2 and winograd_tile(width, 64, 16, [32, 32]) == 4
    # (4x4 tiles repay 32 channels at 28x28 on 16 lanes too)
    assert winograd_pays(width, 32, 32, [28, 28]) and not winograd_pays(width, 8, 32, [28, 28])


def test_builds_take_the_tile_size_the_rule_gives(executor):
    """A static build of 64 channels at 16x16 takes 4x4 tiles (on either x86 width); built over
    run-time sizes, 4x4 tiles where the least picture is 16x16, 2x2 where it is 2x2."""
    from modelkiln.orchestrator.api import build
    static = build(conv_model((1, 64, 16, 16), 64), executor=executor, cache=None, progress=False)
    assert conv_path(static) == "winograd4"
    model = conv_model((1, 64, 16, 16), 64)
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_param, dims[3].dim_param = "h", "w"
    for least, m in ((2, 2), (16, 4)):
        result = build(model, dims={"h": (least, 64), "w": (least, 64)}, executor=executor, cache=None,
                       progress=False)
        filters = [i for c in result.lowered.calls for i in c.inputs if "winograd" in i]
        assert [re.search(r"_winograd(\d)", i).group(1) for i in filters] == [str(m)], least  # (U's name says which)


@pytest.mark.parametrize("xshape, cout", [((1, 3, 56, 56), 64), ((1, 8, 28, 28), 32)])
def test_few_input_channels_keep_the_implicit_gemm(xshape, cout, executor):
    """A stem's 3 channels (or 8) cannot repay the transforms (3 -> 64 at 56x56: 2.7x slower)."""
    for target in X86_TARGETS:
        assert not conv_path(build_and_compare_for(conv_model(xshape, cout), executor, target)).startswith("winograd")


def _numpy_conv64(x, w, b):
    """The conv in float64 (pads 1): the exact value the float32 results round."""
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    h, wd = x.shape[2:]
    cols = np.stack([xp[:, :, r:r + h, s:s + wd] for r in range(3) for s in range(3)], axis=2)  # n c 9 h w
    return np.einsum("nckhw,ock->nohw", cols, w.reshape(w.shape[0], w.shape[1], 9).astype(np.float64)) + \
        b.astype(np.float64)[None, :, None, None]


def test_winograds_error_is_reassociations(executor, tile, monkeypatch):
    """Against the float64 conv, Winograd's float32 error stays within float32 reassociation's
    bound and near the implicit GEMM's: inputs with a large common offset (where the input
    transform's differences cancel) and weights of mixed scales."""
    from modelkiln.ir.lower import conv
    from modelkiln.orchestrator.api import build
    rng = np.random.default_rng(3)
    cin, cout = 128, 96
    model = conv_model((1, cin, 14, 14), cout, residual=False)
    w = numpy_helper.to_array(model.graph.initializer[0]) * rng.choice([1e-2, 1.0, 30.0], (cout, cin, 1, 1))
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(w.astype(np.float32), "w"))
    b = numpy_helper.to_array(model.graph.initializer[1])
    x = (rng.standard_normal((1, cin, 14, 14)) + 20.0).astype(np.float32)
    exact = np.maximum(_numpy_conv64(x, w.astype(np.float32), b), 0)
    winograd = build(model, executor=executor, cache=None, progress=False)
    assert conv_path(winograd) == winograd_path(tile)
    monkeypatch.setattr(conv, "winograd_pays", lambda *args: False)
    implicit = build(model, executor=executor, cache=None, progress=False)
    assert not conv_path(implicit).startswith("winograd")
    errors = {}
    for label, result in (("winograd", winograd), ("implicit", implicit)):
        errors[label] = float(np.abs(result.load().run({"x": x})["y"] - exact).max())
    # Reassociation's bound: k * eps * sum |w x| (k = 9 * cin terms), far above either.
    terms = np.einsum("nckhw,ock->nohw", np.abs(np.stack(
        [np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))[:, :, r:r + 14, s:s + 14] for r in range(3) for s in range(3)],
        axis=2)).astype(np.float64), np.abs(w.astype(np.float64)).reshape(cout, cin, 9))
    bound = float((9 * cin * np.finfo(np.float32).eps * terms).max())
    assert errors["winograd"] < bound / 50, (errors, bound)
    assert errors["winograd"] < 8 * errors["implicit"] + 1e-6, errors


def test_a_run_time_batch_runs_winograd(executor, tile):
    """A batch known only at run time (1..4): the slots are planned for the bound; batches of
    1 and 3 match onnxruntime, the threads dividing the slots."""
    from modelkiln.orchestrator.api import build
    model = conv_model((1, 64, 22, 30), 64, batch="n")
    result = build(model, dims={"n": (1, 4)}, executor=executor, cache=None, progress=False)
    assert conv_path(result) == winograd_path(tile)
    module = result.load(threads=2)
    for n in (1, 3):
        x = np.random.default_rng(n).standard_normal((n, 64, 22, 30)).astype(np.float32)
        want = model_zoo.onnxruntime_outputs(model, {"x": x})["y"]
        np.testing.assert_allclose(module.run({"x": x})["y"], want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.parametrize("xshape, cout", [((1, 64, 40, 40), 64), ((3, 32, 30, 26), 64), ((1, 512, 4, 4), 512)])
def test_threads_give_the_same_bits(xshape, cout, executor, tile):
    """However many threads divide the slots (or one block's phases: ResNet-18's last convs
    at 112x112), the sums are the same."""
    from modelkiln.orchestrator.api import build
    model = conv_model(xshape, cout, residual=True)
    result = build(model, executor=executor, cache=None, progress=False)
    assert conv_path(result) == winograd_path(tile)
    rng = np.random.default_rng(0)
    x = {"x": rng.standard_normal(xshape).astype(np.float32),
         "r": rng.standard_normal((xshape[0], cout, *xshape[2:])).astype(np.float32)}
    outs = [result.load(threads=t).run(x)["y"] for t in (1, 2, 3, 5)]
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


@pytest.mark.parametrize("target", X86_TARGETS)
def test_run_time_image_sizes_run_winograd(target, executor, tile):
    """Height, width and batch known only at run time: blocks of one tile row (planned at the
    bounds), or the whole picture as one block where it has few tiles (as phases for one
    image, in slots for several), the last tile row or column holding one output row or
    column where a size is odd (with 4x4 tiles, 1 to 3). Against onnxruntime at sizes even and odd, the smallest and
    the greatest, on 1 and 2 threads (or the kernels' instructions where this host cannot
    run the target)."""
    from modelkiln.orchestrator.api import build
    from tests.isa import run_or_inspect
    model = conv_model((1, 64, 32, 32), 64, residual=True)
    for value in (model.graph.input[0], model.graph.input[1]):
        dims = value.type.tensor_type.shape.dim
        dims[0].dim_param, dims[2].dim_param, dims[3].dim_param = "n", "h", "w"
    result = build(model, target=target, dims={"n": (1, 3), "h": (1, 120), "w": (1, 120)}, executor=executor,
                   cache=None, progress=False)
    [call] = [c for c in result.lowered.calls if any("winograd" in i for i in c.inputs)]  # (its transformed filters)
    # Each buffer is a noalias parameter, so a run-time alias check LLVM adds before a vector
    # loop compares accesses to one buffer it could not tell apart: the output transform's
    # even and odd columns stored in two rows ow apart were such, and every call took the
    # scalar loop (64 channels at 56x56: 0.68 ms against a static build's 0.58).
    from modelkiln.codegen_worker.compile import compile_kernel
    optimized = compile_kernel(call.kernel.to_bytes(), call.kernel.symbol, result.target.to_dict(), emit_ir=True)["ir"]
    assert "vector.memcheck" not in optimized
    # Threads divide it: each way of running it is a guarded phase (conditions that are one
    # comparison each; two conditions joined by an `and` made the whole kernel one phase).
    from modelkiln.ir.loop import For, Store, phases
    assert len(phases(call.kernel.body)[1]) > 1
    # Each way of running it writes a tile row's outputs in one loop (and the last tile's
    # columns in one copy of it), whatever the last tile row's and column's counts are (a copy
    # for every count made F(4x4)'s kernel twice as slow to compile): three ways here.
    from tests.conftest import kernel_statements
    row_loops = [s for s in kernel_statements(call.kernel.body)
                 if isinstance(s, For) and any(isinstance(t, Store) and t.buf == "o0" for t in s.body)]
    assert len(row_loops) == 3 and all(s.kind == "independent" for s in row_loops), row_loops

    def compare():
        rng = np.random.default_rng(0)
        for threads in (1, 2):
            module = result.load(threads=threads)
            # (whole pictures: 1x1x1 to 3x8x11; rows of tiles: the rest)
            for n, h, w in ((1, 1, 1), (2, 1, 2), (1, 2, 3), (1, 8, 8), (1, 9, 13), (2, 15, 20), (3, 8, 11),
                            (2, 57, 31), (3, 120, 120), (1, 100, 77)):
                x = {"x": rng.standard_normal((n, 64, h, w)).astype(np.float32),
                     "r": rng.standard_normal((n, 64, h, w)).astype(np.float32)}
                want = model_zoo.onnxruntime_outputs(model, x)["y"]
                np.testing.assert_allclose(module.run(x)["y"], want, rtol=1e-4,
                                           atol=1e-4 * float(np.abs(want).max()), err_msg=f"{n}x{h}x{w}")
    run_or_inspect(result, compare)


def test_one_weight_at_several_scales_shares_its_filters(executor, tile):
    """A detector head runs one conv over each scale of its feature pyramid: each scale's
    kernel reads the same transformed filters (one copy in the bundle, not one per scale), and
    each matches onnxruntime."""
    from modelkiln.orchestrator.api import build
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((64, 64, 3, 3)) / 24).astype(np.float32), "w")
    sizes = (28, 14)
    inputs = [helper.make_tensor_value_info(f"x{s}", TensorProto.FLOAT, [1, 64, s, s]) for s in sizes]
    outputs = [helper.make_tensor_value_info(f"y{s}", TensorProto.FLOAT, None) for s in sizes]
    nodes = [helper.make_node("Conv", [f"x{s}", "w"], [f"y{s}"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
             for s in sizes]
    model = helper.make_model(helper.make_graph(nodes, "pyramid", inputs, outputs, [w]),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    result = build(model, executor=executor, cache=None, progress=False)
    convs = [c for c in result.lowered.calls if any("winograd" in i for i in c.inputs)]
    assert len(convs) == 2
    assert len({i for c in convs for i in c.inputs if "winograd" in i}) == 1
    assert len([n for n in result.lowered.constants if "winograd" in n]) == 1
    feeds = {f"x{s}": rng.standard_normal((1, 64, s, s)).astype(np.float32) for s in sizes}
    want = model_zoo.onnxruntime_outputs(model, feeds)
    got = result.load().run(feeds)
    for s in sizes:
        np.testing.assert_allclose(got[f"y{s}"], want[f"y{s}"], rtol=1e-4, atol=1e-4 * float(np.abs(want[f"y{s}"]).max()))


@pytest.mark.parametrize("target", X86_TARGETS)
def test_run_time_sizes_take_whole_panels_of_output_channels(target, executor, tile):
    """Over run-time sizes, output channels a little short of whole panels are computed as
    whole panels (a partial one doubled the GEMM's code): 248 channels are 256 columns, the
    extra ones never stored, and the outputs match onnxruntime's at sizes even and odd."""
    from modelkiln.ir.loop import Gemm
    from modelkiln.orchestrator.api import build
    from tests.conftest import kernel_statements
    from tests.isa import run_or_inspect
    model = conv_model((1, 32, 16, 16), 248)
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_param, dims[3].dim_param = "h", "w"
    result = build(model, target=target, dims={"h": (1, 40), "w": (1, 40)}, executor=executor, cache=None,
                   progress=False)
    [call] = [c for c in result.lowered.calls if any("winograd" in i for i in c.inputs)]
    gemms = [s for s in kernel_statements(call.kernel.body) if isinstance(s, Gemm)]
    assert gemms and all(g.n % g.nr == 0 and 248 < g.n < 248 + g.nr for g in gemms), [(g.n, g.nr) for g in gemms]

    def compare():
        rng = np.random.default_rng(0)
        for threads in (1, 2):
            module = result.load(threads=threads)
            for h, w in ((1, 1), (7, 9), (16, 16), (33, 40)):
                x = {"x": rng.standard_normal((1, 32, h, w)).astype(np.float32)}
                want = model_zoo.onnxruntime_outputs(model, x)["y"]
                np.testing.assert_allclose(module.run(x)["y"], want, rtol=1e-4,
                                           atol=1e-4 * float(np.abs(want).max()), err_msg=f"{h}x{w}")
    run_or_inspect(result, compare)
