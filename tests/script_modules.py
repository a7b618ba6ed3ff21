"""Scripts of ``scripts/`` imported by the tests: they are files, not a package."""

import importlib.util
import re
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(relpath: str):
    """``scripts/<relpath>`` as a module named after its file, registered in ``sys.modules`` under that name
    (so what it imports by that name, and pickling, find it); loaded once per process."""
    path = SCRIPTS / relpath
    module = sys.modules.get(path.stem)
    if module is not None and getattr(module, "__file__", None) == str(path):
        return module
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def shell_function(relpath: str, name: str) -> str:
    """The definition of function ``name`` in the bash script ``scripts/<relpath>``, to be run in bash by a test."""
    m = re.search(rf"^{name}\(\) {{.*?^}}$", (SCRIPTS / relpath).read_text(), re.S | re.M)
    assert m, f"{relpath} has no function {name}()"
    return m.group(0)
