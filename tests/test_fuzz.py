"""A seeded fuzz run over malformed models, and models too wide or deep for a recursive walk
(a Concat and a Sum of thousands of branches, chains of thousands of nodes): every case ends
in a built module that agrees with onnxruntime (where onnxruntime accepts the model too) or in
a KilnError. Never another exception, a crash, a hang or an allocation of terabytes."""
import os
import random

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelkiln.ir.errors import KilnError
from modelkiln.orchestrator.api import build
from tests import model_zoo

CASES = int(os.environ.get("KILN_FUZZ_CASES", 120))  # per run, over 4 seeds; raise it for a longer run


def _small() -> onnx.ModelProto:
    g = model_zoo.GraphMaker(3)
    h = g.op("Relu", [g.conv("x", 3, 4, 3)])
    h = g.op("Flatten", [g.op("MaxPool", [h], kernel_shape=[2, 2], strides=[2, 2])])
    h = g.op("Softmax", [g.linear(h, 4 * 4 * 4, 5)], axis=-1)
    return g.model({"x": [1, 3, 8, 8]}, [h], name="fuzz")


def _mutate(rng: random.Random, base: onnx.ModelProto, tmp_path):
    m = onnx.ModelProto()
    m.CopyFrom(base)
    g = m.graph
    kind = rng.choice(["flip", "truncate", "drop_input", "extra_input", "attr", "empty_name", "dup_output",
                       "bad_init", "huge_const", "deep", "deep_math", "wide", "neg_pads", "huge_batch", "reorder",
                       "external"])
    node = g.node[rng.randrange(len(g.node))]
    if kind == "flip":
        data = bytearray(m.SerializeToString())
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return kind, bytes(data)
    if kind == "truncate":
        data = m.SerializeToString()
        return kind, data[:rng.randrange(len(data))]
    if kind == "drop_input":
        node.input[rng.randrange(len(node.input))] = "nowhere"
    elif kind == "extra_input":
        node.input.extend([g.input[0].name] * rng.randint(1, 3))
    elif kind == "attr":
        node.attribute.append(rng.choice([helper.make_attribute("axis", "not-an-int"),
                                          helper.make_attribute("no_such_attribute", 1)]))
    elif kind == "empty_name":
        node.output[0] = ""
    elif kind == "dup_output":
        g.node[-1].output[0] = g.node[0].output[0]
    elif kind == "bad_init":
        init = g.initializer[rng.randrange(len(g.initializer))]
        init.dims[0] = init.dims[0] * 3 + 1
    elif kind == "huge_const":
        g.node.insert(0, helper.make_node("ConstantOfShape", ["huge_shape"], ["huge"],
                                          value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])))
        g.initializer.append(numpy_helper.from_array(np.array([10**6, 10**6], np.int64), "huge_shape"))
        g.output.append(helper.make_tensor_value_info("huge", TensorProto.FLOAT, None))
    elif kind == "deep":  # thousands of nodes, listed last-first: a recursive walk would overflow
        prev, chain = g.output[0].name, []
        for i in range(rng.randint(1500, 3000)):
            chain.append(helper.make_node("Identity", [prev], [f"deep{i}"]))
            prev = f"deep{i}"
        g.node.extend(reversed(chain))
        g.output[0].name = prev
    elif kind == "deep_math":  # an arithmetic chain thousands of nodes long, fused group by group
        prev = g.output[0].name
        g.initializer.append(numpy_helper.from_array(np.float32(0.999), "deep_c"))
        for i in range(rng.randint(1500, 3000)):
            g.node.append(helper.make_node("Mul" if i % 2 else "Add", [prev, "deep_c"], [f"math{i}"]))
            prev = f"math{i}"
        g.output[0].name = prev
    elif kind == "wide":  # a Concat and a Sum of thousands of branches (distinct: CSE keeps them)
        out, n = g.output[0].name, rng.randint(1000, 2500)
        for i in range(n):
            g.initializer.append(numpy_helper.from_array(np.float32(i / n), f"wide_c{i}"))
            g.node.append(helper.make_node("Add", [out, f"wide_c{i}"], [f"wide{i}"]))
        g.node.append(helper.make_node("Concat", [f"wide{i}" for i in range(n)], ["wide_cat"], axis=1))
        g.node.append(helper.make_node("Sum", [f"wide{i}" for i in range(n)], ["wide_sum"]))
        g.output[0].name = "wide_cat"
        g.output.append(helper.make_tensor_value_info("wide_sum", TensorProto.FLOAT, None))
    elif kind == "neg_pads":
        conv = next(n for n in g.node if n.op_type == "Conv")
        for a in conv.attribute:
            if a.name == "pads":
                a.ints[:] = [-1, 0, -1, 0]
    elif kind == "huge_batch":
        g.input[0].type.tensor_type.shape.dim[0].dim_value = 2**33
    elif kind == "reorder":
        nodes = list(g.node)
        rng.shuffle(nodes)
        del g.node[:]
        g.node.extend(nodes)
    elif kind == "external":  # hostile external data: outside the folder, absolute, missing
        init = g.initializer[rng.randrange(len(g.initializer))]
        location = rng.choice(["../../etc/passwd", "/etc/passwd", "missing.data", ""])
        init.ClearField("raw_data")
        init.ClearField("float_data")
        init.data_location = TensorProto.EXTERNAL
        init.external_data.add(key="location", value=location)
        path = tmp_path / f"ext{rng.randrange(10**9)}"
        path.mkdir()
        (path / "model.onnx").write_bytes(m.SerializeToString())
        return kind, str(path / "model.onnx")
    return kind, m


def _onnxruntime(model, inputs):
    """onnxruntime's outputs, or None where it refuses the model."""
    import onnxruntime as ort
    try:
        data = model if isinstance(model, bytes) else model.SerializeToString()
        sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, inputs)))
    except Exception:  # noqa: BLE001 - any refusal
        return None


@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in (1, 2, 3))])
def test_malformed_models_end_in_a_module_or_a_clean_error(seed, executor, tmp_path):
    rng = random.Random(seed)
    base = _small()
    outcomes = {}
    for _ in range(CASES // 4):
        kind, model = _mutate(rng, base, tmp_path)
        try:
            result = build(model, executor=executor, cache=None, progress=False)
        except KilnError:
            outcomes[kind, "error"] = outcomes.get((kind, "error"), 0) + 1
            continue
        outcomes[kind, "built"] = outcomes.get((kind, "built"), 0) + 1
        module = result.load()
        inputs = module.random_inputs(seed)
        got = module.run(inputs)
        if not isinstance(model, str):
            want = _onnxruntime(model, inputs)
            if want is not None:
                for name, value in want.items():
                    np.testing.assert_allclose(got[name], value, rtol=1e-3, atol=1e-4, err_msg=f"{kind}: {name}")
    assert sum(outcomes.values()) == CASES // 4
    assert any(what == "built" for _, what in outcomes), "no case built: the comparison never ran"
