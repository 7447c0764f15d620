"""Capture settings as NeMo Gym names them: `+key=value`, validation, the manifest, the task."""

from __future__ import annotations

import pytest

from producer.cli.overrides import parse_overrides
from producer.config.overrides import resolve_settings
from schemas.config import ServersConfig
from schemas.errors import PlanningError
from schemas.messages import CollectRequest, RunRef
from schemas.settings import CollectionSettings
from workers.collect_messages import CollectMessages

CONFIG = ServersConfig.model_validate({"agents": {"a": {"url": "http://a"}}})
RUN = RunRef(run_id="r", output_dir="/out", token="t")


def test_overrides_set_the_capture_and_the_manifest_records_it() -> None:
    overrides = parse_overrides(
        ["+observability_enabled=true", "+model_call_capture_dir=s3://bucket/calls"]
    )
    settings = resolve_settings(None, overrides)
    recorded = settings.model_dump(mode="json")  # what the manifest's `settings` holds
    assert recorded["observability_enabled"] is True
    assert recorded["model_call_capture_dir"] == "s3://bucket/calls"
    assert recorded["delete_model_call_capture"] is False


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"observability_enabled": True}, "model_call_capture_dir is required"),
        (
            {"observability_enabled": True, "model_call_capture_dir": "calls"},
            "model_call_capture_dir must be an absolute path",
        ),
        (
            {"delete_model_call_capture": True, "include_model_call_payloads": False},
            "delete_model_call_capture needs include_model_call_payloads",
        ),
    ],
)
def test_nemo_gyms_capture_errors(values: dict[str, object], message: str) -> None:
    with pytest.raises(PlanningError, match=message):
        resolve_settings(None, values)


def test_with_observability_off_the_dir_is_ignored() -> None:
    settings = CollectionSettings(model_call_capture_dir="relative")
    messages = CollectMessages.of(RUN, CONFIG, settings, None)
    payload, _ = messages.message({"_ng_task_index": 0, "_ng_rollout_index": 0}, "0-0", "a")
    assert "capture" not in payload


def test_each_rollout_task_carries_the_capture_dir() -> None:
    settings = CollectionSettings(
        observability_enabled=True, model_call_capture_dir="/calls", delete_model_call_capture=True
    )
    messages = CollectMessages.of(RUN, CONFIG, settings, None)
    payload, _ = messages.message({"_ng_task_index": 0, "_ng_rollout_index": 0}, "0-0", "a")
    req = CollectRequest.model_validate(payload)
    assert req.capture is not None
    assert (req.capture.dir, req.capture.delete_after_merge) == ("/calls", True)
