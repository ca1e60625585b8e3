"""Training of the embedded model and its tokenizer (not part of the runtime package)."""
