"""Where a pure-decode step's model forward spends its time on one GPU: launches or kernels.

Runs the engine on one workload (by default gemma-3-12b with bf16 dummy weights, 32 prompts of
4096 tokens, 96 tokens out) and, on the model forwards of pure-decode steps with every request
running, measures:

- plain: the forward's wall time (the device synchronised at both ends) and its issue time
  (until the host returns from it, the device not waited for);
- asleep: the same with the device first set spinning for longer than the forward takes to
  issue (`torch.cuda._sleep`), a CUDA event recorded as each layer is reached: the host issues
  at its own pace until the launch queue fills, and the layers queued by then run back to back
  once the device wakes, so their events give the device's time per layer, undisturbed by the
  host. A device time per layer well below the host's time to issue one: launches set the
  pace (CUDA graphs or fewer operators per layer are the cure); close to it: the kernels do;
- ops: the aten operators the forward dispatches (a `TorchDispatchMode` counting them; Triton
  kernels launched from Python are not among them) and the host synchronisations it asks for
  (`torch.cuda.set_sync_debug_mode("warn")`), on a forward of its own (counting slows it).

    python scripts/gpu_decode_anatomy.py [--model gemma-3-12b] [--output-json out.json]
    python scripts/gpu_decode_anatomy.py --cpu-dry-run   # tiny-gemma3 on the CPU: logic only

On the CPU the sleep is skipped (every op is synchronous) and only the counts mean something.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

# The workload arguments the GPU timing scripts share (this folder is on the path when run).
from gpu_engine_timing import add_workload_arguments, workload_settings


def op_counter():
    """A `TorchDispatchMode` counting the aten operators dispatched while it is active (in its
    `counts`, by operator); torch is imported on the first call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            self.counts[name] = self.counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    return OpCounter()


class Anatomy:
    """Forward hooks on the model that measure pure-decode forwards (`batch` tokens, or one
    fewer): the first `skip` are left alone (warm-up), then they take turns being measured
    plain, asleep (`sleep_cycles` of device spin first) and counted. Registered after the
    benchmark's own timer, so its pre-hook runs after the benchmark's synchronisation and its
    post-hook before the benchmark's."""

    KINDS = ("plain", "asleep", "ops")

    def __init__(self, model, batch: int, skip: int, sleep_cycles: int, device) -> None:
        import torch

        self._torch, self._batch, self._skip = torch, batch, skip
        self._sleep_cycles, self._cuda = sleep_cycles, device.type == "cuda"
        self._device = device
        self._seen = 0
        self._kind: str | None = None
        self._started = 0.0
        self._counter = None
        self._caught = None
        self._warnings: list = []
        self.samples: dict[str, list[dict]] = {kind: [] for kind in self.KINDS}
        self._marks: list[float] = []
        self._events: list = []
        self._handles = [
            model.register_forward_pre_hook(self._before),
            model.register_forward_hook(self._after, prepend=True),
        ]
        from hybrid_cache.attention import attention_layers

        # When the host reaches each attention layer: the pace at which it issues layers.
        for layer in attention_layers(model):
            self._handles.append(layer.register_forward_pre_hook(self._mark))

    def _mark(self, module, inputs) -> None:
        if self._kind in ("plain", "asleep"):
            self._marks.append(time.perf_counter())
        if self._kind == "asleep":
            event = self._torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)

    def _sync(self) -> None:
        if self._cuda:
            self._torch.cuda.synchronize(self._device)

    def _before(self, module, inputs) -> None:
        self._kind = None
        # A pure-decode forward of (nearly) every request: the first to finish may leave.
        if not self._batch - 1 <= inputs[0].shape[0] <= self._batch:
            return
        self._seen += 1
        if self._seen <= self._skip:
            return
        kind = self.KINDS[(self._seen - self._skip - 1) % len(self.KINDS)]
        if kind == "asleep" and not self._cuda:
            return
        self._kind = kind
        self._sync()
        if kind == "ops":
            self._caught = warnings.catch_warnings(record=True)
            self._warnings = self._caught.__enter__()
            warnings.simplefilter("always")
            if self._cuda:
                self._torch.cuda.set_sync_debug_mode("warn")
            self._counter = op_counter()
            self._counter.__enter__()
        self._marks, self._events = [], []
        self._started = time.perf_counter()
        if kind == "asleep":
            self._torch.cuda._sleep(self._sleep_cycles)

    def _after(self, module, inputs, output) -> None:
        kind, self._kind = self._kind, None
        if kind is None:
            return
        issued = time.perf_counter() - self._started
        if kind == "ops":
            self._counter.__exit__(None, None, None)
            if self._cuda:
                self._torch.cuda.set_sync_debug_mode("default")
            self._caught.__exit__(None, None, None)
            syncs = [str(w.message) for w in self._warnings if "synchroniz" in str(w.message)]
            counts = self._counter.counts
            self.samples["ops"].append(
                dict(
                    ops=sum(counts.values()),
                    by_op=counts,
                    syncs=len(syncs),
                    sync_examples=syncs[:3],
                )
            )
            return
        self._sync()
        wall = time.perf_counter() - self._started
        marks = [mark - self._started for mark in self._marks]
        gaps = [later - earlier for earlier, later in zip(marks, marks[1:])]
        sample = dict(
            issue_s=issued,
            wall_s=wall,
            first_layer_at_s=marks[0] if marks else 0.0,
            layer_issue_s=statistics.median(gaps) if gaps else 0.0,
        )
        if kind == "asleep" and gaps:
            # The host stalls once, where the launch queue fills (or never): the layers it
            # queued before that ran back to back after the sleep, at the device's own pace.
            stall = max(range(len(gaps)), key=gaps.__getitem__)
            queued = stall + 1 if gaps[stall] > 10 * sample["layer_issue_s"] else len(marks)
            events = self._events[:queued]
            device = [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]
            sample.update(
                layers_queued_before_stall=queued,
                stall_s=gaps[stall] if queued < len(marks) else 0.0,
                device_layer_s=statistics.median(device) if device else 0.0,
            )
        self.samples[kind].append(sample)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def sleep_seconds(torch, cycles: int) -> float:
    """The device time of `torch.cuda._sleep(cycles)` (median of three)."""
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def summarise(anatomy: Anatomy, sleep_s: float | None, num_layers: int) -> dict:
    """The medians of each kind of sample, with what they imply."""
    out: dict = {"num_layers": num_layers}
    plain, asleep, ops = (anatomy.samples[kind] for kind in Anatomy.KINDS)
    for kind, samples in (("plain", plain), ("asleep", asleep)):
        for key in (
            "wall_s", "issue_s", "first_layer_at_s", "layer_issue_s", "layers_queued_before_stall",
            "stall_s", "device_layer_s",
        ):  # fmt: skip
            if samples and key in samples[0]:
                out[f"{kind}_{key}"] = statistics.median(s[key] for s in samples)
    if asleep and sleep_s is not None:
        out["sleep_s"] = sleep_s
        out["after_sleep_s"] = statistics.median(s["wall_s"] - sleep_s for s in asleep)
    if ops:
        out["aten_ops"] = ops[-1]["ops"]
        out["aten_ops_per_layer"] = ops[-1]["ops"] / num_layers
        top = sorted(ops[-1]["by_op"].items(), key=lambda item: -item[1])[:12]
        out["top_ops"] = dict(top)
        out["syncs"] = ops[-1]["syncs"]
        out["sync_examples"] = ops[-1]["sync_examples"]
        if "plain_layer_issue_s" in out:
            # A layer's issue time over its operators (views and dtype no-ops included).
            out["host_us_per_op"] = out["plain_layer_issue_s"] / out["aten_ops_per_layer"] * 1e6
    out["samples"] = {kind: len(samples) for kind, samples in anatomy.samples.items()}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, output_len=96)
    parser.add_argument("--skip", type=int, default=3, help="pure-decode forwards left alone")
    parser.add_argument("--sleep-ms", type=float, default=400.0, help="device spin before asleep")
    args = parser.parse_args()
    import torch
    from hybrid_cache.attention import attention_layers
    from hybrid_cache.bench.engine_run import ModeRun

    if args.cpu_dry_run:
        args.skip = 1
    elif not torch.cuda.is_available():
        print("no CUDA device (use --cpu-dry-run to check the script on the CPU)")
        return 2
    settings = workload_settings(args, dry_output_len=12)
    sleep_s = cycles = None
    if not args.cpu_dry_run:
        probe = 10**8
        per_cycle = sleep_seconds(torch, probe) / probe
        cycles = int(args.sleep_ms / 1e3 / per_cycle)
        sleep_s = sleep_seconds(torch, cycles)
        print(f"device: {torch.cuda.get_device_name()}; sleep {sleep_s * 1e3:.1f} ms")
    run = ModeRun(settings, args.mode)
    device = next(run.llm.model.parameters()).device
    anatomy = Anatomy(run.llm.model, args.num_prompts, args.skip, cycles or 0, device)
    try:
        while not run.done:
            run.step()
    finally:
        anatomy.remove()
        run.close()
    layers = len(attention_layers(run.llm.model))
    figures = summarise(anatomy, sleep_s, layers)
    print(f"{args.model} {args.mode}: pure-decode forwards of {args.num_prompts} tokens")
    if not any(figures["samples"].values()):
        print("  none met (requests finished while others prefilled): raise --output-len")
        return 1
    ms = {k: v * 1e3 for k, v in figures.items() if k.endswith("_s") and isinstance(v, float)}
    if "plain_wall_s" in figures:
        print(
            f"  plain: wall {ms['plain_wall_s']:.2f} ms, issued in {ms['plain_issue_s']:.2f} ms "
            f"(first layer reached after {ms['plain_first_layer_at_s']:.2f} ms, then "
            f"{ms['plain_layer_issue_s']:.3f} ms per layer)"
        )
    if "after_sleep_s" in figures:
        print(
            f"  device asleep {ms['sleep_s']:.1f} ms first: issued in {ms['asleep_issue_s']:.2f} "
            f"ms (first layer after {ms['asleep_first_layer_at_s']:.2f} ms, then "
            f"{ms['asleep_layer_issue_s']:.3f} ms per layer), done {ms['after_sleep_s']:.2f} ms "
            "after the device woke"
        )
        print(
            f"  the host stalled {ms['asleep_stall_s']:.1f} ms after queueing "
            f"{figures['asleep_layers_queued_before_stall']:.0f} layers (the launch queue full); "
            f"those ran at {ms['asleep_device_layer_s']:.3f} ms per layer on the device, against "
            f"{ms['plain_layer_issue_s']:.3f} ms per layer to issue"
        )
    if "aten_ops" in figures:
        print(
            f"  {figures['aten_ops']} aten ops ({figures['aten_ops_per_layer']:.1f} per layer of "
            f"{layers}), {figures.get('host_us_per_op', 0):.1f} us of host time per op; "
            f"{figures['syncs']} host synchronisations"
        )
        print(f"  most dispatched: {figures['top_ops']}")
        for example in figures["sync_examples"]:
            print(f"  sync: {example}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
