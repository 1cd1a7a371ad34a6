"""Paged KV cache: torch-free block accounting plus the one KV tensor per worker."""
