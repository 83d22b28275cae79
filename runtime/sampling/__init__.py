"""Sampling: per-request parameters, their per-step tensors, and the batched sampling call."""

from sprig.runtime.sampling.batch import SamplingBatch
from sprig.runtime.sampling.logprobs import TopLogprobs, token_logprobs
from sprig.runtime.sampling.params import SamplingParams
from sprig.runtime.sampling.sampler import SampleOutput, process_logits, sample

__all__ = [
    "SampleOutput",
    "SamplingBatch",
    "SamplingParams",
    "TopLogprobs",
    "process_logits",
    "sample",
    "token_logprobs",
]
