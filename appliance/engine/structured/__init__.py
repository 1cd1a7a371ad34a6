"""Structured outputs by constrained decoding, on llguidance (benchmarks/results/grammar_engines.md
says why): compile.py turns a request's StructuredOutput into a grammar and checks it,
vocabulary.py gives the engine the model's tokenizer, matcher.py follows one request's
tokens through its grammar, masks.py masks a step's logits to what the grammars allow."""
