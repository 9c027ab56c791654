"""Structured outputs: completions held to a JSON schema by constrained decoding, with xgrammar.

- ``spec.py``: what a completion must match (``GrammarSpec``, a JSON schema and the request field it came
  from; ``response_format`` as one), and ``Grammar``, a compiled spec, which a request carries.
- ``tool_calls.py``: the schema that makes a completion a tool call, and the ``tool_calls`` read back from it.
- ``manager.py``: everything xgrammar does for the engine: compiling specs (cached), one matcher per
  completion, and each step's token bitmask; ``vocab.py`` gives xgrammar the tokenizer's vocabulary and
  ``bitmask.py`` holds a step's bitmask until the sampler applies it.

How a constrained completion runs: ``EngineCore.compile_grammar`` compiles its spec; ``EngineCore.add`` gives
each of the request's ``n`` completions a matcher; before each step the core fills one bitmask row per
constrained draw from the matchers; the sampler masks those rows of the logits in one call; the commit
(``OutputProcessor.check_stop``) advances the matcher by the sampled token and finishes the completion
("stop") when its grammar has terminated.

``spec.py`` and ``tool_calls.py`` import neither torch nor xgrammar. The engine imports ``manager.py`` on the
first grammar it compiles (xgrammar brings in ``transformers``: about a second), so an engine that never
constrains an output never loads it.
"""
