"""Held requests ended by Envoy's access log entries (gateway/epp/completions.py), and bounded."""

from __future__ import annotations

import asyncio

from gateway.epp.completions import Completions
from gateway.epp.proto import envoy_subset_pb2 as pb


class Exchange:
    def __init__(self) -> None:
        self.held = True
        self.served_with: tuple | None = None
        self.unconfirmed_calls = 0

    def served(self, status, upstream, first_byte_s, duration_s) -> None:
        self.served_with = (status, upstream, first_byte_s, duration_s)
        self.held = False

    def unconfirmed(self) -> None:
        self.unconfirmed_calls += 1
        self.held = False


def entry(request_id: str, *, status: int = 200, address: str = "10.0.0.2", port: int = 8000) -> pb.HTTPAccessLogEntry:
    e = pb.HTTPAccessLogEntry()
    e.request.request_headers["x-request-id"] = request_id
    e.response.response_code.value = status
    e.common_properties.upstream_remote_address.socket_address.address = address
    e.common_properties.upstream_remote_address.socket_address.port_value = port
    e.common_properties.time_to_first_upstream_rx_byte.FromMilliseconds(120)
    e.common_properties.duration.FromMilliseconds(900)
    return e


async def test_an_entry_ends_the_request_it_names_with_what_envoy_saw() -> None:
    done = Completions(timeout_s=60)
    ex, other = Exchange(), Exchange()
    done.hold("r1", ex)
    done.hold("r2", other)
    done.report(entry("r1", status=200, address="10.0.0.2", port=8001))
    assert ex.served_with == (200, "10.0.0.2:8001", 0.12, 0.9)
    assert other.held and len(done) == 1
    done.report(entry("r1"))  # again, or a request nobody holds (refused, another picker's)
    assert done.unmatched == 1 and done.reported == 1


async def test_an_entry_without_an_upstream_or_status_says_so() -> None:
    done = Completions(timeout_s=60)
    ex = Exchange()
    done.hold("r1", ex)
    e = pb.HTTPAccessLogEntry()
    e.request.request_id = "r1"  # no logged header: Envoy's own request id field
    done.report(e)
    assert ex.served_with == (0, None, None, None)


async def test_a_request_no_entry_ends_is_released_after_the_timeout() -> None:
    done = Completions(timeout_s=0.05)
    ex = Exchange()
    done.hold("r1", ex)
    await asyncio.sleep(0.15)
    assert ex.unconfirmed_calls == 1 and len(done) == 0 and done.unconfirmed == 1
    done.report(entry("r1"))  # too late: counted, changes nothing
    assert ex.served_with is None and done.unmatched == 1


async def test_the_held_requests_are_bounded_and_the_oldest_goes_first() -> None:
    done = Completions(timeout_s=60, max_held=2)
    a, b, c = Exchange(), Exchange(), Exchange()
    done.hold("a", a)
    done.hold("b", b)
    done.hold("c", c)
    assert a.unconfirmed_calls == 1 and b.held and c.held and len(done) == 2


async def test_the_same_id_again_ends_the_older_request_and_stopping_releases_all() -> None:
    done = Completions(timeout_s=60)
    first, second = Exchange(), Exchange()
    done.hold("r", first)
    done.hold("r", second)  # a client's own X-Request-Id, reused
    assert first.unconfirmed_calls == 1 and second.held
    done.close()
    assert second.unconfirmed_calls == 1 and len(done) == 0
