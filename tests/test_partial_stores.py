"""Masked stores of a leading-lanes mask become plain stores on targets without mask
registers (codegen_worker/partial_stores.py): the rewriting itself, and the code of an AVX2
conv whose write-back ends in one, against onnxruntime where the host runs it."""
import re

import numpy as np
import pytest

from modelkiln.codegen_worker.partial_stores import split_prefix_masked_stores
from tests.isa import X86_TARGETS, lanes

LLVM22 = ("  tail call void @llvm.masked.store.v8f32.p0(<8 x float> %v, ptr align 32 %p, <8 x i1> "
          "<{}>)")


def _mask(count, lanes=8):
    return ", ".join(["i1 true"] * count + ["i1 false"] * (lanes - count))


@pytest.mark.parametrize("count, pieces", [(6, [(0, 4), (4, 2)]), (7, [(0, 4), (4, 2), (6, 1)]), (1, [(0, 1)]),
                                           (5, [(0, 4), (4, 1)])])
def test_a_prefix_mask_is_stored_as_power_of_two_pieces(count, pieces):
    text, rewritten = split_prefix_masked_stores(LLVM22.format(_mask(count)))
    assert rewritten == 1 and "masked.store" not in text
    stores = [line.strip() for line in text.splitlines() if line.strip().startswith("store")]
    assert len(stores) == len(pieces)
    for store, (first, size) in zip(stores, pieces):
        kind = "float" if size == 1 else f"<{size} x float>"
        at = "%p" if first == 0 else f"%kiln.ps1.p{first}"
        # (a piece at byte offset 4 * first is aligned to what that offset keeps of 32)
        assert store.startswith(f"store {kind} ") and f"ptr {at}, align {np.gcd(32, 4 * first) if first else 32}" \
            in store
    assert text.startswith("  %kiln.ps1")  # ("tail call" replaced whole, indentation kept)


@pytest.mark.parametrize("mask", [
    "i1 true, i1 false, i1 true, i1 false, i1 true, i1 false, i1 true, i1 false",  # not a prefix
    _mask(8), "i1 false, " * 7 + "i1 false",  # every lane or none: not what the loop vectorizer leaves
])
def test_other_masks_stay_masked(mask):
    text, rewritten = split_prefix_masked_stores(LLVM22.format(mask))
    assert rewritten == 0 and text == LLVM22.format(mask)


def test_older_llvm_alignment_operand_and_a_run_time_mask():
    old = ("call void @llvm.masked.store.v4i32.p0(<4 x i32> %x, ptr %q, i32 4, <4 x i1> "
           "<i1 true, i1 true, i1 true, i1 false>), !tbaa !3")
    text, rewritten = split_prefix_masked_stores(old)
    assert rewritten == 1 and "store <2 x i32> %kiln.ps1.v0, ptr %q, align 4" in text
    assert "store i32 %kiln.ps1.v2, ptr %kiln.ps1.p2, align 4" in text
    runtime = "call void @llvm.masked.store.v8f32.p0(<8 x float> %v, ptr align 4 %p, <8 x i1> %m)"
    assert split_prefix_masked_stores(runtime) == (runtime, 0)


@pytest.mark.parametrize("target", X86_TARGETS)
def test_an_avx2_conv_writes_its_six_pixel_columns_without_vmaskmovps(target, executor):
    """A 3-channel stem conv (tiles of 6 pixels on AVX2, whose columns were masked stores):
    AVX2 code has no vmaskmovps store left, AVX-512 code keeps its cheap masked stores."""
    from tests.conftest import build_and_compare_for
    from tests.isa import kernel_assembly
    from tests.test_conv_paths import _conv_model
    model = _conv_model("Conv", (1, 3, 50, 50), (32, 3, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]})
    asm = kernel_assembly(build_and_compare_for(model, executor, target))
    # (AT&T operand order: a store's memory operand comes last, after two registers)
    masked_stores = re.findall(r"vmaskmovps\s+%ymm\d+, %ymm\d+, [-\w]*\(", asm)
    if lanes(target) == 8:
        assert not masked_stores
    else:
        assert "{%k" in asm  # (AVX-512's masked stores stay)
