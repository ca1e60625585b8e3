"""reasoning_content end to end: the tiny model served with a chat template that opens `<think>` like Kimi K2.5's
thinking mode, and with one that ends the prompt `<|assistant|><think>` like GLM-5's (each written into a temp copy of
the embedded tokenizer). The random model never closes the block, so
its whole output is reasoning, the same whole and streamed; thinking off (chat_template_kwargs or
reasoning_effort) renders `<think></think>` and the output is content."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from jaxserve.engine import Engine
from jaxserve.tokenizer import Tokenizer
from test_server import MODEL, TOKENIZER, Served, engine_config, serve, tiny_model

# the relevant lines of K2.5's template: the generation prompt opens <think> unless thinking is false, and an
# earlier assistant turn's reasoning_content is rendered back inside <think>...</think>
K25_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "<think>{{ m.get('reasoning_content') or '' }}</think>{{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_user|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}")
# the relevant lines of GLM-5's template: the generation prompt ends `<|assistant|><think>`; enable_thinking false
# renders `</think>` alone (the newer GLM templates); earlier reasoning goes back inside <think>...</think>
GLM5_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}<|assistant|><think>{{ m.get('reasoning_content') or '' }}</think>"
    "{{ m['content'] }}"
    "{%- else -%}<|{{ m['role'] }}|>{{ m['content'] }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>"
    "{%- if enable_thinking is defined and enable_thinking is false -%}</think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}")
# each template with the chat_template_kwargs flag that turns its thinking off
TEMPLATES = {"k2.5": (K25_TEMPLATE, "thinking"), "glm-5": (GLM5_TEMPLATE, "enable_thinking")}
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 6, "temperature": 0,
        "extra_body": {"ignore_eos": True}}


def thinking_server(template: str) -> Served:
    folder = Path(tempfile.mkdtemp(prefix="thinking-tokenizer-"))
    shutil.copytree(TOKENIZER, folder, dirs_exist_ok=True)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return serve(Engine(tiny_model(), engine_config(), Tokenizer(folder)))


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def srv(family) -> Served:
    served = thinking_server(TEMPLATES[family][0])
    yield served
    served.close()


def test_an_unclosed_block_is_all_reasoning_whole_and_streamed(srv):
    whole = srv.client().chat.completions.create(**BODY)
    msg = whole.choices[0].message
    assert msg.reasoning_content and msg.content == "" and whole.choices[0].finish_reason == "length"
    chunks = list(srv.client().chat.completions.create(**BODY, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == msg.reasoning_content
    assert "".join(d.content or "" for d in deltas) == ""


@pytest.mark.parametrize("how", ["chat_template_kwargs", "reasoning_effort"])
def test_thinking_off_is_all_content(srv, family, how):
    flag = TEMPLATES[family][1]
    off = ({"extra_body": {"ignore_eos": True, "chat_template_kwargs": {flag: False}}} if how == "chat_template_kwargs"
           else {"reasoning_effort": "none"})
    r = srv.client().chat.completions.create(**{**BODY, **off})
    msg = r.choices[0].message
    assert msg.content and getattr(msg, "reasoning_content", None) is None


def test_earlier_reasoning_is_rendered_back(srv):
    history = [*BODY["messages"], {"role": "assistant", "content": "4", "reasoning_content": "add them"},
               {"role": "user", "content": "and 3+3?"}]
    r = srv.client().chat.completions.create(**{**BODY, "messages": history})
    rendered = srv.engine.tokenizer.apply_chat_template(history)  # the server renders the same messages
    assert "<think>add them</think>4" in rendered
    assert r.usage.prompt_tokens == len(srv.engine.tokenizer.encode_chat(history))


def test_a_thinking_budget_closes_the_block_and_the_answer_follows(srv):
    """max_thinking_tokens=3: the first 3 tokens are the reasoning (the same as an unbudgeted run's first 3), then
    the server forces `</think>` and the rest of max_tokens is content; whole and streamed agree, and every token
    (the forced ones too, with the model's logprob of them) is in logprobs."""
    first3 = srv.client().chat.completions.create(**{**BODY, "max_tokens": 3}).choices[0].message.reasoning_content
    body = {**BODY, "max_tokens": 12, "logprobs": True,
            "extra_body": {"ignore_eos": True, "max_thinking_tokens": 3}}
    whole = srv.client().chat.completions.create(**body)
    msg = whole.choices[0].message
    assert msg.reasoning_content == first3 and msg.content and whole.usage.completion_tokens == 12
    lps = whole.choices[0].logprobs.content
    assert len(lps) == 12 and all(lp.logprob <= 0 for lp in lps)
    assert "".join(lp.token for lp in lps[3:]).startswith("</think>")
    chunks = list(srv.client().chat.completions.create(**body, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == msg.reasoning_content
    assert "".join(d.content or "" for d in deltas) == msg.content


def test_a_thinking_budget_with_thinking_off_is_ignored(srv):
    off = {**BODY, "reasoning_effort": "none"}
    plain = srv.client().chat.completions.create(**off).choices[0].message
    budgeted = srv.client().chat.completions.create(
        **{**off, "extra_body": {"ignore_eos": True, "max_thinking_tokens": 2}}).choices[0].message
    assert budgeted.content == plain.content and getattr(budgeted, "reasoning_content", None) is None
