"""The integer micro-kernel's products: each row's 4 A bytes of a k quad as one i32 splat
over the lanes (a signed A's bytes shifted to unsigned), times B's 4 bytes per lane summed
into the lane's int32 (vpdpbusd where the target has it at the vector's width, else
emulated byte by byte), or with B packed in 16-bit pairs, vpmaddwd. A part of
llvm_emit.FunctionEmitter, whose state it shares."""
from __future__ import annotations

from ..ir.loop import Gemm

from .llvm_types import VPDPBUSD



class IntegerDotEmitter:
    """FunctionEmitter's integer products for the Gemm micro-kernel (a mixin)."""

    def a_quads(self, g: Gemm, a_ptr, rowbase, k, vt, half: int = 0) -> list:
        """Each row's 4 A bytes of quad k as one i32 splat over the lanes (a signed A's bytes
        shifted to unsigned); with b_words (A in 16-bit elements), its pair `half` (elements
        2*half, 2*half + 1 of the quad)."""
        vw = self.vw
        if g.a_ktab:  # the quad's element offset comes from a table (the conv's input copy)
            tp = self.gep(self.bufs[g.a_ktab][0], "i64", k)
            koff = self.tmp("koff")
            self.emit(f"{koff} = load i64, ptr {tp}, align 8")
        else:
            koff = self.mul_const(k, 4)
        splats = []
        for base in rowbase:
            ai = self.tmp("ai")
            self.emit(f"{ai} = add nsw i64 {base}, {koff}")
            if half:
                ai2 = self.tmp("ai")
                self.emit(f"{ai2} = add nsw i64 {ai}, {2 * half}")
                ai = ai2
            p = self.gep(a_ptr, "i16" if g.b_words else "i8", ai)
            a = self.tmp("a4")
            self.emit(f"{a} = load i32, ptr {p}, align {2 if g.b_words else 1}")
            if g.kind == "s8s8":  # signed bytes + 128 = the same bytes read unsigned, top bits flipped
                flipped = self.tmp("a4u")
                self.emit(f"{flipped} = xor i32 {a}, -2139062144")
                a = flipped
            ins, splat = self.tmp("ins"), self.tmp("splat")
            self.emit(f"{ins} = insertelement {vt} poison, i32 {a}, i64 0")
            self.emit(f"{splat} = shufflevector {vt} {ins}, {vt} poison, <{vw} x i32> zeroinitializer")
            splats.append(splat)
        return splats

    def byte_products(self, g: Gemm, a_ptr, rowbase, k, bvec, accs, nexts, vt) -> None:
        """One quad step of an 8-bit GEMM: each row's 4 A bytes (one i32, splat) times each
        B vector's 4 bytes per lane, summed into the lane's i32 (vpdpbusd, or its emulation)."""
        vw = self.vw
        for r, splat in enumerate(self.a_quads(g, a_ptr, rowbase, k, vt)):
            for v in range(len(bvec)):
                unsigned, signed = (bvec[v], splat) if g.kind == "s8u8" else (splat, bvec[v])
                if vw in self.dot_widths:
                    self.emit(f"{nexts[r][v]} = call {vt} @{VPDPBUSD[vw]}({vt} {accs[r][v]}, "
                              f"{vt} {unsigned}, {vt} {signed})")
                else:
                    self.dot4_emulated(accs[r][v], unsigned, signed, nexts[r][v], vt)

    def word_products(self, g: Gemm, a_ptr, rowbase, k, bvec, accs, nexts, vt) -> None:
        """One quad step of an 8-bit GEMM whose B is packed in 16-bit pairs (Gemm.b_words):
        each row's A pairs (a0, a1) and (a2, a3), 16-bit elements, each one i32 splat over the
        lanes, times B's two pair vectors (vpmaddwd: a0*b0 + a1*b1 per lane, exact), each
        product added to the lane's i32 sum. Pair by pair, so that only one pair's B vectors
        are live beside the accumulators (a 6x16 tile's 12 fill 16 registers with them)."""
        vw, nv = self.vw, len(accs[0])
        wt = f"<{2 * vw} x i16>"
        words = [self.tmp("bw") for _ in bvec]
        for b_vec, w in zip(bvec, words):
            self.emit(f"{w} = bitcast {vt} {b_vec} to {wt}")
        sums = accs
        for j in range(2):
            splats = self.a_quads(g, a_ptr, rowbase, k, vt, j)
            after = nexts if j else [[self.tmp("pms") for _ in row] for row in accs]
            for r in range(len(rowbase)):
                pair = self.tmp("apw")
                self.emit(f"{pair} = bitcast {vt} {splats[r]} to {wt}")
                for v in range(nv):
                    prod = self.tmp("pmw")
                    self.emit(f"{prod} = call {vt} @llvm.x86.avx2.pmadd.wd({wt} {pair}, {wt} {words[j * nv + v]})")
                    self.emit(f"{after[r][v]} = add {vt} {sums[r][v]}, {prod}")
            sums = after

    def dot4_emulated(self, acc, unsigned, signed, out, vt) -> None:
        """acc + sum over the 4 bytes of each lane of unsigned byte x signed byte."""
        total = acc
        for j in range(4):
            u, s1, s2, prod = self.tmp("ub"), self.tmp("sb"), self.tmp("sb"), self.tmp("pr")
            sh = f"splat (i32 {8 * j})" if j else None
            if sh:
                self.emit(f"{u} = lshr {vt} {unsigned}, {sh}")
                u2 = self.tmp("ub")
                self.emit(f"{u2} = and {vt} {u}, splat (i32 255)")
                u = u2
            else:
                self.emit(f"{u} = and {vt} {unsigned}, splat (i32 255)")
            self.emit(f"{s1} = shl {vt} {signed}, splat (i32 {24 - 8 * j})")
            self.emit(f"{s2} = ashr {vt} {s1}, splat (i32 24)")
            self.emit(f"{prod} = mul {vt} {u}, {s2}")
            nxt = out if j == 3 else self.tmp("dsum")
            self.emit(f"{nxt} = add {vt} {total}, {prod}")
            total = nxt
