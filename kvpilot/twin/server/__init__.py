"""The twin's HTTP face: vLLM's OpenAI-compatible API and `/metrics`, paced by the simulated engine.

Modules:
  app       the aiohttp application, the engine loop and the process lifecycle (`serve`)
  protocol  request parsing and response shapes of vLLM's OpenAI server
  parsing   large request bodies, parsed in worker processes
  connection  HTTP connections: malformed requests, half-closed clients, keep-alive timeouts
  cli       `kvpilot twin serve`: vLLM's `vllm serve` flags, start-up failures as vLLM prints them
  jsonlog   JSON-lines logging for the server

The simulator core (`kvpilot.twin.engine` and below) never imports this package.
"""
