"""What a chat request means to a model: templates, tool-call syntaxes, grammars, reading replies (no sockets, no llama)."""
