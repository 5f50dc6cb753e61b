"""The mlx backend: GGUF models through MLX and mlx-lm (Apple GPU, or the CPU elsewhere).

``engine`` needs ``mlx`` and ``mlx-lm`` (without them the registry reports
``pip install 'localinfer[mlx]'``); ``memory`` imports neither.
"""
