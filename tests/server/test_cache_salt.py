"""`cache_salt` over HTTP (as vLLM accepts it): prefix-cache pages are shared only within one salt; a bad salt
is a 400 naming the field."""
from __future__ import annotations

import openai
import pytest

from test_server import MODEL, Served, shared_server


@pytest.fixture(scope="module")
def srv() -> Served:
    return shared_server()


PROMPT = "def salted(x):\n    return sorted(set(x), key=lambda v: (len(str(v)), v))  # a long enough prompt\n"


def cached(srv: Served, salt: str | None, endpoint: str = "completions") -> int:
    extra = {} if salt is None else {"cache_salt": salt}
    client = srv.client()
    if endpoint == "completions":
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, extra_body=extra)
    else:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                           max_completion_tokens=1, temperature=0, extra_body=extra)
    return r.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_pages_are_shared_only_within_a_salt(srv, endpoint):
    a, b = f"tenant-a-{endpoint}", f"tenant-b-{endpoint}"
    assert cached(srv, a, endpoint) == 0
    assert cached(srv, a, endpoint) > 0  # same salt: a hit
    assert cached(srv, b, endpoint) == 0  # another tenant's salt: no hit on a's pages
    assert cached(srv, None, endpoint) == 0  # unsalted: no hit on salted pages


@pytest.mark.parametrize("bad", ["", 7, "x" * 1025])
def test_bad_salt_is_400_naming_the_field(srv, bad):
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"cache_salt": bad})
    assert e.value.body["param"] == "cache_salt"
