"""The engine twin: a vLLM-faithful simulator of chunked prefill and the paged KV cache.

Modules:
  hardware   GPU presets (memory, dense bf16 FLOP/s, HBM and NVLink bandwidth)
  models     transformer shapes from a Hugging Face config.json, plus presets
  memory     KV-cache sizing exactly as vLLM does it at start-up, and its start-up errors
  steptime   the time of one engine step (roofline linear layers, attention, TP all-reduce, CPU)
  scheduler  vLLM V1's scheduler and block pool
  engine     the Engine the HTTP server and the offline runner drive, one step at a time
  workload   arrivals and request lengths (Poisson, gamma, fixed/uniform/lognormal, ShareGPT-like, JSONL)
  offline    virtual-time runs and their report (`simulate`)
  flags      the `vllm serve` flags the twin accepts
  server     the HTTP server (OpenAI API + vLLM `/metrics`), its protocol, CLI and logging
  calibration  device profiles fitted on measured times (`kvpilot twin calibrate`), and those kvpilot ships
"""
