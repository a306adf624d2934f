"""A model on CPU: llama.cpp's ``llama-server`` on a GGUF file, published through an endpoint file."""
