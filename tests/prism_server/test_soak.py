"""The short soak: mixed traffic, constant preemption and page movement, random disconnects."""

from __future__ import annotations

import pytest

from scripts.soak import Soak, SoakConfig

pytestmark = pytest.mark.slow  # measured: over 20 s a module on the 2-core machine


def test_short_soak_loses_nothing_and_leaks_nothing():
    report = Soak(SoakConfig(seconds=15, clients=10, seed=3)).run()
    print(report.summary())
    assert report.completed > 100 and report.cancelled > 10
    assert report.preemptions > 0 and report.pages_reclaimed > 0  # it did churn
    assert not report.wrong, report.wrong[:3]
    assert not report.errors, report.errors[:3]
    assert report.leaked_blocks == 0 and report.integrity == "ok"
    assert report.ok, report.summary()


def test_short_soak_with_eviction_churn_loses_nothing_and_leaks_nothing():
    """Two of the three models fit; random admin evicts every second on top of LRU pressure."""
    report = Soak(SoakConfig(seconds=15, clients=10, seed=4, evict_churn=True)).run()
    print(report.summary())
    assert report.completed > 50
    assert report.admin_evicts >= 5 and report.activations >= 5 and report.evictions >= 5
    assert not report.wrong, report.wrong[:3]
    assert not report.errors, report.errors[:3]
    assert report.leaked_blocks == 0 and report.integrity == "ok"
    assert report.ok, report.summary()


def test_short_soak_with_lora_churn_loses_nothing_and_leaks_nothing():
    """Four adapters of one model in two slots (two found in lora_dirs on first use), one
    unloaded or loaded again every second while requests for them run; the models in FP8."""
    report = Soak(SoakConfig(seconds=15, clients=10, seed=5, lora_churn=True, fp8=True)).run()
    print(report.summary())
    assert report.completed > 50
    assert report.adapter_unloads >= 5  # it did churn (the resolver loads them back)
    assert any(o.model.startswith("ad-") for o in report.outcomes if o.status == 200)
    assert not report.wrong, report.wrong[:3]
    assert not report.errors, report.errors[:3]
    assert report.leaked_blocks == 0 and report.integrity == "ok"
    assert report.ok, report.summary()
