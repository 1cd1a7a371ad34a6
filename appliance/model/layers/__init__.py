"""Shared building blocks of the decoders: attention (the module and the paged op), MLP,
routed experts, norms, rotary embeddings, the decoder layer."""
