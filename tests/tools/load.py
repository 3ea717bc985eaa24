"""Load a script from tools/ (not a package) as a module."""

import importlib.util
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    # Registered so that pickle finds its functions by name (the multiprocessing workers).
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
