"""vLLM's KV cache event batches as they arrive on the wire, decoded within bounds.

The wire format (``gateway/engines/kvevents.py`` says how a feed is followed): a ``KVEventBatch`` is
msgpack, an array ``[ts, events, data_parallel_rank?]``; events are tagged maps (vLLM 0.32) or
arrays with the tag first (older vLLM). A batch is decoded outline first, every field left raw
(``msgspec.Raw``), then field by field with bounded types: msgspec checks a list's length on its
header, before it builds an item, so a batch over ``max_blocks`` hashes costs a header read, not
its hashes. Kept apart from the subscriber: this is the part a forged feed talks to first, and
the part whose bounds the tests pin down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from policies.beliefs.blockhash import BlockHash

END_SEQ = -1  # the replay socket's end marker (signed)
SEQ_BYTES = 8  # a sequence number's frame
MAX_BATCH_BLOCKS = 131_072  # 2M tokens of 16-token blocks in one engine step
MAX_HASH_BYTES = 64  # a block hash as bytes is a digest (32 bytes for sha256)
MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # a step's batch of 8k new tokens is ~100 KB
QUEUE_BYTES = 128 * 1024 * 1024  # what a socket's receive queue may hold, in messages of the longest size
MIN_QUEUED_MESSAGES = 16


# -- decoded events --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    extra_keys: list[Any] | None = None
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None  # vLLM 0.32: "LOCAL" or "REMOTE" relative to the publisher (None: unsaid)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared
MEDIUM_GPU = "GPU"  # vLLM's medium of its own (GPU) KV cache blocks
LOCALITY_REMOTE = "REMOTE"  # a tier every engine reaches (vLLM 0.32's kv_events.py: "LOCAL or REMOTE")


class DecodeError(ValueError):
    """A payload that is not a vLLM KV event batch, or one over the bounds."""


_Meta = msgspec.Meta
_Hash = int | Annotated[bytes, _Meta(max_length=MAX_HASH_BYTES)]
_Name = Annotated[str, _Meta(max_length=64)]
# An event with its fields left raw (msgspec.Raw: a view of the payload, skipped, not built): a
# tagged map (vLLM 0.32), or an array with the tag first (older vLLM).
_RawEvent = Annotated[dict[str, msgspec.Raw], _Meta(max_length=32)] | Annotated[list[msgspec.Raw], _Meta(max_length=16)]
_RawBatch = Annotated[list[msgspec.Raw], _Meta(max_length=8)] | Annotated[dict[str, msgspec.Raw], _Meta(max_length=8)]
_Dec = msgspec.msgpack.Decoder
# What msgspec raises for a malformed payload: msgspec.DecodeError, or RecursionError for containers
# nested past the interpreter's limit (~1000 levels; skipping a msgspec.Raw recurses as well).
_MALFORMED = (msgspec.DecodeError, RecursionError)
_batch_dec, _ts_dec, _name_dec = _Dec(_RawBatch), _Dec(float | None), _Dec(_Name | None)
_int_dec, _hash_dec = _Dec(int | None), _Dec(_Hash | None)


def _field(decoder: msgspec.msgpack.Decoder[Any], raw: msgspec.Raw | None, name: str) -> Any:
    if raw is None:
        return None
    try:
        return decoder.decode(raw)
    except _MALFORMED as err:
        raise DecodeError(f"{name}: {err}") from None


class BatchDecoder:
    """Decodes ``KVEventBatch`` payloads within bounds (see the module's docstring).

    ``max_blocks``: block hashes (and events) one batch may carry, all its events together.
    ``tokens_per_block``: decode the events' token ids and extra keys too, at most this many token
    ids per block hash (only hash translation needs them); None: leave them out (``[]``/None).
    """

    def __init__(self, max_blocks: int = MAX_BATCH_BLOCKS, tokens_per_block: int | None = 16) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be positive")
        self.max_blocks = max_blocks
        self.max_tokens = max_blocks * tokens_per_block if tokens_per_block is not None else 0
        self._events = _Dec(Annotated[list[_RawEvent], _Meta(max_length=max_blocks)])
        self._hashes = _Dec(Annotated[list[_Hash], _Meta(max_length=max_blocks)])
        self._tokens = _Dec(Annotated[list[int], _Meta(max_length=max(self.max_tokens, 1))] | None)
        self._extra = _Dec(Annotated[list[Any], _Meta(max_length=max_blocks)] | None)
        self._blocks_left = self._tokens_left = 0  # of the batch being decoded

    def decode(self, payload: bytes) -> tuple[float, list[Event]]:
        """``(ts, events)`` of one payload (unknown event types left out); DecodeError otherwise."""
        try:
            outline = _batch_dec.decode(payload)
        except _MALFORMED as err:
            raise DecodeError(str(err)) from None
        ts_raw: msgspec.Raw | None
        if isinstance(outline, list) and len(outline) >= 2:
            ts_raw, events_raw = outline[0], outline[1]
        elif isinstance(outline, dict) and "events" in outline:
            ts_raw, events_raw = outline.get("ts"), outline["events"]
        else:
            raise DecodeError("not a KV event batch")
        ts = _field(_ts_dec, ts_raw, "ts") or 0.0
        raws: list[dict[str, msgspec.Raw] | list[msgspec.Raw]] = _field(self._events, events_raw, "events")
        self._blocks_left, self._tokens_left = self.max_blocks, self.max_tokens
        events = []
        for raw in raws:
            ev = self._event(raw)
            if ev is not None:
                events.append(ev)
        return float(ts), events

    def _event(self, raw: dict[str, msgspec.Raw] | list[msgspec.Raw]) -> Event | None:
        """One event; None for a type this gateway does not know (newer vLLM may add some)."""
        if isinstance(raw, dict):
            kind = _field(_name_dec, raw.get("type"), "type")
            if kind == "BlockStored":
                return self._stored(
                    raw.get("block_hashes"),
                    raw.get("parent_block_hash"),
                    raw.get("token_ids"),
                    raw.get("block_size"),
                    raw.get("extra_keys"),
                    raw.get("medium"),
                    raw.get("group_idx"),
                    raw.get("locality"),
                )
            if kind == "BlockRemoved":
                return BlockRemoved(
                    self._hashes_of(raw.get("block_hashes")),
                    _field(_name_dec, raw.get("medium"), "medium"),
                    _field(_int_dec, raw.get("group_idx"), "group_idx"),
                    _field(_name_dec, raw.get("locality"), "locality"),
                )
            return AllBlocksCleared() if kind == "AllBlocksCleared" else None
        if not raw:
            raise DecodeError("an event is an empty array")
        kind = _field(_name_dec, raw[0], "type")

        def at(i: int) -> msgspec.Raw | None:
            return raw[i] if len(raw) > i else None

        if kind == "BlockStored" and len(raw) >= 5:
            # tag, block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
            # group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, locality, ... (vLLM 0.32)
            return self._stored(raw[1], raw[2], raw[3], raw[4], at(8), at(6), at(9), at(12))
        if kind == "BlockRemoved" and len(raw) >= 2:
            # tag, block_hashes, medium, group_idx, locality, ownership
            return BlockRemoved(
                self._hashes_of(raw[1]),
                _field(_name_dec, at(2), "medium"),
                _field(_int_dec, at(3), "group_idx"),
                _field(_name_dec, at(4), "locality"),
            )
        return AllBlocksCleared() if kind == "AllBlocksCleared" else None

    def _stored(
        self,
        hashes: msgspec.Raw | None,
        parent: msgspec.Raw | None,
        tokens: msgspec.Raw | None,
        block_size: msgspec.Raw | None,
        extra: msgspec.Raw | None,
        medium: msgspec.Raw | None,
        group_idx: msgspec.Raw | None,
        locality: msgspec.Raw | None = None,
    ) -> BlockStored:
        token_ids: list[int] = []
        extra_keys = None
        if self.max_tokens:
            token_ids = _field(self._tokens, tokens, "token_ids") or []
            self._tokens_left -= len(token_ids)
            if self._tokens_left < 0:
                raise DecodeError(f"more than {self.max_tokens} token ids in one batch")
            extra_keys = _field(self._extra, extra, "extra_keys")
        return BlockStored(
            self._hashes_of(hashes),
            _field(_hash_dec, parent, "parent_block_hash"),
            token_ids,
            _field(_int_dec, block_size, "block_size") or 0,
            extra_keys,
            _field(_name_dec, medium, "medium"),
            _field(_int_dec, group_idx, "group_idx"),
            _field(_name_dec, locality, "locality"),
        )

    def _hashes_of(self, raw: msgspec.Raw | None) -> list[BlockHash]:
        if raw is None:
            raise DecodeError("an event without block_hashes")
        hashes: list[BlockHash] = _field(self._hashes, raw, "block_hashes")
        self._blocks_left -= len(hashes)
        if self._blocks_left < 0:
            raise DecodeError(f"more than {self.max_blocks} block hashes in one batch")
        return hashes


def decode_batch(payload: bytes, decoder: BatchDecoder | None = None) -> tuple[float, list[Event]]:
    """``(ts, events)`` of one ``KVEventBatch`` payload."""
    return (decoder or BatchDecoder()).decode(payload)


@dataclass(frozen=True, slots=True)
class FeedLimits:
    """What one engine's feed may make the gateway hold (``routing.prefix.max_event_*``).

    ``max_message_bytes``: the longest message (``ZMQ_MAXMSGSIZE`` of the feed and replay sockets).
    ``max_batch_blocks``: block hashes (and events) one batch may carry, all its events together.
    """

    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_batch_blocks: int = MAX_BATCH_BLOCKS

    @property
    def queued_messages(self) -> int:
        """A socket's receive queue (``RCVHWM``): ZMQ counts messages, not bytes, so at most
        ``QUEUE_BYTES`` of the longest ones. A feed that falls behind further loses messages at
        the engine's side, which the replay then fills (or the entries are rebuilt)."""
        return max(MIN_QUEUED_MESSAGES, QUEUE_BYTES // self.max_message_bytes)
