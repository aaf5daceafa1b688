"""Tenants, priority classes and objectives: from API keys' lines, headers and config."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from pydantic import ValidationError

from gateway.config import AdminConfig, AuthConfig, FairnessConfig
from gateway.fairness.tenants import Labels, Tenancy, key_tenants, label_secret
from gateway.http.errors import APIError


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
    assert b.tenant == key_tenants(entries)[1] == "key-1"  # the first unnamed key: its name says nothing of it
    assert (b.weight, b.cls) == (2, "standard")
    assert AuthConfig(api_keys_file=str(tmp_path / "keys")).api_keys() == ["sk-a", "sk-b"]


@pytest.mark.parametrize(
    "line", ["sk x=1", "sk weight=0", "sk weight=abc", "sk tenant=a/b", "sk tenant=a tenant=b", "sk tenant=other"]
)
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


SECRET = "a-long-per-install-secret-0123456789"


def test_an_unnamed_keys_tenant_reveals_no_hash_of_the_key(tmp_path, monkeypatch) -> None:
    """Issue 27.7: the label was the first 40 bits of the key's plain sha256, on an unauthenticated
    /metrics: a weak key could be guessed offline. Now nothing computable from the key alone."""
    weak = ["sk-1234", "password", "sk-test"]
    entries = keys(tmp_path, "\n".join([weak[0], "sk-named tenant=acme", *weak[1:]]))
    plain = {hashlib.sha256(k.encode()).hexdigest()[:10] for k in weak}
    without = key_tenants(entries)
    assert without == ["key-1", "acme", "key-2", "key-3"]  # the unnamed keys' places, in file order
    monkeypatch.setenv("PDGATE_LABEL_SECRET", SECRET)
    secret = label_secret(AdminConfig(tenant_label_secret_env="PDGATE_LABEL_SECRET"))
    assert secret == SECRET.encode()
    keyed = key_tenants(entries, secret)
    assert keyed[1] == "acme"
    for name, key in zip([keyed[0], *keyed[2:]], weak, strict=True):
        assert name == "key-" + hmac.new(SECRET.encode(), key.encode(), hashlib.sha256).hexdigest()[:10]
        assert name[4:] not in plain and key not in name
    # Stable whatever the order of the lines (another replica's file, an edit above it) ...
    reordered = keys(tmp_path, "\n".join(reversed(weak)))
    assert key_tenants(reordered, secret) == [keyed[3], keyed[2], keyed[0]]
    # ... and another install's secret names the same key otherwise.
    assert key_tenants(entries, b"another-install-secret-987654")[0] != keyed[0]
    t = Tenancy(FAIR, entries, secret)
    assert t.identify({}, 0).tenant == keyed[0] and t.names[:2] == ["acme", keyed[0]]


def test_a_label_secret_that_is_missing_or_short_is_a_config_error(monkeypatch) -> None:
    cfg = AdminConfig(tenant_label_secret_env="PDGATE_LABEL_SECRET")
    monkeypatch.delenv("PDGATE_LABEL_SECRET", raising=False)
    with pytest.raises(ValueError, match="unset"):
        label_secret(cfg)
    monkeypatch.setenv("PDGATE_LABEL_SECRET", "short")
    with pytest.raises(ValueError, match="too short"):
        label_secret(cfg)
    assert label_secret(AdminConfig()) is None


def test_an_unnamed_keys_name_may_not_be_a_configured_tenant(tmp_path) -> None:
    """key-1 configured as a tenant would hand the unnamed key that tenant's weight and classes."""
    fair = FairnessConfig(enabled=True, tenants={"key-1": {"weight": 50, "allow": ["interactive"]}})
    with pytest.raises(ValueError, match="key-1"):
        Tenancy(fair, keys(tmp_path, "sk-a"))
    with pytest.raises(ValueError, match="key-2"):
        Tenancy(FAIR, keys(tmp_path, "sk-a\nsk-b\nsk-c tenant=key-2"))
    assert Tenancy(fair, keys(tmp_path, "sk-a tenant=mine")).identify({}, 0).tenant == "mine"


def test_protecting_metrics_needs_an_admin_token() -> None:
    with pytest.raises(ValidationError, match="protect_metrics"):
        AdminConfig(protect_metrics=True)
    assert AdminConfig(protect_metrics=True, token_env="T").protect_metrics
    assert not AdminConfig().protect_metrics  # open by default: Prometheus scrapes without credentials
