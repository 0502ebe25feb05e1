import socket
import threading
import urllib.request

import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    generate_latest,
    start_http_server,
)
from prometheus_client.parser import text_string_to_metric_families

from specdistill.acceptance import DraftCounts
from specdistill.engines.client import Scrape, parse_spec_decode_counters
from specdistill.ops.metrics import (
    LiveSample,
    SpecDecodeMetrics,
    acceptance_between,
    sample_live_acceptance,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def values(registry) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_record_uses_vllm_style_names_and_design_definitions():
    m = SpecDecodeMetrics()
    m.record(DraftCounts(10, 40, 25, [9, 7, 5, 4]))
    m.record(DraftCounts(5, 20, 5, [3, 1, 1, 0]))
    v = values(m.registry)
    assert v[("specdistill_spec_decode_num_drafts_total", ())] == 15
    assert v[("specdistill_spec_decode_num_draft_tokens_total", ())] == 60
    assert v[("specdistill_spec_decode_num_accepted_tokens_total", ())] == 30
    assert v[("specdistill_spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),))] == 12
    assert v[("specdistill_acceptance_rate", ())] == pytest.approx(5 / 20)  # the last sample
    assert v[("specdistill_mean_accepted_length", ())] == pytest.approx(1 + 5 / 5)
    with pytest.raises(ValueError, match="inconsistent"):
        m.record(DraftCounts(1, 2, 3, []))


def test_gauges_have_no_value_before_the_first_sample():
    """Before any sample the page showed acceptance 0.0 and accepted length 0.0: real-looking values."""
    m = SpecDecodeMetrics()
    names = {name for name, _ in values(m.registry)}
    assert "specdistill_acceptance_rate" not in names and "specdistill_mean_accepted_length" not in names
    assert "specdistill_pipeline_last_success_timestamp_seconds" not in names
    assert ("specdistill_serving_config_errors_total", ()) in values(m.registry)  # a counter: 0 is the truth
    m.record(DraftCounts(0, 0, 0, []))  # nothing proposed: still no value
    assert "specdistill_acceptance_rate" not in {name for name, _ in values(m.registry)}
    m.record(DraftCounts(2, 4, 1, [1]))
    m.record(DraftCounts(2, 4, 3, [2, 1]))
    assert values(m.registry)[("specdistill_acceptance_rate", ())] == 0.75


def test_serving_mode_and_versions_are_exclusive():
    m = SpecDecodeMetrics()
    m.set_serving("draft", target_fingerprint="aaa", draft_version="1")
    m.set_serving("ngram", target_fingerprint="bbb")
    v = values(m.registry)
    assert v[("specdistill_serving_mode", (("mode", "ngram"),))] == 1
    assert v[("specdistill_serving_mode", (("mode", "draft"),))] == 0
    assert ("specdistill_target_version_info", (("fingerprint", "aaa"),)) not in v
    assert v[("specdistill_target_version_info", (("fingerprint", "bbb"),))] == 1
    m.mark_pipeline_success(1234.0)
    assert values(m.registry)[("specdistill_pipeline_last_success_timestamp_seconds", ())] == 1234.0


def test_serve_exposes_metrics_on_loopback():
    m = SpecDecodeMetrics()
    m.record(DraftCounts(2, 8, 6, [2, 2, 1, 1]))
    port = free_port()
    server, thread = m.serve(port)
    try:
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
    scraped = parse_spec_decode_counters(page, prefix="specdistill_")
    assert (scraped.counts.rounds, scraped.counts.proposed, scraped.counts.accepted) == (2, 8, 6)


@pytest.fixture
def fake_vllm():
    """A serving engine's /metrics page in vLLM's metric names, on 127.0.0.1."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    counters = {
        "drafts": Counter("vllm:spec_decode_num_drafts", "", labels, registry=registry),
        "tokens": Counter("vllm:spec_decode_num_draft_tokens", "", labels, registry=registry),
        "accepted": Counter("vllm:spec_decode_num_accepted_tokens", "", labels, registry=registry),
    }
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    yield f"http://127.0.0.1:{port}/metrics", counters
    server.shutdown()


def bump(counters, engine: str, drafts: int, tokens: int, accepted: int) -> None:
    counters["drafts"].labels("m", engine).inc(drafts)
    counters["tokens"].labels("m", engine).inc(tokens)
    counters["accepted"].labels("m", engine).inc(accepted)


def test_live_sampler_computes_acceptance_from_two_scrapes(fake_vllm):
    url, counters = fake_vllm
    bump(counters, "0", 100, 400, 300)  # history before the window must not count
    timer = threading.Timer(0.3, lambda: (bump(counters, "0", 50, 200, 60), bump(counters, "1", 50, 200, 40)))
    timer.start()
    sample = sample_live_acceptance(url, interval_s=0.8, min_draft_tokens=100)
    timer.join()
    assert sample.ok, sample.reason
    assert sample.acceptance_rate == pytest.approx(100 / 400)  # summed over engines: a ratio of sums
    assert sample.mean_accepted_length == pytest.approx(1 + 100 / 100)


def test_live_sampler_no_sample_cases(fake_vllm):
    url, counters = fake_vllm
    bump(counters, "0", 1, 4, 1)
    quiet = sample_live_acceptance(url, interval_s=0.05, min_draft_tokens=100)
    assert not quiet.ok and "draft tokens" in quiet.reason

    unreachable = sample_live_acceptance(f"http://127.0.0.1:{free_port()}/metrics", interval_s=0)
    assert not unreachable.ok and "unreachable" in unreachable.reason and unreachable.acceptance_rate is None


def test_counter_reset_is_detected():
    before = Scrape(DraftCounts(rounds=100, proposed=400, accepted=300))
    after = Scrape(DraftCounts(rounds=10, proposed=40, accepted=10))
    sample = acceptance_between(before, after)
    assert not sample.ok and "reset" in sample.reason


@pytest.mark.parametrize("page, match", [
    ("this is { not prometheus", "malformed"),
    ("# TYPE x counter\nx_total 3\n", "lacks"),
])
def test_malformed_or_incomplete_pages_are_errors(page, match):
    with pytest.raises((ValueError, KeyError), match=match):
        parse_spec_decode_counters(page)


def test_a_live_sample_keeps_its_keys_and_one_written_before_the_counts_type_is_read():
    old = {"ok": True, "reason": "", "acceptance_rate": 0.25, "first_position_acceptance": 0.6,
           "mean_accepted_length": 2.0, "draft_tokens": 40.0, "accepted": 10.0, "drafts": 10.0,
           "per_position_acceptance": [0.6, 0.3, 0.1, 0.0], "source": "live", "proposed": 40.0, "rounds": None}
    sample = LiveSample.from_dict(old)
    assert (sample.counts.rounds, sample.counts.proposed, sample.counts.accepted) == (10.0, 40.0, 10.0)
    assert sample.acceptance_rate == 0.25 and sample.first_position_acceptance == 0.6
    written = sample.to_dict()
    assert {k: written[k] for k in old if k != "per_position_acceptance"} == {
        k: v for k, v in old.items() if k != "per_position_acceptance"}  # the counters' names, rounds null
    live = acceptance_between(Scrape(DraftCounts(10, 40, 20, [8, 6, 4, 2])), Scrape(DraftCounts(20, 80, 35, [16, 11, 6, 2])))
    assert LiveSample.from_dict(live.to_dict()) == live


def test_fallback_never_on_no_sample():
    assert LiveSample(False, "x").acceptance_rate is None


LLAMACPP_PAGE = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 120
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 40
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted by the target model
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 13
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 10
"""


def test_llamacpp_counters_are_found_by_name():
    """llama.cpp's page (format of its server-task.cpp) is read without being told the engine."""
    scraped = parse_spec_decode_counters(LLAMACPP_PAGE)
    c = scraped.counts
    assert (c.rounds, c.proposed, c.accepted, scraped.prefix) == (10, 40, 13, "llamacpp:")
    with pytest.raises(KeyError, match="vllm:spec_decode_num_drafts_total"):
        parse_spec_decode_counters(LLAMACPP_PAGE, prefix="vllm:")
