"""The mlx backend: GGUF models through MLX and mlx-lm (Apple GPU, or the CPU elsewhere).

Importing this package needs ``mlx`` and ``mlx-lm``; without them the import
fails and the backend registry reports ``pip install 'localinfer[mlx]'``.
"""

try:
    import mlx.core  # noqa: F401
    import mlx_lm  # noqa: F401
except ImportError as exc:
    raise ImportError(f"mlx and mlx-lm are not installed ({exc})") from exc

from localinfer.backends.mlx.engine import MLXEngine

__all__ = ["MLXEngine"]
