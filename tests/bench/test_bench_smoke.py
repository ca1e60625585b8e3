"""Smoke tests of the bench scripts: each runs with --smoke (a CI-sized --quick) and writes JSON of its documented
schema; report.py turns them into REPORT.md. Nothing here asserts a speed."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("results")


def run(name: str, results: Path, *extra: str) -> dict:
    out = results / f"{name}.json"
    assert load(name).main(["--smoke", *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def positive(x: object) -> bool:
    return isinstance(x, (int, float)) and x > 0


def test_kv_dtype_concurrency(results: Path) -> None:
    r = run("kv_dtype_concurrency", results)
    b = r["budget"]
    # one byte budget; FP8 pages are about half as big, so FP8 gets about twice the pages and admits more
    assert b["num_decode_pages"]["fp8"] > 1.8 * b["num_decode_pages"]["bf16"] - 2
    for d in ("bf16", "fp8"):
        assert b["num_decode_pages"][d] * b["page_bytes"][d] <= b["bytes"]
    admits = b["max_concurrency_admitted"]
    top = max(r["spec"]["concurrency"])
    assert admits["bf16"] < top <= admits["fp8"]
    assert [row["concurrency"] for row in r["rows"]] == list(r["spec"]["concurrency"])
    last = r["rows"][-1]
    assert last["bf16"]["status"] == "out of memory" and last["bf16"]["tokens_per_s"] is None
    assert positive(last["bf16"]["over_budget_run"]["tokens_per_s"])
    for row in r["rows"]:
        for d in ("bf16", "fp8"):
            if row[d]["status"] == "ok":
                assert positive(row[d]["tokens_per_s"]) and len(row[d]["runs"]) == r["spec"]["reps"]
                assert row[d]["preemptions"] == 0 and row[d]["peak_decoding"] == row["concurrency"]
    assert positive(r["peak_ratio_fp8_over_bf16"]) and r["machine"]["cores"] >= 1


def test_roofline(results: Path) -> None:
    r = run("roofline", results)
    bw = r["bandwidth_bytes_per_s"]
    assert positive(bw["reduce_read"]) and positive(bw["copy_read_write"])
    for row in r["tiny"]["rows"]:
        assert row["activated"]["total"] <= row["all"]["total"]
        assert positive(row["program_s"]) and positive(row["activated"]["bound_s"])
        # the compiled program's roofline (what bench/gpu.sh prints first): a bound at least the bytes' minimum
        p = row["predicted"]
        assert positive(p["traffic_bytes"]["outside"]) and p["predicted_s"] >= p["minimum_s"] > 0
        assert row["measured_over_predicted"] == pytest.approx(row["program_s"] / p["predicted_s"])
    k = {(x["kv_dtype"], x["weights"], x["batch"]): x for x in r["kimi_k2.6"]["rows"]}
    # INT4 experts read fewer bytes than FP8, FP8 than BF16; FP8 KV fewer than BF16 KV
    assert k["fp8", "int4", 8]["activated"]["total"] < k["fp8", "fp8", 8]["activated"]["total"] \
        < k["fp8", "bf16", 8]["activated"]["total"] < k["bf16", "bf16", 8]["activated"]["total"]
    assert positive(k["fp8", "int4", 1]["seeds_step_over_8xH200_bound"])


@pytest.mark.slow  # a peer bench's smoke run: 34 s of CI for a script the results file already records
def test_peer_transformers(results: Path) -> None:
    r = run("peer_transformers", results)
    assert [row["concurrency"] for row in r["rows"]] == [1, 2]
    for row in r["rows"]:
        assert positive(row["tokens_per_s"]["hf"]) and positive(row["tokens_per_s"]["f32"])
        a = row["agreement_vs_hf"]["f32"]
        assert a["rows"] == row["concurrency"] and 0 <= a["token_match"] <= 1
    lc = r["llama_cpp"]  # optional peer (`make peers`): measured and compared when installed, else recorded absent
    for row in r["rows"]:
        if lc["status"] == "ok":
            assert positive(row["tokens_per_s"]["llama.cpp"]) and positive(row["llama_cpp_over_hf"])
            a = row["agreement_vs_hf"]["llama.cpp"]
            assert a["rows"] == row["concurrency"] and 0 <= a["token_match"] <= 1
            assert lc["context_params"][str(row["concurrency"])]["n_seq_max"] == row["concurrency"]
        else:
            assert "llama.cpp" not in row["tokens_per_s"] and row["llama_cpp_over_hf"] == lc["status"]
    pf = r["prefill"]
    assert [row["prompt_len"] for row in pf["rows"]] == list(r["spec"]["prefill_lengths"])
    assert all(positive(row["tokens_per_s"]) for row in pf["rows"]) and positive(pf["longest_over_shortest"])


def test_serving(results: Path) -> None:
    r = run("serving", results)
    s = r["summary"]
    assert s["planned"] == r["spec"]["num_requests"] and s["errors"] == 0 and s["completed"] == s["planned"]
    assert positive(s["output_tokens_per_s"]) and positive(s["request_throughput_per_s"])
    for k in ("ttft", "itl", "tpot", "e2e_latency"):
        assert set(s[k]) == {"mean_ms", "p50_ms", "p95_ms", "p99_ms"}
        assert s[k]["p50_ms"] <= s[k]["p95_ms"] <= s[k]["p99_ms"]
    assert r["health_after"]["status"] == "ok"


def test_report(results: Path) -> None:
    out = results / "REPORT.md"
    assert load("report").main(["--results", str(results), "--out", str(out)]) == 0
    text = out.read_text()
    assert "## Machine" in text and "What the CPU numbers" in text
    wanted = {"kv_dtype_concurrency.json": "FP8 vs BF16 KV", "roofline.json": "Decode roofline",
              "serving.json": "HTTP serving", "peer_transformers.json": "Peer: transformers"}
    for fname, title in wanted.items():  # the benches above that ran (this test may run alone) get a section
        assert (title in text) == (results / fname).exists()
    assert "unexpected schema" not in text


EMBEDDED = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-kimi"


@pytest.mark.skipif(not (EMBEDDED / "jaxserve.json").exists(), reason="checkpoints/tiny-kimi not present")
def test_flop_bounds(results: Path) -> None:
    """The parameter-tree FLOP count equals a count by hand from the config, and each bound and 'needs' rate solves
    the cost model it states (F + A c per decode row; prefill tokens over their causal pairs)."""
    from jaxserve.checkpoint import load_config

    out = results / "flop_bounds.json"
    assert load("flop_bounds").main(["--checkpoint", str(EMBEDDED), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    c = load_config(EMBEDDED)
    h, n = c.hidden_size, c.num_heads
    attn = (h * c.q_lora_rank + c.q_lora_rank * n * (c.qk_nope_head_dim + c.qk_rope_head_dim)
            + h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * n * (c.qk_nope_head_dim + c.v_head_dim)
            + n * c.v_head_dim * h)
    dense = 3 * h * c.intermediate_size
    moe = 3 * h * c.moe_intermediate_size * (c.num_experts_per_tok + c.n_shared_experts) + h * c.n_routed_experts
    n_dense = c.mlp_layer_types.count("dense")
    f = 2 * (c.num_layers * attn + n_dense * dense + (c.num_layers - n_dense) * moe + h * c.vocab_size)
    assert r["matmul_flops_per_token"] == {"all": f, "lm_head": 2 * h * c.vocab_size}
    b = r["bounds"]["absorbed"]
    a = c.num_layers * n * (4 * c.kv_lora_rank + 2 * c.qk_rope_head_dim)
    assert b["attention_flops_per_pair"] == a
    assert b["decode_step_ratio"] == pytest.approx((f + 2000 * a) / (f + 1030 * a))
    rate = b["decode_goal_needs_attention_rate_at_most"]  # attention that slow gives exactly the goal
    assert (f + 2000 * a / rate) / (f + 1030 * a / rate) == pytest.approx(1.5)
    rate, fp, head = b["prefill_goal_needs_attention_rate_at_least"], f - 2 * h * c.vocab_size, 2 * h * c.vocab_size
    per_token = lambda t: fp + head / t + a * (t + 1) / 2 / rate  # noqa: E731
    assert per_token(256) / per_token(2000) == pytest.approx(0.8)
    assert "context goals allow" in load("report").build(results)
