"""Named target presets: one JSON file per preset, each with a target string and LLVM options."""
import json
import os

_DIR = os.path.dirname(__file__)


def preset_names() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(_DIR) if f.endswith(".json"))


def load_preset(name: str) -> dict | None:
    path = os.path.join(_DIR, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
