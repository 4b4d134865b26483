"""The kernel verifier: every kernel lowering produces passes it (the whole suite builds
through it); these are the malformed ones it must name before any codegen job starts."""
from dataclasses import replace

import pytest

from modelkiln.ir.errors import InternalError
from modelkiln.ir.loop import (Assign, Bin, Buffer, Cast, Const, Deinterleave, For, Gemm, Kernel, Let, Load, Local,
                               Store, TransposeBlock, Var, WindowDot)
from modelkiln.ir.verify import verify_kernel

BUFS = (Buffer("o0", "f32", 16), Buffer("i0", "f32", 16), Buffer("w0", "i64", 4))


def _kernel(*body):
    return Kernel(BUFS, tuple(body))


BYTE_BUFS = (Buffer("p0", "u8", 256), Buffer("w1", "i32", 9), Buffer("t0", "i32", 32))


def _window_dot(p_buf="p0", stride=1):
    """A 3x3 window row over 16 outputs of plane p0, weights w1, sums into t0."""
    return Kernel(BYTE_BUFS, (WindowDot(p_buf, Const(0), 20, stride, 1, "w1", Const(0), 3, 3, 16, "t0", Const(0)),))


WORD_BUFS = (Buffer("o0", "i32", 64), Buffer("a0", "u8", 64), Buffer("b0", "i16", 64), Buffer("b1", "i8", 64),
             Buffer("a1", "i16", 64))


def _byte_gemm(b_buf="b0", kind="u8s8", b_words=True, a_buf="a1"):
    """An 8-bit 4x16 GEMM of 4 quads, A from a_buf, B from b_buf, storing its sums into o0."""
    return Kernel(WORD_BUFS, (Gemm(a_buf, Const(0), 16, 1, b_buf, Const(0), 4, 16, 4, 4, 16, "m", "n", "acc",
                                   (Store("o0", Bin("add", Bin("mul", Var("m"), Const(16)), Var("n")),
                                          Var("acc", "i32")),), kind=kind, b_words=b_words),))


def good():
    return _kernel(For("i", 16, (Local("acc", "f32", Const(0.0, "f32")),
                                 Assign("acc", Bin("add", Var("acc", "f32"), Load("i0", Var("i")))),
                                 Store("o0", Var("i"), Var("acc", "f32")))))


@pytest.mark.parametrize("kernel,message", [
    (_kernel(Store("o0", Var("i"), Const(1.0, "f32"))), "variable i is used outside"),
    (_kernel(Store("o0", Const(0), Bin("add", Load("i0", Const(0)), Load("w0", Const(0))))), "add of f32 and i64"),
    (_kernel(Store("w0", Const(0), Bin("mul", Load("w0", Const(1)), Const(0.5, "f32")))), "literal 0.5 used as i64"),
    (_kernel(Store("o0", Const(0), Bin("shl", Load("i0", Const(0)), Const(1)))), "shl is not defined on f32"),
    (_kernel(Store("o0", Const(0), Load("w0", Const(0)))), "store of i64 into o0"),
    (_kernel(Store("o1", Const(0), Const(1.0, "f32"))), "buffer o1 does not exist"),
    (_kernel(Store("o0", Const(16), Const(1.0, "f32"))), "constant index 16 outside o0"),
    (_kernel(Let("x", Const(1.0, "f32")), Assign("x", Const(2.0, "f32"))), "not an accumulator"),
    (_kernel(Store("o0", Const(0), Var("i", "f32"))), "variable i is used outside"),
    (_kernel(For("i", 4, (Store("o0", Var("i"), Var("i", "f32")),))), "used as f32 but bound as i64"),
    (_kernel(Store("o0", Const(0), Cast("b8", Const(1.0, "f32")))), "cast to b8"),
    (_window_dot(p_buf="w1"), "window dot operand w1 is not a u8 buffer"),
    (_window_dot(stride=5), "16 outputs span over 64 bytes"),
    (Kernel(BYTE_BUFS, (TransposeBlock("t0", Const(0), 64, "p0", Const(0), 64, 17, 4),)), "17x4 elements"),
    (Kernel(BYTE_BUFS, (TransposeBlock("t9", Const(0), 64, "p0", Const(0), 64, 4, 4),)), "buffer t9 does not exist"),
    (_kernel(Deinterleave("i0", Const(0), "w0", Const(0), 8, 2, 4)), "deinterleave operand w0 is not a f32 buffer"),
    (_kernel(Deinterleave("i0", Const(0), "o0", Const(0), 3, 2, 4)), "4 x 2 phases into runs 3 apart"),
    (_byte_gemm(kind="s8s8"), "s8s8 gemm with B packed as 16-bit pairs"),
    (Kernel(WORD_BUFS, (replace(_byte_gemm().body[0], a_sb=4),)), "u8s8 gemm with A in row blocks 4 apart"),
    (Kernel(WORD_BUFS, (replace(_byte_gemm().body[0], a_mtab="b0"),)), "row-offset table b0 is not an i64 buffer"),
    (Kernel(WORD_BUFS, (replace(_byte_gemm().body[0], a_rows=2),)), "4 rows in rows of 2 pixels: needs a row-offset"),
    (Kernel(WORD_BUFS, (replace(_byte_gemm().body[0], a_rows=3),)), "4 rows in rows of 3 pixels"),
    (Kernel(WORD_BUFS, (replace(_byte_gemm().body[0], a_kspan="a1"),)), "k-span table a1: an i64 buffer"),
    (_kernel(Gemm("i0", Const(0), 1, 1, "i0", Const(0), 4, 16, 4, 4, 16, "m", "n", "acc", (), a_kspan="w0")),
     "k-span table w0: an i64 buffer, beside row and k-offset tables"),
    (_kernel(Gemm("i0", Const(0), 1, 1, "i0", Const(0), 4, Load("w0", Const(0)), 4, 4, 16, "m", "n", "acc", (),
                  split="n")), "columns read in place with row stride 0 or table ''"),
    (_byte_gemm(b_buf="b1"), "a1, b1 are not 16-bit buffers"),
    (_byte_gemm(a_buf="a0"), "a0, b0 are not 16-bit buffers"),
    (_byte_gemm(b_words=False, a_buf="a0"), "not byte buffers"),
])
def test_malformed_kernel_is_named_with_its_ops(kernel, message):
    with pytest.raises(InternalError, match=message) as e:
        verify_kernel(kernel, "fused_broken", ["Add", "Relu"])
    assert "fused_broken (ops Add, Relu)" in str(e.value)


def test_well_formed_kernel_passes():
    verify_kernel(good(), "fused_ok", ["ReduceSum"])
    verify_kernel(_window_dot(stride=4), "fused_ok", ["ConvInteger"])
    verify_kernel(_kernel(Deinterleave("i0", Const(0), "o0", Const(0), 8, 2, 4)), "fused_ok", ["Conv"])
    verify_kernel(_byte_gemm(), "fused_ok", ["MatMulInteger"])
    verify_kernel(_byte_gemm(b_buf="b1", b_words=False, a_buf="a0"), "fused_ok", ["MatMulInteger"])


def test_a_malformed_kernel_stops_the_build_before_any_job(monkeypatch):
    from modelkiln.ir import lower as lower_pkg
    from modelkiln.orchestrator import pipeline
    from modelkiln.orchestrator.api import build
    from modelkiln.orchestrator.executor import Executor
    from tests import model_zoo

    real = lower_pkg.lower

    def broken_lower(graph, config, schedules=None):
        lowered = real(graph, config, schedules)
        call = lowered.calls[0]
        call.kernel = Kernel(call.kernel.buffers, call.kernel.body + (Store("o9", Const(0), Const(0.0, "f32")),),
                             call.kernel.schedule)
        return lowered

    class NoJobs(Executor):
        def run(self, jobs, on_result=None):
            raise AssertionError("a job was dispatched")
    monkeypatch.setattr(pipeline, "lower", broken_lower)
    with pytest.raises(InternalError, match="buffer o9 does not exist"):
        build(model_zoo.cnn(), executor=NoJobs(), cache=None, progress=False)
