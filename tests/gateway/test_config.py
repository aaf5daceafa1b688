from __future__ import annotations

import re

import pytest
from pydantic import BaseModel

from gateway.config import (
    ConfigError,
    PinnedFiles,
    PolicySpec,
    RoutingConfig,
    access_switched_off,
    load_config,
    parse_config,
)
from policies import registry

BASE = {
    "models": [{"name": "m", "tokenizer": "/tok", "max_model_len": 4096}],
    "pools": {"decode": {"endpoints": ["http://d0:8000/"]}},
}


def test_defaults():
    cfg = parse_config(BASE)
    assert cfg.routing.decider.name == "token_threshold"
    assert cfg.pools.decode.urls == ["http://d0:8000"]
    assert cfg.pools.prefill.urls == []
    assert cfg.model("m").max_model_len == 4096 and cfg.model("x") is None


@pytest.mark.parametrize(
    ("patch", "where"),
    [
        ({"pools": {"decode": {"endpoints": []}}}, "pools.decode"),
        ({"pools": {"decode": {"endpoints": ["d0:8000"]}}}, "pools.decode.endpoints"),
        ({"pools": {"decode": {"endpoints": ["http://d0/v1"]}}}, "pools.decode.endpoints"),
        ({"serverr": {}}, "serverr"),
        ({"models": [{"name": "m", "tokenizer": "/t", "max_model_len": "big"}]}, "models[0].max_model_len"),
        ({"models": []}, "models"),
    ],
)
def test_errors_name_their_location(patch, where):
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, **patch}, "gw.yaml")
    assert str(info.value).startswith("gw.yaml: invalid configuration")
    assert f"  {where}" in str(info.value)


def test_yaml_syntax_error_has_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("models:\n  - name: [oops\n")
    with pytest.raises(ConfigError, match="line"):
        load_config(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "none.yaml")


def test_endpoint_objects_with_kv_events_and_pipeline_per_pool():
    cfg = parse_config(
        {
            **BASE,
            "pools": {
                "decode": {
                    "endpoints": [
                        "http://d0:8000",
                        {"url": "http://d1:8000/", "kv_events": "tcp://d1:5557", "kv_events_replay": "tcp://d1:5558"},
                    ]
                }
            },
            "routing": {
                "decider": {"name": "cost_model", "kv_bandwidth_gbps": 100},
                "decode": {"scorers": [{"name": "session_affinity", "weight": 3, "header": "x-chat"}]},
                "prefix": {"block_size": 128, "hash_seed": "0"},
            },
        }
    )
    assert cfg.pools.decode.urls == ["http://d0:8000", "http://d1:8000"]
    assert cfg.pools.decode.endpoints[1].kv_events == "tcp://d1:5557"
    scorer = cfg.routing.decode.scorers[0]
    assert (scorer.name, scorer.weight, scorer.params) == ("session_affinity", 3, {"header": "x-chat"})
    assert [s.name for s in cfg.routing.prefill.scorers] == ["prefix_affinity", "load", "lora_affinity"]  # defaults
    assert cfg.routing.decider.params == {"kv_bandwidth_gbps": 100}


@pytest.mark.parametrize(
    ("routing", "where"),
    [
        ({"prefix": {"hash_algo": "md5"}}, "routing.prefix.hash_algo"),
        ({"decode": {"scorers": [{"name": "load", "weight": -1}]}}, "routing.decode.scorers[0].weight"),
        ({"prefix": {"block_size": 0}}, "routing.prefix.block_size"),
    ],
)
def test_bad_routing_values_name_their_place(routing, where):
    with pytest.raises(ConfigError, match=re.escape(where)):
        parse_config({**BASE, "routing": routing})


def test_kv_events_address_must_be_zmq():
    with pytest.raises(ConfigError, match="ZMQ address"):
        parse_config({**BASE, "pools": {"decode": {"endpoints": [{"url": "http://d0", "kv_events": "http://x"}]}}})


def routing_errors(routing: dict) -> list[str]:
    """The error lines a config with this ``routing`` section gets, without the header line."""
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "routing": routing}, "gw.yaml")
    header, *lines = str(info.value).splitlines()
    assert header == "gw.yaml: invalid configuration"
    return [line.strip() for line in lines]


@pytest.mark.parametrize(
    ("routing", "error"),
    [
        (
            {"decode": {"scorers": [{"name": "prefix_affinity"}, {"name": "session_affinity", "haeder": "x-chat"}]}},
            "routing.decode.scorers[1].haeder: unknown parameter (did you mean 'header'?)",
        ),
        (
            {"decider": {"name": "token_threshold", "treshold": 2048}},
            "routing.decider.treshold: unknown parameter (did you mean 'threshold'?)",
        ),
        (
            {"prefill": {"scorers": [{"name": "load", "wieght": 2}]}},  # the scorer's own key is suggested too
            "routing.prefill.scorers[0].wieght: unknown parameter (did you mean 'weight'?)",
        ),
        (
            {"decode": {"filters": [{"name": "bounded_load", "limit": 2}]}},
            "routing.decode.filters[0].limit: unknown parameter of policy 'bounded_load' (known: load_factor, slack)",
        ),
        (
            {"decode": {"picker": {"name": "least_inflight", "tie_margin": 0.1}}},
            "routing.decode.picker.tie_margin: unknown parameter: policy 'least_inflight' takes none",
        ),
        (
            {"decider": {"name": "token_threshold", "threshold": 0}},
            "routing.decider.threshold: Input should be greater than 0",
        ),
        (
            {"decider": {"name": "cost_model", "min_gain_s": -1}},
            "routing.decider.min_gain_s: Input should be greater than or equal to 0",
        ),
        (
            {"decode": {"filters": [{"name": "bounded_load", "load_factor": 0.8}]}},
            "routing.decode.filters[0].load_factor: Input should be greater than or equal to 1",
        ),
        (
            {"decode": {"scorers": [{"name": "prefix_afinity"}]}},
            "routing.decode.scorers[0].name: unknown policy 'prefix_afinity' (known: bounded_load, cost_model, "
            "least_inflight, load, lora_affinity, max_score, prefix_affinity, same_zone, session_affinity, "
            "token_threshold, topology)",
        ),
    ],
)
def test_policy_errors_name_their_yaml_location(routing, error):
    assert routing_errors(routing) == [error]


@pytest.mark.parametrize(
    ("routing", "error"),
    [
        (
            {"decider": {"name": "token_threshold", "threshold": True}},
            "routing.decider.threshold: Input should be a valid integer",
        ),
        (
            {"decider": {"name": "cost_model", "itl_budget_s": False}},
            "routing.decider.itl_budget_s: Input should be a valid number",
        ),
        (
            {"decode": {"filters": [{"name": "bounded_load", "slack": True}]}},
            "routing.decode.filters[0].slack: Input should be a valid number",
        ),
        (
            {"decode": {"scorers": [{"name": "load", "weight": True}]}},
            "routing.decode.scorers[0].weight: Input should be a valid number",
        ),
        (
            {"decode": {"scorers": [{"name": "session_affinity", "vnodes": True}]}},
            "routing.decode.scorers[0].vnodes: Input should be a valid integer",
        ),
    ],
)
def test_yaml_booleans_are_not_numbers(routing, error):
    assert routing_errors(routing) == [error]


def test_yaml_yes_is_refused_where_a_number_is_expected(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "models: [{name: m, tokenizer: /tok, max_model_len: 4096}]\n"
        "pools: {decode: {endpoints: [http://d0:8000]}}\n"
        "routing:\n  decider: {name: token_threshold, threshold: yes}\n"
    )
    with pytest.raises(ConfigError, match=re.escape("routing.decider.threshold: Input should be a valid integer")):
        load_config(path)


def test_every_bad_parameter_is_reported_at_once():
    assert routing_errors(
        {
            "decider": {"name": "cost_model", "kv_bandwidth_gbps": 0, "min_gain": 1},
            "decode": {"scorers": [{"name": "load", "kv_weight": -1}]},
        }
    ) == [
        "routing.decider.kv_bandwidth_gbps: Input should be greater than 0",
        "routing.decider.min_gain: unknown parameter (did you mean 'min_gain_s'?)",
        "routing.decode.scorers[0].kv_weight: Input should be greater than or equal to 0",
    ]


@pytest.mark.parametrize(
    ("routing", "error"),
    [
        (
            {"decode": {"filters": [{"name": "load"}]}},
            "routing.decode.filters[0].name: policy 'load' is a scorer, not a filter",
        ),
        (
            {"prefill": {"scorers": [{"name": "bounded_load"}]}},
            "routing.prefill.scorers[0].name: policy 'bounded_load' is a filter, not a scorer",
        ),
        (
            {"decode": {"picker": {"name": "prefix_affinity"}}},
            "routing.decode.picker.name: policy 'prefix_affinity' is a scorer, not a picker",
        ),
        ({"decider": {"name": "max_score"}}, "routing.decider.name: policy 'max_score' is a picker, not a decider"),
    ],
)
def test_a_policy_in_the_wrong_place(routing, error):
    assert routing_errors(routing) == [error]


def test_another_kind_as_the_decider_is_said_before_its_parameters():
    """``name: load`` where the decider goes, the decider's parameter left in (issue 28): the kind
    is the mistake, not "unknown parameter of policy 'load'"."""
    assert routing_errors({"decider": {"name": "load", "threshold": 4096}}) == [
        "routing.decider.name: policy 'load' is a scorer, not a decider"
    ]
    assert routing_errors({"decider": {"name": "token_threshold", "treshold": 1}}) == [  # a decider's own typo
        "routing.decider.treshold: unknown parameter (did you mean 'threshold'?)"
    ]


@pytest.mark.parametrize(
    ("patch", "error"),
    [
        ({"sever": {"port": 1}}, "sever: unknown key (did you mean 'server'?)"),
        ({"routng": {}}, "routng: unknown key (did you mean 'routing'?)"),
        ({"routing": {"decidr": {"name": "token_threshold"}}}, "routing.decidr: unknown key (did you mean 'decider'?)"),
        (
            {"models": [{"name": "m", "tokenizer": "/t", "max_model_len": 64, "tokeniser": "/u"}]},
            "models[0].tokeniser: unknown key (did you mean 'tokenizer'?)",
        ),
        (
            {"fairness": {"tenants": {"team-a": {"weigth": 2}}}},
            "fairness.tenants.team-a.weigth: unknown key (did you mean 'weight'?)",
        ),
        (
            {"volume": "loud"},
            "volume: unknown key (known: admin, admission, auth, engines, epp, failover, fairness, health, "
            "limits, lora, models, planner, pools, routing, server, signals, state, telemetry, timeouts, tokenizer)",
        ),
    ],
)
def test_an_unknown_key_names_the_closest_known_one(patch, error):
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, **patch}, "gw.yaml")
    assert str(info.value).splitlines()[1:] == [f"  {error}"]


def test_a_policy_named_twice_in_one_list():
    assert routing_errors(
        {
            "decode": {
                "filters": [{"name": "bounded_load"}, {"name": "bounded_load", "slack": 4}],
                "scorers": [{"name": "load"}, {"name": "prefix_affinity"}, {"name": "load", "weight": 3}],
            }
        }
    ) == [
        "routing.decode.filters[1].name: policy 'bounded_load' is already in this list",
        "routing.decode.scorers[2].name: policy 'load' is already in this list (give it more weight instead)",
    ]


def test_two_instances_of_one_policy_need_their_own_names():
    cfg = parse_config(
        {
            **BASE,
            "routing": {
                "decode": {
                    "scorers": [
                        {"name": "session_affinity", "instance": "by_user", "header": "x-user"},
                        {"name": "session_affinity", "header": "x-chat"},
                        {"name": "load", "instance": "load_2"},
                        {"name": "load"},
                    ]
                }
            },
        }
    )
    scorers = cfg.routing.decode.scorers
    assert [(s.name, s.instance_name, s.params) for s in scorers] == [
        ("session_affinity", "by_user", {"header": "x-user"}),
        ("session_affinity", "session_affinity", {"header": "x-chat"}),
        ("load", "load_2", {}),
        ("load", "load", {}),
    ]
    assert scorers[0].model_dump() == {
        "name": "session_affinity",
        "instance": "by_user",
        "weight": 1.0,
        "header": "x-user",
    }
    assert scorers[1].model_dump() == {"name": "session_affinity", "weight": 1.0, "header": "x-chat"}  # as before


def test_an_instance_name_used_twice_in_one_list_is_located():
    assert routing_errors(
        {
            "decode": {
                "filters": [{"name": "same_zone"}, {"name": "same_zone", "instance": "same_zone", "strict": False}],
                "scorers": [
                    {"name": "load", "instance": "busy"},
                    {"name": "session_affinity", "instance": "busy"},
                    {"name": "load"},
                ],
            }
        }
    ) == [
        "routing.decode.filters[1].instance: 'same_zone' is already in this list",
        "routing.decode.scorers[1].instance: 'busy' is already in this list",
    ]
    assert routing_errors({"decider": {"name": "cost_model", "instance": "a b"}}) == [
        "routing.decider.instance: String should match pattern '^[A-Za-z0-9_-]+$'"
    ]
    assert routing_errors({"decider": {"name": "cost_model", "instanse": "x"}}) == [
        "routing.decider.instanse: unknown parameter (did you mean 'instance'?)"
    ]


def test_the_same_policy_in_different_lists_and_pools_is_fine():
    cfg = parse_config(
        {
            **BASE,
            "routing": {
                "decode": {"scorers": [{"name": "load"}, {"name": "session_affinity"}]},
                "prefill": {"scorers": [{"name": "load"}, {"name": "session_affinity"}]},
            },
        }
    )
    assert [s.name for s in cfg.routing.decode.scorers] == [s.name for s in cfg.routing.prefill.scorers]


def test_params_stay_as_written():
    """The spec keeps what the YAML says (defaults are the policy's business)."""
    cfg = parse_config({**BASE, "routing": {"decider": {"name": "cost_model", "itl_budget_s": 0}}})
    assert cfg.routing.decider.params == {"itl_budget_s": 0}
    assert RoutingConfig(decider=PolicySpec(name="cost_model")).decider.params == {}


class _Margin:
    class Params(BaseModel):
        model_config = {"extra": "forbid"}
        margin_tokens: int = 100

    def __init__(self, margin_tokens: int = 100) -> None:
        self.margin_tokens = margin_tokens

    def decide(self, ctx, decode, prefill): ...


class _Plain:
    def __init__(self, pd: bool = False) -> None:
        self.pd = pd

    def score(self, ctx, candidates): ...


@pytest.fixture
def third_party(monkeypatch):
    class EntryPoint:
        def __init__(self, name, cls):
            self.name, self.cls = name, cls

        def load(self):
            return self.cls

    eps = [EntryPoint("margin", _Margin), EntryPoint("plain", _Plain)]
    monkeypatch.setattr(registry, "entry_points", lambda group: eps)


def test_third_party_policies_get_the_same_checks(third_party):
    assert parse_config({**BASE, "routing": {"decider": {"name": "margin", "margin_tokens": 5}}})
    assert routing_errors({"decider": {"name": "margin", "margin_token": 5}}) == [
        "routing.decider.margin_token: unknown parameter (did you mean 'margin_tokens'?)"
    ]
    # Without Params only building it can tell: the error is the constructor's, at the policy's place.
    [error] = routing_errors({"decode": {"scorers": [{"name": "plain", "p": True}]}})
    assert error.startswith("routing.decode.scorers[0]: policy 'plain': ") and "'p'" in error
    assert routing_errors({"decider": {"name": "plain"}}) == [
        "routing.decider.name: policy 'plain' is a scorer, not a decider"
    ]


# -- configs that would turn authentication off without saying so (issue 27) ----------------------

YAML_BASE = """\
models: [{name: m, tokenizer: /tok, max_model_len: 4096}]
pools: {decode: {endpoints: ["http://d0:8000"]}}
"""


@pytest.mark.parametrize(
    ("tail", "key", "line"),
    [
        ("auth: {api_keys_file: /etc/keys}\nauth: {}\n", "'auth'", 4),  # the attack: the second wins
        ("routing:\n  decider: {name: token_threshold}\n  decider: {name: cost_model}\n", "'decider'", 5),
        ("fairness:\n  tenants:\n    a: {weight: 1}\n    b: {weight: 2, weight: 3}\n", "'weight'", 6),
        ("health:\n  outlier: [{url: 'http://d1:8000', url: 'http://d2:8000'}]\n", "'url'", 4),  # in a list
    ],
)
def test_a_key_given_twice_in_one_mapping_is_refused_at_any_depth(tmp_path, tail, key, line):
    path = tmp_path / "c.yaml"
    path.write_text(YAML_BASE + tail)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"{key} appears twice" in str(info.value) and f"line {line}," in str(info.value)


def test_a_merge_key_still_overrides_what_it_merges(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        YAML_BASE + "health: &h {interval_s: 1, timeout_s: 0.5}\nsignals:\n  max_age_s: 3\n"
        "routing:\n  prefix: {block_size: 16}\n" + "admission:\n  <<: {max_in_flight: 5}\n"
        "  max_in_flight: 7\n"
    )
    assert load_config(path).admission.max_in_flight == 7


@pytest.mark.parametrize(
    ("section", "where"),
    [
        ({"auth": {"api_keys_file": ""}}, "auth.api_keys_file"),
        ({"auth": {"api_keys_env": "  "}}, "auth.api_keys_env"),
        ({"admin": {"token_file": ""}}, "admin.token_file"),
        ({"admin": {"token_env": ""}}, "admin.token_env"),
    ],
)
def test_an_empty_secret_path_is_refused(section, where):
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, **section}, "gw.yaml")
    assert f"  {where}: is empty" in str(info.value)


def test_an_auth_section_says_keys_or_disabled():
    with pytest.raises(ConfigError, match="auth: names no API keys"):
        parse_config({**BASE, "auth": {}})
    assert parse_config({**BASE, "auth": {"disabled": True}}).auth.disabled
    assert not parse_config(BASE).auth.configured  # no section at all: keys off, as before
    with pytest.raises(ConfigError, match="disabled: true and API keys at once"):
        parse_config({**BASE, "auth": {"disabled": True, "api_keys_env": "K"}})
    with pytest.raises(ConfigError, match="disabled: true and a token at once"):
        parse_config({**BASE, "admin": {"disabled": True, "token_file": "/t"}})


def test_switching_keys_or_the_admin_token_off_must_be_said(tmp_path):
    (tmp_path / "keys").write_text("sk-a\n")
    (tmp_path / "token").write_text("t\n")
    on = parse_config(
        {**BASE, "auth": {"api_keys_file": str(tmp_path / "keys")}, "admin": {"token_file": str(tmp_path / "token")}}
    )
    with pytest.raises(
        ValueError,
        match=r"switches off API keys \(from auth.api_keys_file .*keys'\) and the admin "
        r"token .* must say auth.disabled: true and admin.disabled: true",
    ):
        access_switched_off(on, parse_config(BASE))
    with pytest.raises(ValueError, match=r"must say admin\.disabled: true"):
        access_switched_off(on, parse_config({**BASE, "auth": {"disabled": True}}))
    said = parse_config({**BASE, "auth": {"disabled": True}, "admin": {"disabled": True}})
    assert len(access_switched_off(on, said)) == 2
    assert access_switched_off(on, on) == [] and access_switched_off(parse_config(BASE), on) == []
    # the token file emptied: the token is gone as surely as its key
    emptied = tmp_path / "empty"
    emptied.write_text("\n")
    with pytest.raises(ValueError, match="the admin token"):
        access_switched_off(
            on, parse_config({**BASE, "auth": on.auth.model_dump(), "admin": {"token_file": str(emptied)}})
        )


def test_a_pinned_config_reads_its_files_as_pinned(tmp_path):
    keys, template = tmp_path / "keys", tmp_path / "t.jinja"
    keys.write_text("sk-a tenant=x\n")
    template.write_text("{{ messages }}")
    cfg = parse_config(
        {
            **BASE,
            "auth": {"api_keys_file": str(keys)},
            "models": [{**BASE["models"][0], "chat_template": str(template)}],
        }
    )
    assert cfg.named_files() == {str(keys): "auth.api_keys_file", str(template): "models[0].chat_template"}
    pinned = cfg.pin(PinnedFiles.read(cfg.named_files()))
    keys.write_text("sk-b\n")
    template.unlink()
    assert [e.key for e in pinned.key_entries()] == ["sk-a"] and [e.key for e in cfg.key_entries()] == ["sk-b"]
    assert pinned.tokenizer_model(pinned.models[0]).chat_template == "{{ messages }}"
    gone = cfg.pin(PinnedFiles.read(cfg.named_files()))  # pinned while the template file is missing
    with pytest.raises(ValueError, match="cannot be read"):
        gone.tokenizer_model(gone.models[0])
    inline = parse_config({**BASE, "models": [{**BASE["models"][0], "chat_template": "{{ messages }}"}]})
    assert inline.named_files() == {}  # a template given inline names no file
