"""Col2Im: the columns of sliding blocks (im2col's output: [N, C x block, blocks]) summed back
into an image [N, C, *image_shape], overlapping blocks added. A reader: each image element
sums the block taps that cover it (a tap covers it where its offset, the padding and the
dilation put a block start on the stride's grid), so it fuses like any index map. The
image and block shapes must be known when building (they are constants in exports).
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from ..attrs import const_input
from ..graph import ShapeError, TensorType, UnsupportedError
from ..loop import Const, add, cmp, div, fold_balanced, mul, rem, select
from ..lower.elementwise import and_, iclamp
from ..symbolic import is_symbolic
from .registry import INJECTIVE, OpDef, one_output, register

COL2IM = "Col2Im"


def _col2im(g, node, p):
    x = g.types[node.inputs[0]]
    image = [int(v) for v in const_input(g, node, 1, "image_shape", required=True).reshape(-1)]
    block = [int(v) for v in const_input(g, node, 2, "block_shape", required=True).reshape(-1)]
    dims = len(image)
    strides = list(node.attrs.get("strides", [1] * dims))
    dilations = list(node.attrs.get("dilations", [1] * dims))
    pads = list(node.attrs.get("pads", [0] * 2 * dims))
    if len(x.shape) != 3 or any(is_symbolic(d) for d in x.shape[1:]) or len(block) != dims:
        raise UnsupportedError(f"{node.describe()}: Col2Im of {x} into {image} by blocks {block} (a [N, C x block, "
                               "blocks] input, its last two sizes known when building)")
    blocks = [(image[d] + pads[d] + pads[d + dims] - dilations[d] * (block[d] - 1) - 1) // strides[d] + 1
              for d in range(dims)]
    if x.shape[1] % math.prod(block) or x.shape[2] != math.prod(blocks) or min(blocks) < 1:
        raise ShapeError(f"{node.describe()}: an input {x} is not the columns of {blocks} blocks of {block} into "
                         f"{image} (strides {strides}, dilations {dilations}, pads {pads})")
    p.update(image=image, block=block, blocks=blocks, strides=strides, dilations=dilations, pads=pads[:dims])
    return TensorType((x.shape[0], x.shape[1] // math.prod(block), *image), x.dtype)


def _col2im_reader(b, node):
    """Image element (n, c, y...) = the sum over block taps k of column (c, k), block
    (y + pad - k x dilation) / stride, where that divides and lies among the blocks."""
    a, x = b.attrs(node), b.reader(node.inputs[0])
    block, blocks, t = a["block"], a["blocks"], b.compute(node.inputs[0])
    taps = math.prod(block)

    def read(idx):
        n, c, spatial = idx[0], idx[1], idx[2:]
        terms = []
        for flat, k in enumerate(itertools.product(*(range(s) for s in block))):
            covered, at = None, Const(0)
            for d, y in enumerate(spatial):
                offset = add(y, Const(a["pads"][d] - k[d] * a["dilations"][d]))  # (y - tap + pad: a block start)
                start = iclamp(offset, 0, (blocks[d] - 1) * a["strides"][d])
                test = and_(and_(cmp("ge", offset, Const(0)), cmp("eq", rem(start, a["strides"][d]), Const(0))),
                            cmp("eq", start, offset))
                covered = test if covered is None else and_(covered, test)
                at = add(mul(at, Const(blocks[d])), div(start, a["strides"][d]))
            column = add(mul(c, Const(taps)), Const(flat))
            terms.append(select(covered, x([n, column, at]), Const(0.0, t) if t in ("f32", "f64") else Const(0, t)))
        return fold_balanced("add", terms)
    return read


def _col2im_fold(a, values, g, node):
    x = values[0]
    image, block, blocks = a["image"], a["block"], a["blocks"]
    n, c = x.shape[0], x.shape[1] // math.prod(block)
    out = np.zeros((n, c, *image), x.dtype)
    cols = x.reshape(n, c, *block, *blocks)
    for k in itertools.product(*(range(s) for s in block)):
        for bi in itertools.product(*(range(s) for s in blocks)):
            y = [bi[d] * a["strides"][d] - a["pads"][d] + k[d] * a["dilations"][d] for d in range(len(image))]
            if all(0 <= y[d] < image[d] for d in range(len(image))):
                out[(slice(None), slice(None), *y)] += cols[(slice(None), slice(None), *k, *bi)]
    return [out]


register(OpDef(COL2IM, INJECTIVE, _col2im, _col2im_fold, one_output(_col2im_reader)))
