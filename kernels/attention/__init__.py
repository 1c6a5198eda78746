"""Attention over the paged KV pool: the torch backend (the native CPU kernel or torch's flash op) and Triton."""

ATTENTION_BACKENDS = ("auto", "torch", "triton")  # auto: triton on CUDA, torch elsewhere
