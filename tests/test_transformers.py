"""Transformer models as the torch exporters write them (tests/transformer_zoo.py) build and
match onnxruntime; their attention masks fuse into the attention scores instead of being
written out, and embedding lookups stay gathers."""
import numpy as np
import pytest

from modelkiln.orchestrator.api import build
from tests import model_zoo
from tests import transformer_zoo as tz

MODELS = {
    "bert-dynamo": lambda: tz.bert_encoder("dynamo"),
    "bert-torchscript": lambda: tz.bert_encoder("torchscript"),
    "gpt2-block": tz.gpt2_block,
    "gpt2-block-fp16": lambda: tz.gpt2_block(dtype=np.float16),
    "t5-block": tz.t5_block,
    "swin-block": tz.swin_block,
    "wav2vec2-features": tz.wav2vec2_features,
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_builds_and_matches_onnxruntime(name, executor):
    model, feeds = MODELS[name]()
    result = build(model, executor=executor, cache=None, progress=False)
    got = result.load().run(feeds)
    want = model_zoo.onnxruntime_outputs(model, feeds)
    half = name.endswith("fp16")
    for out, w in want.items():
        assert got[out].dtype == w.dtype and got[out].shape == w.shape, out
        scale = float(np.max(np.abs(w.astype(np.float64))))
        # float32: reassociated sums and polynomial exp/erf; float16: rounding once per kernel
        # where onnxruntime rounds after every op.
        np.testing.assert_allclose(got[out].astype(np.float64), w.astype(np.float64), rtol=0,
                                   atol=(4e-3 if half else 2e-5) * scale, err_msg=out)


def test_attention_mask_is_part_of_the_scores_kernel():
    """The dynamo mask chain (GreaterOrEqual, Unsqueeze, Expand, Where) is recomputed in each
    layer's score epilogue: no kernel writes the [1, heads, seq, seq] mask."""
    model, _ = tz.bert_encoder("dynamo")
    kernels = build(model, executor="inprocess", cache=None, progress=False).report["kernels"]
    with_mask = [k["ops"] for k in kernels if "Where" in k["ops"]]
    assert len(with_mask) == 2  # one per layer
    for ops in with_mask:
        assert ops[:4] == ["GreaterOrEqual", "Unsqueeze", "Expand", "Where"] and "MatMul" in ops


def test_embedding_lookup_is_a_gather():
    model, _ = tz.bert_encoder("torchscript")
    kernels = build(model, executor="inprocess", cache=None, progress=False).report["kernels"]
    embedding = [k["ops"] for k in kernels if "Gather" in k["ops"]][0]
    assert embedding[0] == "Gather" and "MatMul" not in embedding and "OneHot" not in embedding


def test_causal_mask_folds_at_compile_time():
    """GPT-2's Range/LessOrEqual mask depends on shapes only: it is a constant by codegen."""
    model, _ = tz.gpt2_block()
    kernels = build(model, executor="inprocess", cache=None, progress=False).report["kernels"]
    ops = {op for k in kernels for op in k["ops"]}
    assert "Range" not in ops and "LessOrEqual" not in ops
    assert any("Where" in k["ops"] and "MatMul" in k["ops"] for k in kernels)


@pytest.mark.parametrize("name", ["gpt2-block", "bert-torchscript"])
def test_gelu_is_its_matmuls_epilogue(name):
    """GELU, tanh form (GPT-2: x read by Pow, Add and Mul) or erf form (x read twice),
    runs in its MatMul's kernel: the MatMul's output is never written out for it. The
    kernel still matches onnxruntime (test_builds_and_matches_onnxruntime)."""
    model, _ = MODELS[name]()
    kernels = build(model, executor="inprocess", cache=None, progress=False).report["kernels"]
    gelu = "Tanh" if name.startswith("gpt2") else "Erf"
    with_gelu = [k["ops"] for k in kernels if gelu in k["ops"]]
    assert with_gelu and all("MatMul" in ops for ops in with_gelu)


def _ops_in(kernel) -> set:
    """Every Bin op name in a kernel's body."""
    from dataclasses import fields

    from modelkiln.ir.loop import Bin
    found, stack = set(), list(kernel.body)
    while stack:
        x = stack.pop()
        if isinstance(x, Bin):
            found.add(x.op)
        if isinstance(x, tuple):
            stack.extend(x)
        elif hasattr(x, "__dataclass_fields__"):
            stack.extend(getattr(x, f.name) for f in fields(x))
    return found


@pytest.mark.parametrize("src, dst, perm", [
    ([1, 197, 384], [1, 197, 6, 64], [0, 2, 1, 3]),  # ViT's head split: no division by 197
    ([2, 3, 20], [6, 4, 5], [2, 0, 1]),  # runs that merge and split at once
    ([4, 1, 6], [2, 12], [1, 0]),  # dims of 1 between the runs
])
def test_reshape_maps_dims_run_by_run(src, dst, perm, executor):
    """A reshape inside a fused group maps its index through runs of dims with a common
    boundary, so splitting a dim costs no division; the values are onnxruntime's."""
    from onnx import TensorProto, helper, numpy_helper
    shape = numpy_helper.from_array(np.array(dst, np.int64), "shape")
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Transpose", ["r"], ["y"], perm=perm)]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, src)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [shape]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    result = build(model, executor=executor, cache=None, progress=False)
    x = np.random.default_rng(0).standard_normal(src).astype(np.float32)
    assert np.array_equal(result.load().run({"x": x})["y"], model_zoo.onnxruntime_outputs(model, {"x": x})["y"])
    if src[1] == 197:
        assert not _ops_in(result.lowered.calls[0].kernel) & {"div", "rem"}
