"""Tiny checkpoints trained in this repo: the stdlib corpus split and the tiny Kimi-style tokenizer."""
