"""From sampled tokens to what a caller sees: text, stop conditions and ``RequestOutput``s.

After each token appended to a sequence, ``check_stop`` advances the completion's grammar matcher, if it
has one (engine/structured), and decides whether it ends, in this order:

1. a stop string (``params.stop``) in the text: the text is cut before the string, which never shows;
2. its grammar has terminated (it accepted a stop token once complete, ``ignore_eos`` or not), an EOS
   token (unless ``ignore_eos``) or one of ``params.stop_token_ids``: the token stays in ``token_ids``,
   the text keeps whatever it decoded to;
3. ``max_tokens`` output tokens: "length".

Text: a completion whose request streams or has stop strings is decoded token by token, with an
``IncrementalDetokenizer`` that holds back an incomplete character until it completes; when it ends other
than at a stop string, what is held back is flushed (a character cut off at the end becomes U+FFFD). Any
other completion is decoded once, when it finishes.

The text state (``detokenizer``, ``text``, ``stopped_by_string``) lives on the sequence but belongs to this
module alone. A sequence gets its detokenizer with its first output token, so that whoever creates
sequences (the scheduler, which forks them) never needs the tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.outputs import CompletionOutput, RequestOutput
from engine.prompting.detokenizer import IncrementalDetokenizer
from engine.prompting.tokenizer import Tokenizer
from engine.sched.request import Request, SeqStatus, Sequence


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)

    def check_stop(self, seq: Sequence, token: int) -> str | None:
        """``token`` was just appended to ``seq``: update its text and return its finish reason, if any."""
        request = seq.request
        params = request.params
        matcher = request.matchers[seq.index] if request.matchers else None
        # The sampler drew the token under this matcher's mask, so refusing it means the two disagree.
        if matcher is not None and not matcher.accept_token(token):
            raise RuntimeError(f"{request.request_id}: token {token} was drawn outside its grammar")
        detokenizer = seq.detokenizer
        if detokenizer is None and self.tokenizer is not None and (params.stop or request.stream):
            detokenizer = seq.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)
        reason = None
        if detokenizer is not None:
            reason = self._check_stop_strings(seq, detokenizer.step(token))
        if reason is None:
            if ((matcher is not None and matcher.is_terminated())
                    or (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids):
                reason = "stop"
            elif seq.num_output_tokens >= request.max_tokens:
                reason = "length"
        if reason is not None and detokenizer is not None and not seq.stopped_by_string:
            seq.text += detokenizer.flush()
        return reason

    def output(self, request: Request, finished: bool) -> RequestOutput:
        """The request's completions so far; ``finished`` is ``request.finished``, which the caller has."""
        completions = []
        for seq in request.seqs:
            if seq.detokenizer is None and self.tokenizer is not None and seq.status is SeqStatus.FINISHED:
                seq.text = self.tokenizer.decode(seq.output_token_ids)
            completions.append(CompletionOutput(seq.index, seq.text, seq.output_token_ids, seq.finish_reason))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             request.num_cached_tokens, finished)

    @staticmethod
    def _check_stop_strings(seq: Sequence, new_text: str) -> str | None:
        """Append ``new_text``; on a stop string, cut the text before it and return ``"stop"``."""
        stops = seq.request.params.stop or []
        start = max(0, len(seq.text) - max((len(s) for s in stops), default=0) + 1)
        seq.text += new_text
        if not stops or not new_text:
            return None
        hits = [i for s in stops if (i := seq.text.find(s, start)) >= 0]
        if not hits:
            return None
        seq.text = seq.text[: min(hits)]
        seq.stopped_by_string = True
        return "stop"
