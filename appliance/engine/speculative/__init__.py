"""Speculative decoding: proposers guess the next tokens, one forward pass verifies them."""
