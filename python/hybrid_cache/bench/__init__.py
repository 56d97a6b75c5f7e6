"""Throughput benchmarks: hybrid vs uniform KV cache, on the real engine or simulated.

One job per file:

    errors.py        BenchConfigError: a bad flag or contradicting flags, with what to change
    settings.py      BenchSettings: the workload and engine flags of one benchmark run;
                     `make_feed`, the prompt feed of its workload
    workload.py      seeded random prompts with an optional shared prefix
    multi_turn.py    chat sessions resending their history each turn; reusable-token hit rate
    metrics.py       RunResult: throughput, peak blocks, preemptions, concurrency, per-step series
    engine_run.py    runs one mode on the real engine (model forward timed apart from the step)
    interleaved.py   both modes' engines side by side in one process, time slices by turns
    cost_model.py    step time of a GPU-sized model from bytes read and FLOPs (H100-like constants)
    simulate.py      the real scheduler + Rust allocator with the cost model instead of a model
    report.py        the printed summary and the JSON document
    plot.py          blocks in use per group and running requests over steps (matplotlib, Agg)
    hf_compare.py    the same model and prompts through transformers' `generate_batch`

`hybrid-cache bench` (commands/bench.py) is the front. Heavy imports (torch, matplotlib,
transformers) stay inside the functions that need them.
"""
