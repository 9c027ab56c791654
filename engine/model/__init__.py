"""The Llama/Qwen2-family decoder, its config, the weight loaders and the built-in tiny model.

Empty on purpose: import what you use from its module (``from engine.model.loader import load_model``). Were
the loader imported here, a module of this package that names a sibling through the package
(``from engine.model import llama``) would import the loader, which imports that module back: a circle.
"""
