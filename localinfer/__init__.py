"""localinfer: plan and run GGUF language models on the machines people own."""

__version__ = "0.1.0"
