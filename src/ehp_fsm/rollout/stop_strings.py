"""Stop strings found as a request's output grows, decoding a bounded tail per token.

The rule: after each output token, the request stops on the first of its stop strings, in the
order given, that occurs in a decoding of its whole output so far — the engine's two, as
SGLang's: special tokens kept (SGLang decodes its tail with `tokenizer.decode`'s default), and,
with `skip_special_tokens`, skipped (the answer's text; `EngineCore._stop_string`). A scan is
given one decoding (`decode`). Decoding the whole output every token made that quadratic:
3,000 tokens took 4.8–6.2 s against 3.5–4.1 s without a stop string
(`benchmarks/stop_strings.py`).

`StopScan` keeps what an incremental detokenizer keeps (SGLang's `DetokenizerManager`, vLLM's
`detokenize_incrementally`, HF's `TextStreamer`): `surr` and `read` offsets into the output and
the text decoded up to `read` — of which only its last `longest stop string - 1` characters,
where a stop string that ends in new text may begin. Each token decodes `output[surr:]` and
takes the text past `output[surr:read]`'s decoding as new. No stop string occurred before
(else the request would have stopped), so one occurs now exactly when it occurs in the kept
characters + the new text. Text is committed (`read` moves up) only when it does not end in
U+FFFD: a multi-byte character split over tokens decodes as U+FFFD until its last byte comes,
and is then decoded again, whole, from `surr`.

That equals the whole-output rule when decoding is local: the decoding of `a + b` is the
decoding of `a` followed by the new text `b` adds past a context of tokens before it.
`decodes_locally` says which tokenizers are: a `PreTrainedTokenizerFast` (its own `decode`, not a
subclass's), without `clean_up_tokenization_spaces` (it deletes a space before punctuation
that may lie anywhere behind), whose decoder is built of ByteLevel, ByteFallback, Fuse, Replace,
Strip and Metaspace pieces. Every other tokenizer keeps the whole-output decode, as does a
request whose context's decoding changed when a token was added (a byte-fallback run turned
invalid), from that token on. The context is never empty text: the decoding of a
Metaspace/Strip decoder drops the leading space of its first token only.
`tests/rollout/test_stop_strings.py` checks equality with the whole-output rule on a
byte-level BPE, a SentencePiece-style and the tiny model's character tokenizer (Hypothesis).

It knows nothing of the engine, its locks or its requests: the engine passes `decode`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: The decoder pieces whose decoding is local (see the module docstring).
LOCAL_DECODERS = frozenset({"ByteLevel", "ByteFallback", "Fuse", "Replace", "Strip", "Metaspace"})
REPLACEMENT = "\ufffd"  # what a decoder makes of a character whose bytes are not all there yet


def _decoder_types(node: Any) -> list[str]:
    if not isinstance(node, dict):
        return ["?"]
    kind = str(node.get("type"))
    if kind == "Sequence":
        return [t for child in node.get("decoders") or [] for t in _decoder_types(child)]
    return [kind]


def decodes_locally(tokenizer: Any) -> bool:
    """Whether `tokenizer.decode` is local, so `StopScan` may decode a tail (module docstring).
    False for anything it cannot tell: the whole output is then decoded, as it always was."""
    try:
        from transformers import PreTrainedTokenizerFast

        kind = type(tokenizer)
        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            return False
        if kind.decode is not PreTrainedTokenizerFast.decode:
            return False
        if kind._decode is not PreTrainedTokenizerFast._decode:
            return False
        if getattr(tokenizer, "clean_up_tokenization_spaces", True):
            return False
        decoder = tokenizer.backend_tokenizer.decoder
        if decoder is None:  # tokens joined with spaces
            return False
        types = _decoder_types(json.loads(decoder.__getstate__()))
    except Exception:  # any tokenizer it cannot inspect decodes whole
        return False
    return bool(types) and all(t in LOCAL_DECODERS for t in types)


@dataclass(eq=False)
class StopScan:
    """One request's incremental stop-string check (module docstring). `matched` is called
    after each token is appended; a tokenizer that changes (an install while the request was
    paused in place) or an output that shrinks (a retract) starts the scan over."""

    stops: tuple[str, ...]
    tokenizer: Any = None
    local: bool = False
    surr: int = 0  # decoding starts here: the context of the text past `read`
    read: int = 0  # the text of output[:read] is committed
    context: str = ""  # the decoding of output[surr:read]
    tail: str = ""  # the committed text's last `keep` characters

    def __post_init__(self) -> None:
        self.stops = tuple(s for s in self.stops if s)
        self.keep = max((len(s) for s in self.stops), default=1) - 1

    def reset(self) -> None:
        """Start over (the output was dropped: a retract)."""
        self.tokenizer, self.local = None, False
        self.surr = self.read = 0
        self.context = self.tail = ""

    def matched(
        self,
        output: Sequence[int],
        decode: Callable[[Sequence[int]], str],
        *,
        tokenizer: Any,
        local: bool,
    ) -> str | None:
        """The stop string (the first of `stops` in their order) that occurs in `decode(output)`,
        given that none occurred in the decoding of `output[:-1]`; None when none does."""
        if not self.stops:
            return None
        if tokenizer is not self.tokenizer or len(output) < self.read:
            self.reset()
            self.tokenizer, self.local = tokenizer, local
        if not self.local:
            return self._first_in(decode(output))
        full = decode(output[self.surr :])
        if not full.startswith(self.context):  # the context's decoding changed
            self.local = False
            return self._first_in(decode(output))
        new = full[len(self.context) :]
        found = self._first_in(self.tail + new)
        if found is None and not new.endswith(REPLACEMENT):
            self._commit(output, decode, full, new)
        return found

    def _commit(
        self,
        output: Sequence[int],
        decode: Callable[[Sequence[int]], str],
        full: str,
        new: str,
    ) -> None:
        """`new` is final: keep its tail, and decode from the last commit on next time (from
        `surr` still while that would be a context of no text)."""
        end = len(output)
        if self.keep:
            self.tail = (self.tail + new)[-self.keep :]
        context = decode(output[self.read : end]) if self.read < end else ""
        if context:
            self.surr, self.context = self.read, context
        else:
            self.context = full
        self.read = end

    def _first_in(self, text: str) -> str | None:
        for s in self.stops:
            if s in text:
                return s
        return None
