"""The stream records the engine process sends every step (`StreamOutput`, `SampleDelta`) are
pickled as their constructors' arguments: every field survives the trip, a field added later
included (its value here differs from its default, so a `__reduce__` that forgets it fails)."""

from __future__ import annotations

import dataclasses
import pickle

from hybrid_cache.engine.outputs import CompletionOutput, RequestOutput
from hybrid_cache.entrypoints.streaming import SampleDelta, StreamOutput


def non_default(cls, **values):
    """An instance of dataclass `cls` whose every field is set (to `values` or a marker)."""
    fields = {
        field.name: values.get(field.name, f"<{field.name}>") for field in dataclasses.fields(cls)
    }
    return cls(**fields)


def test_a_sample_delta_survives_pickling_field_for_field():
    delta = non_default(
        SampleDelta, index=2, token_ids=[5, 6], logprobs=[([5, 1], [-0.5, -0.1], 2)]
    )
    loaded = pickle.loads(pickle.dumps(delta, pickle.HIGHEST_PROTOCOL))
    assert type(loaded) is SampleDelta and loaded == delta
    assert loaded.token_ids is not delta.token_ids


def test_a_stream_output_survives_pickling_field_for_field():
    output = RequestOutput("r1", "hi", [1, 2], [CompletionOutput(0, [5], "a", "length")])
    stream_output = non_default(
        StreamOutput,
        prompt_token_ids=[1, 2],
        deltas=[non_default(SampleDelta, index=0, token_ids=[5], logprobs=None)],
        finished=True,
        num_cached_tokens=16,
        prompt_logprobs=[([2], [-1.0], 1)],
        output=output,
    )
    loaded = pickle.loads(pickle.dumps(stream_output, pickle.HIGHEST_PROTOCOL))
    assert type(loaded) is StreamOutput and loaded == stream_output
    assert loaded.deltas[0] == stream_output.deltas[0] and loaded.output.request_id == "r1"
