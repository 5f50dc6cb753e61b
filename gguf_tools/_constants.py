"""gguf's own constant tables, without importing the whole `gguf` package.

`import gguf` pulls in numpy, yaml and the writer/reader/vocab modules
(hundreds of ms), while the header path needs only `gguf/constants.py`.  We
execute that one file as the module ``gguf.constants`` - the same module
object a later ``import gguf`` reuses, so enum identity is shared - and set the
package attribute ``gguf.constants`` once the full package is imported.
"""

from __future__ import annotations

import importlib.util
import sys
from importlib.abc import MetaPathFinder


class _AttachConstants(MetaPathFinder):
    """One-shot finder: when `gguf` itself is imported, bind gguf.constants on it."""

    def find_spec(self, name, path=None, target=None):
        if name != "gguf":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("gguf")
        if spec is None or spec.loader is None:
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            module.constants = sys.modules["gguf.constants"]
            loader_exec(module)

        spec.loader.exec_module = exec_module
        return spec


def _load():
    if "gguf" in sys.modules or "gguf.constants" in sys.modules:
        import gguf.constants

        return gguf.constants
    spec = importlib.util.find_spec("gguf")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the `gguf` package is not installed (pip install gguf)")
    origin = next(iter(spec.submodule_search_locations)) + "/constants.py"
    cspec = importlib.util.spec_from_file_location("gguf.constants", origin)
    module = importlib.util.module_from_spec(cspec)
    sys.modules["gguf.constants"] = module
    try:
        cspec.loader.exec_module(module)
    except BaseException:
        del sys.modules["gguf.constants"]
        raise
    sys.meta_path.insert(0, _AttachConstants())
    return module


_c = _load()
GGML_QUANT_SIZES = _c.GGML_QUANT_SIZES
GGMLQuantizationType = _c.GGMLQuantizationType
GGUFValueType = _c.GGUFValueType
LlamaFileType = _c.LlamaFileType
