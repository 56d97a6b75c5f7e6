"""The contract between `LLMEngine` and what runs a scheduled step.

`LLMEngine.step()` hands each `SchedulerOutput` to a `StepRunner` and feeds the sampled tokens
back to the scheduler. `ModelRunner` (model_runner.py) is the real one: the model's forward over
the paged KV cache, then sampling. `bench/simulate.py` has one without a model. The engine
builds its runner through a `StepRunnerFactory`, given the engine's KV-cache manager and sampler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Protocol

if TYPE_CHECKING:
    from hybrid_cache.engine.kv_cache import KVCacheManager
    from hybrid_cache.engine.logprobs import LogprobLog
    from hybrid_cache.engine.sampler import Sampler
    from hybrid_cache.engine.scheduler import SchedulerOutput


class StepRunner(Protocol):
    # Where the runner records the sampled tokens' logprobs, which the engine's requests read
    # (None: a runner that computes none).
    logprob_log: Optional[LogprobLog]

    def execute(self, output: SchedulerOutput) -> list[int]:
        """Runs the scheduled tokens; returns the sampled token of every scheduled request
        whose `samples` is set (and of no other), in `output.scheduled` order (a list: no
        request id is hashed for it). A runner that computes logprobs records them before returning: the sampled tokens' in `logprob_log`, the
        prompt tokens' on the requests that ask (`Request.prompt_logprobs`)."""
        ...


StepRunnerFactory = Callable[["KVCacheManager", "Sampler"], StepRunner]
