"""/v1/completions' lm-evaluation-harness path through the `openai` client: `echo` with `logprobs` returns the
prompt tokens' logprobs (computed by the prefill) before the generated ones, `max_tokens` 0 scores only, `prompt`
may be a batch (one choice per prompt, n each, in order; usage sums the prompts). Checked against the full-sequence
forward of an f32 model (chunked prompts, prefix-cache hits) and, on the embedded model, by ranking the true
continuations of held-out snippets against swapped ones."""
from __future__ import annotations

from pathlib import Path

import httpx2 as httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from test_server import MODEL, TIMEOUT, Served, serve, tiny_model, tokenizer, wait_idle
from jaxserve.engine import Engine, EngineConfig
from jaxserve.eval import quality
from jaxserve.models import forward

TOL = 1e-4  # f32 weights and KV pools: the paged prefill and the plain forward differ in summation order only
CKPT = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-kimi"


@pytest.fixture(scope="module")
def srv():
    cfg = EngineConfig(kv_dtype="f32", prefill_weights="f32", decode_weights="f32", dtype="float32", page_size=8,
                       num_decode_pages=128, num_prefill_pages=128, max_batch=8, max_prefill_tokens=64,
                       prefill_chunk=32, max_model_len=256)
    served = serve(Engine(tiny_model(), cfg, tokenizer()))
    yield served
    served.close()


def reference(prompt: list[int]) -> np.ndarray:
    """[len, V] f32: log-softmax of the full-sequence forward, row t the distribution after prompt[:t + 1]."""
    logits = forward(tiny_model(), jnp.asarray([prompt], jnp.int32))
    return np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))


def check_choice(choice, prompt: list[int], generated: int) -> None:
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(prompt) + generated and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    ref = reference(prompt)
    got = np.array(lp.token_logprobs[1:len(prompt)], np.float64)
    want = ref[np.arange(len(prompt) - 1), prompt[1:]]
    assert np.abs(got - want).max() < TOL, np.abs(got - want).max()
    for t in range(1, len(prompt)):  # logprobs=1: the most likely next token's logprob
        assert abs(max(lp.top_logprobs[t].values()) - ref[t - 1].max()) < TOL
    tok = tokenizer()
    assert lp.tokens[:len(prompt)] == [tok.decode([t]) for t in prompt]
    assert choice.text.startswith(tok.decode(prompt))
    assert lp.text_offset[0] == 0 and all(b >= a for a, b in zip(lp.text_offset, lp.text_offset[1:]))


def test_batched_token_prompts_echo_logprobs_match_the_forward(srv: Served):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 4000, n).tolist() for n in (80, 20, 45)]  # 80 > prefill_chunk: three chunks
    client = srv.client()
    for max_tokens in (1, 0):
        r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=max_tokens, logprobs=1, echo=True,
                                      temperature=0)
        assert [c.index for c in r.choices] == [0, 1, 2]
        for c, p in zip(r.choices, prompts):
            check_choice(c, p, max_tokens)
            assert c.finish_reason == "length"
        assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 3 * max_tokens
        print(f"max_tokens={max_tokens}: cached tokens {r.usage.prompt_tokens_details.cached_tokens}")
    # the plain requests above filled the prefix cache; a scoring request recomputes and gets the same values
    hit = client.completions.create(model=MODEL, prompt=prompts[0] + [5], max_tokens=1, temperature=0)
    assert hit.usage.prompt_tokens_details.cached_tokens > 0
    again = client.completions.create(model=MODEL, prompt=[prompts[0] + [5]], max_tokens=1, logprobs=1, echo=True,
                                      temperature=0)
    check_choice(again.choices[0], prompts[0] + [5], 1)
    wait_idle(srv.engine)


def test_n_choices_per_prompt_in_openai_order_and_string_prompts(srv: Served):
    prompts = ["def add(a, b):\n", "import os\n"]
    r = srv.client().completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=3, echo=True,
                                        temperature=1.0, seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c, p in zip(r.choices, [prompts[0]] * 2 + [prompts[1]] * 2):
        assert c.text.startswith(p) and c.logprobs is None
    tok = tokenizer()
    assert r.usage.prompt_tokens == sum(len(tok.encode(p, special_tokens=False)) for p in prompts)
    # echo without generating: the prompt text alone
    r0 = srv.client().completions.create(model=MODEL, prompt="x = 1\n", max_tokens=0, echo=True)
    assert r0.choices[0].text == "x = 1\n" and r0.usage.completion_tokens == 0
    wait_idle(srv.engine)


def test_echo_refusals(srv: Served):
    client = srv.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", echo=True, stream=True, max_tokens=1)
    assert e.value.param == "echo" and "stream" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert e.value.param == "max_tokens"
    # the raw lm-eval body, as its local-completions model sends it
    body = {"model": MODEL, "prompt": [[5, 6, 7, 8]], "max_tokens": 1, "logprobs": 1, "echo": True,
            "temperature": 0, "seed": 1234}
    r = httpx.post(f"{srv.base}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["token_logprobs"][0] is None


@pytest.mark.skipif(not (CKPT / "jaxserve.json").exists(), reason="checkpoints/tiny-kimi not present")
def test_embedded_model_ranks_true_continuations_of_heldout_snippets():
    """20 held-out snippets (64-token windows of the held-out stream): context 48 tokens; the true 16-token
    continuation against the next snippet's, scored as lm-eval's loglikelihood does (one batched request).
    Measured (f32, deterministic on CPU): the true continuation wins 16/20 (chance: 10; mean total logprob -62.8 vs
    -76.2 for the swapped ones); the bound keeps one of
    margin. The scores themselves are checked exactly against the forward above: this checks they mean something."""
    engine = Engine.from_checkpoint(CKPT, EngineConfig(kv_dtype="f32", prefill_weights="f32", decode_weights="f32",
                                                       dtype="float32", page_size=16, num_decode_pages=128,
                                                       num_prefill_pages=128, max_batch=8, max_prefill_tokens=256,
                                                       prefill_chunk=64, max_model_len=256))
    served = serve(engine)
    try:
        w = quality.make_windows(quality.heldout_tokens(engine.tokenizer, 20 * 65), 64)[:, :64].tolist()
        ctx, cont = [x[:48] for x in w], [x[48:] for x in w]
        wrong = cont[1:] + cont[:1]
        prompts = [c + t for c, t in zip(ctx, cont)] + [c + t for c, t in zip(ctx, wrong)]
        r = served.client().completions.create(model=MODEL, prompt=prompts, max_tokens=0, logprobs=1, echo=True,
                                               temperature=0)
        total = [sum(c.logprobs.token_logprobs[48:]) for c in r.choices]
        true, swapped = np.array(total[:20]), np.array(total[20:])
        wins = int((true > swapped).sum())
        print(f"true continuation wins {wins}/20; mean logprob true {true.mean():.1f}, swapped {swapped.mean():.1f}")
        assert wins >= 15
    finally:
        served.close()
