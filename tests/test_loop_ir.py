"""The loop IR as the codegen and the cache see it: loop kinds read from the IR LLVM optimized
(the kernels that use each run in the suite's model tests), and a kernel's encoding."""
from modelkiln.codegen_worker.compile import compile_kernel
from modelkiln.ir.loop import Buffer, Const, For, Kernel, Load, Store, Var, add, div, fbin, mul
from modelkiln.ir.verify import verify_kernel

TARGET = {"triple": "x86_64-unknown-linux-gnu", "cpu": "x86-64-v3", "features": ""}


def _rows_copied(outer_kind: str) -> Kernel:
    """Four rows of a length known at run time doubled, each by a vectorized loop."""
    row = Load("n", Const(0))
    at = add(mul(Var("r"), row), Var("j"))
    copy = For("j", row, (Store("o0", at, fbin("mul", Const(2.0, "f32"), Load("i0", at))),), "vectorize")
    bufs = (Buffer("o0", "f32", 4096), Buffer("i0", "f32", 4096), Buffer("n", "i64", 1))
    return Kernel(bufs, (For("r", 4, (copy,), outer_kind),), (("vector_width", 8), ("vectorize", True)))


def _vector_stores(kind: str) -> int:
    ir = compile_kernel(_rows_copied(kind).to_bytes(), "k", TARGET, emit_ir=True)["ir"]
    return sum(line.count("store <8 x float>") for line in ir.splitlines())


def test_a_rolled_loop_keeps_one_copy_of_the_loops_inside():
    """LLVM unrolls a short loop whole, the loops inside it copied once per iteration (a
    Winograd block's window rows, and its units); a rolled loop keeps one."""
    verify_kernel(_rows_copied("rolled"), "fused_rows", ["Mul"])
    rolled = _vector_stores("rolled")
    assert rolled > 0 and _vector_stores("serial") == 4 * rolled


def test_a_kernel_of_shared_nodes_encodes_as_written_out():
    """Lowering shares subexpressions (a run-time size read everywhere); the encoding writes
    each use out, so a kernel's bytes (its cache key) are those of the same kernel unshared,
    and decode to it."""
    size = mul(Load("n", Const(0)), Const(4))
    shared = Kernel((Buffer("o0", "f32", 64), Buffer("n", "i64", 1)),
                    (Store("o0", size, Const(1.0, "f32")), Store("o0", add(size, Const(1)), Const(2.0, "f32"))))
    unshared = Kernel.from_bytes(shared.to_bytes())
    assert unshared.body[0].index is not unshared.body[1].index.a  # (decoding builds each use anew)
    assert unshared == shared and unshared.to_bytes() == shared.to_bytes()


def test_a_symbolic_dim_left_in_a_kernel_is_named_where_its_group_is_lowered():
    """A lowering that takes a shape's symbolic dim where it needs the kernel's expression of
    it (KernelBuilder.dim) cannot be encoded: a SymbolError saying so, which lowering turns
    into the group's "not supported yet" error (not a JSON error from the cache key)."""
    import pytest
    from modelkiln.ir.symbolic import Dim, SymbolError
    batch = Dim.symbol("batch", 1, 4)
    kernel = Kernel((Buffer("o0", "f32", 64),), (For("b", batch, (Store("o0", Var("b"), Const(1.0, "f32")),)),))
    with pytest.raises(SymbolError, match="batch is a symbolic dimension, not a number or a kernel expression"):
        kernel.digest


def _two_rows(kind: str) -> str:
    """Each iteration stores a pair of columns into each of two rows a run-time n apart (as
    the Winograd output transform stores its tiles): the optimized IR."""
    n = Load("n", Const(0))
    j = Var("j")
    body = tuple(Store("o0", add(row, add(mul(j, Const(2)), Const(col))),
                       fbin("mul", Const(2.0 + col, "f32"), Load("i0", add(row, j))))
                 for row in (Const(0), n) for col in (0, 1))
    bufs = (Buffer("o0", "f32", 4096), Buffer("i0", "f32", 4096), Buffer("n", "i64", 1))
    kernel = Kernel(bufs, (For("j", div(n, Const(2)), body, kind),), (("vector_width", 8), ("vectorize", True)))
    verify_kernel(kernel, "fused_rows", ["Mul"])
    return compile_kernel(kernel.to_bytes(), "k", TARGET, emit_ir=True)["ir"]


def test_an_independent_loop_is_vectorized_without_an_overlap_check():
    """Rows a run-time size apart may overlap as far as LLVM knows: a vectorized loop checks
    at run time first (and a check it cannot pass sends every call to the scalar loop: the
    Winograd output transform's); an independent loop promises they do not."""
    assert "vector.memcheck" in _two_rows("vectorize")
    independent = _two_rows("independent")
    assert "vector.memcheck" not in independent and "vector.body" in independent
