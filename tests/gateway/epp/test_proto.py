"""The generated module is the .proto's (scripts/gen-envoy-proto.sh), and the .proto keeps Envoy's
field numbers: every message and field declared there is in the module with that number and type.
The numbers themselves are Envoy's (copied from envoy/service/ext_proc/v3, envoy/service/accesslog/v3,
envoy/data/accesslog/v3, envoy/config/core/v3): the listed ones are checked here against the
values in Envoy's protos, and tests/e2e/test_epp_envoy.py checks them against a real Envoy."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.epp.proto import envoy_subset_pb2 as pb

PROTO = Path(pb.__file__).with_name("envoy_subset.proto")
FIELD = re.compile(r"^\s*(?:repeated\s+)?(?:map<[^>]+>|[\w.]+)\s+(\w+)\s*=\s*(\d+);")
MESSAGE = re.compile(r"^\s*message\s+(\w+)\s*\{")


def declared() -> dict[str, dict[str, int]]:
    """{message: {field: number}} as the .proto file declares them (nested messages dotted)."""
    out: dict[str, dict[str, int]] = {}
    blocks: list[str | None] = []  # open blocks: a message's name, or None for a oneof

    def name() -> str:
        return ".".join(b for b in blocks if b is not None)

    for raw in PROTO.read_text().splitlines():
        line = raw.split("//", 1)[0].strip()
        if m := MESSAGE.match(line):
            blocks.append(m.group(1))
            out[name()] = {}
            if line.endswith("}"):  # message X {}
                blocks.pop()
        elif line.startswith("oneof "):
            blocks.append(None)
        elif line == "}":
            blocks.pop()
        elif (m := FIELD.match(line)) and blocks:
            out[name()][m.group(1)] = int(m.group(2))
    return out


def test_the_generated_module_is_the_proto_files() -> None:
    messages = declared()
    assert len(messages) >= 25
    for name, fields in messages.items():
        desc = pb.DESCRIPTOR.message_types_by_name[name.split(".")[0]]
        for part in name.split(".")[1:]:
            desc = desc.nested_types_by_name[part]
        assert {f.name: f.number for f in desc.fields} == fields, name


@pytest.mark.parametrize(
    ("message", "field", "number"),
    [  # Envoy 1.40's numbers for what the picker could not work without
        ("ProcessingRequest", "request_headers", 2),
        ("ProcessingRequest", "request_body", 4),
        ("ProcessingRequest", "request_trailers", 6),
        ("ProcessingRequest", "metadata_context", 8),
        ("ProcessingResponse", "request_headers", 1),
        ("ProcessingResponse", "request_body", 3),
        ("ProcessingResponse", "immediate_response", 7),
        ("ProcessingResponse", "dynamic_metadata", 8),
        ("CommonResponse", "clear_route_cache", 5),
        ("BodyMutation", "streamed_response", 3),
        ("HeaderValue", "raw_value", 3),
        ("AccessLogCommon", "upstream_remote_address", 13),
        ("AccessLogCommon", "time_to_first_upstream_rx_byte", 9),
        ("HTTPRequestProperties", "request_id", 9),
        ("HTTPRequestProperties", "request_headers", 13),
        ("HTTPResponseProperties", "response_code", 1),
    ],
)
def test_envoys_field_numbers(message: str, field: str, number: int) -> None:
    assert pb.DESCRIPTOR.message_types_by_name[message].fields_by_name[field].number == number


def test_no_name_of_envoys_own_api_is_registered() -> None:
    """A process that also loads Envoy's generated API (xds-protos) must not see a name twice."""
    assert pb.DESCRIPTOR.package == "pdgate.envoy.v3"
