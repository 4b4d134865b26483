"""A batch manifest: the models of a `kiln build-many --manifest batch.yaml`, each with its own
shapes, dims, target and output folder.

    target: x86-64-v3            # defaults for every model: target, opt_level, shapes, dims, precision
    models:
      - model: models/resnet50.onnx          # a path relative to the manifest's folder
        output: resnet50                     # its bundle's folder under -o (default: the file's stem)
        shapes: {x: [1, 3, 224, 224]}
      - model: models/bert.onnx
        dims: {batch: [1, 8], seq: [1, 512]}
        target: llvm

YAML (JSON is YAML too). Every mistake is an error naming the file and line: an unknown key,
a value of the wrong kind, a missing model, two models with one output folder.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..ir.errors import KilnError
from .options import PRECISIONS

_SETTINGS = ("target", "opt_level", "shapes", "dims", "precision")
_MODEL_KEYS = ("model", "output", *_SETTINGS)


@dataclass(frozen=True)
class BatchEntry:
    """One model of a batch and the settings it has apart from the batch's (None: the batch's)."""
    model: object  # a path, bytes or an onnx.ModelProto
    target: object = None
    opt_level: int | None = None
    shapes: dict | None = None
    dims: dict | None = None
    precision: str | None = None  # "fp32" or "bf16" (orchestrator/options.py)
    output: str | None = None  # the bundle's folder name under the batch's output folder


class ManifestError(KilnError):
    pass


def _where(path: str, node) -> str:
    return f"{path}:{node.start_mark.line + 1}"


def _check_shapes(value, node, path):
    if not isinstance(value, dict) or not all(
            isinstance(dims, list) and all(isinstance(d, (int, str)) and not isinstance(d, bool) for d in dims)
            for dims in value.values()):
        raise ManifestError(f"{_where(path, node)}: shapes maps each input to a list of sizes "
                            f"(numbers, or names for symbolic dims): {{x: [1, 3, 224, 224]}}")
    return {str(k): list(v) for k, v in value.items()}


def _check_dims(value, node, path):
    def bounds(v):
        return isinstance(v, list) and len(v) == 2 and all(isinstance(b, int) and not isinstance(b, bool) for b in v)
    if not isinstance(value, dict) or not all(bounds(v) for v in value.values()):
        raise ManifestError(f"{_where(path, node)}: dims maps each symbol to its [least, greatest]: "
                            "{batch: [1, 8]}")
    return {str(k): tuple(v) for k, v in value.items()}


def _check_setting(key, value, node, path):
    if key == "target" and not isinstance(value, str):
        raise ManifestError(f"{_where(path, node)}: target is a target string or preset name")
    if key == "opt_level" and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 3):
        raise ManifestError(f"{_where(path, node)}: opt_level is 0, 1, 2 or 3, not {value!r}")
    if key == "shapes":
        return _check_shapes(value, node, path)
    if key == "dims":
        return _check_dims(value, node, path)
    if key == "precision" and value not in PRECISIONS:
        raise ManifestError(f"{_where(path, node)}: precision {value!r} is not supported "
                            f"(supported: {', '.join(PRECISIONS)})")
    return value


def _mapping(node, path: str, allowed: tuple, what: str) -> dict:
    """{key: (value node, python value)} of a YAML mapping, its keys checked against `allowed`."""
    import yaml
    if not isinstance(node, yaml.MappingNode):
        raise ManifestError(f"{_where(path, node)}: {what} is a mapping of {', '.join(allowed)}")
    out = {}
    for key_node, value_node in node.value:
        key = key_node.value
        if key not in allowed:
            raise ManifestError(f"{_where(path, key_node)}: unknown key '{key}' in {what} "
                                f"(expected one of: {', '.join(allowed)})")
        if key in out:
            raise ManifestError(f"{_where(path, key_node)}: '{key}' given twice in {what}")
        out[key] = (value_node, yaml.SafeLoader("").construct_object(value_node, deep=True))
    return out


def read_manifest(path: str) -> list[BatchEntry]:
    """The entries of the manifest at `path`, the batch's defaults applied to each."""
    import yaml
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ManifestError(f"batch manifest '{path}' cannot be read: {e.strerror or e}") from None
    try:
        root = yaml.compose(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise ManifestError(f"{path}:{mark.line + 1 if mark else '?'}: not valid YAML: {e.problem}") from None
    if root is None:
        raise ManifestError(f"{path}: the manifest is empty: it lists its models under 'models:'")
    top = _mapping(root, path, ("models", *_SETTINGS), "the manifest")
    if "models" not in top:
        raise ManifestError(f"{_where(path, root)}: the manifest lists its models under 'models:'")
    defaults = {k: _check_setting(k, v, n, path) for k, (n, v) in top.items() if k != "models"}
    models_node = top["models"][0]
    if not isinstance(models_node, yaml.SequenceNode) or not models_node.value:
        raise ManifestError(f"{_where(path, models_node)}: models is a list of entries, each with a 'model:'")
    folder = os.path.dirname(os.path.abspath(path))
    entries, outputs = [], {}
    for item in models_node.value:
        fields = _mapping(item, path, _MODEL_KEYS, "a model's entry")
        if "model" not in fields or not isinstance(fields["model"][1], str):
            raise ManifestError(f"{_where(path, item)}: each entry names its model file: 'model: path/to/model.onnx'")
        settings = {**defaults, **{k: _check_setting(k, v, n, path) for k, (n, v) in fields.items()
                                   if k in _SETTINGS}}
        model = os.path.join(folder, fields["model"][1])
        output = fields["output"][1] if "output" in fields else os.path.splitext(os.path.basename(model))[0]
        if not isinstance(output, str) or not output or os.sep in output or output in (".", ".."):
            raise ManifestError(f"{_where(path, fields['output'][0])}: output is a folder name, not {output!r}")
        if output in outputs:
            raise ManifestError(f"{_where(path, item)}: output '{output}' is also model {outputs[output]}'s "
                                "(give each an output of its own)")
        outputs[output] = len(entries) + 1
        entries.append(BatchEntry(model, output=output, **settings))
    return entries
