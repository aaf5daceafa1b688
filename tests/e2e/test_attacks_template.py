"""Template kwargs that configure the tokenizer (issue 27, point 4): the real gateway process in
front of a simulated engine. Before the fix, 146 bytes of ``chat_template_kwargs`` (``tokenize``,
``padding: max_length``, ``max_length: 10000000``) made the gateway pad the prompt to ten million
ids: its peak memory went from 112 MB to 1,219 MB for one request (3.5 s of work, on the event
loop for a body that small). Now such kwargs get a 400 before any work, the engine never sees the
request, and the kwargs a template reads still pass.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.procs import ProcGroup, memory_mb, reset_peak

from .cluster import Cluster

pytestmark = pytest.mark.e2e
KEY = "sk-template"
PAD_10M = {"tokenize": True, "padding": "max_length", "max_length": 10_000_000}
# The peak memory one refused request may add (before the fix: ~1,100 MB for PAD_10M).
PEAK_BOUND_MB = 150


@pytest.fixture(scope="module")
def cluster(tokenizer_dir, tmp_path_factory):
    group = ProcGroup(tmp_path_factory.mktemp("logs"))
    c = Cluster(group, tokenizer_dir)
    (group.log_dir / "keys").write_text(KEY)
    try:
        c.decode.append(c.start_sim("decode"))
        c.start_gateway(10_000, auth={"api_keys_file": str(group.log_dir / "keys")})
        yield c
    finally:
        group.stop_all()


def post(cluster: Cluster, **body) -> httpx.Response:
    return httpx.post(
        cluster.url + "/v1/chat/completions",
        timeout=60,
        headers={"authorization": f"Bearer {KEY}"},
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body},
    )


def refused(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "chat_template_kwargs", error
    return error


def test_padding_kwargs_are_refused_before_any_work(cluster):
    assert cluster.gateway is not None
    pid = cluster.gateway.pid
    assert post(cluster).status_code == 200  # warm: tokenizer and template compiled
    cluster.decode[0].clear()
    reset_peak(pid)
    before = memory_mb(pid)

    error = refused(post(cluster, chat_template_kwargs=PAD_10M))
    assert "max_length, padding, tokenize" in error["message"] and error["code"] == "invalid_chat_template_kwargs"
    # several at once (each used to get its own copy of the tokenizer, then pad)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: post(cluster, chat_template_kwargs=PAD_10M), range(16)))
    for r in answers:
        refused(r)

    after = memory_mb(pid)
    assert after["VmHWM"] - before["VmHWM"] < PEAK_BOUND_MB, (before, after)
    assert after["VmRSS"] - before["VmRSS"] < PEAK_BOUND_MB, (before, after)
    assert cluster.decode[0].requests() == []  # nothing reached the engine
    assert post(cluster).status_code == 200


def test_truncating_kwargs_point_to_the_request_field(cluster):
    error = refused(post(cluster, chat_template_kwargs={"tokenize": True, "truncation": True, "max_length": 5}))
    assert "truncate_prompt_tokens" in error["message"]
    r = post(cluster, truncate_prompt_tokens=3)
    assert r.status_code == 200 and r.headers["x-pdgate-prompt-tokens"] == "3"


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({f"k{i}": i for i in range(33)}, "chat_template_kwargs_max_keys"),
        ({"a": "x" * (300 * 1024)}, "chat_template_kwargs_max_bytes"),
        ({"a": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}, "chat_template_kwargs_max_depth"),
        ({"messages": []}, "messages"),
    ],
    ids=["keys", "bytes", "depth", "call-argument"],
)
def test_oversized_kwargs_are_refused_and_never_reach_the_engine(cluster, kwargs, says):
    cluster.decode[0].clear()
    assert says in refused(post(cluster, chat_template_kwargs=kwargs))["message"]
    assert cluster.decode[0].requests() == []


def test_kwargs_a_template_reads_still_pass_unchanged(cluster):
    cluster.decode[0].clear()
    kwargs = {"enable_thinking": False, "custom_flag": "x"}
    r = post(cluster, chat_template_kwargs=kwargs)
    assert r.status_code == 200, r.text
    sent = cluster.decode[0].requests()
    assert len(sent) == 1 and sent[0]["body"]["chat_template_kwargs"] == kwargs  # the body goes upstream as sent
