"""The test and benchmark harness: real servers and control planes started as processes (the twin, vLLM,
Prometheus, PostgreSQL, KMock and a local control plane), the Helm chart rendered, and the oracle that
checks the twin's scheduler against vLLM's (`harness.conformance`).

Not part of the kvpilot wheel: tests and benchmarks import it, kvpilot never does.
"""
