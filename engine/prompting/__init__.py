"""Torch-free prompt handling shared by the engine server and the guard: tokenizers, chat templates,
incremental detokenization, prompt counting and context-window checks."""
