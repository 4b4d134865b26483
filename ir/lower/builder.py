"""KernelBuilder: the state of lowering one fused group into one Kernel.

A *reader* is a function from a multi-index (a list of loop-IR expressions, one per dim
of a tensor) to the expression of that tensor's element. Tensors from outside the group
read from kernel parameters; tensors produced inside the group are computed inline by
composing their op's reader with its inputs' readers. Anchor ops (conv, matmul,
reductions) write loop nests of their own and apply the rest of the group as an epilogue.

Parameter names are positional ('o0', 'i0', 'w0'), never tensor names, so two groups that
compute the same thing produce byte-identical kernels (and share one compiled object).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..dtypes import dtype
from ..graph import Graph, TensorType, UnsupportedError
from ..errors import InternalError
from ..loop import (SYMBOLS, Buffer, Const, Expr, For, Gemm, Kernel, Let, Load, Var, add, bits, div, flat_index, mul,
                    phases, rem)
from ..parallel import MIN_PIECE_WORK
from ..schedule import CODEGEN_OPTIONS, KNOBS, ScheduleError, gemm_tiles, value_of
from ..symbolic import Dim, SymbolError, greatest, product


SHORT_ROW = 63  # innermost extents up to this are vectorized along themselves, tails masked


@dataclass
class ScheduleConfig:
    """Target-dependent choices lowering makes: vector width and GEMM register tile, and
    whether 8-bit GEMMs pack B as 16-bit pairs (8-lane x86 without a byte dot product:
    see Gemm.b_words) or may run on AMX tiles (Gemm.tiles)."""
    vector_width: int = 16
    mr: int = 14
    nr: int = 32
    vectorize: bool = True
    int8_pairs: bool = False
    int8_tiles: bool = False  # AMX's tile unit for 8-bit GEMMs (ir/lower/integer_gemm.py, tile_unit)
    bf16_tiles: bool = False  # AMX-BF16 for bf16 products (ir/lower/bf16_gemm.py)
    precision: str = "fp32"  # the build's: "bf16" rounds GEMM operands to bfloat16 (ir/lower/bf16_gemm.py)
    # In a bf16 build, the nodes (by Node.key) whose products stay float32: an accuracy
    # budget's choice (orchestrator/accuracy_budget.py).
    fp32_nodes: frozenset = frozenset()

    def tile(self, n: int) -> tuple[int, int]:
        """(mr, nr) for a GEMM with n columns: a narrow GEMM (n within one vector) would waste
        half of a two-vector panel on zero padding, so it uses one-vector panels and twice the
        rows, which keeps the register count the same."""
        if n <= self.vector_width < self.nr:
            return 2 * self.mr, self.vector_width
        return self.mr, self.nr

    @classmethod
    def for_vector_width(cls, vw: int) -> "ScheduleConfig":
        if vw >= 16:
            return cls(16, 14, 32)
        if vw == 8:
            return cls(8, 6, 16)
        return cls(4, 6, 8)

    @classmethod
    def for_target(cls, vw: int, x86: bool, byte_dot_widths: set, int8_tiles: bool = False,
                   bf16_tiles: bool = False) -> "ScheduleConfig":
        config = cls.for_vector_width(vw)
        config.int8_pairs = x86 and vw == 8 and 8 not in byte_dot_widths
        config.int8_tiles = x86 and vw == 16 and int8_tiles
        config.bf16_tiles = x86 and vw == 16 and bf16_tiles
        return config


@dataclass
class KernelBuilder:
    g: Graph
    config: ScheduleConfig
    outputs: list = field(default_factory=list)   # tensor names
    inputs: list = field(default_factory=list)    # tensor names (incl. packed constants)
    workspaces: list = field(default_factory=list)  # sizes in float32 units (4 bytes), for the memory plan
    workspace_types: list = field(default_factory=list)  # (storage type, element count) of each
    new_constants: dict = field(default_factory=dict)  # packed weights this kernel introduced
    readers: dict = field(default_factory=dict)   # tensor name -> reader, for in-group tensors
    shapes: dict = field(default_factory=dict)    # tensor name -> shape override (collapsed dims)
    conv_collapsed: bool = False  # the conv epilogue indexes (batch, channel, pixel)
    # Float sums keep the order written (no reassociation): a depthwise window's per-row
    # partial sums, which LLVM otherwise folds back into one long dependent chain.
    ordered_sums: bool = False
    reads_symbols: bool = False  # a run-time size is read: the kernel takes the SYMBOLS buffer
    members: tuple = ()  # the group's nodes, in order
    setup: list = field(default_factory=list)  # statements run before the kernel's own (a reader's run-time tables)
    tuning: dict = field(default_factory=dict)  # knob -> value: a tuned schedule (ir/schedule.py); {} = the rules
    space: dict = field(default_factory=dict)  # knob -> (choices, default): what this kernel's code could vary
    reduced: bool = False  # a product of this kernel computes in bf16 (its KernelCall's precision)
    _n: int = 0

    def in_bf16(self) -> bool:
        """Whether this group's products take the build's bf16 precision: a bf16 build, and
        none of its nodes kept in float32."""
        return self.config.precision == "bf16" and not any(m.key in self.config.fp32_nodes for m in self.members)

    def knob(self, name: str, default, choices):
        """The value of knob `name` for this kernel: the tuned schedule's, else `default` (the
        rule's). Records the choices, so lowering with the defaults also finds what to tune."""
        if name not in KNOBS:
            raise InternalError(f"knob '{name}' is not in ir/schedule.py's KNOBS")
        choices = tuple(dict.fromkeys((default, *choices)))
        if name in self.space and self.space[name][1] != default:
            raise InternalError(f"knob '{name}' consulted twice in one kernel with different rules")
        self.space[name] = (choices, default)
        value = value_of(self.tuning.get(name, default))
        if value not in choices:
            raise ScheduleError(f"{name}={value!r} is not a choice for "
                                f"{', '.join(m.describe() for m in self.members)} (choices: {choices})")
        return value

    def tile(self, n: int) -> tuple[int, int]:
        """(mr, nr) of a GEMM with n columns: the target's rule, or the schedule's."""
        return self.knob("tile", self.config.tile(n), gemm_tiles(self.config.vector_width, n))

    def schedule(self) -> dict:
        """The knobs this kernel consulted that its schedule set away from their defaults."""
        return {name: value_of(self.tuning[name]) for name, (_, default) in self.space.items()
                if name in self.tuning and value_of(self.tuning[name]) != default}

    def fresh(self, base: str) -> str:
        self._n += 1
        return f"{base}{self._n}"

    def shape(self, name: str) -> tuple:
        """The shape a kernel indexes a tensor by: its symbolic dims are loop-IR expressions of
        the symbols' run-time values (`dim`)."""
        shape = self.shapes.get(name, self.g.types[name].shape)
        return shape if all(isinstance(d, int) for d in shape) else tuple(self.dim(d) for d in shape)

    def storage(self, name: str) -> tuple:
        """The shape a tensor's elements are laid out by: its own, except for a KV cache's
        tensors, which lie in a buffer with the cache's capacity along its axis."""
        shape = self.g.storage_shape(name)
        return self.shape(name) if shape is None else tuple(self.dim(d) for d in shape)

    def dim(self, d):
        """A dim as a kernel computes it: an int, or an i64 expression reading the symbols."""
        if not isinstance(d, Dim):
            return d
        order = list(self.g.symbols)
        total = Const(0)
        for monomial, coef in d.terms:
            term = Const(coef)
            for s in monomial:
                term = mul(term, Load(SYMBOLS, Const(order.index(s))))
            total = add(total, term)
        self.reads_symbols = True
        return total

    def type(self, name: str) -> TensorType:
        return self.g.types[name]

    def compute(self, name: str) -> str:
        """The loop-IR type tensor `name`'s elements compute in."""
        return dtype(self.g.types[name].dtype).compute

    def is_float(self, name: str) -> bool:
        return dtype(self.g.types[name].dtype).is_float

    def attrs(self, node) -> dict:
        """The node's attributes as written, with inference's canonical parameters over them
        (explicit pads for auto_pad, normalized axes, Clip's bounds, ...)."""
        return {**node.attrs, **self.g.params_of(node)}

    def out_param(self, name: str) -> str:
        if name not in self.outputs:
            self.outputs.append(name)
        return f"o{self.outputs.index(name)}"

    def in_param(self, name: str, strided: bool = False) -> str:
        """The parameter reading `name`. A KV cache's tensor is strided (`storage`): only code
        that indexes by it may take it (`strided`), never a kernel that assumes a dense buffer."""
        if not strided and self.g.storage_shape(name) is not None:
            raise UnsupportedError(f"tensor '{name}' lies in a KV cache buffer (strided by its capacity), which "
                                   f"{', '.join(m.describe() for m in self.members)} cannot read")
        if name not in self.inputs:
            self.inputs.append(name)
        return f"i{self.inputs.index(name)}"

    def workspace(self, elements: "int | Dim", storage: str = "f32") -> str:
        """A scratch buffer of `elements` elements of `storage` type, in the arena. A Dim (a
        slice per image of a run-time batch) is planned at its bounds, and a call places it
        for its own size (orchestrator.bundle.plan_memory); its bytes must be whole 4-byte units
        at every size (each term's coefficient a multiple of 4 for bytes)."""
        if isinstance(elements, Dim):
            try:
                self.workspaces.append(elements * storage_bytes(storage) // 4)
            except SymbolError:
                raise InternalError(f"a workspace of {elements} {storage} elements is not whole 4-byte units "
                                    "at every size") from None
        else:
            self.workspaces.append(-(-int(elements) * storage_bytes(storage) // 4))
        self.workspace_types.append((storage, greatest(elements)))
        return f"w{len(self.workspaces) - 1}"

    def constant_param(self, base: str, value: np.ndarray) -> str:
        """Add a compile-time array (e.g. packed weights) as an input of this kernel."""
        return self.in_param(self._new_constant(base, value))

    def packed_param(self, base: str, recipe: tuple, make) -> str:
        """A constant computed from others by `make()` (packed weights), once per `recipe` (a
        hashable naming the weights and how they are packed) in the graph: the kernels of one
        weight read one copy."""
        name = self.g.packed.get(recipe)
        if name is None or name not in self.g.constants:
            name = self.g.packed[recipe] = self._new_constant(base, make())
        return self.in_param(name)

    def _new_constant(self, base: str, value) -> str:
        name = self.g.fresh_name(base)
        self.g.add_constant(name, value)
        self.new_constants[name] = self.g.constants[name]
        return name

    def reader(self, name: str):
        """Reader of tensor `name`: inline if computed in this group, else a parameter load."""
        if name in self.readers:
            return self.readers[name]
        param = self.in_param(name, strided=True)
        shape = self.storage(name)
        return lambda idx: Load(param, flat_index(idx, shape))

    def loops(self, shape, body_fn, inner_kind="vectorize", parallel: bool = False):
        """A loop nest over `shape`; body_fn(idx) returns the statements of one point. With
        `parallel`, the outermost loop may be divided across threads: the caller promises
        that points write only their own outputs."""
        if any(isinstance(d, int) and d == 0 for d in shape):
            return ()  # (no points: not one, as an extent of 1 would make it)
        vars_ = [self.fresh("i") for _ in shape]
        runs = [isinstance(d, Expr) or d > 1 for d in shape]  # (a run-time extent always loops)
        idx = [Var(v) if r else Const(0) for v, r in zip(vars_, runs)]
        body = tuple(body_fn(idx))
        real = [pos for pos, r in enumerate(runs) if r]
        if inner_kind == "vectorize" and len(real) > 1 and isinstance(shape[real[-1]], int) and \
                shape[real[-1]] <= SHORT_ROW:
            # (left to itself, LLVM unrolled a short row whole and vectorized the loop around
            # it across rows with gathers and scatters: a [960, 49] multiply ran 10x slower)
            inner_kind = "vector_masked"
        # A run-time outermost extent (a batch of 1 while decoding) would leave the threads
        # nothing to divide: it and the static loop inside it run as one loop, split by threads.
        fuse = parallel and len(real) > 2 and isinstance(shape[real[0]], Expr) and isinstance(shape[real[1]], int)
        for pos in reversed(real[2:] if fuse else real):
            kind = inner_kind if pos == real[-1] else "serial"
            body = (For(vars_[pos], shape[pos], body, kind, parallel and pos == real[0]),)
        if fuse:
            (outer, o_var), (inner, i_var) = ((shape[p], vars_[p]) for p in real[:2])
            both = self.fresh("i")
            body = (For(both, mul(outer, Const(inner)), (Let(o_var, div(Var(both), Const(inner))),
                                                         Let(i_var, rem(Var(both), Const(inner))), *body),
                        "serial", True),)
        return body

    def kernel(self, body) -> Kernel:
        def buffer(param, name):
            t, layout = self.g.types[name], self.g.storage_shape(name)
            return Buffer(param, dtype(t.dtype).storage, greatest(t.size if layout is None else product(layout)))
        bufs = [buffer(f"o{i}", n) for i, n in enumerate(self.outputs)]
        bufs += [buffer(f"i{i}", n) for i, n in enumerate(self.inputs)]
        bufs += [Buffer(f"w{i}", t, n) for i, (t, n) in enumerate(self.workspace_types)]
        if self.reads_symbols:  # (last: the entry passes the symbols' values after the workspaces)
            bufs.append(Buffer(SYMBOLS, "i64", len(self.g.symbols)))
        if not self.reads_symbols and any(isinstance(s, Gemm) or isinstance(s, For) and s.parallel
                                          for s in phases(tuple(body))[1]):
            self.knob("piece_work", MIN_PIECE_WORK, CODEGEN_OPTIONS["piece_work"])  # (read by ir.parallel)
        schedule = (("vector_width", self.config.vector_width), ("vectorize", self.config.vectorize))
        if self.ordered_sums:
            schedule += (("reassociate", False),)
        schedule += tuple((k, v) for k, v in self.schedule().items() if k in CODEGEN_OPTIONS)
        return Kernel(tuple(bufs), tuple(body), tuple(sorted(schedule)))


def storage_bytes(storage: str) -> int:
    """Bytes per element of a loop-IR storage type."""
    return bits(storage) // 8


def broadcast_index(idx, out_shape, in_shape) -> list:
    """Index into a tensor of in_shape broadcast (numpy rules) to out_shape."""
    offset = len(out_shape) - len(in_shape)
    return [Const(0) if d == 1 else idx[offset + i] for i, d in enumerate(in_shape)]


def _aligned(shape, rank):
    return (1,) * (rank - len(shape)) + tuple(shape)


def collapse_shapes(b: KernelBuilder, names, out_shape, fixed: int = 0, into: int | None = None) -> bool:
    """Merge adjacent dims of out_shape over which every tensor in `names` is uniformly
    full or broadcast, and give each tensor the merged shape: fewer loops, longer inner
    loops, no div/mod. The first `fixed` dims are kept as they are. With `into`, only a
    merge into exactly that many dims is made. Returns whether the shapes were merged."""
    rank = len(out_shape)
    if any(b.g.storage_shape(n) is not None for n in names):
        return False  # (a KV cache's tensor is strided: its dims do not merge)
    aligned = {n: _aligned(b.shape(n), rank) for n in names}
    if any(len(s) != rank for s in aligned.values()):
        return False
    groups: list[list[int]] = [[d] for d in range(fixed)]
    last_pattern = None
    for d in range(fixed, rank):
        if out_shape[d] == 1 and d >= fixed:
            continue
        pattern = tuple(s[d] == out_shape[d] for s in aligned.values())
        if any(s[d] not in (1, out_shape[d]) for s in aligned.values()):
            return False
        if groups and len(groups) > fixed and pattern == last_pattern:
            groups[-1].append(d)
        else:
            groups.append([d])
        last_pattern = pattern
    if into is not None and len(groups) != into:
        return False
    for n, s in aligned.items():
        b.shapes[n] = tuple(math.prod(s[d] for d in grp) for grp in groups)
    return True
