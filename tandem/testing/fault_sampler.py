"""A fault-injecting layer on the `sample` hook, for tests of per-request failure isolation.

Stacked before `default-sampler`, it raises inside `sample` whenever a row of the batch has
`top_k == fail_top_k` (a request marks itself as the faulty one by its own parameter), and
otherwise returns None so the sampler after it answers. The kernel must then end that
request alone with `finish_reason == "error"` while the others finish normally. Without a
sampler after it nothing answers `sample`: a worker failure no request explains.

    plugins: [reference-scheduler, {name: fault-sampler, options: {fail_top_k: 13}},
              default-sampler]
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from tandem.core import hookimpl
from tandem.core.model_runner_output import SamplerOutput
from tandem.core.worker.sampling_metadata import SamplingMetadata
from tandem.schema.config import EngineConfig


class FaultSamplerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fail_top_k: int | None = 13


class FaultSampler:
    Options: ClassVar[type[BaseModel]] = FaultSamplerOptions

    def __init__(self, config: EngineConfig, options: FaultSamplerOptions) -> None:
        self.fail_top_k = options.fail_top_k
        #: Number of `sample` calls that raised (tests read it through the worker).
        self.num_raised = 0

    @hookimpl
    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput | None:
        if self.fail_top_k is not None and bool((metadata.top_k == self.fail_top_k).any()):
            self.num_raised += 1
            raise RuntimeError(
                f"fault-sampler: injected failure (a row has top_k={self.fail_top_k})"
            )
        return None
