"""Model file formats: GGUF (header, tensor index, names) and safetensors, and weights
renamed or cut into the parts a decoder loads."""
