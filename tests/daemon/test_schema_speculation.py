"""The generate request's `speculation` field (docs/speculative.md): checked once at the edge
and handed to the engine's SamplingParams; the SDK sends it as any other parameter."""

from __future__ import annotations

import pytest

from daemon.wire import ProtocolError
from daemon.wire.schema import parse_generate
from edge_runtime import SamplingParams


@pytest.mark.parametrize("value", ["auto", "on", "off"])
def test_speculation_reaches_the_engine(value):
    args = parse_generate("generate", {"prompt": "hi", "speculation": value})
    assert SamplingParams(**args.sampling_kwargs(8)).speculation == value


def test_speculation_defaults_to_auto_and_refuses_other_values():
    assert parse_generate("generate", {"prompt": "hi"}).sampling_kwargs(8)["speculation"] == "auto"
    with pytest.raises(ProtocolError) as err:
        parse_generate("generate", {"prompt": "hi", "speculation": "sometimes"})
    assert "'auto', 'on' or 'off'" in str(err.value)
