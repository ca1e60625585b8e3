"""The shipped checkpoints/tiny-kimi: held-out perplexity as recorded, and greedy code completion that makes sense."""
from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from tools.train_tiny import heldout_subset_perplexity
from jaxserve.models import forward
from jaxserve.tokenizer import Tokenizer

CKPT = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-kimi"
pytestmark = pytest.mark.skipif(not (CKPT / "jaxserve.json").exists(), reason="checkpoints/tiny-kimi not present")


@pytest.fixture(scope="module")
def loaded():
    cfg, model = jaxserve.load(CKPT)
    return cfg, model, Tokenizer(CKPT)


def test_subset_perplexity_as_recorded(loaded):
    _, model, tokenizer = loaded
    rec = json.loads((CKPT / "eval.json").read_text())
    sub = rec["subset"]
    ppl = heldout_subset_perplexity(model, tokenizer, sub["n_tokens"], sub["window"])
    assert ppl <= rec["subset_ppl"] * 1.05
    assert ppl < 100  # far below the 4096-way uniform guess: the model has learned Python


def greedy(model, prompt_ids: list[int], n_new: int, width: int = 64) -> list[int]:
    """Greedy decoding by full-sequence forwards over one fixed [1, width] shape (right padding is causal-safe)."""
    ids = list(prompt_ids)
    for _ in range(n_new):
        buf = np.zeros((1, width), np.int32)
        buf[0, :len(ids)] = ids
        logits = forward(model, jnp.asarray(buf), lengths=jnp.asarray([len(ids)], jnp.int32))
        ids.append(int(jnp.argmax(logits[0, len(ids) - 1])))
    return ids


def test_greedy_completion_of_def(loaded):
    _, model, tokenizer = loaded
    prompt = tokenizer.encode("def ")
    ids = greedy(model, prompt, 40)
    text = tokenizer.decode(ids)
    assert text.startswith("def ")
    assert "(" in text and ":" in text, text
    assert tokenizer.encode(tokenizer.decode(ids, skip_special_tokens=True))  # the text re-tokenizes
