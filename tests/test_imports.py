"""Imports point one way: the loader's package (artifacts) needs nothing of the compiler
(ir), and no module imports, however lazily, a module that imports it back."""
import ast
import os

from tests.conftest import ROOT

PACKAGES = ("orchestrator", "ir", "codegen_worker", "artifacts", "configs")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[:-9] if rel.endswith(".__init__") else rel


def import_graph() -> dict:
    """module -> the Kiln modules it imports anywhere in its body (lazy imports included)."""
    modules = {}
    for top in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    modules[_module_name(os.path.join(folder, f))] = os.path.join(folder, f)
    graph = {}
    for name, path in modules.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
                # `from pkg import name`: the submodule pkg.name if there is one, else pkg itself
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def test_artifacts_imports_nothing_from_the_compiler():
    graph = import_graph()
    bad = {m: sorted(d for d in deps if d.split(".")[0] != "artifacts") for m, deps in graph.items()
           if m.split(".")[0] == "artifacts"}
    assert not any(bad.values()), bad


def test_no_import_cycle():
    graph = import_graph()
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_each_op_is_named_in_one_source_file():
    """One definition per operator: its ONNX name (as a string) stands in its family module
    only, so adding or changing an op is one place, not five."""
    from modelkiln.ir.ops import SUPPORTED_OPS
    sources = {}
    for top in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            sources.update({os.path.join(folder, f): open(os.path.join(folder, f)).read()
                            for f in files if f.endswith(".py")})
    # (An op of another domain is registered as "domain.Op": named so, or by its bare name.)
    names = {op: {f'"{op}"', f'"{op.rpartition(".")[2]}"'} for op in SUPPORTED_OPS}
    spread = {op: sorted(os.path.relpath(p, ROOT) for p, text in sources.items() if any(n in text for n in names[op]))
              for op in SUPPORTED_OPS}
    assert {op: files for op, files in spread.items() if len(files) != 1} == {}
