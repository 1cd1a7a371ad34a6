"""llama.cpp server's own API (/completion, /props), served through the text completion
pipeline: the body and what it becomes (request.py), llama.cpp's answer shapes (reply.py),
the routes (route.py). /tokenize, /detokenize and /apply-template take its fields in
server/tokenization.py."""
