"""onnx's own node test cases for every op Kiln claims: each ends exactly as
tests/conformance_expected.json says (pass, bounded, frozen, or rejected with a KilnError naming the
unsupported dtype/attribute/dynamic input) - never a wrong result or a crash. Run
`python -m tests.conformance` for the counts quoted in docs/operators.md."""

import pytest

from tests.conformance import claimed_cases, expected_outcomes, run_case
from tests.conftest import shared_cache

CASES = claimed_cases()
EXPECTED = expected_outcomes()


def test_the_table_covers_exactly_the_claimed_cases():
    assert sorted(EXPECTED) == sorted(CASES)
    assert "fail" not in EXPECTED.values()


@pytest.mark.parametrize("name", sorted(CASES))
def test_node_case(name, executor):
    """Each case ends exactly as the committed table says: a case that regresses from pass
    to rejected (or from rejected to a wrong result) is a failure. (A kernel several cases
    share compiles once: tests/conftest.py, shared_cache.)"""
    outcome, detail = run_case(CASES[name], executor, shared_cache())
    assert outcome == EXPECTED.get(name), f"{name}: {outcome} (expected {EXPECTED.get(name)}): {detail}"


def _feeds_or_returns_a_sequence(model) -> bool:
    return any(vi.type.WhichOneof("value") != "tensor_type" for vi in [*model.graph.input, *model.graph.output])


def test_every_claimed_op_passes_some_case():
    """Every op Kiln claims that has a case of its own is expected to pass one. (test_node_case
    holds each case to its expected outcome, so this needs no build of its own.) Cases whose
    model takes or gives a sequence do not count: Kiln's inputs and outputs are tensors, so the
    sequence ops (SequenceInsert and SplitToSequence have no other cases) are tested inside
    models against onnxruntime and onnx's evaluator (tests/test_sequences.py)."""
    from modelkiln.ir.ops import SUPPORTED_OPS
    with_cases, passing = set(), set()
    for name, case in CASES.items():
        ops = {n.op_type for n in case.model.graph.node}
        if len(ops) != 1 or _feeds_or_returns_a_sequence(case.model):
            continue
        op = ops.pop()
        with_cases.add(op)
        if EXPECTED.get(name) in ("pass", "bounded", "frozen"):
            passing.add(op)
    missing = sorted(op for op in with_cases if op in SUPPORTED_OPS and op not in passing)
    assert not missing, f"claimed ops with no passing onnx case: {missing}"
