"""The loop-nest kernel IR: the contract between lowering and codegen.

Plain frozen dataclasses with a canonical byte form (`Kernel.to_bytes`), so a kernel can
cross a process or machine boundary, be hashed into a cache key, and be decoded by a
codegen worker that knows nothing of graphs. This module imports nothing else of Kiln but
the table of small float formats (ir/minifloats.py, which imports nothing).

Types. A value computes as one of COMPUTE_TYPES: f32, f64, i1 (booleans), the signed
integers i8..i64 and the unsigned u8..u64 (integer arithmetic wraps at the type's width;
division, comparison, max/min and widening follow its signedness). A buffer stores one of
STORAGE_TYPES: the compute types except i1, plus b8 (a bool in a byte), f16 and bf16, and the
4- and 2-bit integers i4, u4, i2, u2 (one to a byte, in its low bits), and the 8- and 4-bit
floats of MINIFLOATS and E8M0 (f8e4m3fn, f8e5m2, ..., f8e8m0: one a byte). A Load converts
the stored element to its compute type (`compute_type`: b8 -> i1, f16/bf16 and the small
floats -> f32, i4/i2 -> i8 sign-extended, u4/u2 -> u8 with the high bits cleared) and a Store
converts back, rounding to nearest even (a small float's overflow is its Inf or NaN; E8M0's
exponent is truncated: a Cast rounds it first; a 4- or 2-bit integer keeps its low bits: it
wraps at its width).

A Const is a literal: where it meets a non-constant operand (in a Bin, Cmp, Select, Call,
Store, Local or Assign) it takes that operand's type, so `x * 0.5` is written once for f32
and f64 and `max(x, 0)` for every integer type. On its own it has its own `dtype`.

Every loop runs from 0 to its extent: an int, or for a model built with symbolic dims
(ir/symbolic.py) an i64 expression of the symbols' run-time values, which a kernel reads from
its buffer `SYMBOLS` (`Load(SYMBOLS, Const(k))` is symbol k's value). A Gemm's `m` may be
such an expression too. A static kernel is exactly what it was before symbols existed. A loop
nested in a phase may also run to a count the kernel computed (the Var of a Local: a list's
length), which no thread plan divides.

Threads. A kernel's body is a sequence of *phases* (`phases`): its top-level loops and
Gemms, when it holds nothing else at top level but pure Lets; otherwise the whole body is
one phase. The compiled function takes `(buffers..., phase, lo, hi)` and runs one phase; a
phase that is a `For(parallel=True)` runs only iterations [lo, hi), a Gemm phase only row
blocks or column panels [lo, hi) (`Gemm.split`). The entry function runs the phases in
order, each on one thread or as ranges across the module's thread pool: lowering marks a
loop parallel only where its iterations write disjoint outputs and share no workspace, so
the result does not depend on how the range is divided. A phase may be *guarded*: an `If`
whose condition is a comparison of run-time extents, around one loop or Gemm, runs only where
the condition holds (`guarded_phase`; the entry tests it before it hands the phase to
threads, and the kernel again). So a conv over a run-time batch has two sets: its images on
threads of their own, or for a batch of one its copy and GEMM as phases divided as a static
batch of one's are; and a GEMM over run-time rows is divided by row blocks or by panels as
the call's rows decide.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass, fields, is_dataclass

from .minifloats import E8M0, E8M0_ROUNDINGS, MINIFLOATS, e8m0_rounding
from .symbolic import Dim, SymbolError

FORMAT_VERSION = 4
SYMBOLS = "s"  # the kernel buffer of the symbols' run-time values (i64), where a kernel reads any

INT_TYPES = ("i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64")
FLOAT_TYPES = ("f32", "f64")
COMPUTE_TYPES = frozenset(("i1",) + INT_TYPES + FLOAT_TYPES)
SUB_BYTE_TYPES = ("i4", "u4", "i2", "u2")
SMALL_FLOAT_TYPES = tuple(MINIFLOATS) + (E8M0,)
STORAGE_TYPES = frozenset(INT_TYPES + FLOAT_TYPES + SUB_BYTE_TYPES + SMALL_FLOAT_TYPES + ("b8", "f16", "bf16"))
_LOADS_AS = {"b8": "i1", "f16": "f32", "bf16": "f32", "i4": "i8", "u4": "u8", "i2": "i8", "u2": "u8",
             **{t: "f32" for t in SMALL_FLOAT_TYPES}}


def compute_type(storage: str) -> str:
    """The type a Load of a buffer of `storage` type yields."""
    return _LOADS_AS.get(storage, storage)


def bits(t: str) -> int:
    """Bits a value of type t takes in a register or a buffer (a 4-bit integer: its byte)."""
    if t in ("f16", "bf16"):
        return 16
    return 1 if t == "i1" else 8 if t == "b8" or t in SUB_BYTE_TYPES or t in SMALL_FLOAT_TYPES else int(t[1:])


def value_bits(storage: str) -> int:
    """Bits of a stored value: 4 for i4, where `bits` gives the byte it is stored in."""
    return int(storage[1:]) if storage in SUB_BYTE_TYPES else bits(storage)


def is_unsigned(t: str) -> bool:
    return t[0] == "u"


def lowest(t: str) -> float | int:
    """The least value of compute type t (the identity of max)."""
    if t in FLOAT_TYPES:
        return -math.inf
    return 0 if t == "i1" or is_unsigned(t) else -(1 << (bits(t) - 1))


def highest(t: str) -> float | int:
    """The greatest value of compute type t (the identity of min)."""
    if t in FLOAT_TYPES:
        return math.inf
    return 1 if t == "i1" else (1 << bits(t)) - 1 if is_unsigned(t) else (1 << (bits(t) - 1)) - 1


class Expr:
    def __add__(self, o): return add(self, o)
    def __radd__(self, o): return add(o, self)
    def __sub__(self, o): return sub(self, o)
    def __rsub__(self, o): return sub(o, self)
    def __mul__(self, o): return mul(self, o)
    def __rmul__(self, o): return mul(o, self)
    def __floordiv__(self, o): return div(self, o)
    def __mod__(self, o): return rem(self, o)


@dataclass(frozen=True)
class Const(Expr):
    value: float
    dtype: str = "i64"


@dataclass(frozen=True)
class Var(Expr):
    name: str
    dtype: str = "i64"


@dataclass(frozen=True)
class Load(Expr):
    buf: str
    index: Expr


@dataclass(frozen=True)
class Bin(Expr):
    op: str  # add sub mul div rem max min pow and or xor shl shr (div/rem truncate on integers)
    a: Expr
    b: Expr


@dataclass(frozen=True)
class Cmp(Expr):
    op: str  # lt le gt ge eq ne
    a: Expr
    b: Expr


@dataclass(frozen=True)
class Call(Expr):
    # see FLOAT_CALLS; `not` on i1; round_f16/round_bf16 (and round_ of each small float
    # format, overflowing to its Inf or NaN; E8M0's per rounding mode and saturation: see
    # ir/minifloats.py) round an f32 to that precision;
    # max_no_nan(a, b) is the larger, and either one where one is NaN (no NaN fix-ups)
    fn: str
    args: tuple


@dataclass(frozen=True)
class Select(Expr):
    cond: Expr
    a: Expr
    b: Expr


@dataclass(frozen=True)
class Cast(Expr):
    dtype: str
    a: Expr


FLOAT_CALLS = frozenset(("exp", "log", "sqrt", "tanh", "erf", "abs", "floor", "ceil", "round", "neg", "fmod",
                         "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh",
                         "round_f16", "round_bf16", "max_no_nan", *(f"round_{t}" for t in MINIFLOATS),
                         *(e8m0_rounding(m, s) for m in E8M0_ROUNDINGS for s in (False, True))))


_CHEAP_CALLS = {"abs", "floor", "ceil", "round", "neg", "not", "sqrt", "round_f16", "round_bf16"}


_FIELD_NAMES: dict = {}  # node class -> its fields' names, in order


def field_names(node) -> tuple:
    """The names of a loop IR node's fields, in order (dataclasses.fields builds its answer
    anew at every call: walks over a kernel's expressions made 212,000 such calls for one
    model's link)."""
    names = _FIELD_NAMES.get(type(node))
    if names is None:
        names = _FIELD_NAMES[type(node)] = tuple(f.name for f in fields(node))
    return names


def called_functions(node, seen: set | None = None) -> set:
    """The functions (Call.fn) that loop IR calls: an expression, a statement or a tuple of
    them, nested ones included (a shared subexpression is visited once)."""
    seen = set() if seen is None else seen
    if isinstance(node, (tuple, list)):
        return set().union(*(called_functions(n, seen) for n in node))
    if id(node) in seen or not is_dataclass(node):
        return set()
    seen.add(id(node))
    own = {node.fn} if isinstance(node, Call) else set()
    return own.union(*(called_functions(getattr(node, n), seen) for n in field_names(node)))


def uses_tiles(body) -> bool:
    """Does a kernel body (a statement or a tuple of them) hold a Gemm on AMX tiles?"""
    if isinstance(body, (tuple, list)):
        return any(uses_tiles(s) for s in body)
    if isinstance(body, Gemm):
        return body.tiles
    if isinstance(body, For):
        return uses_tiles(body.body)
    if isinstance(body, If):
        return uses_tiles(body.then) or uses_tiles(body.orelse)
    return False


def calls_math(node) -> bool:
    """Does loop IR (as called_functions takes it) call a math function costlier than a few
    instructions?"""
    return bool(called_functions(node) - _CHEAP_CALLS)


def operand_type(operands, type_of) -> str:
    """The type operands meeting in one expression share: that of the first one that is not a
    literal (a Const), else the first literal's own."""
    for e in operands:
        if not isinstance(e, Const):
            return type_of(e)
    return operands[0].dtype


class Stmt:
    pass


@dataclass(frozen=True)
class For(Stmt):
    var: str
    extent: "int | Expr"
    body: tuple
    # serial | vectorize | masked (vectorize; a short ragged tail masked) | unroll | forced_vector
    # (vectorize before LLVM's full unroll of a short loop can: rows of a converting or
    # deinterleaving copy otherwise became scalar moves) | vector_masked (forced_vector, and
    # a ragged tail masked at any length: a row of bytes is one masked 64-byte move) | scalar
    # (never vectorized: LLVM vectorizes a serial loop whose inner loop it removed, with gathers)
    # | rolled (serial, never unrolled: a short loop around loops, which LLVM copies whole for
    # every iteration at no gain in speed and much in compile time) | independent (vectorize;
    # no iteration reads or writes what another writes, so LLVM needs no run-time overlap check:
    # one that it cannot settle sends every call to the scalar loop)
    kind: str = "serial"
    # Iterations may run on several threads: honoured where the loop is a phase (see above).
    parallel: bool = False


@dataclass(frozen=True)
class Store(Stmt):
    buf: str
    index: Expr
    value: Expr


@dataclass(frozen=True)
class Let(Stmt):
    """Bind an immutable value; visible to the statements after it in the same block."""
    var: str
    value: Expr


@dataclass(frozen=True)
class Local(Stmt):
    """Declare a mutable scalar (an accumulator), visible after it in the same block."""
    var: str
    dtype: str
    init: Expr


@dataclass(frozen=True)
class Assign(Stmt):
    var: str
    value: Expr


@dataclass(frozen=True)
class If(Stmt):
    cond: Expr
    then: tuple
    orelse: tuple = ()


@dataclass(frozen=True)
class Gemm(Stmt):
    """C[m, n] = sum_k A[a_off + m*a_sm + k*a_sk] * Bp[b_off + panel(n)][k][n % nr], then `epilogue`.

    With `a_mtab` (an i64 buffer of m offsets), A's row term is a_mtab[m] instead (an implicit
    GEMM over a conv's whole output plane: pixel m's window starts at a_mtab[m]). With
    `a_rows` (w) as well, the table holds one offset per row of w pixels (a conv's output
    row): pixel m = row*w + c has the row term a_mtab[row] + c*a_sm, and register tiles never
    cross a row (each row is whole blocks of mr, then shorter ones); split "m" divides by
    rows. One GEMM over the plane, not one per row: threads can divide it by panels, and a
    chunk of B's panels that stays in L2 serves every row. Over sizes known at run time,
    a_rows is an expression (m too) and a row's last rows are one or two shorter tiles.

    With `a_sb` (A packed in row blocks, as im2col writes it: [m // mr][k][mr], a_sm 1 and
    a_sk mr), the row term is m0*a_sb + (m - m0)*a_sm for m in the row block starting at m0:
    each block's A is contiguous (a_sb = k).

    With `a_ktab` (an i64 buffer of k offsets), A's k term is a_ktab[k] instead of k*a_sk:
    the implicit-GEMM convolution reads its A operand straight from the (padded) input.

    With `a_kspan` as well (an i64 buffer of [lo, hi) pairs, one per entry of a_mtab), a tile
    sums only k in the smallest range holding its first and last entries' ranges: outside
    an entry's range its window reads only the zero border (a conv's k ordered window row
    first, so an output row near the top or bottom skips the window rows that fall in the
    padding). Consecutive entries' ranges must move monotonically, as a conv's windows do,
    so that a tile's middle entries lie within its ends'.

    B is packed in panels of `nr` columns: Bp[p][k][j] = B[k][p*nr + j], zero past N; or,
    with `b_sk` (float32 only), read in place: B[k][n] = B_buf[b_off + k*b_sk + n] (a 1x1
    conv's input, pixels contiguous), the last partial panel through masked loads (over
    sizes known at run time, n and b_sk are expressions, split "n", m static, and `n_bound`
    is n's greatest value: what the codegen sizes its choices by); or with
    `b_ktab` (an i64 buffer, float32 only) read in place at B_buf[b_off + b_ktab[k] + n] (a
    conv with few output channels: its weights are A, an input row is B). The
    codegen computes register tiles of `mr` x `nr`, then runs `epilogue` once per element of
    each tile with `m_var`, `n_var` bound to the element's row and column and `acc_var` to
    its sum; the epilogue stores the result (fused bias, activation, residual).

    `kind` "f32" is the float GEMM above. The 8-bit kinds multiply bytes and sum into i32
    (`acc_var` is an i32): k counts *quads* of 4 bytes, A's row r, quad q is the 4 bytes at
    a_off + r*a_sm + 4*q (a_sk unused; with a_ktab, + a_ktab[q]), and B is packed [panel][quad][nr][4] bytes.
    The kind names the signedness of A's bytes, then B's: "u8s8", "s8s8" (A's bytes are
    offset by +128 to unsigned as they load: the epilogue subtracts 128 * column sum) and
    "s8u8". This is the shape of AVX-512 VNNI's vpdpbusd (unsigned x signed, 4 products per
    i32 lane); targets without it get the same sums from widening multiplies.

    With `b_words` (kinds "u8s8" and "s8u8", packed B), both operands are 16-bit, for
    vpmaddwd: A is an i16 buffer holding the values the kind names (a signed activation
    already shifted by 128 by the lowering that widened it; quad q of row r is the four
    elements at a_off + r*a_sm + 4*q), and B is packed [panel][quad][pair][nr] i32 lanes, each
    holding two consecutive k of one column as int16 (low half the first). Each of A's pairs
    is one 32-bit broadcast, multiplied by B's pair vector with vpmaddwd: exact (two products
    of bytes fit an i32), where AVX2's byte multiply (vpmaddubsw) saturates its 16-bit pair
    sums. (A widened once by the lowering costs a pass over it; widened by shuffles in the
    micro-kernel, it cost two per row and quad, for every column panel.)

    With `tiles` (8-bit kinds, packed B, no b_words), the register tile runs on AMX's tile
    unit (codegen_worker/tile_gemm.py): 16 x 16 int32 accumulator tiles, A read as tiles of
    16 rows by 64 bytes of k at row stride a_sm, B's packed panel as tiles of 16 quads by 16
    columns at row stride nr * 4 bytes, so nr is 16 or 32. The dot instruction multiplies
    each kind's bytes with their own signs, so "s8s8" takes no 128 from A (the lowering's
    zero-point terms must not either). A k offset table is then `a_kruns` instead:
    ((count, byte stride), ...) from outermost, k's quads being runs of k / prod(counts)
    consecutive quads, each run at the sum of its indices times the strides (a conv's window
    rows over the channels-last copy: (kh, dh * wp * cp), the kw * cp bytes of a window row
    contiguous). Every k step is 64 bytes: each run is a multiple of 16 quads, B's quads past
    a run's real ones are zero, and A may be read up to the run's padded end (the lowering
    pads a copy of A, or leaves 64 bytes of slack after its workspace).

    `kind` "bf16" (on tiles only: tdpbf16ps) multiplies bfloat16 and sums in float32 (`acc_var`
    an f32): A is a bf16 buffer (a_sm and a_off in its elements, rows whole 64-byte steps),
    k counts *pairs* of elements, and B is packed [panel][pair][nr][2] 16-bit, two consecutive
    k of one column per 32-bit lane (ir/lower/bf16_gemm.py), or read in place in that lane
    layout with `b_sk` lanes from one pair to the next (a pointwise conv's input, its pixels
    the columns: ir/lower/bf16_conv.py).

    With `m_rows` (width, real), m counts virtual rows, a plane's rows of `width` pixels laid
    end to end, of which the first `real` of each row are pixels: the write-back stores only
    those, and the epilogue's m is the pixel's index in a plane of `real` columns, (q //
    width) * real + q % width for virtual row q. (A stride-1 conv over its padded input: its
    pixels are then equally spaced in A across output rows.)
    """
    a_buf: str
    a_off: Expr
    a_sm: int
    a_sk: int
    b_buf: str
    b_off: Expr
    m: int
    n: int
    k: int
    mr: int
    nr: int
    m_var: str
    n_var: str
    acc_var: str
    epilogue: tuple
    a_ktab: str = ""
    kind: str = "f32"
    # Where the Gemm is a phase, threads divide it by row blocks ("m") or column panels ("n").
    split: str = "m"
    b_sk: int = 0  # B's row stride when it is read in place (0: packed); with a run-time n, an expression
    # The epilogue's stores are contiguous along n (a row-major C) or m (a conv's pixels):
    # the direction its loop over the tile is vectorized in.
    stores_along: str = "n"
    b_ktab: str = ""
    b_words: bool = False
    a_sb: int = 0
    a_mtab: str = ""
    a_rows: int = 0
    a_kspan: str = ""
    n_bound: int = 0
    tiles: bool = False
    a_kruns: tuple = ()
    m_rows: tuple = ()

    @property
    def in_place_b(self) -> bool:
        return bool(self.b_sk or self.b_ktab)

    @property
    def pieces(self) -> "int | Expr":
        """How many parts its split dimension has: row blocks (with a_rows, rows) or panels
        (the last one partial); an expression for a run-time m split by rows."""
        if self.split == "n":
            return -(-self.n // self.nr) if isinstance(self.n, int) else div(add(self.n, self.nr - 1), self.nr)
        if self.a_rows:
            return self.m // self.a_rows
        return -(-self.m // self.mr) if isinstance(self.m, int) else div(add(self.m, self.mr - 1), self.mr)


GEMM_KINDS = ("f32", "u8s8", "s8s8", "s8u8", "bf16")
FLOAT_GEMM_KINDS = ("f32", "bf16")  # (float accumulators)
GEMM_SPLITS = ("m", "n")


@dataclass(frozen=True)
class WindowDot(Stmt):
    """One output row of a depthwise window over bytes, summed exactly in i32:

        out[out_off + x] = sum over r < rows, t < taps of
            P[p_off + r*p_row + x*stride + t*dilation] * (byte t % 4 of W[w_off + r*quads + t // 4])

    for x < width. P holds unsigned bytes (a bordered input plane); W is i32, each element
    four signed weight bytes (taps 4q..4q+3 of one window row, zero past `taps`), so
    quads = ceil(taps / 4). The codegen computes 16 outputs at a time: per window row and
    quad, one 64-byte load, a byte shuffle placing each output's four inputs in one i32 lane,
    and a vpdpbusd (or its emulation). So it writes `out` up to width rounded up to 16, and
    reads up to `window_dot_reach` bytes from each window row's start: P must extend that far.
    """
    p_buf: str
    p_off: Expr
    p_row: int
    stride: int
    dilation: int
    w_buf: str
    w_off: Expr
    rows: int
    taps: int
    width: int
    out_buf: str
    out_off: Expr

    @property
    def quads(self) -> int:
        return -(-self.taps // 4)

    @property
    def vectors(self) -> int:
        return -(-self.width // WINDOW_DOT_LANES)


WINDOW_DOT_LANES = 16  # outputs per vector: i32 lanes of a 64-byte register


def window_dot_reach(stride: int, dilation: int, taps: int, width: int) -> int:
    """Bytes a WindowDot reads from a window row's start: to the end of the last vector's
    last quad's 64-byte load."""
    vectors, quads = -(-width // WINDOW_DOT_LANES), -(-taps // 4)
    return (vectors - 1) * WINDOW_DOT_LANES * stride + (quads - 1) * 4 * dilation + 64


def window_dot_fits(stride: int, dilation: int, taps: int) -> bool:
    """Do 16 outputs' inputs for one quad of taps lie within one 64-byte load?"""
    return (WINDOW_DOT_LANES - 1) * stride + (min(taps, 4) - 1) * dilation < 64


@dataclass(frozen=True)
class TransposeBlock(Stmt):
    """A block of 4-byte elements transposed: element (i, j) of the source, the 4 bytes at
    byte src_off + i*src_stride + 4*j, goes to byte dst_off + j*dst_stride + 4*i of the
    destination, for i < rows, j < cols (each at most 16). The codegen loads the rows as
    16-lane vectors, transposes them in registers (64 shuffles) and stores the columns; a
    loop left to LLVM gathers one element per instruction. The int8 conv's channels-last
    copy is its user: rows are quads of 4 channels, columns pixels. Over a run-time width,
    src_stride and cols are expressions (cols at most 16: the lowering clamps it)."""
    src: str
    src_off: Expr
    src_stride: "int | Expr"
    dst: str
    dst_off: Expr
    dst_stride: int
    rows: int
    cols: "int | Expr"


TRANSPOSE_LANES = 16  # elements each way of a block: the i32 lanes of a 64-byte register


@dataclass(frozen=True)
class Deinterleave(Stmt):
    """`count * phases` consecutive float32 elements of src from src_off, dealt out by phase:
    element t * phases + p goes to dst[dst_off + p * dst_stride + t] (one phase: a copy). The
    codegen loads whole vectors, separates the phases with shuffles and stores each phase's
    run, a ragged last vector through masks. A strided conv's or pool's column-phase copy is
    its user: left to LLVM, a row shorter than two vectors (14 wide at stride 2) became
    scalar moves. `count` and `dst_stride` may be i64 expressions of the symbols (a row of a
    length known at run time). With `src_count`, only that many elements from src_off exist
    (the rest of an input row; it may be less than count * phases, or not positive): the
    elements past them read as `border`, so a bordered copy's row end is filled by the same
    stores."""
    src: str
    src_off: Expr
    dst: str
    dst_off: Expr
    dst_stride: int | Expr
    phases: int
    count: int | Expr
    src_count: "int | Expr | None" = None
    border: float = 0.0


@dataclass(frozen=True)
class Buffer:
    name: str
    dtype: str
    size: int  # elements


@dataclass(frozen=True)
class Kernel:
    """One compiled function: `void name(ptr buf0, ptr buf1, ...)` in `buffers` order."""
    buffers: tuple
    body: tuple
    schedule: tuple = ()  # sorted (key, value) pairs: vector_width, vectorize, unroll

    def to_bytes(self) -> bytes:
        return self._bytes

    @functools.cached_property
    def _bytes(self) -> bytes:  # kernels are immutable: encode once
        return json.dumps([FORMAT_VERSION, _encode(self, {})], separators=(",", ":")).encode()

    @staticmethod
    def from_bytes(data: bytes) -> "Kernel":
        version, obj = json.loads(data)
        if version != FORMAT_VERSION:
            raise ValueError(f"kernel format {version}, expected {FORMAT_VERSION}")
        return _decode(obj)

    @functools.cached_property
    def digest(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @property
    def symbol(self) -> str:
        """The function name: derived from content, so equal kernels share one symbol."""
        return "kiln_" + self.digest[:20]

    def has_gemm(self) -> bool:
        """Does the kernel hold a Gemm statement (the slow kind to compile)?"""
        stack = list(self.body)
        while stack:
            s = stack.pop()
            if isinstance(s, Gemm):
                return True
            stack.extend(getattr(s, "body", ()) or ())
            stack.extend(getattr(s, "then", ()) or ())
            stack.extend(getattr(s, "orelse", ()) or ())
        return False

    def option(self, key: str, default=None):
        return dict(self.schedule).get(key, default)

    def with_schedule(self, **updates) -> "Kernel":
        merged = dict(self.schedule)
        merged.update(updates)
        return Kernel(self.buffers, self.body, tuple(sorted(merged.items())))


def _reads_memory(e) -> bool:
    if isinstance(e, Load):
        return True
    if isinstance(e, Call):
        return any(map(_reads_memory, e.args))
    return any(_reads_memory(v) for v in (getattr(e, n) for n in field_names(e)) if isinstance(v, Expr))


def _buffers_loaded(e, into: set) -> None:
    if isinstance(e, Load):
        into.add(e.buf)
    parts = e.args if isinstance(e, Call) else [getattr(e, n) for n in field_names(e)]
    for v in parts:
        if isinstance(v, Expr):
            _buffers_loaded(v, into)


def recomputable(body: tuple) -> bool:
    """Whether a loop body may run an iteration again with the same effect: it stores only to
    buffers it does not read, and assigns only variables it declares (no sum carried across
    iterations). Without mask registers the emitter then ends a ragged loop with a whole
    vector overlapping the one before rather than a masked or scalar remainder."""
    stored, loaded, declared, assigned = set(), set(), set(), set()

    def visit(stmts) -> bool:
        for s in stmts:
            exprs = ()
            if isinstance(s, Store):
                stored.add(s.buf)
                exprs = (s.index, s.value)
            elif isinstance(s, (Let, Assign)):
                if isinstance(s, Assign):
                    assigned.add(s.var)
                exprs = (s.value,)
            elif isinstance(s, Local):
                declared.add(s.var)
                exprs = (s.init,)
            elif isinstance(s, For):
                exprs = (s.extent,) if isinstance(s.extent, Expr) else ()
                if not visit(s.body):
                    return False
            elif isinstance(s, If):
                exprs = (s.cond,)
                if not (visit(s.then) and visit(s.orelse)):
                    return False
            else:  # (a Gemm, a WindowDot, ...: not looked into)
                return False
            for e in exprs:
                _buffers_loaded(e, loaded)
        return True
    return visit(body) and not stored & loaded and assigned <= declared


def guarded_phase(s) -> bool:
    """Whether a statement is a guarded phase: If(a comparison of run-time extents, (one
    loop or Gemm,)) with no else."""
    return (isinstance(s, If) and not s.orelse and len(s.then) == 1 and isinstance(s.then[0], (For, Gemm))
            and isinstance(s.cond, Cmp) and of_symbols(s.cond.a) and of_symbols(s.cond.b))


def phases(body: tuple) -> tuple[tuple, tuple]:
    """(prelude, phases) of a kernel body (see "Threads" above): its top-level Lets, which
    every phase sees, and its top-level loops, Gemms and guarded phases. A body holding
    anything else at top level (an accumulator, a store, a Let that loads) is one phase: the
    body itself, a tuple."""
    lets = tuple(s for s in body if isinstance(s, Let))
    work = tuple(s for s in body if not isinstance(s, Let))
    if (work and all(isinstance(s, (For, Gemm)) or guarded_phase(s) for s in work)
            and not any(_reads_memory(s.value) for s in lets)):
        return lets, work
    return (), (tuple(body),)


def parallel_extent(phase) -> "int | Expr":
    """How many independent parts a phase divides into across threads (0: it runs whole); an
    expression where that is known only at run time."""
    if isinstance(phase, If):  # (a guarded phase: its loop's or Gemm's)
        return parallel_extent(phase.then[0])
    if isinstance(phase, For) and phase.parallel:
        return phase.extent
    if isinstance(phase, Gemm):
        return phase.pieces
    return 0


def loop(var: str, extent: int, body, kind: str = "serial", parallel: bool = False) -> tuple:
    """A loop as statements; one of a single iteration is its body with `var` bound to 0, so
    the phases inside it (a batch-1 conv's copy and GEMM) stay top level."""
    if extent == 1:
        return (Let(var, Const(0)), *body)
    return (For(var, extent, tuple(body), kind, parallel),)


_CLASSES = {c.__name__: c for c in (Const, Var, Load, Bin, Cmp, Call, Select, Cast, For, Store, Let, Local,
                                     Assign, If, Gemm, WindowDot, TransposeBlock, Deinterleave, Buffer, Kernel)}


def _encode(x, done: dict):
    """x as JSON-able lists; `done` holds each node already encoded by id (lowering shares
    subexpressions, a run-time size's above all: a conv's kernel is 1.7 MB of JSON written
    from far fewer nodes)."""
    if isinstance(x, (Expr, Stmt, Buffer, Kernel)):
        hit = done.get(id(x))
        if hit is None:
            hit = done[id(x)] = [type(x).__name__] + [_encode(getattr(x, n), done) for n in field_names(x)]
        return hit
    if isinstance(x, tuple):
        return {"t": [_encode(v, done) for v in x]}
    if isinstance(x, Dim):  # (a lowering that took a shape's dim where it needed KernelBuilder.dim)
        raise SymbolError(f"{x} is a symbolic dimension, not a number or a kernel expression")
    return x


def _decode(x):
    if isinstance(x, dict):
        return tuple(_decode(v) for v in x["t"])
    if isinstance(x, list):
        return _CLASSES[x[0]](*(_decode(v) for v in x[1:]))
    return x


# ---- builders that fold integer constants, so index math stays small ---------------------

def _c(x) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, bool):
        return Const(int(x), "i1")
    if isinstance(x, int):
        return Const(x, "i64")
    return Const(float(x), "f32")


def _ival(x):
    return x.value if isinstance(x, Const) and x.dtype == "i64" else None


def add(a, b) -> Expr:
    a, b = _c(a), _c(b)
    va, vb = _ival(a), _ival(b)
    if va is not None and vb is not None:
        return Const(va + vb)
    if va == 0:
        return b
    if vb == 0:
        return a
    return _refolded(a, b) or Bin("add", a, b)


def _refolded(a: Expr, b: Expr) -> Expr | None:
    """a + b without unflatten's division where it undoes one: (f / d) * d + f % d is f, and
    (y + f / d) * d + f % d is y * d + f. So flat_index over unflatten(f) of a buffer's
    trailing dims is its row's offset plus f, a unit stride LLVM vectorizes (a reduction over
    H and W as one loop of H * W)."""
    if not (isinstance(b, Bin) and b.op == "rem" and isinstance(a, Bin) and a.op == "mul" and a.b == b.b):
        return None
    f, d = b.a, b.b
    quotient = Bin("div", f, d)
    if a.a == quotient:
        return f
    if isinstance(a.a, Bin) and a.a.op == "add" and a.a.b == quotient:
        return add(mul(a.a.a, d), f)
    return None


def sub(a, b) -> Expr:
    a, b = _c(a), _c(b)
    va, vb = _ival(a), _ival(b)
    if va is not None and vb is not None:
        return Const(va - vb)
    if vb == 0:
        return a
    return Bin("sub", a, b)


def mul(a, b) -> Expr:
    a, b = _c(a), _c(b)
    va, vb = _ival(a), _ival(b)
    if va is not None and vb is not None:
        return Const(va * vb)
    if va == 0 or vb == 0:
        return Const(0)
    if va == 1:
        return b
    if vb == 1:
        return a
    return Bin("mul", a, b)


def div(a, b) -> Expr:
    """Integer division of non-negative index values."""
    a, b = _c(a), _c(b)
    va, vb = _ival(a), _ival(b)
    if va is not None and vb is not None:
        return Const(va // vb)
    if vb == 1:
        return a
    return Bin("div", a, b)


def rem(a, b) -> Expr:
    a, b = _c(a), _c(b)
    va, vb = _ival(a), _ival(b)
    if va is not None and vb is not None:
        return Const(va % vb)
    if vb == 1:
        return Const(0)
    return Bin("rem", a, b)


def fbin(op: str, a, b) -> Expr:
    return Bin(op, _c(a), _c(b))


def fold_balanced(op: str, values: list) -> Expr:
    """values[0] op values[1] op ... as a balanced tree (same operations as a left fold,
    depth log2(n)): a Sum or Max of 2000 inputs nested 2000 deep, past what the recursive
    walkers of a kernel (verifier, emitter, encoder) can descend."""
    values = list(values)
    while len(values) > 1:
        values = [fbin(op, *values[i:i + 2]) if i + 1 < len(values) else values[i] for i in range(0, len(values), 2)]
    return values[0]


def cmp(op: str, a, b) -> Expr:
    return Cmp(op, _c(a), _c(b))


def call(fn: str, *args) -> Expr:
    return Call(fn, tuple(_c(a) for a in args))


def select(c, a, b) -> Expr:
    return Select(_c(c), _c(a), _c(b))


def stored_value(storage: str, value: Expr) -> Expr:
    """`value` (of `storage`'s compute type) as a Store into `storage` keeps it: a 4- or 2-bit
    integer wraps at its width. For code that uses a converted value before it is stored."""
    if storage not in SUB_BYTE_TYPES:
        return value
    if is_unsigned(storage):
        return fbin("and", value, (1 << value_bits(storage)) - 1)
    unused = 8 - value_bits(storage)
    return fbin("shr", fbin("shl", value, unused), unused)


def const(value, dtype: str) -> Const:
    return Const(float(value) if dtype in FLOAT_TYPES else int(value), dtype)


def flat_index(idx, shape) -> Expr:
    """Row-major offset of a multi-index into a buffer of `shape`."""
    out: Expr = Const(0)
    for i, d in zip(idx, shape):
        out = add(mul(out, d), i)
    return out


def unflatten(flat, shape) -> list:
    """The multi-index of row-major offset `flat` within `shape`."""
    idx = []
    for pos in range(len(shape) - 1, -1, -1):
        d = shape[pos]
        idx.append(rem(flat, d) if pos else flat)
        flat = div(flat, d)
    return idx[::-1]


# ---- run-time extents: expressions of the symbols' values (see "Every loop runs ...") --------

_EXTENT_OPS = {"add": ("+", lambda a, b: a + b), "sub": ("-", lambda a, b: a - b), "mul": ("*", lambda a, b: a * b),
               "div": ("/", lambda a, b: a // b), "rem": ("%", lambda a, b: a % b),
               "min": ("<", min), "max": (">", max)}  # (C: a choice by comparison)


def of_symbols(e) -> bool:
    """Whether an expression is an extent: constants and the symbols' values, combined by
    _EXTENT_OPS."""
    if isinstance(e, (int, Const)):
        return True
    if isinstance(e, Load):
        return e.buf == SYMBOLS and isinstance(e.index, Const)
    return isinstance(e, Bin) and e.op in _EXTENT_OPS and of_symbols(e.a) and of_symbols(e.b)


def extent_value(e, symbols: list) -> int:
    """An extent's value with symbol k = symbols[k] (its bound, or its run-time value)."""
    if isinstance(e, int):
        return e
    if isinstance(e, Const):
        return int(e.value)
    if isinstance(e, Load) and e.buf == SYMBOLS and isinstance(e.index, Const):
        return int(symbols[e.index.value])
    if isinstance(e, Bin) and e.op in _EXTENT_OPS:
        return _EXTENT_OPS[e.op][1](extent_value(e.a, symbols), extent_value(e.b, symbols))
    raise ValueError(f"{e!r} is not an expression of the symbols")


def extent_c(e, symbols: str = "dims") -> str:
    """An extent as a C expression over the array of the symbols' values (long long)."""
    if isinstance(e, int):
        return str(e)
    if isinstance(e, Const):
        return str(int(e.value))
    if isinstance(e, Load) and e.buf == SYMBOLS and isinstance(e.index, Const):
        return f"{symbols}[{int(e.index.value)}]"
    if isinstance(e, Bin) and e.op in ("min", "max"):
        a, b = extent_c(e.a, symbols), extent_c(e.b, symbols)
        return f"({a} {_EXTENT_OPS[e.op][0]} {b} ? {a} : {b})"
    if isinstance(e, Bin) and e.op in _EXTENT_OPS:
        return f"({extent_c(e.a, symbols)} {_EXTENT_OPS[e.op][0]} {extent_c(e.b, symbols)})"
    raise ValueError(f"{e!r} is not an expression of the symbols")


_CMP_C = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


def condition_c(cond: Cmp, symbols: str = "dims") -> str:
    """A guarded phase's condition as a C expression over the symbols' values."""
    return f"({extent_c(cond.a, symbols)} {_CMP_C[cond.op]} {extent_c(cond.b, symbols)})"
