"""Serving: many requests sharing one model — requests, paged KV blocks with a prefix cache, the scheduler,
executors (llama.cpp, simulated), and the step-level engine the HTTP server runs on."""
