"""`specdec serve`: an OpenAI-compatible HTTP server with continuous batching over one warm engine.

app (the server and its endpoints), api (OpenAI's request and response shapes), scheduler (continuous
batching), metrics (Prometheus), bench (a load generator).
"""
