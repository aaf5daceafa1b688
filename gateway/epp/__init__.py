"""pdgate as an endpoint picker (Gateway API Inference Extension, proposal 004) behind Envoy.

``pdgate epp`` runs the gateway with a gRPC listener beside its HTTP one: Envoy asks it over
ext_proc which engine serves each request (``service``: the streams; ``picking``: one request's
way through the gateway's own request path up to the engine; ``protocol``: proposal 004 in
ext_proc messages), reports each request's end over its access log service (``completions``),
and checks it with gRPC health. Envoy relays the bytes. See docs/epp.md.
"""
