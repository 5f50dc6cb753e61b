"""Small helpers every layer shares: atomic writes, capped reads, deadlines, a per-spec memo, timing statistics.

The sanitiser for untrusted text is ``gguf_tools.text.safe_text`` (the lowest
layer needs it too); number and size formatters are in :mod:`localinfer.units`.
"""
