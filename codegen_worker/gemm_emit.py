"""The Gemm statement as explicit vector code: an mr x nr register tile of <vw x float> (or
int32) accumulators fed by FMAs or byte/word dot products, its k loop, B's prefetching, the
tile written to a stack tile, then the write-back running the epilogue over it as ordinary
(vectorizable) loops; AMX tiles through codegen_worker/tile_gemm.py. A part of
llvm_emit.FunctionEmitter, whose state it shares."""
from __future__ import annotations

from ..ir.loop import FLOAT_GEMM_KINDS, SYMBOLS, Gemm, called_functions

from . import tile_gemm
from .llvm_types import LL, VPDPBUSD



# Packed B larger than this (past L2) is prefetched into L2 as the micro-kernel runs: the
# next panel where a panel is at most PREFETCH_NEXT_PANEL_BYTES, else PREFETCH_K_STEPS
# ahead in the panel. Measured on ResNet-50/18, ViT and BERT: their 7x7-stage convs 1.36 ->
# 0.91 ms (the 2048-wide downsample), 0.64 -> 0.46 (1x1), 1.39 -> 1.08-1.10 (3x3, 512 wide);
# from 512 KiB rather than 1 MiB, MobileNetV3's 960-wide 1x1 convs at 7x7 0.10 -> 0.075 ms.
PREFETCH_B_BYTES = 512 * 1024
PREFETCH_NEXT_PANEL_BYTES = 256 * 1024
PREFETCH_K_STEPS = 64
# Only the first row block's pass over B misses L2; every later block's prefetches are
# instructions spent for nothing. Past this many row blocks they cost more than the first
# pass gains: on x86-64-v3 (an instruction in every 12 FMAs) ResNet's 3x3 128-channel conv at
# 28x28 (131 blocks of 6 pixels) 2.13 -> 2.05 ms without; level at 14x14 (33 blocks); its
# 7x7-stage layers (9 blocks) keep theirs (512-channel 3x3 2.13 ms without, 2.08 with).
PREFETCH_MAX_ROW_BLOCKS = 32


def _row_blocks(g: Gemm) -> int:
    """A GEMM's row blocks (a run-time m counts as few: a prefill's rows may well be)."""
    return g.m // g.mr if isinstance(g.m, int) else 0


# A GEMM whose B is read in place (a 1x1 conv's input planes) reads, at each k step, a line of
# another plane: MobileNetV2's 144 -> 24 projection streams 144 planes at once, more than the
# hardware prefetcher follows. Where B is past L2 (PREFETCH_B_BYTES), the micro-kernel fetches
# each k step's lines of the panel PREFETCH_IN_PLACE_PANELS_AHEAD ahead into L2 (as many row
# blocks as packed B's prefetch allows). Built both ways and timed interleaved, 1 thread,
# AVX-512: 96 -> 24 at 128 x 128 alone 1.47 -> 0.76 ms (2 to 16 panels ahead alike; 1 ahead,
# 2.2 ms, slower than none); in MobileNetV2 at 512 x 512, 32 -> 16 at 256 x 256 1.33 -> 0.80
# ms, 144 -> 24 at 128 x 128 1.52 -> 1.13, the 16 -> 96 expansion at 256 x 256 2.94 -> 2.66.
PREFETCH_IN_PLACE_PANELS_AHEAD = 4


def streams_b_in_place(g: Gemm) -> bool:
    """Whether the micro-kernel prefetches B read in place (see PREFETCH_IN_PLACE_PANELS_AHEAD):
    over sizes known at run time, where B at its bound would."""
    n = g.n if isinstance(g.n, int) else g.n_bound
    return g.in_place_b and n > g.nr and g.k * n * 4 > PREFETCH_B_BYTES and _row_blocks(g) <= PREFETCH_MAX_ROW_BLOCKS


# A register tile needs this many accumulators (FMA latency 4 x 2 FMA ports) for its k loop
# to run at the FMAs' rate; one of fewer waits on each sum. Where an output row's last block
# (Gemm.a_rows) would have fewer, it shares the last whole block's rows: 71 = 4 x 14 + 8 + 7.
MIN_TILE_ACCUMULATORS = 8


class GemmEmitter:
    """FunctionEmitter's Gemm statements (a mixin: the state is FunctionEmitter's)."""

    def gemm(self, g: Gemm, lo: str | None = None, hi: str | None = None) -> None:
        """The whole GEMM, or with lo and hi (a phase's range) its row blocks or column panels
        [lo, hi) as `g.split` says; the last block or panel may be partial. On tiles, its
        blocks configure them and it releases them when it ends."""
        self.gemm_blocks(g, lo, hi)
        if g.tiles:
            tile_gemm.release(self)

    def gemm_blocks(self, g: Gemm, lo: str | None, hi: str | None) -> None:
        vw, nr, mr = self.vw, g.nr, g.mr
        if nr % vw:
            raise ValueError(f"gemm panel width {nr} is not a multiple of the vector width {vw}")
        elt = "float" if g.kind in FLOAT_GEMM_KINDS else "i32"
        vt = f"<{vw} x {elt}>"
        if g.kind == "f32":
            self.decls.add(f"declare {vt} @llvm.fma.v{vw}f32({vt}, {vt}, {vt})")
        elif g.b_words:
            if vw != 8:
                raise ValueError(f"gemm with B in 16-bit pairs at vector width {vw}: AVX2's vpmaddwd is 8 lanes")
            self.decls.add("declare <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16>, <16 x i16>)")
        elif g.tiles:
            self.decls |= tile_gemm.declarations(g)
        elif vw in self.dot_widths:
            self.decls.add(f"declare {vt} @{VPDPBUSD[vw]}({vt}, {vt}, {vt})")
        tile = f"%tile{len(self.allocas)}"
        self.allocas.append(f"{tile} = alloca [{self.tile_rows(g) * nr} x {elt}], align 64")
        a_ptr = self.bufs[g.a_buf][0]
        b_ptr, _ = self.bufs[g.b_buf]
        a_off, b_off = self.expr(g.a_off), self.expr(g.b_off)
        runtime_n = not isinstance(g.n, int)  # (B read in place: a run-time count of pixels)
        if runtime_n:  # whole panels, then one of the run-time count of columns left, if any
            n = self.expr(g.n)
            full_panels, last_cols = self.int_op("udiv", n, nr), self.int_op("urem", n, nr)
            some_left = self.int_op("icmp ne", last_cols, 0)
        else:
            full_panels, last_cols = divmod(g.n, nr)
        runtime_m = not isinstance(g.m, int)
        full_blocks, last_rows = (self.int_op("udiv", self.expr(g.m), mr), None) if runtime_m else divmod(g.m, mr)
        # B in chunks of panels that stay in L2 (each k step of a panel is nr 4-byte lanes).
        chunk = max(1, self.panel_chunk_bytes // (g.k * nr * 4))
        rows_range = lo is not None and g.split == "m"

        # Row blocks outside, panels inside: the block's A rows (k-major in conv) stay in
        # cache while the panels of B stream past them; when B outgrows L2, every row block
        # runs over one L2-sized chunk of panels before the next chunk is read.
        # `panels` is (first, count) or, for a range known at run time, (first, end) values;
        # `partial` says whether the partial last panel follows (True, False or an i1 value).
        # `valid`: a run-time count of the tile's rows that are the GEMM's (left_over_rows).
        def block(m0: str, rows: int, panels: tuple, partial, valid: str | None = None) -> None:
            if g.tiles:  # (the tile shapes of this block's rows, once for its panels)
                tile_gemm.configure(self, g, rows)

            def panel(p: str, cols: int) -> None:
                pb = self.mul_const(p, nr if g.in_place_b else g.k * nr * (2 if g.b_words else 1))
                bp = self.tmp("bp")
                self.emit(f"{bp} = add nsw i64 {pb}, {b_off}")
                if g.tiles:
                    tile_gemm.tile_microkernel(self, g, a_ptr, a_off, b_ptr, bp, m0, rows, tile, vt)
                elif self.outline_tiles(g):
                    self.outlined_microkernel(g, a_off, bp, m0, rows, vt, tile, cols, valid)
                else:
                    self.microkernel(g, a_ptr, a_off, b_ptr, bp, m0, rows, vt, tile, cols, valid)
                self.writeback(g, tile, m0, p, rows, cols, valid)

            first, count = panels
            pan = f"{g.n_var}.pan"
            if not isinstance(count, int):
                self.loop(pan, 0, lambda: panel(self.lookup(pan)[1], nr), lo=first, hi=count)
            elif count:
                self.loop(pan, count, lambda: panel(
                    self.lookup(pan)[1] if first == 0 else self.int_op("add nsw", self.lookup(pan)[1], first), nr))
            if last_cols and partial is True:
                panel(str(full_panels), last_cols)
            elif last_cols and partial:
                self.when(partial, lambda: panel(str(full_panels), last_cols))

        def by_blocks(panels: tuple, partial) -> None:
            blk = f"{g.m_var}.blk"
            run = lambda: block(self.mul_const(self.lookup(blk)[1], mr), mr, panels, partial)  # noqa: E731
            if runtime_m:  # (threads dividing by row blocks: [lo, hi), the last one partial)
                self.loop(blk, 0, run, lo=lo if rows_range else "0",
                          hi=self.int_op("smin", hi, full_blocks) if rows_range else full_blocks)
                rest = lambda: left_over_rows(self.mul_const(full_blocks, mr),  # noqa: E731
                                              self.int_op("urem", self.expr(g.m), mr), panels, partial)
                if rows_range:
                    self.when(self.int_op("icmp sgt", hi, full_blocks), rest)
                else:
                    rest()
                return
            if not rows_range:
                if full_blocks:
                    self.loop(blk, full_blocks, run)
                if last_rows:
                    block(str(full_blocks * mr), last_rows, panels, partial)
                return
            if full_blocks:
                self.loop(blk, 0, run, lo=lo, hi=self.int_op("smin", hi, full_blocks))
            if last_rows:
                self.when(self.int_op("icmp sgt", hi, full_blocks),
                          lambda: block(str(full_blocks * mr), last_rows, panels, partial))

        def by_rows(panels: tuple, partial) -> None:
            """With a_rows: each row's whole blocks, then its shorter ones; rows [lo, hi) where
            threads divide by rows."""
            if not isinstance(g.a_rows, int):
                return by_run_time_rows(panels, partial)
            full, last = divmod(g.a_rows, mr)
            tail = [last] if last else []
            if full and 0 < last * (g.nr // vw) < MIN_TILE_ACCUMULATORS and not g.tiles:
                # (a last block too short to hide the FMA latency shares the last whole one's rows)
                full, tail = full - 1, [(mr + last + 1) // 2, (mr + last) // 2]
            row, blk = f"{g.m_var}.row", f"{g.m_var}.blk"

            def one_row():
                first = self.mul_const(self.lookup(row)[1], g.a_rows)
                if full:
                    self.loop(blk, full, lambda: block(
                        self.int_op("add nsw", first, self.mul_const(self.lookup(blk)[1], mr)), mr, panels, partial))
                done = full * mr
                for rows in tail:
                    block(self.int_op("add nsw", first, done), rows, panels, partial)
                    done += rows
            if rows_range:
                self.loop(row, 0, one_row, lo=lo, hi=hi)
            else:
                self.loop(row, g.m // g.a_rows, one_row)

        def by_run_time_rows(panels: tuple, partial) -> None:
            """by_rows over rows of a length known at run time: each row's whole blocks, then
            its last rows (left_over_rows)."""
            width, row, blk = self.expr(g.a_rows), f"{g.m_var}.row", f"{g.m_var}.blk"
            full = self.int_op("udiv", width, mr)

            def one_row():
                first = self.int_op("mul nsw", self.lookup(row)[1], width)
                self.loop(blk, 0, lambda: block(
                    self.int_op("add nsw", first, self.mul_const(self.lookup(blk)[1], mr)), mr, panels, partial),
                    lo="0", hi=full)
                left_over_rows(self.int_op("add nsw", first, self.mul_const(full, mr)),
                               self.int_op("urem", width, mr), panels, partial)
            if rows_range:
                self.loop(row, 0, one_row, lo=lo, hi=hi)
            else:
                self.loop(row, 0, one_row, lo="0", hi=self.int_op("udiv", self.expr(g.m), width))

        def left_over_rows(base: str, left: str, panels: tuple, partial) -> None:
            """The last rows < mr, known at run time: one tile of that many rows where they
            are at most half a tile, else two tiles of half of them each (rounded up, then
            down), each chosen by a switch. (As blocks of the powers of two in their count, a
            7-wide output row was tiles of 4, 2 and 1 rows, each k loop waiting on FMA
            latency: a ResNet's 7 x 7 stage over run-time sizes ran at 1.6x its static time.
            A tile for every count up to mr - 1 came within 1.2x too, but its 13 tiles on
            AVX-512 took a ResNet-18's build from 4.5 to 10.9 s.) A count from 3 up that is
            too small to fill MIN_TILE_ACCUMULATORS runs in the least tile that does, its rows
            past the count reading the last real row and stored nowhere, so LLVM compiles
            fewer tiles (a 6-column GEMM's 28-row tiles: 9 for its last rows, not 14). Not 1
            or 2 rows, a decoding step's: a 768 -> 3072 GEMV took 1.18x and 1.13x as long in
            the 4-row tile, 3 rows 1.01-1.05x."""
            half, part = mr // 2, f"{g.m_var}.part"
            # (rows of the least tile; on the tile unit, any count of rows is one tile shape)
            least = 1 if g.tiles else min(half, -(-MIN_TILE_ACCUMULATORS // (nr // vw)))
            two = self.int_op("icmp ugt", left, half)
            first = self.tmp("first")  # (the rows of the first tile: all of them, or half rounded up)
            self.emit(f"{first} = select i1 {two}, i64 {self.int_op('sub', left, self.int_op('lshr', left, 1))}, "
                      f"i64 {left}")

            def one_part():  # part 0: `first` rows from base; part 1: the rest after them
                later = self.int_op("icmp ne", self.lookup(part)[1], 0)
                size, at = self.tmp("rows"), self.tmp("at")
                self.emit(f"{size} = select i1 {later}, i64 {self.int_op('sub', left, first)}, i64 {first}")
                self.emit(f"{at} = select i1 {later}, i64 {self.int_op('add', base, first)}, i64 {base}")
                small = self.int_op("icmp ult", size, least)
                between, shape = self.tmp("between"), self.tmp("shape")  # (3 .. least - 1 rows: the least tile)
                self.emit(f"{between} = and i1 {small}, {self.int_op('icmp ugt', size, 2)}")
                self.emit(f"{shape} = select i1 {between}, i64 {least}, i64 {size}")
                # (the least tile reads and stores the count's rows only where it serves fewer)
                self.switch(shape, {rows: (lambda rows=rows: block(at, rows, panels, partial,
                                                                   size if rows == least > 3 else None))
                                    for rows in sorted({*range(1, min(3, least)), *range(least, half + 1)})})
            parts = self.tmp("parts")
            self.emit(f"{parts} = select i1 {two}, i64 2, i64 1")
            self.loop(part, 0, one_part, lo="0", hi=parts)

        blocks = by_rows if g.a_rows else by_blocks
        if lo is not None and g.split == "n":
            # Panels [lo, hi): the full ones in L2-sized chunks, then the partial one if in range.
            end = self.int_op("smin", hi, full_panels)
            span = self.int_op("smax", self.int_op("sub", end, lo), 0)
            n_chunks = self.int_op("udiv", self.int_op("add", span, chunk - 1), chunk)
            chk = f"{g.n_var}.chk"

            def one_chunk():
                c0 = self.int_op("add", lo, self.mul_const(self.lookup(chk)[1], chunk))
                blocks((c0, self.int_op("smin", self.int_op("add", c0, chunk), end)), False)
            self.loop(chk, 0, one_chunk, lo="0", hi=n_chunks)
            if runtime_n:
                self.when(self.int_op("icmp sgt", hi, full_panels), lambda: blocks((0, 0), some_left))
            elif last_cols:
                self.when(self.int_op("icmp sgt", hi, full_panels), lambda: blocks((0, 0), True))
            return
        if runtime_n:
            blocks(("0", full_panels), some_left)
            return
        chunks, rest = divmod(full_panels, chunk)
        if chunks <= 1 and not (chunks == 1 and rest):
            blocks((0, full_panels), True)
        else:
            self.loop(f"{g.n_var}.chk", chunks, lambda: blocks(
                (self.mul_const(self.lookup(f"{g.n_var}.chk")[1], chunk), chunk), False))
            blocks((chunks * chunk, rest), True)

    def outline_tiles(self, g: Gemm) -> bool:
        """Whether the tile's k loop is a function of its own: on AVX-512, where the epilogue
        calls exp, tanh or erf (a SiLU, sigmoid or GELU). Their polynomials' constants, hoisted
        out of every loop, held registers through the k loop, whose 28 accumulators then
        spilled (a 128 -> 256 1x1 conv with SiLU took 1.81 ms, 0.84 outlined; a 256 -> 1024
        one with GELU 3.18, 1.15). A function's registers are its own. (AVX2's k loop kept
        its registers: there the call only cost 1-7%.)"""
        if g.kind != "f32" or self.vw < 16:
            return False
        if id(g) not in self.outline_choice:
            self.outline_choice[id(g)] = bool(called_functions(g.epilogue) & {"exp", "tanh", "erf"})
        return self.outline_choice[id(g)]

    def outlined_microkernel(self, g: Gemm, a_off: str, bp: str, m0: str, rows: int, vt: str, tile: str,
                             cols: int, valid: str | None = None) -> None:
        """microkernel() as a call of `void (ptr a, ptr b, [ptr tables...,] ptr tile, i64
        a_off, i64 bp, i64 m0[, i64 cols][, i64 valid])`, one function per tile shape of this
        Gemm."""
        tables = [t for t in (g.a_mtab, g.a_ktab, g.b_ktab, g.a_kspan) if t]
        # (a row length or B's row stride known at run time reads the symbols)
        buffers = [g.a_buf, g.b_buf, *tables] + ([SYMBOLS] if self.reads_symbols else [])
        run_time_cols = not isinstance(cols, int)  # (then an argument of the function)
        key = (id(g), rows, "run-time" if run_time_cols else cols, valid is not None)
        name = self.outlined.get(key)
        if name is None:
            name = f"{self.symbol}_tile{len(self.outlined)}"
            self.outlined[key] = name
            saved = (self.lines, self.block, self.bufs, self.symbol_values, self.block_values)
            self.lines, self.block, self.symbol_values, self.block_values = [], "entry", None, {}
            self.bufs = {**self.bufs, **{buf: (f"%mk.{i}", self.bufs[buf][1]) for i, buf in enumerate(buffers)}}
            self.microkernel(g, "%mk.0", "%mk.a_off", "%mk.1", "%mk.bp", "%mk.m0", rows, vt, "%mk.tile",
                             "%mk.cols" if run_time_cols else cols, valid and "%mk.valid")
            body, (self.lines, self.block, self.bufs, self.symbol_values, self.block_values) = self.lines, saved
            params = [f"ptr noalias nocapture readonly %mk.{i}" for i in range(len(buffers))]
            params += ["ptr noalias nocapture writeonly %mk.tile", "i64 %mk.a_off", "i64 %mk.bp", "i64 %mk.m0"]
            params += ["i64 %mk.cols"] if run_time_cols else []
            params += ["i64 %mk.valid"] if valid else []
            self.functions.append("\n".join([f"define internal void @{name}({', '.join(params)}) #2 {{", "entry:",
                                             *body, "  ret void", "}"]))
        args = [f"ptr {self.bufs[buf][0]}" for buf in buffers] + [f"ptr {tile}", f"i64 {a_off}", f"i64 {bp}",
                                                                  f"i64 {m0}"]
        args += [f"i64 {cols}"] if run_time_cols else []
        args += [f"i64 {valid}"] if valid else []
        self.emit(f"call void @{name}({', '.join(args)})")

    def mul_const(self, v: str, c: int) -> str:
        return self.pure(f"mul nsw i64 {v}, {c}", "m")

    def microkernel(self, g: Gemm, a_ptr, a_off, b_ptr, bp, m0, rows, vt, tile, cols: int,
                    valid: str | None = None) -> None:
        """The tile's k loop, its sums stored to `tile`. With `valid` (a run-time count of its
        rows that are the GEMM's), the rows past it read the last of them."""
        vw, nv = self.vw, g.nr // self.vw
        elt = "float" if g.kind == "f32" else "i32"
        last = valid and self.int_op("sub nsw", valid, 1)

        def at_row(r: int, stride: int = 1):  # (row r's distance from the first, in A's elements)
            if not valid or r == 0:
                return str(r * stride)
            row = self.int_op("smin", last, r)
            return self.mul_const(row, stride) if stride != 1 else row
        rowbase = []
        entries = None  # (the tile's first and last entries of a_mtab)
        if g.a_rows:  # the tile's output row from a table, its pixels a_sm apart along it
            row, base = self.tmp("row"), self.tmp("ra")
            width = g.a_rows if isinstance(g.a_rows, int) else self.expr(g.a_rows)
            self.emit(f"{row} = udiv i64 {m0}, {width}")
            entries = (row, row)
            column = self.int_op("sub nsw", m0, self.int_op("mul nsw", row, width) if not isinstance(width, int)
                                 else self.mul_const(row, width))
            self.emit(f"{base} = load i64, ptr {self.gep(self.bufs[g.a_mtab][0], 'i64', row)}, align 8")
            first = self.int_op("add nsw", self.int_op("add nsw", base, a_off), self.mul_const(column, g.a_sm))
            rowbase = [first] + [self.int_op("add nsw", first, at_row(r, g.a_sm)) for r in range(1, rows)]
        elif g.a_mtab:  # each row's offset from a table (a conv's output pixels over its input)
            for r in range(rows):
                idx, off, t = self.tmp("mi"), self.tmp("moff"), self.tmp("ra")
                self.emit(f"{idx} = add nsw i64 {m0}, {at_row(r)}")
                self.emit(f"{off} = load i64, ptr {self.gep(self.bufs[g.a_mtab][0], 'i64', idx)}, align 8")
                self.emit(f"{t} = add nsw i64 {off}, {a_off}")
                rowbase.append(t)
        else:
            block_base = self.tmp("ra")  # row m0's element: A's blocks are a_sb apart per row of m0
            self.emit(f"{block_base} = add nsw i64 {self.mul_const(m0, g.a_sb or g.a_sm)}, {a_off}")
            for r in range(rows):
                t = self.tmp("ra")
                self.emit(f"{t} = add nsw i64 {block_base}, {at_row(r, g.a_sm)}")
                rowbase.append(t)
        k_first, k_end = "0", str(g.k)
        if g.a_kspan:  # only the k where some window of the tile is not all zero border
            entries = entries or (m0, self.int_op("add nsw", m0, last or rows - 1) if rows > 1 else m0)
            k_first, k_end = self.kspan(g, entries[0])
            if entries[1] != entries[0]:
                last_lo, last_hi = self.kspan(g, entries[1])
                k_first, k_end = self.int_op("smin", k_first, last_lo), self.int_op("smax", k_end, last_hi)
        self.n += 1
        pred, head, exit_ = self.block, f"K{self.n}.body", f"K{self.n}.exit"
        self.emit(f"br label %{head}")
        self.label(head)
        k, knext = self.tmp("k"), self.tmp("knext")
        self.emit(f"{k} = phi i64 [{k_first}, %{pred}], [{knext}, %{head}]")
        accs = [[self.tmp(f"acc{r}_{v}_") for v in range(nv)] for r in range(rows)]
        nexts = [[self.tmp(f"nacc{r}_{v}_") for v in range(nv)] for r in range(rows)]
        for r in range(rows):
            for v in range(nv):
                self.emit(f"{accs[r][v]} = phi {vt} [zeroinitializer, %{pred}], [{nexts[r][v]}, %{head}]")
        if g.b_ktab:  # B's row k starts at a table's offset (an input row of a conv)
            btp = self.gep(self.bufs[g.b_ktab][0], "i64", k)
            kb = self.tmp("bkoff")
            self.emit(f"{kb} = load i64, ptr {btp}, align 8")
        elif not isinstance(g.b_sk, int):  # (B's row stride known at run time: a plane of pixels)
            kb = self.int_op("mul nsw", k, self.expr(g.b_sk))
        else:
            kb = self.mul_const(k, g.b_sk or g.nr * (2 if g.b_words else 1))
        kbp = self.tmp("kb")
        self.emit(f"{kbp} = add nsw i64 {kb}, {bp}")
        bvec = []  # B's vectors of this k step (with b_words: the first pair's, then the second's)
        for v in range(nv * (2 if g.b_words else 1)):
            idx = self.tmp("bi")
            self.emit(f"{idx} = add nsw i64 {kbp}, {v * vw}")
            p = self.gep(b_ptr, "f32" if g.kind == "f32" else "i32", idx)
            if isinstance(cols, int):
                lanes = min(max(cols - v * vw, 0), vw) if g.in_place_b else vw
            else:  # (a run-time count of columns: B's lanes past it are not read)
                lanes = self.int_op("smin", self.int_op("smax", self.int_op("sub", cols, v * vw), 0), vw)
            # (in place, partly past N: only the columns that exist are read; wholly past: none)
            bvec.append(self.load_first(p, elt, vw, lanes, 4) if lanes else "zeroinitializer")
        # (a run-time m: its full row blocks, a prefill's; not the rows left after them, a decoding step's one)
        many_rows = g.m >= g.mr if isinstance(g.m, int) else rows == g.mr
        prefetch = not g.in_place_b and (self.prefetch == "on" or (
            self.prefetch == "auto" and g.k * g.n * 4 > PREFETCH_B_BYTES and _row_blocks(g) <= PREFETCH_MAX_ROW_BLOCKS))
        if g.kind == "f32" and streams_b_in_place(g):
            # B read in place is a row of another plane (or input row) at each k step: more
            # streams than the hardware's prefetcher follows. Fetch this k step's lines of a
            # panel a few ahead while this one computes.
            self.prefetch_lines(b_ptr, kbp, PREFETCH_IN_PLACE_PANELS_AHEAD * g.nr, g.nr)
        if g.kind == "f32" and prefetch and many_rows:
            # B past L2 streams from memory on the first row block's pass over it: fetch the
            # next panel's lines for this k while this panel computes, or, for panels too
            # big for two to share L2 with A, this panel's a few k steps ahead. (With one row
            # block or less, a GEMV, B is a plain stream the hardware prefetches by itself.)
            panel = g.k * g.nr
            self.prefetch_lines(b_ptr, kbp, panel if panel * 4 <= PREFETCH_NEXT_PANEL_BYTES
                                else PREFETCH_K_STEPS * g.nr, g.nr)
        if g.b_words:
            self.word_products(g, a_ptr, rowbase, k, bvec, accs, nexts, vt)
        elif g.kind != "f32":
            self.byte_products(g, a_ptr, rowbase, k, bvec, accs, nexts, vt)
        elif g.a_ktab:  # implicit GEMM: A's k offset comes from a table
            tp = self.gep(self.bufs[g.a_ktab][0], "i64", k)
            ks = self.tmp("koff")
            self.emit(f"{ks} = load i64, ptr {tp}, align 8")
        else:
            ks = k if g.a_sk == 1 else self.mul_const(k, g.a_sk)
        for r in range(rows if g.kind == "f32" else 0):
            ai = self.tmp("ai")
            self.emit(f"{ai} = add nsw i64 {rowbase[r]}, {ks}")
            a = self.load(a_ptr, self.bufs[g.a_buf][1], ai)
            ins = self.tmp("ins")
            self.emit(f"{ins} = insertelement {vt} poison, float {a}, i64 0")
            splat = self.tmp("splat")
            self.emit(f"{splat} = shufflevector {vt} {ins}, {vt} poison, <{vw} x i32> zeroinitializer")
            for v in range(nv):
                self.emit(f"{nexts[r][v]} = call {vt} @llvm.fma.v{vw}f32({vt} {splat}, {vt} {bvec[v]}, "
                          f"{vt} {accs[r][v]})")
        self.emit(f"{knext} = add nuw nsw i64 {k}, 1")
        c = self.tmp("kc")
        self.emit(f"{c} = icmp ult i64 {knext}, {k_end}")
        self.emit(f"br i1 {c}, label %{head}, label %{exit_}")
        self.label(exit_)
        self.store_registers(g, tile, nexts, rows, vt, elt)

    def store_registers(self, g: Gemm, tile: str, regs: list, rows: int, vt: str, elt: str) -> None:
        """A register tile's vectors (regs[r][v]: row r's v-th vector) into the stack tile the
        write-back reads: row-major, or for stores along m column-major, each column's rows
        [j * R, j * R + rows) transposed in registers vw x vw at a time (rows past the tile
        are zeros), so that the write-back reads and stores a column as vectors."""
        vw, nv = self.vw, g.nr // self.vw
        if g.stores_along == "m":
            height = self.tile_rows(g)
            for rb in range(0, height, vw):
                for v in range(nv):
                    block = [regs[rb + i][v] if rb + i < rows else "zeroinitializer" for i in range(vw)]
                    for lane, column in enumerate(self.transpose(block, vt)):
                        p = self.tmp("tp")
                        self.emit(f"{p} = getelementptr inbounds {elt}, ptr {tile}, i64 {(v * vw + lane) * height + rb}")
                        self.emit(f"store {vt} {column}, ptr {p}, align 4")
            return
        for r in range(rows):
            for v in range(nv):
                p = self.tmp("tp")
                self.emit(f"{p} = getelementptr inbounds {elt}, ptr {tile}, i64 {r * g.nr + v * vw}")
                self.emit(f"store {vt} {regs[r][v]}, ptr {p}, align 4")

    def prefetch_lines(self, base: str, at: str, ahead: int, floats: int) -> None:
        """Prefetch into L2 the cache lines of `floats` floats from element at + ahead of base."""
        self.decls.add("declare void @llvm.prefetch.p0(ptr, i32, i32, i32)")
        for line in range(0, floats, 16):
            idx, p = self.tmp("pf"), self.tmp("pfp")
            self.emit(f"{idx} = add nsw i64 {at}, {ahead + line}")
            # (not inbounds: past the last panel it points past B, which a prefetch may)
            self.emit(f"{p} = getelementptr float, ptr {base}, i64 {idx}")
            self.emit(f"call void @llvm.prefetch.p0(ptr {p}, i32 0, i32 2, i32 1)")

    def kspan(self, g: Gemm, entry: str) -> tuple:
        """The [lo, hi) k range of a_mtab's entry `entry`, from g.a_kspan."""
        at = self.mul_const(entry, 2)
        ends = []
        for i in (0, 1):
            v = self.tmp("kspan")
            idx = self.int_op("add nsw", at, i) if i else at
            self.emit(f"{v} = load i64, ptr {self.gep(self.bufs[g.a_kspan][0], 'i64', idx)}, align 8")
            ends.append(v)
        return tuple(ends)

    def tile_rows(self, g: Gemm) -> int:
        """Rows of the stack tile: mr, or for a column-major tile mr rounded up to vectors."""
        return -(-g.mr // self.vw) * self.vw if g.stores_along == "m" else g.mr

    def transpose(self, rows: list, vt: str, vw: int = 0) -> list:
        """A vw x vw block given as vw row vectors, as vw column vectors: for d = vw/2 .. 1,
        each 2d x 2d block swaps its off-diagonal d x d blocks (two shuffles per row pair)."""
        vw = vw or self.vw
        rows = list(rows)
        d = vw // 2
        while d:
            for i in range(vw):
                if i & d:
                    continue
                a, b = rows[i], rows[i + d]
                low = [lane if not lane & d else vw + lane - d for lane in range(vw)]
                high = [lane + d if not lane & d else vw + lane for lane in range(vw)]
                rows[i], rows[i + d] = self.tmp("tr"), self.tmp("tr")
                for out, mask in ((rows[i], low), (rows[i + d], high)):
                    self.emit(f"{out} = shufflevector {vt} {a}, {vt} {b}, <{vw} x i32> <"
                              + ", ".join(f"i32 {m}" for m in mask) + ">")
            d //= 2
        return rows

    def writeback(self, g: Gemm, tile: str, m0: str, p: str, rows: int, cols: int, valid: str | None = None) -> None:
        """The epilogue over the tile, vectorized along the direction its stores are contiguous
        in (`g.stores_along`): along a row (n) for a row-major C or a pointwise conv's tile of
        pixels, down a column (m) for a conv's NCHW output, whose rows are pixels. Left to
        itself, LLVM unrolls the inner loop and vectorizes the outer one, with scatters where
        that is not the contiguous direction. With `valid`, its first `valid` rows only."""
        n0 = self.mul_const(p, g.nr)
        acc_type = "f32" if g.kind in FLOAT_GEMM_KINDS else "i32"
        m_base = [m0]  # (row r of the tile is the epilogue's m_base + r: with g.m_rows, per row segment)

        def element():
            r, j = self.lookup("__wb_r")[1], self.lookup("__wb_j")[1]
            m, n, ti = self.tmp("mm"), self.tmp("nn"), self.tmp("ti")
            self.emit(f"{m} = add nsw i64 {m_base[0]}, {r}")
            self.emit(f"{n} = add nsw i64 {n0}, {j}")
            if g.stores_along == "m":  # (the tile is column-major: microkernel)
                self.emit(f"{ti} = add nsw i64 {self.mul_const(j, self.tile_rows(g))}, {r}")
            else:
                self.emit(f"{ti} = add nsw i64 {self.mul_const(r, g.nr)}, {j}")
            tp = self.gep(tile, acc_type, ti)
            acc = self.tmp("accv")
            self.emit(f"{acc} = load {LL[acc_type]}, ptr {tp}, align 4")
            self.bind(g.m_var, ("ssa", m, "i64"))
            self.bind(g.n_var, ("ssa", n, "i64"))
            self.bind(g.acc_var, ("ssa", acc, acc_type))
            self.stmts(g.epilogue)

        if g.m_rows:
            # Virtual rows (Gemm.m_rows): the tile's rows in segments, one per plane row it
            # meets, each [lo, hi) of the rows that are pixels; the gap between is not stored.
            width, real = g.m_rows
            first = self.int_op("udiv", m0, width)
            end = self.int_op("add nsw", m0, rows)
            last = self.int_op("udiv", self.int_op("sub nsw", end, 1), width)

            def segment():
                row = self.lookup("__wb_seg")[1]
                start = self.mul_const(row, width)
                lo = self.int_op("sub nsw", self.int_op("smax", m0, start), m0)
                hi = self.int_op("sub nsw", self.int_op("smin", end, self.int_op("add nsw", start, real)), m0)
                # (row r of the tile is pixel row * real + (m0 + r - start))
                m_base[0] = self.int_op("add nsw", self.int_op("sub nsw", self.mul_const(row, real), start), m0)
                self.loop("__wb_j", cols, lambda: self.loop("__wb_r", 0, element, "run_time_tail", lo=lo, hi=hi),
                          "scalar")
            self.loop("__wb_seg", 0, segment, "scalar", lo=first, hi=self.int_op("add nsw", last, 1))
        elif valid and g.stores_along == "m":
            self.loop("__wb_j", cols, lambda: self.loop("__wb_r", 0, element, "run_time_tail", lo="0", hi=valid),
                      "scalar")
        elif valid:
            def a_row():
                if isinstance(cols, int):  # (as the rows of a whole tile below)
                    self.loop("__wb_j", cols, element, "vector_only" if g.in_place_b or g.kind == "s8u8" and g.b_words
                              else "vectorize")
                else:
                    self.loop("__wb_j", 0, element, "run_time_tail", lo="0", hi=cols)
            self.loop("__wb_r", 0, a_row, "scalar", lo="0", hi=valid)
        elif g.stores_along == "m":
            self.loop("__wb_j", cols, lambda: self.loop("__wb_r", rows, element, "vector_masked"), "scalar")
        elif not isinstance(cols, int):  # (a run-time count of columns, fewer than the panel's)
            self.loop("__wb_r", rows, lambda: self.loop("__wb_j", 0, element, "run_time_tail", lo="0", hi=cols),
                      "scalar")
        elif g.in_place_b or g.kind == "s8u8" and g.b_words:
            # (A tile of pixels: measured, LLVM's own choice scatters, and on AVX2's 16-bit
            # pointwise tile it ran scalar, half the speed; the byte tile on AVX-512 is 7% faster
            # left to LLVM.)
            self.loop("__wb_r", rows, lambda: self.loop("__wb_j", cols, element, "vector_only"), "scalar")
        elif not isinstance(g.m, int):  # (a run-time m: left to itself, LLVM scattered down the columns)
            self.loop("__wb_r", rows, lambda: self.loop("__wb_j", cols, element, "vectorize"), "scalar")
        else:
            # A row-major C: rows unrolled, each row's stores whole vectors. LLVM's own choice
            # vectorized down the rows with gathers and scatters as soon as the epilogue did
            # more than store (a bias, a ReLU, a residual): 128x512x2048 + bias 1.37 -> 1.01 ms.
            self.loop("__wb_r", rows, lambda: self.loop("__wb_j", cols, element, "vector_only"), "unroll")
