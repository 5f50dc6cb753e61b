"""The GGUF format: bounded header reader, quant layouts, inspect summary, skeleton writer.

Depends on nothing else in this repository.
"""

from ._constants import LlamaFileType
from .errors import GGUFFormatError
from .quants import QuantLayout, all_layouts, layout, parse_type, tensor_bytes
from .reader import GGUFHeader, TensorInfo, read_header

__all__ = [
    "GGUFFormatError",
    "LlamaFileType",
    "GGUFHeader",
    "TensorInfo",
    "QuantLayout",
    "read_header",
    "layout",
    "all_layouts",
    "parse_type",
    "tensor_bytes",
]
