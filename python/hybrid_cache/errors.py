"""Every exception hybrid-cache raises, all derived from `HybridCacheError`.

This module is the package's ground floor: it imports nothing from `hybrid_cache`, so any module
can import its errors from here without a cycle. The Rust extension raises the allocator's errors
as these same classes (it imports them from here when it loads), and the modules that raise the
Python-side ones re-export them next to their code (`hybrid_cache.config.ConfigError` is
`hybrid_cache.errors.ConfigError`). A new error is one class here plus its `__all__` entry.
"""

from __future__ import annotations


class HybridCacheError(Exception):
    """Base of every hybrid-cache error."""


# ---------------------------------------------------------------------------------------------
# The allocator (raised by the Rust extension, `hybrid_cache._core`).


class InvalidArgumentError(HybridCacheError):
    """A size, count or parameter is out of range."""


class NoFreeBlocksError(HybridCacheError):
    """The pool has fewer free blocks than asked; nothing was taken."""


class InvalidBlockError(HybridCacheError):
    """A block id that is the null block, out of range, or not held."""


class DoubleFreeError(HybridCacheError):
    """A block freed more times than it is referenced."""


class UnknownRequestError(HybridCacheError):
    """A request id that was never added or is already freed."""


class DuplicateRequestError(HybridCacheError):
    """A request id added twice."""


class InvalidGroupError(HybridCacheError):
    """A group id out of range."""


class RequestTooLargeError(HybridCacheError):
    """A request the pool or table can never hold."""


class TooManyRequestsError(HybridCacheError):
    """Every block-table row is in use."""


# ---------------------------------------------------------------------------------------------
# Model configs (`config.py`), memory sizes (`sizes.py`) and planning (`planner.py`).


class ConfigError(HybridCacheError, ValueError):
    """A model config that is missing, malformed, or describes something we cannot serve."""


class UnknownModelError(ConfigError):
    """`--model` is neither a folder with a `config.json` nor a built-in preset name."""


class UnknownArchitectureError(ConfigError):
    """The config's architecture is not one we know how to read."""


class MemorySizeError(HybridCacheError, ValueError):
    """A memory size that is not a non-negative byte count or a number with a known unit."""


class EngineConfigError(HybridCacheError, ValueError):
    """An engine argument (`LLM(...)`, `EngineConfig`, or its command-line flag) is invalid:
    unknown mode, non-positive size, ... The message names the flag and the argument."""


class PlanError(EngineConfigError):
    """Planning options that cannot produce a layout (an engine argument error too: `LLM(...)`
    raises it for the plan options it takes)."""


class InvalidBlockSizeError(PlanError):
    """The block size is not a positive power of two."""


class BudgetTooSmallError(PlanError):
    """The KV-cache budget holds less than one block per group (plus the null block), or (an
    engine) less than one request of `max_model_len` tokens."""


class WindowTooLargeError(PlanError):
    """A window/chunk covers the whole context while `strict_windows` is set."""


class DeviceUnavailableError(EngineConfigError):
    """`--device` names a device this machine does not have (e.g. `cuda` without a GPU)."""


class KVCacheMemoryError(EngineConfigError):
    """The KV-cache budget is more memory than the device (GPU, or the host for the CPU) has
    free; the message says how much there is."""


class TensorParallelConfigError(EngineConfigError):
    """`--tensor-parallel-size` cannot shard this model on this machine (it must divide the
    attention heads and MLP width; CUDA needs one GPU per rank); the message lists what fits."""


# ---------------------------------------------------------------------------------------------
# Tensor-parallel worker processes (`engine/parallel/`).


class TensorParallelError(HybridCacheError, RuntimeError):
    """A tensor-parallel engine cannot go on: a rank died, hung past the collective timeout,
    failed to start, or the engine was shut down. `rank` names the rank (None: unknown)."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class WorkerFailedError(TensorParallelError):
    """A worker rank died, raised, or did not answer a collective within the timeout."""


class EngineShutDownError(TensorParallelError):
    """The tensor-parallel engine was shut down (`LLM.shutdown()`); build a new `LLM`."""


# ---------------------------------------------------------------------------------------------
# Models (`models/loader.py`), attention (`attention/`) and the Triton kernels (`kernels/`).


class ModelLoadError(HybridCacheError):
    """The model folder cannot be turned into a model (missing/malformed config or weights)."""


class UnsupportedArchitectureError(ModelLoadError):
    """config.json names an architecture this engine has no model file for."""


class WeightMismatchError(ModelLoadError):
    """A checkpoint tensor is missing, unexpected, or shaped differently from config.json."""


class ModelNotLocalError(UnknownModelError, ModelLoadError):
    """`--model` names no local folder (a Hugging Face Hub id, or a path that does not exist):
    the engine reads local folders only and downloads nothing. Both a `ConfigError` (the config
    reader raises it) and a `ModelLoadError` (so does `load_model`)."""


class MissingWeightsError(ModelLoadError):
    """A model folder with a config.json but no weight files."""


class UnsupportedWeightFormatError(ModelLoadError):
    """The folder's weights are in a format the loader does not read (PyTorch pickles, GGUF):
    the message says how to convert them to safetensors."""


class UnsupportedQuantizationError(ModelLoadError):
    """config.json's `quantization_config` names a method the loader cannot dequantise (it reads
    MXFP4 experts only)."""


class LayerGroupMismatchError(HybridCacheError, ValueError):
    """An attention layer was put in a KV-cache group whose attention (kind, window or chunk)
    differs from the layer's own: the cache would keep or drop tokens the layer does not."""


class UnknownAttentionBackendError(HybridCacheError):
    """The requested attention backend is not registered (or its module failed to import)."""


class AttentionBackendUnavailableError(HybridCacheError):
    """A backend was forced (or called) where it cannot run: wrong device, a missing package, or a
    layer feature it does not implement. The message says why and what to choose instead."""


class KernelArgumentError(HybridCacheError, ValueError):
    """A kernel launcher was given tensors of the wrong shape, dtype, device or layout.

    Raised before anything is launched; the message names the argument and what to change.
    """


# ---------------------------------------------------------------------------------------------
# The engine (`engine/`) and the benchmark front (`bench/`). Each is also a `ValueError`: the
# caller passed something the engine cannot run. `LLM.generate` raises one
# `InvalidRequestsError` for a batch with bad prompts; `LLMEngine.add_request` raises for one.


class InvalidSamplingParamsError(HybridCacheError, ValueError):
    """A `SamplingParams` field is out of range."""


class InvalidRequestError(HybridCacheError, ValueError):
    """A prompt cannot be run: empty, wrong shape, or token ids outside the vocabulary."""


class UnsupportedSamplingParamsError(InvalidSamplingParamsError, InvalidRequestError):
    """Valid sampling params this engine cannot honour for a request (stop strings without a
    tokenizer, more logprobs than the vocabulary holds)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt has more tokens than `max_model_len`."""


class NoTokenizerError(InvalidRequestError):
    """Text was given (a prompt or a chat) but the model has no tokenizer (a preset, or a folder
    without tokenizer files, or transformers is not installed)."""


class OutputProcessingError(HybridCacheError, RuntimeError):
    """Reading a request's sampled token (its text, its stop check) failed: that request ends
    with `finish_reason == "error"` and this error (the cause chained), the others go on."""


class InvalidRequestsError(InvalidRequestError):
    """`LLM.generate` / `LLM.chat` found bad prompts and ran none of the batch. `errors` holds
    `(index, error)` for every bad one, in order; each error is an `InvalidRequestError`."""

    def __init__(self, errors: list, num_prompts: int) -> None:
        self.errors = list(errors)
        self.num_prompts = num_prompts
        listed = "".join(
            f"\n  [{index}] {type(error).__name__}: {error}" for index, error in self.errors
        )
        super().__init__(
            f"{len(self.errors)} of {num_prompts} prompts cannot run, so none was run:{listed}"
        )

    def __reduce__(self):
        return (type(self), (self.errors, self.num_prompts))


class InsufficientKVCacheError(InvalidRequestError, RequestTooLargeError):
    """The request can never fit in the KV-cache pool, even running alone."""


class BenchConfigError(HybridCacheError, ValueError):
    """A benchmark flag is invalid or the flags contradict each other; the message says which."""


# ---------------------------------------------------------------------------------------------
# The async engine and the OpenAI-compatible server (`entrypoints/`).


class EngineDeadError(HybridCacheError):
    """The async engine's step loop failed or was shut down: every request waiting on it and
    every later one gets this error (its cause is the loop's exception); restart the server."""


class EngineOverloadedError(HybridCacheError):
    """The async engine holds as many requests as it accepts (`max_pending_requests`,
    `--max-pending-requests`); retry later or raise the limit."""


class ServerConfigError(HybridCacheError, ValueError):
    """A `hybrid-cache serve` flag is invalid; the message names it."""


class InvalidFieldError(InvalidRequestError):
    """A request body field is malformed, of the wrong type, or one the server does not
    support; `param` names it (dotted for nested fields), None for the whole body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):
        return (type(self), (str(self), self.param))


class UnknownServedModelError(InvalidRequestError):
    """The request names a model the server does not serve (HTTP 404)."""


class RequestBodyTooLargeError(InvalidRequestError):
    """The request body is over the server's limit (`--max-request-bytes`; HTTP 413)."""


class ClientDisconnectedError(HybridCacheError):
    """The client closed the connection before its response was ready; its requests were
    aborted (HTTP 499, which nobody reads)."""


class AuthenticationError(HybridCacheError):
    """The request's API key is missing or wrong (HTTP 401)."""


__all__ = [
    "AttentionBackendUnavailableError",
    "AuthenticationError",
    "BenchConfigError",
    "BudgetTooSmallError",
    "ClientDisconnectedError",
    "ConfigError",
    "DeviceUnavailableError",
    "DoubleFreeError",
    "DuplicateRequestError",
    "EngineConfigError",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineShutDownError",
    "HybridCacheError",
    "InsufficientKVCacheError",
    "InvalidArgumentError",
    "InvalidBlockError",
    "InvalidBlockSizeError",
    "InvalidFieldError",
    "InvalidGroupError",
    "InvalidRequestError",
    "InvalidRequestsError",
    "InvalidSamplingParamsError",
    "KVCacheMemoryError",
    "KernelArgumentError",
    "LayerGroupMismatchError",
    "MemorySizeError",
    "MissingWeightsError",
    "ModelLoadError",
    "ModelNotLocalError",
    "NoFreeBlocksError",
    "NoTokenizerError",
    "PlanError",
    "OutputProcessingError",
    "PromptTooLongError",
    "RequestBodyTooLargeError",
    "RequestTooLargeError",
    "ServerConfigError",
    "TensorParallelConfigError",
    "TensorParallelError",
    "TooManyRequestsError",
    "UnknownArchitectureError",
    "UnknownAttentionBackendError",
    "UnknownModelError",
    "UnknownRequestError",
    "UnknownServedModelError",
    "UnsupportedArchitectureError",
    "UnsupportedQuantizationError",
    "UnsupportedSamplingParamsError",
    "UnsupportedWeightFormatError",
    "WeightMismatchError",
    "WindowTooLargeError",
    "WorkerFailedError",
]
