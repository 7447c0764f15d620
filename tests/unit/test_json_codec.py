"""The JSON codec workers decode messages with: what kombu's own decoder gives, faster."""

from __future__ import annotations

import datetime
import decimal
import uuid
from typing import Any

import orjson
import pytest
from kombu.serialization import dumps as kombu_dumps
from kombu.serialization import loads as registry_loads
from kombu.utils import json as kombu_json

from infra import json_codec

CASES: list[Any] = [
    {"args": [], "kwargs": {"payload": {"row": {"x": [1, 2.5, None, True]}}}, "embed": None},
    [1, "two", {"three": 3}],
    {"text": 'a "__type__" in a string', "nested": {"deep": [{"k": "é€😀"}]}},
    {"big": 2**70},  # orjson refuses: kombu's decoder decodes it
    "a string",
    12.5,
]


@pytest.mark.parametrize("value", CASES)
def test_same_as_kombus_decoder_for_every_input_type(value: Any) -> None:
    text = kombu_json.dumps(value)
    expected = kombu_json.loads(text)
    raw = text.encode()
    for data in (text, raw, bytearray(raw), memoryview(raw)):
        assert json_codec.loads(data) == expected


def test_type_markers_and_what_orjson_refuses_go_to_kombu() -> None:
    when = datetime.datetime(2026, 12, 2, 10, 0, tzinfo=datetime.UTC)
    value = {"when": when, "id": uuid.UUID(int=7), "price": decimal.Decimal("1.10")}
    text = kombu_json.dumps(value)
    assert '"__type__"' in text
    assert json_codec.loads(text) == value
    assert json_codec.loads('{"x": NaN}')["x"] != json_codec.loads('{"x": NaN}')["x"]  # a NaN
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads('{"x": NaN}')  # so that case did not go through orjson
    with pytest.raises(ValueError):
        json_codec.loads("{not json")


def test_installed_the_registry_decodes_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    original = json_codec.loads

    def counting(data: Any) -> Any:
        calls.append(data)
        return original(data)

    monkeypatch.setattr(json_codec, "loads", counting)
    try:
        json_codec.install()
        content_type, encoding, body = kombu_dumps({"a": 1}, serializer="json")
        assert registry_loads(body, content_type, encoding, accept={"application/json"}) == {"a": 1}
        assert len(calls) == 1
    finally:
        monkeypatch.undo()
        json_codec.install()  # the real one again, as the worker app installs it


ENCODED: list[Any] = [
    *CASES,
    ([{"row": {"x": 1}}], {}, {"callbacks": None, "chord": None}),  # a task body: tuples
    {"floats": [0.1, 1e-05, 1e300, -0.0, 3.0], "é": '€😀\n\t"', "": [[], {}]},
    {"nan": float("nan")},
    {"inf": [float("inf"), float("-inf")]},
    {"id": uuid.UUID(int=7)},
    {"when": datetime.datetime(2026, 12, 2, 10, 0, tzinfo=datetime.UTC)},
    {"price": decimal.Decimal("1.10")},
    {1: "a key that is not a string"},
    {"flag": True, "bytes": b"raw"},
]


def decoded(text: str) -> Any:
    """What a reader makes of a message's text: kombu's decoder, NaN made comparable."""
    return kombu_json.loads(text.replace("NaN", '"nan"'))


@pytest.mark.parametrize("value", ENCODED)
def test_encodes_what_kombus_encoder_encodes(value: Any) -> None:
    """The same values once decoded, by kombu's decoder and by ours; what is not plain JSON
    (markers, NaN, infinities, integers past 64 bits, keys that are not strings) is kombu's
    own text."""
    text, theirs = json_codec.dumps(value), kombu_json.dumps(value)
    assert decoded(text) == decoded(theirs)
    assert json_codec.loads(text.replace("NaN", '"nan"')) == decoded(theirs)
    if not json_codec._plain(value):
        assert text == theirs


def test_only_plain_json_is_written_by_orjson() -> None:
    plain = [v for v in ENCODED if json_codec._plain(v)]
    assert len(plain) == 8
    assert all(json_codec.dumps(v) == orjson.dumps(v).decode() for v in plain if v != CASES[3])
    assert json_codec.dumps(CASES[3]) == kombu_json.dumps(CASES[3])  # 2**70: orjson refuses


def test_a_container_that_holds_itself_is_refused_as_kombu_refuses_it() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular reference"):
        json_codec.dumps({"loop": loop})
    large = {"rows": [[i] for i in range(json_codec.PLAIN_CONTAINERS)]}
    assert json_codec.dumps(large) == kombu_json.dumps(large)  # past the walk: kombu's text
