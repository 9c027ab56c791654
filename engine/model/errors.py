"""The one error type of model loading.

A `ValueError` subclass so callers that validate user input (the CLI, the server's startup) can treat a bad
model directory like any other bad argument. Every message names the file and the field or tensor at fault,
because the person reading it is fixing a checkpoint directory by hand.
"""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model directory, config file or checkpoint that kvguard cannot load."""
