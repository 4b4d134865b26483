"""Statements that are a block of vector code of their own: the 8-bit depthwise window row
(WindowDot), 16x16 register transposes (TransposeBlock) and deinterleaving strided rows
(Deinterleave), with the masked loads and stores they use. A part of
llvm_emit.FunctionEmitter, whose state it shares."""
from __future__ import annotations

from ..ir.loop import TRANSPOSE_LANES, WINDOW_DOT_LANES, Deinterleave, TransposeBlock, WindowDot

from .llvm_types import VPDPBUSD, literal



MASKED_SUFFIX = {"float": "f32", "i32": "i32"}  # llvm.masked.load/store's name for a vector's elements


def first_lanes(lanes: int, count: int) -> str:
    """A constant <lanes x i1> mask with the first `count` lanes on."""
    return f"<{lanes} x i1> <" + ", ".join(f"i1 {'true' if i < count else 'false'}" for i in range(lanes)) + ">"


class VectorBlockEmitter:
    """FunctionEmitter's WindowDot, TransposeBlock and Deinterleave statements (a mixin)."""

    def window_dot(self, s: WindowDot) -> None:
        """16 outputs at a time (ir.loop.WindowDot): per window row and quad of taps, one
        64-byte load of the plane, a byte shuffle (vpermb) putting output i's four inputs in
        lane i, and a vpdpbusd against the quad's weights, splat. One accumulator per window
        row, summed at the end, so the dot products do not wait on each other."""
        lanes = WINDOW_DOT_LANES
        vt, bt = f"<{lanes} x i32>", f"<{lanes * 4} x i8>"
        vnni = lanes in self.dot_widths
        if vnni:
            self.decls.add(f"declare {vt} @{VPDPBUSD[lanes]}({vt}, {vt}, {vt})")
        p_ptr, w_ptr, o_ptr = self.bufs[s.p_buf][0], self.bufs[s.w_buf][0], self.bufs[s.out_buf][0]
        p_off, w_off, o_off = self.expr(s.p_off), self.expr(s.w_off), self.expr(s.out_off)
        weights = {}  # (row, quad) -> the quad's four weight bytes in every lane: loaded once
        for r in range(s.rows):
            for q in range(s.quads):
                wi = self.tmp("wi")
                self.emit(f"{wi} = add nsw i64 {w_off}, {r * s.quads + q}")
                w4, ins, splat = self.tmp("w4"), self.tmp("ins"), self.tmp("wsplat")
                self.emit(f"{w4} = load i32, ptr {self.gep(w_ptr, 'i32', wi)}, align 4")
                self.emit(f"{ins} = insertelement {vt} poison, i32 {w4}, i64 0")
                self.emit(f"{splat} = shufflevector {vt} {ins}, {vt} poison, <{lanes} x i32> zeroinitializer")
                weights[r, q] = splat
        masks = []  # per quad: lane i, byte j <- input i*stride + j*dilation from the quad's first
        for q in range(s.quads):
            masks.append(", ".join(f"i32 {i * s.stride + j * s.dilation if 4 * q + j < s.taps else 0}"
                                   for i in range(lanes) for j in range(4)))

        def one_vector():
            v = self.lookup("__wd_v")[1]
            first = self.int_op("add nsw", p_off, self.mul_const(v, lanes * s.stride))
            sums = []
            for r in range(s.rows):
                acc = "zeroinitializer"
                for q in range(s.quads):
                    at = self.int_op("add nsw", first, r * s.p_row + 4 * q * s.dilation)
                    raw, picked, quads, nxt = self.tmp("row"), self.tmp("pick"), self.tmp("q4"), self.tmp("dot")
                    self.emit(f"{raw} = load {bt}, ptr {self.gep(p_ptr, 'u8', at)}, align 1")
                    self.emit(f"{picked} = shufflevector {bt} {raw}, {bt} poison, <{lanes * 4} x i32> <{masks[q]}>")
                    self.emit(f"{quads} = bitcast {bt} {picked} to {vt}")
                    if vnni:
                        self.emit(f"{nxt} = call {vt} @{VPDPBUSD[lanes]}({vt} {acc}, {vt} {quads}, "
                                  f"{vt} {weights[r, q]})")
                    else:
                        self.dot4_emulated(acc, quads, weights[r, q], nxt, vt)
                    acc = nxt
                sums.append(acc)
            while len(sums) > 1:  # a balanced tree
                pairs = []
                for i in range(0, len(sums) - 1, 2):
                    t = self.tmp("rows")
                    self.emit(f"{t} = add {vt} {sums[i]}, {sums[i + 1]}")
                    pairs.append(t)
                sums = pairs + sums[len(sums) - len(sums) % 2:]
            out = self.int_op("add nsw", o_off, self.mul_const(v, lanes))
            self.emit(f"store {vt} {sums[0]}, ptr {self.gep(o_ptr, 'i32', out)}, align 4")
        self.loop("__wd_v", s.vectors, one_vector, "scalar")

    def first_lanes_mask(self, lanes: int, count) -> str:
        """The <lanes x i1> mask of the first `count` lanes: a constant, or for a count known
        at run time (an i64 value in [0, lanes]), a comparison with the lane numbers."""
        if isinstance(count, int):
            return first_lanes(lanes, count)
        splat = self.splat(count, "i64", lanes)
        numbers = "<" + ", ".join(f"i64 {i}" for i in range(lanes)) + ">"
        mask = self.tmp("lanes")
        self.emit(f"{mask} = icmp ult <{lanes} x i64> {numbers}, {splat}")
        return f"<{lanes} x i1> {mask}"

    def splat(self, value: str, elt: str, lanes: int) -> str:
        ins, out = self.tmp("ins"), self.tmp("splat")
        self.emit(f"{ins} = insertelement <{lanes} x {elt}> poison, {elt} {value}, i64 0")
        self.emit(f"{out} = shufflevector <{lanes} x {elt}> {ins}, <{lanes} x {elt}> poison, "
                  f"<{lanes} x i32> zeroinitializer")
        return out

    def load_first(self, ptr: str, elt: str, lanes: int, count, align: int, fill: str = "zeroinitializer") -> str:
        """A <lanes x elt> vector (elt: float or i32) at ptr of which only the first `count`
        lanes are read (an int, or an i64 value below `lanes`): a plain load, or one under a
        mask (the rest zero, or the vector value `fill`)."""
        vt, v = f"<{lanes} x {elt}>", self.tmp("vec")
        if isinstance(count, int) and count >= lanes:
            self.emit(f"{v} = load {vt}, ptr {ptr}, align {align}")
            return v
        fn = f"@llvm.masked.load.v{lanes}{MASKED_SUFFIX[elt]}.p0"
        self.decls.add(f"declare {vt} {fn}(ptr, i32, <{lanes} x i1>, {vt})")
        mask = self.first_lanes_mask(lanes, count)
        self.emit(f"{v} = call {vt} {fn}(ptr {ptr}, i32 {align}, {mask}, {vt} {fill})")
        return v

    def store_first(self, value: str, ptr: str, elt: str, lanes: int, count, align: int) -> None:
        """The first `count` lanes of a <lanes x elt> value stored at ptr (an int, or an i64
        value below `lanes`; under a mask where that is not all of them)."""
        vt = f"<{lanes} x {elt}>"
        if isinstance(count, int) and count >= lanes:
            self.emit(f"store {vt} {value}, ptr {ptr}, align {align}")
            return
        if not isinstance(count, int) and self.vw < 16:
            # Without mask registers, a store under a run-time mask is vmaskmovps, microcoded
            # on AMD cores (the Deinterleave tails of a strided depthwise conv's copy were a
            # third of its time at 28 x 28 on x86-64-v3); a switch over the counts stores
            # each as constant-prefix stores, which become plain pieces (partial_stores.py).
            return self.switch(count, {n: (lambda n=n: self.store_first(value, ptr, elt, lanes, n, align))
                                       for n in range(1, lanes + 1)})
        fn = f"@llvm.masked.store.v{lanes}{MASKED_SUFFIX[elt]}.p0"
        self.decls.add(f"declare void {fn}({vt}, ptr, i32, <{lanes} x i1>)")
        self.emit(f"call void {fn}({vt} {value}, ptr {ptr}, i32 {align}, {self.first_lanes_mask(lanes, count)})")

    def transpose_block(self, s: TransposeBlock) -> None:
        """ir.loop.TransposeBlock: rows loaded as vectors (a partial row through a masked
        load), transposed in registers, columns stored (partial ones through masked stores)."""
        n = TRANSPOSE_LANES
        src, dst = self.bufs[s.src][0], self.bufs[s.dst][0]
        src_off, dst_off = self.expr(s.src_off), self.expr(s.dst_off)
        run_time = not isinstance(s.cols, int)  # (a run-time width's last block: its columns counted then)
        cols = self.expr(s.cols) if run_time else s.cols
        stride = s.src_stride if isinstance(s.src_stride, int) else self.expr(s.src_stride)
        row_at = (lambda i: i * stride) if isinstance(stride, int) else (lambda i: self.mul_const(stride, i))
        rows = [self.load_first(self.gep(src, "u8", self.int_op("add nsw", src_off, row_at(i))), "i32", n, cols, 1)
                if i < s.rows else "zeroinitializer" for i in range(n)]
        for j, column in enumerate(self.transpose(rows, f"<{n} x i32>", n)[:n if run_time else cols]):
            def store(j=j, column=column):
                self.store_first(column, self.gep(dst, "u8", self.int_op("add nsw", dst_off, j * s.dst_stride)), "i32",
                                 n, s.rows, 1)
            if run_time:
                self.when(self.int_op("icmp sgt", cols, j), store)
            else:
                store()

    def deinterleave(self, s: Deinterleave) -> None:
        """ir.loop.Deinterleave: per vector of slots, one load of its `phases` vectors of
        input, a shuffle per phase, a store per phase; the ragged last one through a masked
        load and masked stores (constant masks)."""
        vw, ph = self.vw, s.phases
        wide = f"<{vw * ph} x float>"
        src, dst = self.bufs[s.src][0], self.bufs[s.dst][0]
        src_off, dst_off = self.expr(s.src_off), self.expr(s.dst_off)
        dst_stride = s.dst_stride if isinstance(s.dst_stride, int) else self.expr(s.dst_stride)

        def slots(t0: str, count, read=None, fill: str = "zeroinitializer") -> None:
            if read is None:
                read = count * ph if isinstance(count, int) else self.mul_const(count, ph)
            row = self.load_first(self.gep(src, "f32", self.int_op("add nsw", src_off, self.mul_const(t0, ph))),
                                  "float", vw * ph, read, 4, fill)
            for q in range(ph):
                part = self.tmp("diph")
                picks = ", ".join(f"i32 {q + ph * i}" for i in range(vw))
                self.emit(f"{part} = shufflevector {wide} {row}, {wide} poison, <{vw} x i32> <{picks}>")
                phase_at = (self.int_op("add nsw", dst_off, q * dst_stride) if isinstance(dst_stride, int)
                            else self.int_op("add nsw", dst_off, self.mul_const(dst_stride, q)))
                at = self.gep(dst, "f32", self.int_op("add nsw", phase_at, t0))
                self.store_first(part, at, "float", vw, count, 4)
        if s.src_count is not None:
            # Whole vectors while every element they read exists, then vectors under masks:
            # the slots' count, and the elements that exist (the rest read as the border).
            count = s.count if isinstance(s.count, int) else self.expr(s.count)
            exist = s.src_count if isinstance(s.src_count, int) else self.expr(s.src_count)
            exist = self.int_op("smax", exist, 0)
            full = self.int_op("smin", self.int_op("udiv", exist, vw * ph), self.int_op("udiv", count, vw))
            fill = self.splat(literal(s.border, "f32"), "float", vw * ph)

            def ragged(v: str) -> None:
                t0 = self.mul_const(v, vw)
                lanes = self.int_op("smin", self.int_op("sub nsw", count, t0), vw)
                read = self.int_op("smin", self.int_op("smax", self.int_op("sub nsw", exist, self.mul_const(t0, ph)), 0),
                                   vw * ph)
                slots(t0, lanes, read, fill)
            self.loop("__di_v", 0, lambda: slots(self.mul_const(self.lookup("__di_v")[1], vw), vw), "scalar",
                      lo="0", hi=full)
            # The first vector under masks stands alone: its masks then depend on sizes only,
            # and leave the loops around it (a short row has no other vector).
            vectors = self.int_op("udiv", self.int_op("add nsw", count, vw - 1), vw)
            self.when(self.int_op("icmp slt", full, vectors), lambda: ragged(full))
            self.loop("__di_v", 0, lambda: ragged(self.lookup("__di_v")[1]), "scalar",
                      lo=self.int_op("add nsw", full, 1), hi=vectors)
            return
        if not isinstance(s.count, int):  # a count known at run time: whole vectors, then a masked one
            count = self.expr(s.count)
            whole, tail = self.int_op("and", count, -vw), self.int_op("and", count, vw - 1)
            self.loop("__di_v", 0, lambda: slots(self.mul_const(self.lookup("__di_v")[1], vw), vw), "scalar",
                      lo="0", hi=self.int_op("lshr", count, (vw - 1).bit_length()))
            self.when(self.int_op("icmp ne", tail, 0), lambda: slots(whole, tail))
            return
        whole, tail = divmod(s.count, vw)
        if whole:
            self.loop("__di_v", whole, lambda: slots(self.mul_const(self.lookup("__di_v")[1], vw), vw), "scalar")
        if tail:
            slots(str(whole * vw), tail)
