"""Picking a step's tokens: the processors and cuts logits go through, the draw, and the
logprobs requests ask for (sampler.py, with its parts beside it)."""
