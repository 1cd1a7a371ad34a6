"""What a chat turn means beyond its text: the tools a request offers (described in the
prompt, constrained when a call is required), and the model's output read back as
content, reasoning and tool calls. Pure Python: no torch."""
