"""The architectures the performance issue measures, in their real topology with random
weights (tests/model_zoo.py's GraphMaker; nothing downloaded): ResNet-50, a MobileNetV3-style
network, EfficientNet-B0, RegNetY-400MF, DenseNet-121, ConvNeXt-T's first stage and a ViT-S/16-style
encoder."""
from __future__ import annotations

import math

import numpy as np

from tests.model_zoo import GraphMaker, _rename_output


def resnet50(size: int = 224):
    """ResNet-50: bottleneck blocks (1x1 reduce, 3x3, 1x1 expand) with projection shortcuts."""
    g = GraphMaker(11)
    h = g.op("Relu", [g.bn(g.conv("x", 3, 64, 7, stride=2, pad=3, bias=False), 64)])
    h = g.op("MaxPool", [h], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for mid, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            s, out = (stride if b == 0 else 1), mid * 4
            y = g.op("Relu", [g.bn(g.conv(h, cin, mid, 1, pad=0, bias=False), mid)])
            y = g.op("Relu", [g.bn(g.conv(y, mid, mid, 3, stride=s, bias=False), mid)])
            y = g.bn(g.conv(y, mid, out, 1, pad=0, bias=False), out)
            short = h if s == 1 and cin == out else g.bn(g.conv(h, cin, out, 1, stride=s, pad=0, bias=False), out)
            h, cin = g.op("Relu", [g.op("Add", [y, short])]), out
    h = g.op("Flatten", [g.op("GlobalAveragePool", [h])])
    y = g.op("Gemm", [h, g.weight((1000, 2048), scale=0.02), g.const(np.zeros(1000, np.float32))], transB=1)
    return g.model({"x": [1, 3, size, size]}, [_rename_output(g, y, "logits")], name="resnet50")


def mobilenet_v3(size: int = 224):
    """MobileNetV3-Large's blocks: 1x1 expansion, depthwise 3x3/5x5, squeeze-excite
    (global pool, two 1x1 convs, hard sigmoid), hard-swish, 1x1 projection, residuals."""
    g = GraphMaker(12)

    def act(x, kind):
        return g.op("HardSwish", [x]) if kind == "hs" else g.op("Relu", [x])

    h = act(g.bn(g.conv("x", 3, 16, 3, stride=2, bias=False), 16), "hs")
    cin = 16
    for exp, out, k, s, se, kind in ((16, 16, 3, 1, False, "re"), (64, 24, 3, 2, False, "re"), (72, 24, 3, 1, False, "re"),
                                     (72, 40, 5, 2, True, "re"), (120, 40, 5, 1, True, "re"), (240, 80, 3, 2, False, "hs"),
                                     (200, 80, 3, 1, False, "hs"), (480, 112, 3, 1, True, "hs"),
                                     (672, 160, 5, 2, True, "hs"), (960, 160, 5, 1, True, "hs")):
        y = h if exp == cin else act(g.bn(g.conv(h, cin, exp, 1, pad=0, bias=False), exp), kind)
        y = act(g.bn(g.conv(y, exp, exp, k, stride=s, group=exp, bias=False), exp), kind)
        if se:
            w = g.op("GlobalAveragePool", [y])
            w = g.op("Relu", [g.conv(w, exp, exp // 4, 1, pad=0)])
            y = g.op("Mul", [y, g.op("HardSigmoid", [g.conv(w, exp // 4, exp, 1, pad=0)], alpha=1 / 6, beta=0.5)])
        y = g.bn(g.conv(y, exp, out, 1, pad=0, bias=False), out)
        h, cin = (g.op("Add", [h, y]) if s == 1 and cin == out else y), out
    h = act(g.bn(g.conv(h, cin, 960, 1, pad=0, bias=False), 960), "hs")
    h = g.op("Flatten", [g.op("GlobalAveragePool", [h])])
    y = g.op("Gemm", [h, g.weight((1000, 960), scale=0.03), g.const(np.zeros(1000, np.float32))], transB=1)
    return g.model({"x": [1, 3, size, size]}, [_rename_output(g, y, "logits")], name="mobilenet_v3")


def efficientnet_b0(size: int = 224):
    """EfficientNet-B0: MBConv blocks (1x1 expansion by 6, depthwise 3x3 or 5x5,
    squeeze-excite to a quarter of the block's input width, 1x1 projection, residual), SiLU
    (x * sigmoid(x), as torch exports it) after every conv but the projections."""
    g = GraphMaker(16)

    def silu(x):
        return g.op("Mul", [x, g.op("Sigmoid", [x])])

    h = silu(g.bn(g.conv("x", 3, 32, 3, stride=2, bias=False), 32))
    cin = 32
    for expand, out, k, s, repeats in ((1, 16, 3, 1, 1), (6, 24, 3, 2, 2), (6, 40, 5, 2, 2), (6, 80, 3, 2, 3),
                                       (6, 112, 5, 1, 3), (6, 192, 5, 2, 4), (6, 320, 3, 1, 1)):
        for i in range(repeats):
            stride, exp = (s if i == 0 else 1), cin * expand
            y = h if expand == 1 else silu(g.bn(g.conv(h, cin, exp, 1, pad=0, bias=False), exp))
            y = silu(g.bn(g.conv(y, exp, exp, k, stride=stride, group=exp, bias=False), exp))
            se = silu(g.conv(g.op("GlobalAveragePool", [y]), exp, max(1, cin // 4), 1, pad=0))
            y = g.op("Mul", [y, g.op("Sigmoid", [g.conv(se, max(1, cin // 4), exp, 1, pad=0)])])
            y = g.op("Conv", [y, g.weight((out, exp, 1, 1), scale=0.5 / math.sqrt(exp))], kernel_shape=[1, 1])
            y = g.bn(y, out)
            h, cin = (g.op("Add", [h, y]) if stride == 1 and cin == out else y), out
    h = silu(g.bn(g.conv(h, cin, 1280, 1, pad=0, bias=False), 1280))
    h = g.op("Flatten", [g.op("GlobalAveragePool", [h])])
    y = g.op("Gemm", [h, g.weight((1000, 1280), scale=0.03), g.const(np.zeros(1000, np.float32))], transB=1)
    return g.model({"x": [1, 3, size, size]}, [_rename_output(g, y, "logits")], name="efficientnet_b0")


def regnety_400mf(size: int = 224):
    """RegNetY-400MF: stages of 48, 104, 208 and 440 channels (1, 3, 6, 6 blocks); each block
    a 1x1 conv, a 3x3 conv in groups of 8 channels (the first of a stage with stride 2),
    squeeze-excite (a quarter of the block's input width, sigmoid), a 1x1 conv, and the
    residual (projected where the shape changes). The last 1x1's weights are scaled down, as
    trained ones are, so that 16 residual blocks of random weights keep activations near 1."""
    g = GraphMaker(15)
    h = g.op("Relu", [g.bn(g.conv("x", 3, 32, 3, stride=2, bias=False), 32)])
    cin = 32
    for width, blocks in ((48, 1), (104, 3), (208, 6), (440, 6)):
        for i in range(blocks):
            s = 2 if i == 0 else 1
            y = g.op("Relu", [g.bn(g.conv(h, cin, width, 1, pad=0, bias=False), width)])
            y = g.op("Relu", [g.bn(g.conv(y, width, width, 3, stride=s, group=width // 8, bias=False), width)])
            se = g.op("Relu", [g.conv(g.op("GlobalAveragePool", [y]), width, cin // 4, 1, pad=0)])
            y = g.op("Mul", [y, g.op("Sigmoid", [g.conv(se, cin // 4, width, 1, pad=0)])])
            y = g.op("Conv", [y, g.weight((width, width, 1, 1), scale=0.3 / math.sqrt(width))], kernel_shape=[1, 1])
            y = g.bn(y, width)
            short = h if s == 1 and cin == width else g.bn(g.conv(h, cin, width, 1, stride=s, pad=0, bias=False),
                                                           width)
            h, cin = g.op("Relu", [g.op("Add", [y, short])]), width
    h = g.op("Flatten", [g.op("GlobalAveragePool", [h])])
    y = g.op("Gemm", [h, g.weight((1000, cin), scale=0.05), g.const(np.zeros(1000, np.float32))], transB=1)
    return g.model({"x": [1, 3, size, size]}, [_rename_output(g, y, "logits")], name="regnety_400mf")


def densenet121(size: int = 224):
    """DenseNet-121: four dense blocks (6, 12, 24, 16 layers, growth 32); every layer is
    BatchNorm-ReLU-1x1 conv to 128 channels, BatchNorm-ReLU-3x3 conv to 32, and its input is
    the Concat of the block's input and every earlier layer's output, as torchvision exports
    it (a new Concat per layer). Between blocks a transition (BatchNorm-ReLU-1x1 conv halving
    the channels, 2x2 average pool)."""
    g = GraphMaker(17)
    h = g.op("Relu", [g.bn(g.conv("x", 3, 64, 7, stride=2, pad=3, bias=False), 64)])
    h = g.op("MaxPool", [h], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for b, layers in enumerate((6, 12, 24, 16)):
        features = [h]
        for i in range(layers):
            x = features[0] if len(features) == 1 else g.op("Concat", features, axis=1)
            c = cin + 32 * i
            y = g.conv(g.op("Relu", [g.bn(x, c)]), c, 128, 1, pad=0, bias=False)
            features.append(g.conv(g.op("Relu", [g.bn(y, 128)]), 128, 32, 3, bias=False))
        h, cin = g.op("Concat", features, axis=1), cin + 32 * layers
        if b < 3:
            h = g.conv(g.op("Relu", [g.bn(h, cin)]), cin, cin // 2, 1, pad=0, bias=False)
            h, cin = g.op("AveragePool", [h], kernel_shape=[2, 2], strides=[2, 2]), cin // 2
    h = g.op("Flatten", [g.op("GlobalAveragePool", [g.op("Relu", [g.bn(h, cin)])])])
    y = g.op("Gemm", [h, g.weight((1000, cin), scale=0.03), g.const(np.zeros(1000, np.float32))], transB=1)
    return g.model({"x": [1, 3, size, size]}, [_rename_output(g, y, "logits")], name="densenet121")


def _layernorm(g: GraphMaker, x: str, d: int) -> str:
    return g.op("LayerNormalization", [x, g.const((1 + g.rng.standard_normal(d) * 0.1).astype(np.float32)),
                                       g.const((g.rng.standard_normal(d) * 0.1).astype(np.float32))],
                axis=-1, epsilon=1e-6)


def _gelu(g: GraphMaker, x: str) -> str:
    erf = g.op("Erf", [g.op("Div", [x, g.const(np.float32(math.sqrt(2)))])])
    return g.op("Mul", [g.op("Mul", [x, g.op("Add", [erf, g.const(np.float32(1))])]), g.const(np.float32(0.5))])


def convnext_stage(size: int = 56, c: int = 96, blocks: int = 3):
    """ConvNeXt-T's first stage: per block a 7x7 depthwise conv, LayerNorm over channels
    (channels last), a 4x MLP with GELU, layer scale, and the residual."""
    g = GraphMaker(13)
    h = "x"
    for _ in range(blocks):
        y = g.conv(h, c, c, 7, group=c)
        y = g.op("Transpose", [y], perm=[0, 2, 3, 1])
        y = g.linear(_gelu(g, g.linear(_layernorm(g, y, c), c, 4 * c)), 4 * c, c)
        y = g.op("Mul", [y, g.const(np.full(c, 0.1, np.float32))])
        h = g.op("Add", [h, g.op("Transpose", [y], perm=[0, 3, 1, 2])])
    return g.model({"x": [1, c, size, size]}, [_rename_output(g, h, "y")], name="convnext_stage")


def vit_encoder(size: int = 224, patch: int = 16, d: int = 384, heads: int = 6, layers: int = 6):
    """A ViT-S/16-style encoder: 16x16 patch embedding, a class token, position embeddings,
    pre-norm layers of multi-head self-attention and a GELU MLP, and the class token's head."""
    g = GraphMaker(14)
    n = (size // patch) ** 2
    seq, dh = n + 1, d // heads
    p = g.op("Conv", ["x", g.weight((d, 3, patch, patch)), g.const(np.zeros(d, np.float32))],
             kernel_shape=[patch, patch], strides=[patch, patch])
    p = g.op("Transpose", [g.op("Reshape", [p, g.const(np.array([1, d, n], np.int64))])], perm=[0, 2, 1])
    h = g.op("Concat", [g.const((g.rng.standard_normal((1, 1, d)) * 0.02).astype(np.float32)), p], axis=1)
    h = g.op("Add", [h, g.const((g.rng.standard_normal((1, seq, d)) * 0.02).astype(np.float32))])

    def heads_of(t):
        return g.op("Transpose", [g.op("Reshape", [t, g.const(np.array([1, seq, heads, dh], np.int64))])],
                    perm=[0, 2, 1, 3])

    for _ in range(layers):
        x = _layernorm(g, h, d)
        q, k, v = (heads_of(g.linear(x, d, d)) for _ in range(3))
        scores = g.op("Mul", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])]),
                              g.const(np.float32(1 / math.sqrt(dh)))])
        attn = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])
        attn = g.op("Reshape", [g.op("Transpose", [attn], perm=[0, 2, 1, 3]), g.const(np.array([1, seq, d], np.int64))])
        h = g.op("Add", [h, g.linear(attn, d, d)])
        h = g.op("Add", [h, g.linear(_gelu(g, g.linear(_layernorm(g, h, d), d, 4 * d)), 4 * d, d)])
    cls = g.op("Gather", [_layernorm(g, h, d), g.const(np.array(0, np.int64))], axis=1)
    y = g.linear(cls, d, 1000)
    return g.model({"x": [1, 3, size, size]}, [_rename_output(g, y, "logits")], name="vit_encoder")


ALL = {"resnet50": resnet50, "mobilenet_v3": mobilenet_v3, "efficientnet_b0": efficientnet_b0,
       "regnety_400mf": regnety_400mf, "densenet121": densenet121,
       "convnext_stage": convnext_stage, "vit_encoder": vit_encoder}
