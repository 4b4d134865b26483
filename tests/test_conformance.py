"""onnx's own node test cases for every op Kiln claims: each ends exactly as
tests/conformance_expected.json says (pass, bounded, frozen, or rejected with a KilnError naming the
unsupported dtype/attribute/dynamic input) - never a wrong result or a crash. Run
`python -m tests.conformance` for the counts quoted in the README."""
import collections

import pytest

from tests.conformance import claimed_cases, expected_outcomes, run_case

CASES = claimed_cases()
EXPECTED = expected_outcomes()


def test_the_table_covers_exactly_the_claimed_cases():
    assert sorted(EXPECTED) == sorted(CASES)
    assert "fail" not in EXPECTED.values()


@pytest.mark.parametrize("name", sorted(CASES))
def test_node_case(name, executor):
    """Each case ends exactly as the committed table says: a case that regresses from pass
    to rejected (or from rejected to a wrong result) is a failure."""
    outcome, detail = run_case(CASES[name], executor)
    assert outcome == EXPECTED.get(name), f"{name}: {outcome} (expected {EXPECTED.get(name)}): {detail}"


def test_every_claimed_op_passes_some_case(executor):
    from modelkiln.ir.ops import SUPPORTED_OPS
    passing = collections.defaultdict(int)
    with_cases = set()
    for name, case in CASES.items():
        ops = {n.op_type for n in case.model.graph.node}
        if len(ops) != 1:
            continue
        op = ops.pop()
        with_cases.add(op)
        if op not in passing and run_case(case, executor)[0] in ("pass", "bounded", "frozen"):
            passing[op] += 1
    missing = sorted(op for op in with_cases if op in SUPPORTED_OPS and not passing[op])
    assert not missing, f"claimed ops with no passing onnx case: {missing}"
