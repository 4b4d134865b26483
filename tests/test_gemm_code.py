"""What kernels compile to, on both x86 vector widths, whatever this host is: a MatMul's
epilogue writes C's rows as whole vectors, a reciprocal taken once per row stays a multiply
in the loop that uses it, and a pool checks its taps only in the border blocks of a plane. Each build also matches onnxruntime where the host runs it
(tests/conftest.py's build_and_compare_for)."""
import re

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.ir.loop import Deinterleave, TransposeBlock
from modelkiln.orchestrator.api import build
from tests.conftest import build_and_compare_for, copies_rows_as_it_goes, kernel_statements
from tests.isa import AVX512, X86_TARGETS, kernel_assembly, run_or_inspect
from tests.model_zoo import onnxruntime_outputs

M, K, N = 20, 48, 80  # N: two 32-column panels and a ragged 16 on AVX-512; ten 8-wide vectors on AVX2


def _matmul_model(epilogue: str):
    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array(rng.standard_normal((K, N)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(N).astype(np.float32), "b")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, M, K])]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"])]
    if epilogue == "bias":
        nodes.append(helper.make_node("Add", ["mm", "b"], ["y"]))
    elif epilogue == "relu":
        nodes.append(helper.make_node("Relu", ["mm"], ["y"]))
    elif epilogue == "residual":
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, M, N]))
        nodes.append(helper.make_node("Add", ["mm", "r"], ["y"]))
    elif epilogue == "bias_gelu":
        nodes += [helper.make_node("Add", ["mm", "b"], ["mb"]), helper.make_node("Gelu", ["mb"], ["y"])]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("epilogue", ["bias", "relu", "residual", "bias_gelu"])
def test_a_matmul_epilogue_writes_whole_vectors_along_its_rows(epilogue, target, executor):
    """C is row-major: its rows are contiguous, so the epilogue runs along them. Left to
    itself LLVM vectorized down the tile's columns instead as soon as the epilogue did more
    than store, gathering the tile and scattering into C (on AVX-512: a 128x512x2048 MatMul
    with a bias took 1.37 ms where the plain one took 1.01)."""
    asm = kernel_assembly(build_and_compare_for(_matmul_model(epilogue), executor, target))
    assert not re.search(r"vgather|vscatter", asm)


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("op", ["Softmax", "LayerNormalization"])
def test_a_rows_reciprocal_is_multiplied_not_divided(op, target, executor):
    """Softmax and LayerNorm take 1/sum and 1/std once per row and multiply the row by it.
    With reassoc on that division LLVM sank it into the loop as a vector divide per element."""
    rng = np.random.default_rng(8)
    shape = [4, 8, 64]
    inits = [numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), n) for n in ("scale", "bias")]
    node = (helper.make_node("Softmax", ["x"], ["y"], axis=-1) if op == "Softmax" else
            helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], axis=-1))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              inits if op != "Softmax" else [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    asm = kernel_assembly(build_and_compare_for(model, executor, target))
    assert not re.search(r"vdivps\s+[^\n]*%[yz]mm", asm)


def _pool_model(op: str, shape, kernel, strides, pads, ceil_mode=0, **attrs):
    node = helper.make_node(op, ["x"], ["y"], kernel_shape=kernel, strides=strides, pads=pads, ceil_mode=ceil_mode,
                            **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)


POOLS = {  # GoogLeNet's, Inception's and SqueezeNet's windows, and odd ones
    "3x3_s1_p1": ([1, 24, 28, 28], [3, 3], [1, 1], [1, 1, 1, 1], 0),
    "5x3_s1_p2_1": ([2, 4, 9, 40], [5, 3], [1, 1], [2, 1, 2, 1], 0),
    # strided: from a bordered copy split by column phase
    "3x3_s2_ceil": ([1, 16, 28, 28], [3, 3], [2, 2], [0, 0, 0, 0], 1),
    "3x3_s2_ceil_13": ([1, 16, 27, 27], [3, 3], [2, 2], [0, 0, 0, 0], 1),
    "3x3_s2_p1_wide": ([1, 8, 14, 56], [3, 3], [2, 2], [1, 1, 1, 1], 0),
    "2x2_s2_ceil_odd": ([2, 8, 13, 45], [2, 2], [2, 2], [0, 0, 0, 0], 1),
    "3x2_s3x2_p1_ceil": ([1, 8, 20, 35], [3, 2], [3, 2], [1, 0, 1, 1], 1),
    "3x3_s3_d2_p2": ([1, 4, 23, 50], [3, 3], [3, 3], [2, 2, 2, 2], 0, {"dilations": [2, 2]}),
    "9x9_s2_p4": ([1, 4, 30, 37], [9, 9], [2, 2], [4, 4, 4, 4], 0),  # 81 taps: running sums or maxima
    # planes past RING_MIN_PLANE_BYTES: copied into a ring of the rows a window spans
    "ring_3x3_s2_p1": ([1, 3, 130, 121], [3, 3], [2, 2], [1, 1, 1, 1], 0),
    "ring_3x2_s3x2_p1_ceil": ([1, 2, 101, 298], [3, 2], [3, 2], [1, 0, 1, 1], 1),
    "ring_3x3_s2_d2_ceil": ([1, 2, 90, 171], [3, 3], [2, 2], [0, 0, 0, 0], 1, {"dilations": [2, 2]}),
    "ring_9x9_s2_p4": ([1, 2, 64, 200], [9, 9], [2, 2], [4, 4, 4, 4], 0),
}


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("case", sorted(POOLS))
def test_a_pool_reads_no_element_by_gather(case, op, target, executor):
    """At stride 1 a plane is up to 3 x 3 blocks of outputs: those whose windows leave the
    input check their taps, the inside ones do not, and only a row inside is vectorized: LLVM
    had vectorized a border column down H, with gathers and scatters. A strided pool reads a
    bordered copy of each plane split by column phase, where a row's taps are contiguous: read
    in place, every other element, LLVM gathered them or ran scalar code. The max's tree of
    taps is bound value by value (nested, it grew fivefold per level: a 3x3 window's kernel
    was 4.6 MB of IR). Matches onnxruntime, padding counted or not, ceil_mode windows past
    the padding. A strided pool's plane past L1 is copied into a ring of the rows its window
    spans, each output row's new rows just before it."""
    shape, kernel, strides, pads, ceil_mode, *extra = POOLS[case]
    attrs = dict(extra[0]) if extra else {}
    if op == "AveragePool" and case in ("3x3_s1_p1", "3x2_s3x2_p1_ceil"):
        attrs["count_include_pad"] = 1
    model = _pool_model(op, shape, kernel, strides, pads, ceil_mode, **attrs)
    result = build_and_compare_for(model, executor, target)
    body = result.lowered.calls[0].kernel.body
    assert len(repr(body)) < 1_000_000  # (a 5x3 window's is 0.2 MB)
    assert any(isinstance(s, Deinterleave) for s in kernel_statements(body)) == (strides[-1] > 1)
    assert copies_rows_as_it_goes(result.lowered.calls[0].kernel) == case.startswith("ring")
    assert not re.search(r"vgather|vscatter", kernel_assembly(result))


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("size", [21, 131])
def test_a_strided_pool_copies_what_its_group_computes(size, target, executor):
    """A strided pool's bordered copy reads its input through the group: float16 storage
    (widened as it is copied) and a producer fused into the pool's kernel (Cast, Relu), with
    an epilogue after it; into whole planes, or (131 x 131) a ring of rows. Matches
    onnxruntime."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 8, size, size])
    nodes = [helper.make_node("Cast", ["x"], ["c"], to=TensorProto.FLOAT), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["p"], ["y"]),
             helper.make_node("AveragePool", ["x"], ["z"], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)]
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                                                helper.make_tensor_value_info("z", TensorProto.FLOAT16, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    result = build_and_compare_for(model, executor, target)
    assert sorted(len(c.ops) for c in result.lowered.calls) == [1, 4]  # (the max's group: Cast, Relu, MaxPool, Sigmoid)
    assert all(copies_rows_as_it_goes(c.kernel) == (size > 100) for c in result.lowered.calls)


def _conv_with_activation(activation: str, kernel: int = 1, size: int = 16):
    """A conv, 128 -> 256 channels (1x1 at 16x16, or `kernel` x `kernel` padded at size x size),
    then an activation whose code calls exp, erf or tanh."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal((256, 128, kernel, kernel)) * 0.1).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(256).astype(np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[kernel // 2] * 4)]
    if activation == "silu":
        nodes += [helper.make_node("Sigmoid", ["c"], ["s"]), helper.make_node("Mul", ["c", "s"], ["y"])]
    else:
        nodes += [helper.make_node("Gelu", ["c"], ["y"], approximate="tanh" if activation == "gelu_tanh" else "none")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 128, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)


@pytest.mark.usefixtures("no_winograd")
@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("activation, kernel, size", [("silu", 1, 16), ("gelu", 1, 16), ("gelu_tanh", 1, 16),
                                                      ("silu", 3, 13)])
def test_a_tile_keeps_its_accumulators_in_registers_under_a_costly_epilogue(activation, kernel, size, target,
                                                                            executor):
    """On AVX-512 a 14 x 32 tile holds 28 of the 32 vector registers through its k loop. The
    constants of exp, erf or tanh in the epilogue, hoisted out of every loop, took registers
    from it and the accumulators were spilled to the stack on every k step (2.2x the time of
    the conv alone): the k loop is a function of its own there, and no vector register
    touches the stack in it (the transposes after it may spill: once per tile); a 3x3 conv
    on 13-wide rows passes it the row-offset table too (Gemm.a_rows). Matches onnxruntime."""
    result = build_and_compare_for(_conv_with_activation(activation, kernel, size), executor, target)
    asm = kernel_assembly(result)
    tiles = re.findall(r"^(\w+_tile\d+):\n(.*?)\.Lfunc_end", asm, re.S | re.M)
    if target == AVX512:
        assert tiles
        for name, body in tiles:
            [(_, k_loop)] = re.findall(r"^(\.LBB\w+):\n(.*?)^\s+j\w+\s+\1$", body, re.S | re.M)
            spill = r"[xyz]mm\d+[^\n]*\(%rsp\)|\(%rsp\)[^\n]*[xyz]mm\d+"
            assert "vfmadd" in k_loop and not re.search(spill, k_loop), name
            assert kernel == 3 or not re.search(spill, body), name  # (a 1x1 tile's transposes fit too)
    else:  # (AVX2's k loop keeps its registers inline)
        assert not tiles


@pytest.mark.usefixtures("no_winograd")
@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("width, tiles", [(71, {14, 8, 7}), (17, {9, 8}), (35, {14, 7})])
def test_a_row_ends_in_no_tile_too_short_for_the_fma_latency(width, tiles, target, executor):
    """A conv tiled within its output rows (Gemm.a_rows, AVX-512's 14-row tiles): a row of 71
    is 4 x 14 + 8 + 7, not 5 x 14 + 1, whose one-row tile waited on each FMA's result (2 sums
    in flight: Inception's 80 -> 192 3x3 at 71 wide 13.36 -> 12.68 ms); a last block of 7 (28
    sums) stays. AVX2's 6-row tiles run across rows (Gemm.a_mtab), untouched. Matches
    onnxruntime."""
    from modelkiln.codegen_worker.llvm_emit import kernel_to_llvm_ir
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array((rng.standard_normal((64, 16, 3, 3)) * 0.1).astype(np.float32), "w")]
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 3, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    result = build_and_compare_for(model, executor, target)
    [call] = result.lowered.calls
    t = result.target
    ir = kernel_to_llvm_ir(call.kernel, "k", t.triple, t.cpu, t.features)
    # each tile's k loop holds one accumulator phi per row and vector of the tile
    loops = re.findall(r"^K\d+\.body:\n(.*?)^\s+br i1", ir, re.S | re.M)
    rows = {len(re.findall(r"= phi <\d+ x float>", body)) // 2 for body in loops}
    assert rows == (tiles if target == AVX512 else {6, width * 3 % 6} - {0})


TRANSPOSES = {  # input shape, perm, reshape of the input first (or None), blocked?
    "tokens_to_planes": ([1, 96, 64], [0, 2, 1], None, True),
    "planes_to_tokens": ([1, 64, 8, 12], [0, 2, 1], [1, 64, 96], True),
    "ragged_batched": ([3, 37, 45], [0, 2, 1], None, True),
    "channels_last": ([2, 5, 7, 19], [0, 2, 3, 1], None, True),
    "matrix": ([40, 24], [1, 0], None, True),
    "unit_axes": ([2, 1, 33], [2, 1, 0], None, True),
    "heads": ([6, 4, 16], [1, 0, 2], None, False),  # (rows move, each whole: not a transpose of lanes)
}


@pytest.mark.parametrize("target", X86_TARGETS)
@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.INT32])
@pytest.mark.parametrize("case", sorted(TRANSPOSES))
def test_a_transpose_of_the_last_axis_moves_blocks(case, elem, target, executor):
    """A group that only moves 4-byte elements across their last axis (a Transpose, with
    Reshapes around it) is a batch of [R, C] -> [C, R] transposes: it runs as 16 x 16 blocks
    transposed in registers, where element by element every output row gathered a column (a
    [128, 16384] plane: 6.6 ms, 0.97 as blocks; onnxruntime 1.5). Ragged edges, size-1 axes
    and axes that move together included; equal to onnxruntime's."""
    shape, perm, reshape, blocked = TRANSPOSES[case]
    nodes, inits, source = [], [], "x"
    if reshape:
        inits.append(numpy_helper.from_array(np.array(reshape, np.int64), "shape"))
        nodes.append(helper.make_node("Reshape", ["x", "shape"], ["r"]))
        source = "r"
    nodes.append(helper.make_node("Transpose", [source], ["y"], perm=perm))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, shape)],
                              [helper.make_tensor_value_info("y", elem, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    if elem == TensorProto.INT32:  # (random_inputs gives float32: the oracle takes integers)
        x = np.random.default_rng(5).integers(-1000, 1000, shape).astype(np.int32)
        result = build(model, target=target, executor=executor, cache=None, progress=False)
        run_or_inspect(result, lambda: np.testing.assert_array_equal(
            result.load().run({"x": x})["y"], onnxruntime_outputs(model, {"x": x})["y"]))
    else:
        result = build_and_compare_for(model, executor, target)
    body = result.lowered.calls[0].kernel.body
    assert any(isinstance(s, TransposeBlock) for s in kernel_statements(body)) == blocked
    if blocked:
        assert not re.search(r"vgather|vscatter", kernel_assembly(result))
