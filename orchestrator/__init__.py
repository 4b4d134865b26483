"""Kiln's driver: targets, compile jobs, executors, the build API and the CLI.

The build API lives in `orchestrator.api`; its public names are re-exported here lazily
(importing the package must stay cheap for the CLI). No public name here is also the name
of a submodule: importing the submodule would replace the function on the package.
"""
_API = ("build", "build_many", "optimize", "BuildResult", "BatchResult", "ModelFailure", "BatchEntry", "BuildError")


def __getattr__(name):
    if name in _API:
        from . import api
        return getattr(api, name)
    if name == "tune":
        from .tuner import tune
        return tune
    raise AttributeError(f"module '{__name__}' has no attribute '{name}'")


def __dir__():
    return sorted(list(globals()) + list(_API) + ["tune"])
