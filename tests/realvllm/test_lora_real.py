"""LoRA adapters through the gateway, on the real vLLM pair (CPU, NIXL): both engines load the tiny
adapter ``adpA`` at start and may load others at run time (conftest.py).

- Direct and P/D answers for an adapter equal one engine's greedy answer for it, and differ from the
  base model's: NIXL carries an adapter's KV as it carries the base model's, as long as both legs
  name the same adapter (vLLM 0.32's NixlConnector has no LoRA field; research in docs/adapters.md).
- The second turn's ``cached_tokens`` equal the gateway's belief for that adapter, and the same
  prompt under the base model hits nothing: the block hashes carry (name, path).
- Dynamic loading puts an adapter the engines lack on the engines the gateway chose, and only there.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.promtext import sample

from . import engines as E
from .conftest import ADAPTER, LOADABLE, THRESHOLD, Gateway, Pair, start_gateway
from .test_real_vllm import chat_messages

TOKEN = "realvllm-lora-admin"
SAMPLING = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def gw(vllm_pair: Pair) -> Iterator[Gateway]:
    token_file = vllm_pair.group.log_dir / "lora-admin-token"
    token_file.write_text(TOKEN)
    model = {
        "name": E.MODEL_NAME,
        "tokenizer": str(vllm_pair.model_dir),
        "max_model_len": E.MAX_MODEL_LEN,
        "adapters": [{"name": LOADABLE, "path": str(vllm_pair.adapters[LOADABLE])}],
    }
    gw = start_gateway(
        vllm_pair,
        "gateway-lora",
        models=[model],
        routing={"decider": {"name": "token_threshold", "threshold": THRESHOLD}},  # prefix index on, learned
        admin={"token_file": str(token_file)},
        lora={"dynamic_loading": True, "refresh_s": 1.0},
        signals={"scrape_interval_s": 0.5, "scrape_timeout_s": 2.0, "max_age_s": 5.0},
    )
    try:
        yield gw
    finally:
        gw.proc.stop()
        for eng in (vllm_pair.prefill, vllm_pair.decode):  # the next module finds the engines as they started
            httpx.post(eng.url + "/v1/unload_lora_adapter", json={"lora_name": LOADABLE}, timeout=30)


def chat(url: str, model: str, messages: list[dict]) -> httpx.Response:
    body = {"model": model, "messages": messages, **SAMPLING}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=E.REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r


def text(r: httpx.Response) -> str:
    return r.json()["choices"][0]["message"]["content"]


def plan(gw: Gateway, model: str, messages: list[dict]) -> dict:
    r = httpx.post(
        gw.url + "/debug/route",
        json={"model": model, "messages": messages},
        headers={"authorization": f"Bearer {TOKEN}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()


def listed(eng: E.Engine) -> set[str]:
    return {m["id"] for m in httpx.get(eng.url + "/v1/models", timeout=10).json()["data"]}


@pytest.mark.parametrize(("tokens", "path"), [(THRESHOLD + 200, "pd"), (THRESHOLD // 4, "direct")])
def test_an_adapters_answer_is_one_engines_greedy_answer_for_it_on_either_path(vllm_pair, gw, tokens, path):
    messages = chat_messages(vllm_pair, tokens)
    reference = text(chat(vllm_pair.prefill.url, ADAPTER, messages))  # one engine, prefill and decode
    base = text(chat(vllm_pair.prefill.url, E.MODEL_NAME, messages))
    r = chat(gw.url, ADAPTER, messages)
    assert r.headers["x-pdgate-path"] == path
    assert r.json()["model"] == ADAPTER
    assert text(r) == reference and reference != base


def test_the_second_turn_hits_the_adapters_cache_as_believed_and_never_the_base_models(vllm_pair, gw):
    messages = chat_messages(vllm_pair, THRESHOLD + 300)
    messages[0]["content"] = "Adapter cache case. " + messages[0]["content"]
    assert chat(gw.url, ADAPTER, messages).headers["x-pdgate-path"] == "pd"
    believed = plan(gw, ADAPTER, messages)
    d = vllm_pair.decode.url
    assert believed["decode"] == d and believed["cached_tokens"].get(d, 0) > THRESHOLD, believed
    r = chat(gw.url, ADAPTER, messages)  # the same prompt again: direct, from the decode engine's cache
    assert r.headers["x-pdgate-path"] == "direct"
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == believed["cached_tokens"][d]
    assert plan(gw, E.MODEL_NAME, messages)["cached_tokens"].get(d, 0) == 0  # not the base model's
    base = chat(d, E.MODEL_NAME, messages).json()["usage"]  # and the engine agrees
    assert (base.get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0


def test_dynamic_loading_puts_the_adapter_on_the_engines_the_gateway_chose(vllm_pair, gw):
    p, d = vllm_pair.prefill, vllm_pair.decode
    assert LOADABLE not in listed(p) | listed(d)
    short = chat_messages(vllm_pair, THRESHOLD // 4)
    r = chat(gw.url, LOADABLE, short)  # direct: the decode engine alone loads it
    assert r.headers["x-pdgate-path"] == "direct"
    assert LOADABLE in listed(d) and LOADABLE not in listed(p)
    assert text(r) != text(chat(d.url, ADAPTER, short))  # its own weights
    long = chat_messages(vllm_pair, THRESHOLD + 100)
    assert chat(gw.url, LOADABLE, long).headers["x-pdgate-path"] == "pd"  # the prefill engine loads it too
    assert LOADABLE in listed(p)
    metrics = httpx.get(gw.url + "/metrics", timeout=10).text
    assert sample(metrics, "pdgate_adapter_loads_total", result="ok") == 2
    unknown = httpx.post(
        gw.url + "/v1/chat/completions", json={"model": "adpZ", "messages": short, **SAMPLING}, timeout=30
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
