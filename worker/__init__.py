"""The worker process: one llama context on one device, N slots, continuous batching with same-slot KV reuse."""
