"""One parser per tool-call format: the model's output text in, content and tool-call
fragments out (feed(text) as it streams, finish() at the end)."""
