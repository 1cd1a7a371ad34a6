"""Model loading (GGUF, Hugging Face folders), the tokenizer and the forward pass."""
