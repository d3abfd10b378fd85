"""Benchmarks anyone can run against any OpenAI-compatible endpoint: `blink-appliance bench ...`.

datasets          the prompts: synthetic text of a controlled token length, random token ids, ShareGPT
load_generator    arrivals (Poisson, fixed rate, all at once) under a concurrency cap; a streaming
                  client that timestamps every SSE chunk
serving_metrics   throughput, TTFT / TPOT / ITL / E2E percentiles, goodput under an SLO, failures
accounting        GPU energy (NVML) and the server's host CPU seconds (psutil) around a run
interference      bounded co-located CPU load: spinners, a memory-bandwidth thrasher, a context-switch storm
serve             `bench serve`: dataset -> one run per request rate -> metrics, accounting, report
report            the printed table and the JSON document
commands          the argparse wiring of `bench serve` and `bench interfere`

The device harness built on these (bench/compare.py and its baseline servers) lives in the repo's
bench/ folder, not in the installed package.

This package imports nothing heavy at import time: interference workers start in fresh interpreters.
"""
