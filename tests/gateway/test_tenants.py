"""Tenants, priority classes and objectives: from API keys' lines, headers and config."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.config import AuthConfig, FairnessConfig
from gateway.errors import APIError
from gateway.tenants import Labels, Tenancy, key_tenant


def keys(tmp_path, text: str):
    f = tmp_path / "keys"
    f.write_text(text)
    return AuthConfig(api_keys_file=str(f)).key_entries()


FAIR = FairnessConfig(enabled=True, tenants={"acme": {"weight": 3, "allow": ["batch"]}})


def test_a_keys_line_names_tenant_weight_and_classes(tmp_path) -> None:
    entries = keys(tmp_path, "# comment\nsk-a tenant=acme priority=interactive allow=batch,standard\nsk-b weight=2\n")
    t = Tenancy(FAIR, entries)
    a = t.identify({}, 0)
    assert (a.tenant, a.weight, a.cls, a.priority) == ("acme", 3, "interactive", -10)
    b = t.identify({}, 1)
    assert b.tenant == key_tenant(entries[1]) and b.tenant.startswith("key-") and "sk-b" not in b.tenant
    assert (b.weight, b.cls) == (2, "standard")
    assert AuthConfig(api_keys_file=str(tmp_path / "keys")).api_keys() == ["sk-a", "sk-b"]


@pytest.mark.parametrize("line", ["sk x=1", "sk weight=0", "sk weight=abc", "sk tenant=a/b", "sk tenant=a tenant=b",
                                  "sk tenant=other"])
def test_bad_key_lines_are_config_errors(tmp_path, line) -> None:
    with pytest.raises(ValueError):
        keys(tmp_path, line)


def test_key_classes_must_exist_and_weights_agree(tmp_path) -> None:
    with pytest.raises(ValueError, match="not a class"):
        Tenancy(FAIR, keys(tmp_path, "sk priority=gold"))
    with pytest.raises(ValueError, match="two weights"):
        Tenancy(FAIR, keys(tmp_path, "sk1 tenant=x weight=1\nsk2 tenant=x weight=2"))


def test_priority_header_only_for_classes_the_key_may_use(tmp_path) -> None:
    t = Tenancy(FAIR, keys(tmp_path, "sk-a tenant=acme\nsk-c tenant=cheap"))
    assert t.identify({"x-pdgate-priority": "batch"}, 0).cls == "batch"  # acme's config allows it
    with pytest.raises(APIError) as err:
        t.identify({"x-pdgate-priority": "interactive"}, 0)
    assert err.value.status == 403 and err.value.code == "priority_not_allowed"
    with pytest.raises(APIError) as err:
        t.identify({"x-pdgate-priority": "gold"}, 1)
    assert err.value.status == 400
    # /debug/route may ask anything
    assert t.identify({"x-pdgate-priority": "interactive"}, None, admin=True).cls == "interactive"


def test_without_keys_the_tenant_header_names_the_tenant() -> None:
    t = Tenancy(FAIR)
    assert t.identify({}, None).tenant == "default"
    acme = t.identify({"x-pdgate-tenant": "acme"}, None)
    assert (acme.tenant, acme.weight) == ("acme", 3)
    assert t.identify({"x-pdgate-tenant": "zed"}, None).weight == 1
    for bad in ["", "a b", "x" * 65, "other"]:
        with pytest.raises(APIError) as err:
            t.identify({"x-pdgate-tenant": bad}, None)
        assert err.value.status == 400
    assert Tenancy(FairnessConfig(tenant_header=None)).identify({"x-pdgate-tenant": "acme"}, None).tenant == "default"


def test_objectives_from_class_or_header() -> None:
    t = Tenancy(FairnessConfig(classes={"standard": {"ttft_slo_s": 2}, "batch": {"priority": 5, "sheddable": True}}))
    assert t.identify({}, None).ttft_slo_s == 2
    assert t.identify({"x-pdgate-ttft-ms": "350"}, None).ttft_slo_s == 0.35
    for bad in ["0", "-1", "1.5", "abc", "3600001", "\u00b2", "1" * 5000, " 5"]:
        with pytest.raises(APIError):
            t.identify({"x-pdgate-ttft-ms": bad}, None)


def test_config_is_strict() -> None:
    with pytest.raises(ValidationError):
        FairnessConfig(default_priority="gold")
    with pytest.raises(ValidationError):
        FairnessConfig(tenants={"a": {"priority": "gold"}})
    with pytest.raises(ValidationError):
        FairnessConfig(classes={"bad name": {}}, default_priority="bad name")
    with pytest.raises(ValidationError):
        FairnessConfig(max_queued=0)
    with pytest.raises(ValidationError):
        FairnessConfig(unknown=1)


def test_metric_labels_are_bounded() -> None:
    labels = Labels(3, ["acme"])
    assert [labels(t) for t in ["acme", "b", "c", "d", "b"]] == ["acme", "b", "c", "other", "b"]
