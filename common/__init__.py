"""What every process shares, and no process owns: config and logs, the default model and its weights, the vocabulary,
keys and private files, the start record, systemd notify, a ZMQ socket read from the event loop, the rules of a slot,
and how llama-cpp-python is built for this machine (build.py: standard library only, `scripts/setup` runs it)."""
