from __future__ import annotations

import pytest

from gateway.config import SignalsConfig
from gateway.engines.enginestats import StatsScraper, parse_stats
from gateway.engines.pools import Pools

V1_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
"""

OLD_PAGE = """\
vllm:num_requests_running{model_name="m"} 1.0
vllm:num_requests_waiting{model_name="m"} 0.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.75
"""


def test_v1_names_are_summed_and_maxed_across_engine_cores():
    st = parse_stats(V1_PAGE, at=1.0)
    assert (st.running, st.waiting, st.kv_usage, st.block_size, st.at) == (5, 4, 0.5, 128, 1.0)


def test_old_metric_names_still_count():
    st = parse_stats(OLD_PAGE, at=0.0)
    assert (st.running, st.waiting, st.kv_usage, st.block_size) == (1, 0, 0.75, None)


def test_a_page_without_vllm_signals_is_not_stats():
    assert parse_stats("# nothing\nprocess_cpu_seconds_total 1.0\n", at=0.0) is None


RUN_PAGE = (
    V1_PAGE
    + """\
process_start_time_seconds 1.796144996e+09
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 5.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0
"""
)


def test_the_engine_run_and_its_prefix_caching_are_read():
    st = parse_stats(RUN_PAGE, at=0.0)
    assert (st.prefix_caching, st.started_at, st.served) == (True, 1.796144996e09, 7.0)
    off = parse_stats(RUN_PAGE.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"'), at=0.0)
    assert off.prefix_caching is False
    assert parse_stats(OLD_PAGE, at=0.0).prefix_caching is None  # not said: not assumed off


def test_a_new_process_or_a_counter_going_back_is_a_restart():
    from gateway.engines.pools import EngineStats

    def stats(started: float | None, served: float | None) -> EngineStats:
        return EngineStats(0, 0, None, 16, 0.0, True, started, served)

    assert stats(2.0, 1.0).restarted_since(stats(1.0, 50.0))
    assert not stats(1.0, 60.0).restarted_since(stats(1.0, 50.0))
    assert stats(None, 3.0).restarted_since(stats(None, 50.0))  # multiprocess mode: no start time
    assert not stats(None, None).restarted_since(stats(None, None))


def test_the_kv_capacity_the_engine_reports_is_read():
    """vLLM stringifies every CacheConfig field into vllm:cache_config_info's labels: the GPU cache's
    block count bounds what routing may believe the engine holds; num_cpu_blocks is "None" without
    vLLM's own CPU tier."""
    page = (
        "vllm:num_requests_running 0.0\n"
        'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_cpu_blocks="None",'
        'num_gpu_blocks="8192",num_gpu_blocks_override="None"} 1.0\n'
    )
    st = parse_stats(page, at=0.0)
    assert st is not None and st.gpu_blocks == 8192 and st.cpu_blocks is None and st.block_size == 16
    offload = page.replace('num_cpu_blocks="None"', 'num_cpu_blocks="39072"')
    assert parse_stats(offload, at=0.0).cpu_blocks == 39072


def test_cached_tokens_by_source_are_read_per_source_summed_across_engine_cores():
    """vLLM 0.32's vllm:prompt_tokens_cached_by_source, as prometheus_client writes a counter."""
    page = V1_PAGE + (
        'vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} 320.0\n'
        'vllm:prompt_tokens_cached_by_source_total{engine="1",model_name="m",source="device"} 16.0\n'
        'vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="external_unspecified"} 512.0\n'
        'vllm:prompt_tokens_cached_by_source_created{engine="0",model_name="m",source="device"} 1.7e9\n'
    )
    assert parse_stats(page, at=0.0).cached_by_source == {"device": 336.0, "external_unspecified": 512.0}
    assert parse_stats(V1_PAGE, at=0.0).cached_by_source is None  # an engine without them


def test_lora_slots_and_active_adapters_come_from_the_newest_lora_requests_info_series():
    """vLLM 0.32 keeps every label set it ever wrote; the value is when it was written."""
    page = V1_PAGE + (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7964909432e+09\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="adpA,adpB",waiting_lora_adapters="adpA,adpB"}'
        " 1.7964909439e+09\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="adpJ",waiting_lora_adapters="adpJ"}'
        " 1.79649065e+09\n"
    )
    st = parse_stats(page, at=0.0)
    assert (st.lora_slots, st.lora_active) == (2, frozenset({"adpA", "adpB"}))
    assert parse_stats(V1_PAGE, at=0.0).lora_slots is None and not parse_stats(V1_PAGE, at=0.0).lora  # LoRA off
    declared = V1_PAGE + "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
    declared += "# TYPE vllm:lora_requests_info gauge\n"  # LoRA on, no step run yet: no sample
    assert parse_stats(declared, at=0.0).lora and parse_stats(declared, at=0.0).lora_slots is None


# Legal sample values in the Prometheus text format that are no usable count, usage or time, and
# numbers too long for a float (they read as +Inf).
UNUSABLE = [*("NaN", "+Inf", "-Inf", "1e999"), pytest.param("9" * 5000, id="5000-digits")]


def _with_unusable(bad: str) -> str:
    """V1_PAGE, plus a third engine core and the run's signals all reporting ``bad``."""
    return V1_PAGE + (
        f'vllm:num_requests_running{{engine="2",model_name="m"}} {bad}\n'
        f'vllm:num_requests_waiting{{engine="2",model_name="m"}} {bad}\n'
        f'vllm:kv_cache_usage_perc{{engine="2",model_name="m"}} {bad}\n'
        f"process_start_time_seconds {bad}\n"
        f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="m"}} {bad}\n'
        f'vllm:prompt_tokens_cached_by_source_total{{engine="0",model_name="m",source="device"}} {bad}\n'
    )


@pytest.mark.parametrize("bad", UNUSABLE)
def test_a_sample_that_is_no_finite_number_is_ignored_and_the_rest_of_the_page_read(bad):
    st = parse_stats(_with_unusable(bad), at=1.0)
    assert st is not None
    assert (st.running, st.waiting, st.kv_usage, st.block_size, st.prefix_caching) == (5, 4, 0.5, 128, True)
    assert (st.started_at, st.served, st.cached_by_source) == (None, None, None)  # as if not reported
    assert parse_stats(f"vllm:num_requests_running {bad}\n", at=0.0) is None  # nothing usable: no stats


def test_request_counts_summing_past_a_floats_range_are_read_as_absent():
    page = 'vllm:num_requests_running{engine="0"} 1.7e308\nvllm:num_requests_running{engine="1"} 1.7e308\n'
    st = parse_stats(page + "vllm:num_requests_waiting 2.0\nvllm:kv_cache_usage_perc 0.5\n", at=0.0)
    assert st is not None and (st.running, st.waiting, st.kv_usage) == (0, 2, 0.5)


@pytest.mark.parametrize("label", ["block_size", "num_gpu_blocks", "num_cpu_blocks", "max_lora"])
def test_an_integer_label_too_long_to_read_is_ignored_and_the_rest_of_the_page_read(label):
    labels = {"block_size": "16", "num_gpu_blocks": "8192", "num_cpu_blocks": "64", "max_lora": "2"}
    labels[label] = "1" * 5000
    page = (
        "vllm:num_requests_running 3.0\nvllm:kv_cache_usage_perc 0.25\n"
        f'vllm:cache_config_info{{block_size="{labels["block_size"]}",enable_prefix_caching="True",'
        f'num_cpu_blocks="{labels["num_cpu_blocks"]}",num_gpu_blocks="{labels["num_gpu_blocks"]}"}} 1.0\n'
        f'vllm:lora_requests_info{{max_lora="{labels["max_lora"]}",running_lora_adapters="a"}} 1.7e9\n'
    )
    st = parse_stats(page, at=0.0)
    assert st is not None and (st.running, st.kv_usage, st.prefix_caching) == (3, 0.25, True)
    got = {"block_size": st.block_size, "num_gpu_blocks": st.gpu_blocks, "num_cpu_blocks": st.cpu_blocks}
    got["max_lora"] = st.lora_slots
    assert got == {**{k: int(v) for k, v in labels.items() if k != label}, label: None}


class _Page:
    """An aiohttp response (and session) that answers ``body``."""

    status = 200

    def __init__(self, body: bytes) -> None:
        self.body, self.content = body, self

    def get(self, url: str, timeout: object = None) -> _Page:
        return self

    async def read(self, n: int) -> bytes:
        return self.body

    async def __aenter__(self) -> _Page:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("bad", UNUSABLE)
async def test_a_scrape_with_unusable_samples_reports_the_engines_other_stats(bad):
    pools = Pools([], ["http://e:1"])
    ep = pools.decode[0]
    scraper = StatsScraper(pools, _Page(_with_unusable(bad).encode()), SignalsConfig())  # type: ignore[arg-type]
    assert await scraper.scrape(ep)
    assert ep.stats is not None and (ep.stats.running, ep.stats.waiting, ep.stats.kv_usage) == (5, 4, 0.5)
