"""ONNX models the tests and benchmarks build themselves (random weights, fixed seeds).

No downloads: every model is written here with onnx.helper, in the topology the real
network has (ResNet-18 exactly; MobileNetV2, transformer encoder and UNet in their
characteristic shapes), and in the spellings exporters use.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

IR_VERSION = 8  # onnxruntime reads up to 10; 8 is what opset 17 exporters write


class GraphMaker:
    """Accumulates nodes and initializers; names are generated so call sites stay short."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits, self.n = [], [], 0

    def name(self, base: str) -> str:
        self.n += 1
        return f"{base}_{self.n}"

    def const(self, value, base: str = "c") -> str:
        name = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, shape, scale=None, base="w") -> str:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        scale = scale if scale is not None else math.sqrt(2.0 / max(fan_in, 1))
        return self.const((self.rng.standard_normal(shape) * scale).astype(np.float32), base)

    def op(self, op_type: str, inputs, n_out: int = 1, **attrs):
        outs = [self.name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.name(op_type), **attrs))
        return outs[0] if n_out == 1 else outs

    def conv(self, x, cin, cout, k, stride=1, pad=None, group=1, bias=True):
        pad = k // 2 if pad is None else pad
        ins = [x, self.weight((cout, cin // group, k, k))]
        if bias:
            ins.append(self.const((self.rng.standard_normal(cout) * 0.1).astype(np.float32), "b"))
        return self.op("Conv", ins, kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4, group=group)

    def bn(self, x, c):
        r = self.rng
        params = [(r.random(c) * 0.5 + 0.75), r.standard_normal(c) * 0.1, r.standard_normal(c) * 0.1,
                  r.random(c) * 0.5 + 0.5]
        ins = [self.const(p.astype(np.float32), "bn") for p in params]
        return self.op("BatchNormalization", [x] + ins, epsilon=1e-5)

    def linear(self, x, fin, fout):
        y = self.op("MatMul", [x, self.weight((fin, fout), scale=1 / math.sqrt(fin))])
        return self.op("Add", [y, self.const((self.rng.standard_normal(fout) * 0.1).astype(np.float32), "b")])

    def model(self, inputs: dict, outputs: list[str], opset: int = 17, name: str = "model") -> onnx.ModelProto:
        ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()]
        outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
        graph = helper.make_graph(self.nodes, name, ins, outs, self.inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)
        m.producer_name = "kiln-tests"
        return m


def _rename_output(g: GraphMaker, tensor: str, name: str) -> str:
    g.nodes.append(helper.make_node("Identity", [tensor], [name], name=g.name("out")))
    return name


def mlp(batch: int = 1) -> onnx.ModelProto:
    g = GraphMaker(1)
    h = g.op("Relu", [g.linear("x", 784, 256)])
    h = g.op("Relu", [g.linear(h, 256, 128)])
    y = g.op("Gemm", [h, g.weight((10, 128)), g.const(np.zeros(10, np.float32))], transB=1)
    return g.model({"x": [batch, 784]}, [_rename_output(g, y, "logits")], name="mlp")


def cnn() -> onnx.ModelProto:
    g = GraphMaker(2)
    h = g.op("Relu", [g.bn(g.conv("x", 3, 16, 3, bias=False), 16)])
    h = g.op("MaxPool", [h], kernel_shape=[2, 2], strides=[2, 2])
    h = g.op("Relu", [g.bn(g.conv(h, 16, 32, 3), 32)])
    h = g.op("AveragePool", [h], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=0)
    h = g.op("Flatten", [g.op("GlobalAveragePool", [h])])
    y = g.op("Gemm", [h, g.weight((10, 32)), g.const(np.zeros(10, np.float32))], transB=1)
    return g.model({"x": [1, 3, 32, 32]}, [_rename_output(g, y, "logits")], name="cnn")


def resnet18(batch: int = 1, size: int = 224) -> onnx.ModelProto:
    g = GraphMaker(3)
    h = g.op("Relu", [g.bn(g.conv("x", 3, 64, 7, stride=2, pad=3, bias=False), 64)])
    h = g.op("MaxPool", [h], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            s = stride if block == 0 else 1
            y = g.op("Relu", [g.bn(g.conv(h, cin, cout, 3, stride=s, bias=False), cout)])
            y = g.bn(g.conv(y, cout, cout, 3, bias=False), cout)
            short = h if (s == 1 and cin == cout) else g.bn(g.conv(h, cin, cout, 1, stride=s, pad=0, bias=False), cout)
            h = g.op("Relu", [g.op("Add", [y, short])])
            cin = cout
    h = g.op("Flatten", [g.op("GlobalAveragePool", [h])], axis=1)
    y = g.op("Gemm", [h, g.weight((1000, 512), scale=0.05), g.const(np.zeros(1000, np.float32))], transB=1)
    return g.model({"x": [batch, 3, size, size]}, [_rename_output(g, y, "logits")], name="resnet18")


def mobilenet_v2(size: int = 112) -> onnx.ModelProto:
    """MobileNetV2's inverted residual blocks: 1x1 expand, 3x3 depthwise, 1x1 project, ReLU6."""
    g = GraphMaker(4)

    def relu6(x):
        return g.op("Clip", [x, g.const(np.float32(0.0)), g.const(np.float32(6.0))])

    h = relu6(g.bn(g.conv("x", 3, 32, 3, stride=2, bias=False), 32))
    cin = 32
    for expand, cout, repeats, stride in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 2, 2), (6, 96, 1, 1)):
        for i in range(repeats):
            s = stride if i == 0 else 1
            hidden = cin * expand
            y = h
            if expand != 1:
                y = relu6(g.bn(g.conv(y, cin, hidden, 1, pad=0, bias=False), hidden))
            y = relu6(g.bn(g.conv(y, hidden, hidden, 3, stride=s, group=hidden, bias=False), hidden))
            y = g.bn(g.conv(y, hidden, cout, 1, pad=0, bias=False), cout)
            h = g.op("Add", [h, y]) if s == 1 and cin == cout else y
            cin = cout
    h = relu6(g.bn(g.conv(h, cin, 320, 1, pad=0, bias=False), 320))
    h = g.op("Flatten", [g.op("GlobalAveragePool", [h])])
    y = g.op("Gemm", [h, g.weight((100, 320), scale=0.05), g.const(np.zeros(100, np.float32))], transB=1)
    return g.model({"x": [1, 3, size, size]}, [_rename_output(g, y, "logits")], name="mobilenet_v2")


def transformer_encoder(seq: int = 64, d: int = 128, heads: int = 4, ffn: int = 512) -> onnx.ModelProto:
    """A pre-norm encoder block: multi-head self-attention and an Erf-GELU MLP."""
    g = GraphMaker(5)
    dh = d // heads

    def layernorm(x):
        return g.op("LayerNormalization", [x, g.const(np.ones(d, np.float32) + g.rng.standard_normal(d).astype(
            np.float32) * 0.1), g.const(g.rng.standard_normal(d).astype(np.float32) * 0.1)], axis=-1, epsilon=1e-5)

    def split_heads(t):
        t = g.op("Reshape", [t, g.const(np.array([1, seq, heads, dh], np.int64))])
        return g.op("Transpose", [t], perm=[0, 2, 1, 3])

    h = layernorm("x")
    q, k, v = (split_heads(g.linear(h, d, d)) for _ in range(3))
    kt = g.op("Transpose", [k], perm=[0, 1, 3, 2])
    scores = g.op("Div", [g.op("MatMul", [q, kt]), g.const(np.float32(math.sqrt(dh)))])
    attn = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])
    attn = g.op("Reshape", [g.op("Transpose", [attn], perm=[0, 2, 1, 3]), g.const(np.array([1, seq, d], np.int64))])
    x1 = g.op("Add", ["x", g.linear(attn, d, d)])
    f = g.linear(layernorm(x1), d, ffn)
    gelu = g.op("Mul", [g.op("Mul", [f, g.op("Add", [g.op("Erf", [g.op("Div", [f, g.const(
        np.float32(math.sqrt(2)))])]), g.const(np.float32(1.0))])]), g.const(np.float32(0.5))])
    y = g.op("Add", [x1, g.linear(gelu, ffn, d)])
    return g.model({"x": [1, seq, d]}, [_rename_output(g, y, "y")], name="transformer_encoder")


def unet(size: int = 64) -> onnx.ModelProto:
    """A two-level UNet: ConvTranspose on one up path, Resize (nearest, linear) on others."""
    g = GraphMaker(6)

    def block(x, cin, cout):
        x = g.op("Relu", [g.bn(g.conv(x, cin, cout, 3, bias=False), cout)])
        return g.op("Relu", [g.bn(g.conv(x, cout, cout, 3, bias=False), cout)])

    e1 = block("x", 3, 16)
    e2 = block(g.op("MaxPool", [e1], kernel_shape=[2, 2], strides=[2, 2]), 16, 32)
    mid = block(g.op("MaxPool", [e2], kernel_shape=[2, 2], strides=[2, 2]), 32, 64)
    up2 = g.op("ConvTranspose", [mid, g.weight((64, 32, 2, 2)), g.const(np.zeros(32, np.float32))],
               kernel_shape=[2, 2], strides=[2, 2])
    d2 = block(g.op("Concat", [up2, e2], axis=1), 64, 32)
    up1 = g.op("Resize", [d2, "", g.const(np.array([1, 1, 2, 2], np.float32))], mode="nearest")
    d1 = block(g.op("Concat", [up1, e1], axis=1), 48, 16)
    side = g.op("Resize", [mid, "", g.const(np.array([1, 1, 4, 4], np.float32))], mode="linear",
                coordinate_transformation_mode="half_pixel")
    side = g.conv(side, 64, 16, 1, pad=0)
    y = g.conv(g.op("Add", [d1, side]), 16, 2, 1, pad=0)
    return g.model({"x": [1, 3, size, size]}, [_rename_output(g, y, "mask")], name="unet")


def pytorch_reshape_chain() -> onnx.ModelProto:
    """The Shape->Gather->Unsqueeze->Concat->Reshape chain torch.onnx writes for x.view(n, -1)."""
    g = GraphMaker(7)
    h = g.op("Relu", [g.conv("x", 3, 8, 3)])
    shape = g.op("Shape", [h])
    n = g.op("Gather", [shape, g.const(np.array(0, np.int64))], axis=0)
    n = g.op("Unsqueeze", [n, g.const(np.array([0], np.int64))])
    target = g.op("Concat", [n, g.const(np.array([-1], np.int64))], axis=0)
    flat = g.op("Reshape", [h, target])
    y = g.op("Gemm", [flat, g.weight((10, 8 * 16 * 16), scale=0.02), g.const(np.zeros(10, np.float32))], transB=1)
    return g.model({"x": [2, 3, 16, 16]}, [_rename_output(g, y, "y")], opset=13, name="pytorch_reshape_chain")


ALL = {
    "mlp_b1": lambda: mlp(1), "mlp_b32": lambda: mlp(32), "cnn": cnn, "resnet18": resnet18,
    "mobilenet_v2": mobilenet_v2, "transformer_encoder": transformer_encoder, "unet": unet,
    "pytorch_reshape_chain": pytorch_reshape_chain,
}


def random_inputs(model: onnx.ModelProto, seed: int = 0, symbols: dict | None = None) -> dict:
    """Standard normal inputs; a symbolic dim (dim_param) takes its size from `symbols`."""
    rng = np.random.default_rng(seed)
    init = {i.name for i in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in init:
            continue
        shape = [symbols[d.dim_param] if symbols and d.dim_param else d.dim_value for d in vi.type.tensor_type.shape.dim]
        elem = vi.type.tensor_type.elem_type  # (float16 and double as their own type: onnxruntime takes no other)
        own = elem in (onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(elem) if own else np.float32
        out[vi.name] = rng.standard_normal(shape).astype(dtype)
    return out


def onnxruntime_outputs(model: onnx.ModelProto, inputs: dict, threads: int = 1) -> dict:
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, inputs)))


def quantized(model: onnx.ModelProto, fmt: str, per_channel: bool = True, seed: int = 0,
              calibration_runs: int = 4, symbols: dict | None = None) -> onnx.ModelProto:
    """`model` quantized to int8 by onnxruntime's own tool, as users quantize theirs: fmt is
    "dynamic" (quantize_dynamic: DynamicQuantizeLinear + MatMulInteger/ConvInteger), "qdq"
    or "qoperator" (quantize_static, calibrated on random inputs: QuantizeLinear/
    DequantizeLinear pairs, or QLinearConv/QLinearMatMul and com.microsoft QLinear ops). A
    model with symbolic dims is calibrated at the sizes `symbols` gives."""
    import os
    import tempfile
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([random_inputs(model, seed + i, symbols) for i in range(calibration_runs)])

        def get_next(self):
            return next(self.feeds, None)

    with tempfile.TemporaryDirectory(prefix="kiln-quantize-") as tmp:
        raw, src, dst = (os.path.join(tmp, f) for f in ("model.onnx", "model.pre.onnx", "model.int8.onnx"))
        onnx.save(model, raw)
        # The tool's documented first step (onnx shape inference, BatchNorm folded); the models
        # here have static shapes, so without its symbolic pass, which needs sympy.
        quant_pre_process(raw, src, skip_symbolic_shape=True)
        if fmt == "dynamic":
            quantize_dynamic(src, dst, per_channel=per_channel)
        else:
            quantize_static(src, dst, Reader(), per_channel=per_channel,
                            quant_format={"qdq": QuantFormat.QDQ, "qoperator": QuantFormat.QOperator}[fmt])
        return onnx.load(dst)


def residual_cnn(size: int = 32, width: int = 32, blocks: int = 2) -> onnx.ModelProto:
    """A small ResNet-style network (conv stem, residual blocks with a strided 1x1 shortcut,
    global pool, classifier): the shapes int8 deployments quantize."""
    g = GraphMaker(5)
    h = g.op("Relu", [g.bn(g.conv("x", 3, width, 3, bias=False), width)])
    cin = width
    for i in range(blocks):
        cout, stride = width * 2 ** i, 1 if i == 0 else 2
        y = g.op("Relu", [g.bn(g.conv(h, cin, cout, 3, stride=stride, bias=False), cout)])
        y = g.bn(g.conv(y, cout, cout, 3, bias=False), cout)
        short = h if stride == 1 and cin == cout else g.conv(h, cin, cout, 1, stride=stride, pad=0)
        h = g.op("Relu", [g.op("Add", [y, short])])
        cin = cout
    h = g.op("Flatten", [g.op("GlobalAveragePool", [h])], axis=1)
    y = g.linear(h, cin, 10)
    return g.model({"x": [1, 3, size, size]}, [_rename_output(g, y, "logits")], name="residual_cnn")


def recurrent_model(cell, seq=5, batch=3, width=6, hidden=8, dirs=2, layers=1, layout=0, lens=True, init=True,
                    peepholes=False, seed=0, **attrs):
    """`layers` stacked LSTM, GRU or RNN nodes (each layer's Y, [seq, dirs, batch, hidden],
    reshaped to the next one's input), with the feeds to run it: sequence_lens and initial
    states at random where asked for."""
    rng = np.random.default_rng(seed)
    g = {"LSTM": 4, "GRU": 3, "RNN": 1}[cell]
    direction = "bidirectional" if dirs == 2 else attrs.pop("direction", "forward")
    xs = [batch, seq, width] if layout else [seq, batch, width]
    st = [batch, dirs, hidden] if layout else [dirs, batch, hidden]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, xs)]
    feeds = {"x": rng.standard_normal(xs).astype(np.float32)}
    if lens:
        inputs.append(helper.make_tensor_value_info("lens", TensorProto.INT32, [batch]))
        feeds["lens"] = rng.integers(1, seq + 1, batch).astype(np.int32)
        feeds["lens"][0] = seq
    inits, nodes, outputs = [], [], []
    x = "x"
    for layer in range(layers):
        w = lambda n, shape: inits.append(numpy_helper.from_array(  # noqa: E731
            (rng.standard_normal(shape) * 0.3).astype(np.float32), f"{n}{layer}")) or f"{n}{layer}"
        cw = width if layer == 0 else dirs * hidden
        ins = [x, w("W", [dirs, g * hidden, cw]), w("R", [dirs, g * hidden, hidden]), w("B", [dirs, 2 * g * hidden]),
               "lens" if lens else ""]
        states = ["h", "c"] if cell == "LSTM" else ["h"]
        for s in states:
            if init:
                inputs.append(helper.make_tensor_value_info(f"{s}{layer}", TensorProto.FLOAT, st))
                feeds[f"{s}{layer}"] = rng.standard_normal(st).astype(np.float32)
            ins.append(f"{s}{layer}" if init else "")
        if peepholes:
            ins.append(w("P", [dirs, 3 * hidden]))
        outs = [f"y{layer}", f"yh{layer}"] + ([f"yc{layer}"] if cell == "LSTM" else [])
        nodes.append(helper.make_node(cell, ins, outs, hidden_size=hidden, direction=direction, layout=layout, **attrs))
        outputs += outs
        if layer + 1 < layers:  # [seq, dirs, batch, hidden] -> [seq, batch, dirs * hidden]
            nodes.append(helper.make_node("Transpose", [f"y{layer}"], [f"t{layer}"], perm=[0, 2, 1, 3]))
            inits.append(numpy_helper.from_array(np.array([seq, batch, dirs * hidden], np.int64), f"shape{layer}"))
            nodes.append(helper.make_node("Reshape", [f"t{layer}", f"shape{layer}"], [f"x{layer + 1}"]))
            x = f"x{layer + 1}"
    graph = helper.make_graph(nodes, "rnn", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8), feeds
