"""Test doubles that run for real: a scripted OpenAI-compatible chat server and its tokenizer."""
