"""The settings model, its sections and the flags made from it: the only reader of the
environment."""
