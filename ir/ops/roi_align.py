"""RoiAlign: each region of interest (a box on a feature map: Faster and Mask R-CNN's second
stage) pooled to a fixed grid of bins, each bin the average (or maximum) of bilinear samples
on a regular grid inside it. Its own kernel: the regions are often a count a NonMaxSuppression
made, and the samples per bin follow from each region's size (sampling_ratio 0), so a loop
runs as long as the region asks.

As onnx's reference and onnxruntime compute it: half_pixel shifts the box by half a pixel
(opset 16's default; opset 10 had output_half_pixel, no shift, and a box of at least one
pixel); a sample more than a pixel outside the map reads 0, one nearer is clamped to the
edge; max mode takes the largest weighted corner of each sample, an outside sample 0.
"""
from __future__ import annotations

from ..attrs import check_attrs
from ..dtypes import is_float
from ..graph import ShapeError, TensorType, UnsupportedError
from ..loop import Assign, Cast, Const, For, Let, Local, Store, Var, add, call, cmp, fbin, flat_index, select, sub
from ..lower.elementwise import as_index, iclamp
from ..symbolic import require_equal
from .registry import OPAQUE, OpDef, register

ROI_ALIGN = "RoiAlign"


def _roi_align(g, node, p):
    x, rois, batch = (g.types[i] for i in node.inputs[:3])
    check_attrs(node, {"mode": ("avg", "max"), "coordinate_transformation_mode": ("half_pixel", "output_half_pixel")})
    if len(x.shape) != 4 or not is_float(x.dtype) or not is_float(rois.dtype):
        raise UnsupportedError(f"{node.describe()}: RoiAlign of {x} over regions {rois} (a float [N, C, H, W] map)")
    if len(rois.shape) != 2 or rois.shape[1] != 4 or len(batch.shape) != 1:
        raise ShapeError(f"{node.describe()}: regions {rois} must be [R, 4] and batch indices {batch} [R]")
    require_equal(rois.shape[0], batch.shape[0], f"{node.describe()}: regions and their batch indices")
    default = "half_pixel" if g.opset >= 16 else "output_half_pixel"
    p["half_pixel"] = node.attrs.get("coordinate_transformation_mode", default) == "half_pixel"
    height, width = node.attrs.get("output_height", 1), node.attrs.get("output_width", 1)
    return TensorType((rois.shape[0], x.shape[1], height, width), x.dtype)


def _roi_align_kernel(b, node):
    """Regions and channels on threads; per bin, the samples' grid as the region asks."""
    a = b.attrs(node)
    x, rois, batch = (b.reader(i) for i in node.inputs[:3])
    images, _, height, width = b.shape(node.inputs[0])
    _, _, out_h, out_w = b.shape(node.outputs[0])
    out = b.out_param(node.outputs[0])
    ratio, scale = int(a.get("sampling_ratio", 0)), float(a.get("spatial_scale", 1.0))
    average = a.get("mode", "avg") == "avg"
    half = 0.5 if a["half_pixel"] else 0.0
    f32 = "f32"

    def f(v):
        return Const(float(v), f32)

    def region(idx):
        r, c, ph, pw = idx
        n, y0, x0, bin_h, bin_w, grid_h, grid_w, acc, first, iy, ix = (b.fresh(v) for v in (
            "n", "y0", "x0", "bin_h", "bin_w", "grid_h", "grid_w", "acc", "first", "iy", "ix"))
        corner = [fbin("sub", fbin("mul", Cast(f32, rois([r, Const(k)])), f(scale)), f(half)) for k in range(4)]
        size_w, size_h = fbin("sub", corner[2], corner[0]), fbin("sub", corner[3], corner[1])
        if not a["half_pixel"]:  # (a malformed region is one pixel)
            size_w, size_h = fbin("max", size_w, f(1)), fbin("max", size_h, f(1))

        def grid(size, bins):
            return Const(ratio) if ratio > 0 else Cast("i64", call("ceil", fbin("div", size, f(bins))))
        y = fbin("add", fbin("add", Var(y0, f32), fbin("mul", Cast(f32, ph), Var(bin_h, f32))),
                 fbin("div", fbin("mul", fbin("add", Cast(f32, Var(iy)), f(0.5)), Var(bin_h, f32)),
                      Cast(f32, Var(grid_h))))
        xx = fbin("add", fbin("add", Var(x0, f32), fbin("mul", Cast(f32, pw), Var(bin_w, f32))),
                  fbin("div", fbin("mul", fbin("add", Cast(f32, Var(ix)), f(0.5)), Var(bin_w, f32)),
                       Cast(f32, Var(grid_w))))
        sample = _bilinear(b, lambda yi, xi: Cast(f32, x([Var(n), c, yi, xi])), y, xx, height, width, average)
        fold = Assign(acc, fbin("add", Var(acc, f32), sample)) if average else \
            Assign(acc, select(cmp("ne", Var(first), Const(0)), sample, fbin("max", Var(acc, f32), sample)))
        samples = For(iy, Var(grid_h), (For(ix, Var(grid_w), (fold, Assign(first, Const(0)))),))
        count = Cast(f32, fbin("max", fbin("mul", Var(grid_h), Var(grid_w)), Const(1)))
        value = fbin("div", Var(acc, f32), count) if average else Var(acc, f32)
        return [Let(n, iclamp(Cast("i64", batch([r])), 0, sub(as_index(images), Const(1)))),
                Let(y0, corner[1]), Let(x0, corner[0]),
                Let(bin_h, fbin("div", size_h, f(out_h))), Let(bin_w, fbin("div", size_w, f(out_w))),
                Let(grid_h, grid(size_h, out_h)), Let(grid_w, grid(size_w, out_w)),
                Local(acc, f32, f(0)), Local(first, "i64", Const(1)), samples,
                Store(out, flat_index(idx, b.shape(node.outputs[0])), Cast(b.compute(node.outputs[0]), value))]
    return b.loops(b.shape(node.outputs[0]), region, inner_kind="serial", parallel=True)


def _bilinear(b, read, y, x, height, width, average: bool):
    """One sample at (y, x): 0 more than a pixel outside the map, else the four pixels around
    it (clamped to the edge) by their bilinear weights, summed (average) or their largest."""
    f32 = "f32"
    h, w = Cast(f32, as_index(height)), Cast(f32, as_index(width))
    outside = fbin("or", fbin("or", cmp("lt", y, Const(-1.0, f32)), cmp("gt", y, h)),
                   fbin("or", cmp("lt", x, Const(-1.0, f32)), cmp("gt", x, w)))
    yc, xc = fbin("max", y, Const(0.0, f32)), fbin("max", x, Const(0.0, f32))
    last_y, last_x = sub(as_index(height), Const(1)), sub(as_index(width), Const(1))
    y_low, x_low = Cast("i64", yc), Cast("i64", xc)  # (truncation: both are at least 0)
    at_end_y, at_end_x = cmp("ge", y_low, last_y), cmp("ge", x_low, last_x)
    y_lo, x_lo = select(at_end_y, last_y, y_low), select(at_end_x, last_x, x_low)
    y_hi, x_hi = select(at_end_y, last_y, add(y_low, Const(1))), select(at_end_x, last_x, add(x_low, Const(1)))
    ly = select(at_end_y, Const(0.0, f32), fbin("sub", yc, Cast(f32, y_low)))
    lx = select(at_end_x, Const(0.0, f32), fbin("sub", xc, Cast(f32, x_low)))
    hy, hx = fbin("sub", Const(1.0, f32), ly), fbin("sub", Const(1.0, f32), lx)
    taps = [fbin("mul", fbin("mul", hy, hx), read(y_lo, x_lo)), fbin("mul", fbin("mul", hy, lx), read(y_lo, x_hi)),
            fbin("mul", fbin("mul", ly, hx), read(y_hi, x_lo)), fbin("mul", fbin("mul", ly, lx), read(y_hi, x_hi))]
    if average:
        value = fbin("add", fbin("add", taps[0], taps[1]), fbin("add", taps[2], taps[3]))
    else:
        value = fbin("max", fbin("max", taps[0], taps[1]), fbin("max", taps[2], taps[3]))
    return select(outside, Const(0.0, f32), value)


register(OpDef(ROI_ALIGN, OPAQUE, _roi_align, alone=_roi_align_kernel))
