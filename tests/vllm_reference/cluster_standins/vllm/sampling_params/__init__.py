"""Stand-in for ``vllm.sampling_params`` (the real one is built on pydantic dataclasses,
which the import root makes inert): a msgspec struct with the fields vLLM's engine core
reads from a request's sampling parameters. ``max_tokens`` is the number of steps the
stand-in scheduler gives the request. Other names are placeholders."""

import sys

import msgspec
from _vllm_standin import make_inert


class SamplingParams(msgspec.Struct, omit_defaults=True):
    max_tokens: int | None = 16
    extra_args: dict[str, object] | None = None
    structured_outputs: None = None
    skip_reading_prefix_cache: bool | None = None


make_inert(sys.modules[__name__])
