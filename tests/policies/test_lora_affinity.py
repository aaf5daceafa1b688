"""Adapter affinity: holders first, and among them the ones that can run the adapter in their next
batch; no opinion on base-model requests."""

from __future__ import annotations

from policies.lora_affinity import LoraAffinity

from .helpers import ctx, ep


def _ctx(adapter: str | None):
    return ctx(10, adapter=adapter)


def test_an_engine_running_the_adapter_beats_one_with_a_free_slot_beats_a_full_one_beats_a_stranger():
    models = frozenset({"m", "adpA"})
    running = ep("d0", models=models, lora_slots=2, lora_active=frozenset({"adpA"}))
    free = ep("d1", models=models, lora_slots=2, lora_active=frozenset({"adpB"}))
    full = ep("d2", models=models, lora_slots=1, lora_active=frozenset({"adpB"}))
    stranger = ep("d3", models=frozenset({"m"}), lora_slots=2)
    unknown = ep("d4", models=models)  # slots not known yet
    scores = LoraAffinity().score(_ctx("adpA"), [running, free, full, stranger, unknown])
    assert scores == [1.0, 0.8, 0.4, 0.0, 0.8]


def test_base_model_requests_score_zero_everywhere():
    assert LoraAffinity().score(_ctx(None), [ep("d0", models=frozenset({"m"}))]) == [0.0]


def test_its_scores_are_parameters():
    full = ep("d2", models=frozenset({"adpA"}), lora_slots=1, lora_active=frozenset({"adpB"}))
    assert LoraAffinity(full_slots=0.1).score(_ctx("adpA"), [full]) == [0.1]
