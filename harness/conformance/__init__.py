"""The twin checked against real vLLM: the same request traces, step by step.

    traces     request traces and scheduler configurations, random per family, as JSON
    replay     a trace through the twin's scheduler, one record per step
    reference  the same trace through vLLM's own V1 scheduler, in the real-vLLM venv
    vllm_worker  the process that runs there (vLLM and the standard library only)
"""
