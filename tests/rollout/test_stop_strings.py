"""Stop strings found on a decoded tail equal the whole-output rule they replace.

The oracle is the whole-output check, kept here only: after each output token, decode the whole
output (special tokens skipped, or kept) and stop on the first stop string, in the order given,
that occurs in it. `StopScan` must give the same stopping token and matched string for every
token sequence, stop list and either decoding Hypothesis draws, over real `tokenizers`
tokenizers of each decoder family a served model may have: byte-level BPE (GPT-2, Qwen,
Llama 3: multi-byte characters split over tokens, added tokens decoded as their own segment),
SentencePiece with byte fallback (Llama 2: a leading space stripped, byte tokens fused),
Metaspace, the tiny model's character tokenizer — and two it must not decode in pieces
(WordPiece, cleanup of spaces), which keep the whole-output decode. Stop strings are drawn
from the texts the outputs decode to (partial characters' U+FFFD included), prefixes of each
other, and anything else.

The engine test runs a real `EngineCore` over a tiny model whose tokenizer is the byte-level
one: what a request with stop strings answers (finish reason, matched string, output ids, the
trimmed `text` with `skip_special_tokens` either way, `no_stop_trim`) equals what the oracle
derives from the same seeded request run without them — SGLang's rule: a stop string counts
in the decoding with special tokens kept, and with `skip_special_tokens` in the one without
them as well (`engine_rule`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ehp_fsm.models.tiny import build_tokenizer, init_model
from ehp_fsm.rollout.engine import EngineCore, SamplingParams
from ehp_fsm.rollout.stop_strings import StopScan, decodes_locally

WORDS = ["héllo", " wörld", "€", "日本", "🙂", " the", ".", "'s", " n't", "ab", "hello", "world!"]


def whole_output_rule(decode: Any, ids: Sequence[int], stops: Sequence[str]) -> tuple[int, str]:
    """The old check: (tokens when it stopped, matched) — (len(ids), "") if it never did."""
    for t in range(1, len(ids) + 1):
        text = decode(ids[:t])
        for s in stops:
            if s and s in text:
                return t, s
    return len(ids), ""


def engine_rule(
    tok: Any, ids: Sequence[int], stops: Sequence[str], *, skip: bool
) -> tuple[int, str]:
    """SGLang's rule, as the whole-output oracle: a stop string occurs in the output decoded
    with special tokens kept, or (`skip_special_tokens`) without them."""
    for t in range(1, len(ids) + 1):
        texts = [_decode(tok, ids[:t], skip=False)]
        if skip:
            texts.append(_decode(tok, ids[:t]))
        for s in stops:
            if s and any(s in text for text in texts):
                return t, s
    return len(ids), ""


def scanned(
    tok: Any, ids: Sequence[int], stops: Sequence[str], *, skip: bool = True
) -> tuple[int, str]:
    scan = StopScan(tuple(stops))
    decode = functools.partial(_decode, tok, skip=skip)
    local = decodes_locally(tok)
    out: list[int] = []
    for i in ids:
        out.append(i)
        found = scan.matched(out, decode, tokenizer=tok, local=local)
        if found is not None:
            return len(out), found
    return len(ids), ""


def _decode(tok: Any, ids: Sequence[int], *, skip: bool = True) -> str:
    return str(tok.decode(list(ids), skip_special_tokens=skip))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte ↔ printable character map (what ByteLevel vocabularies are written in)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += range(ord("®"), ord("ÿ") + 1)
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _fast(tok: Any, *, cleanup: bool = False, **specials: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    fast_class: Any = PreTrainedTokenizerFast
    fast = fast_class(tokenizer_object=tok, clean_up_tokenization_spaces=cleanup, **specials)
    fast.add_tokens(["<|tool|>"])  # an added token that is not special: decoded, never skipped
    return fast


def byte_level() -> Any:
    """Every byte, the 2–4-byte pieces of WORDS (characters cut anywhere), specials."""
    from tokenizers import Tokenizer, decoders, models

    b2u = _bytes_to_unicode()
    vocab: dict[str, int] = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab.setdefault(b2u[b], len(vocab))
    for w in WORDS:
        bs = w.encode()
        for i in range(len(bs)):
            for j in range(i + 2, min(len(bs), i + 4) + 1):
                vocab.setdefault("".join(b2u[x] for x in bs[i:j]), len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.decoder = decoders.ByteLevel()
    return _fast(tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _pieces() -> dict[str, int]:
    vocab: dict[str, int] = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for w in [*WORDS, "▁", "▁▁", "▁h", "llo", "▁wörld", "日", "本", "▁the", "é", "ö", "▁."]:
        vocab.setdefault(w.replace(" ", "▁"), len(vocab))
    return vocab


def sentencepiece(*, cleanup: bool = False) -> Any:
    """Llama 2's decoder: ▁ → space, byte tokens fused into characters, one leading space off."""
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.WordLevel(vocab=_pieces(), unk_token="<unk>"))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return _fast(tok, cleanup=cleanup, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def metaspace() -> Any:
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.WordLevel(vocab=_pieces(), unk_token="<unk>"))
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    return _fast(tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def wordpiece() -> Any:
    from tokenizers import Tokenizer, decoders, models

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2}
    for w in ["a", "b", "##b", "##a", ".", "'", "s", "##s", "n", "##'t", "the", "##é"]:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return _fast(tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]")


TOKENIZERS = {
    "byte-level": (byte_level, True),
    "sentencepiece": (sentencepiece, True),
    "metaspace": (metaspace, True),
    "characters": (build_tokenizer, True),
    "wordpiece": (wordpiece, False),
    "cleanup": (functools.partial(sentencepiece, cleanup=True), False),
}


@functools.cache
def tokenizer(name: str) -> Any:
    return TOKENIZERS[name][0]()


@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_tokenizers_that_decode_locally_are_told_apart(name: str) -> None:
    assert decodes_locally(tokenizer(name)) is TOKENIZERS[name][1]


@st.composite
def stop_lists(draw: st.DrawFn, texts: Sequence[str]) -> list[str]:
    """Stop strings: pieces of `texts`, prefixes of each other, and anything else."""
    stops: list[str] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["piece", "piece", "prefix", "any"]))
        if kind == "piece" and any(texts):
            text = draw(st.sampled_from([t for t in texts if t]))
            a = draw(st.integers(0, len(text) - 1))
            stops.append(text[a : a + draw(st.integers(1, 6))])
        elif kind == "prefix" and stops:
            s = draw(st.sampled_from(stops))
            stops.append(s[: draw(st.integers(0, len(s)))])
        else:
            stops.append(draw(st.text(alphabet="ab é€日.'\ufffd", max_size=3)))
    return stops


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(TOKENIZERS)), skip=st.booleans(), data=st.data())
def test_the_scan_stops_where_the_whole_output_rule_stops(
    name: str, skip: bool, data: st.DataObject
) -> None:
    tok = tokenizer(name)
    n = len(tok)
    special = st.sampled_from(tok.all_special_ids)
    ids = data.draw(st.lists(st.integers(0, n - 1) | special, max_size=40), label="ids")
    decode = functools.partial(_decode, tok, skip=skip)
    texts = [decode(ids[:t]) for t in range(1, len(ids) + 1)]
    stops = data.draw(stop_lists(texts), label="stops")
    assert scanned(tok, ids, stops, skip=skip) == whole_output_rule(decode, ids, stops)


def _across_an_install(
    ids: list[int], switch: int, stops: list[str]
) -> tuple[tuple[int, str], tuple[int, str]]:
    """(the scan's, the whole-output rule's) stop for `ids` decoded by the byte-level
    tokenizer up to token `switch` and by the SentencePiece one after (an install), the scan
    having been reset first (a retract) after it saw other tokens."""
    a, b = tokenizer("byte-level"), tokenizer("sentencepiece")
    expected: tuple[int, str] = (len(ids), "")
    for t in range(1, len(ids) + 1):
        text = _decode(a if t <= switch else b, ids[:t])
        hit = next((s for s in stops if s and s in text), None)
        if hit is not None:
            expected = (t, hit)
            break
    scan, got = StopScan(tuple(stops)), (len(ids), "")
    for i in (5, 200, 7):  # what was generated before the retract
        if scan.matched([i], functools.partial(_decode, a), tokenizer=a, local=True):
            break
    scan.reset()
    for t in range(1, len(ids) + 1):
        tok = a if t <= switch else b
        found = scan.matched(
            ids[:t], functools.partial(_decode, tok), tokenizer=tok, local=decodes_locally(tok)
        )
        if found is not None:
            got = (t, found)
            break
    return got, expected


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_new_tokenizer_or_a_retract_starts_the_scan_over(data: st.DataObject) -> None:
    """A request paused in place across an install may go on under another tokenizer (the
    whole output is then decoded by the new one, as the old rule did at every token); a
    retract drops the output and regenerates it. Either way the scan starts over."""
    a, b = tokenizer("byte-level"), tokenizer("sentencepiece")
    ids = data.draw(st.lists(st.integers(0, min(len(a), len(b)) - 1), max_size=30), label="ids")
    switch = data.draw(st.integers(0, len(ids)), label="install after")
    texts = [_decode(t, ids[:i]) for t in (a, b) for i in range(1, len(ids) + 1)]
    stops = data.draw(stop_lists(texts), label="stops")
    got, expected = _across_an_install(ids, switch, stops)
    assert got == expected


def test_the_scan_forgets_the_text_the_old_tokenizer_decoded() -> None:
    """Found by the property above with random draws, when a new tokenizer did not start the
    scan over: the byte-level tokenizer decodes these ids as U+FFFD and two NULs, the
    SentencePiece one (a byte-fallback run that is not UTF-8) as three U+FFFD. Once the install
    lands, the whole output holds the stop string; a scan that kept the old text missed it."""
    got, expected = _across_an_install([0, 0, 131, 3, 3, 0], 5, ["\ufffd\ufffd"])
    assert expected == (6, "\ufffd\ufffd")
    assert got == expected


def _byte_ids(*pieces: bytes) -> list[int]:
    """The byte-level tokenizer's ids of `pieces`, one token each (a piece may cut a character)."""
    b2u = _bytes_to_unicode()
    tok = tokenizer("byte-level")
    return [tok.convert_tokens_to_ids("".join(b2u[b] for b in p)) for p in pieces]


@pytest.mark.parametrize(
    ("pieces", "stops", "expected"),
    [
        # "€" is E2 82 AC, one byte a token: it exists only once its last byte came
        ((b"a", b"\xe2", b"\x82", b"\xac", b"b"), ["€"], (4, "€")),
        # ... and before that the partial character decodes as U+FFFD, which the rule sees
        ((b"a", b"\xe2", b"\x82", b"\xac", b"b"), ["\ufffd"], (2, "\ufffd")),
        # "é" cut between two tokens, the stop string spanning three
        ((b"h", b"\xc3", b"\xa9", b"llo"), ["\xe9ll"], (4, "\xe9ll")),
        # a stop string that is a prefix of another stops first when it occurs first ...
        ((b"he", b"llo"), ["hello", "he"], (1, "he")),
        # ... and when both occur at once, the first in the request's order wins
        ((b"a", b"hel", b"lo"), ["hello", "hel"], (2, "hel")),
        ((b"a", b"he", b"llo"), ["hello", "hel"], (3, "hello")),
        ((b"a", b"he", b"llo"), ["hel", "hello"], (3, "hel")),
        # the kept tail reaches back the longest stop string's length - 1
        ((b"wo", b"r", b"l", b"d", b"!"), ["x", "world"], (4, "world")),
    ],
)
def test_named_cases_stop_where_the_whole_output_rule_stops(
    pieces: tuple[bytes, ...], stops: list[str], expected: tuple[int, str]
) -> None:
    tok = tokenizer("byte-level")
    ids = _byte_ids(*pieces)
    assert tok.unk_token_id not in ids
    decode = functools.partial(_decode, tok)
    assert whole_output_rule(decode, ids, stops) == expected
    assert scanned(tok, ids, stops) == expected


# -- through the engine ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def byte_level_engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An engine serving a tiny Qwen3 model whose tokenizer is `byte_level()` (the model's
    vocabulary is made large enough for it)."""
    tok = byte_level()
    alphabet = "".join(chr(0x100 + i) for i in range(len(tok)))
    model = init_model(tmp_path_factory.mktemp("byte-model") / "m", seed=3, vocab=alphabet)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model / name).unlink(missing_ok=True)
    tok.save_pretrained(model)
    core = EngineCore(context_length=200)
    ok, message, _ = core.update_weights_from_disk(str(model))
    assert ok, message
    assert core._tokenizer_local  # the tail is what is decoded
    yield core, tok
    core.shutdown()


def _run(core: EngineCore, **params: Any) -> dict[str, Any]:
    sp = SamplingParams(ignore_eos=True, temperature=1.0, **params)
    return core.submit(input_ids=[1, 4, 5, 6], params=sp).result(timeout=60)


def _expected_text(tok: Any, ids: Sequence[int], matched: str, *, skip: bool, trim: bool) -> str:
    text = str(tok.decode(list(ids), skip_special_tokens=skip))
    if trim and matched and (pos := text.find(matched)) != -1:
        text = text[:pos]
    return text


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), skip=st.booleans(), trim=st.booleans(), data=st.data())
def test_the_engine_answers_as_the_whole_output_rule_says(
    byte_level_engine: Any, seed: int, skip: bool, trim: bool, data: st.DataObject
) -> None:
    core, tok = byte_level_engine
    free = _run(core, max_new_tokens=40, sampling_seed=seed)["output_ids"]
    texts = [
        _decode(tok, free[:t], skip=sk) for t in range(1, len(free) + 1) for sk in (False, True)
    ]
    stops = data.draw(stop_lists(texts))
    stopped, matched = engine_rule(tok, free, stops, skip=skip)
    got = _run(
        core,
        max_new_tokens=40,
        sampling_seed=seed,
        stop=tuple(stops),
        skip_special_tokens=skip,
        no_stop_trim=not trim,
    )
    reason = {"type": "stop", "matched": matched} if matched else {"type": "length", "length": 40}
    assert got["meta_info"]["finish_reason"] == reason
    assert got["output_ids"] == free[:stopped]
    assert got["text"] == _expected_text(tok, free[:stopped], matched, skip=skip, trim=trim)


@pytest.fixture(scope="module")
def special_output(byte_level_engine: Any) -> tuple[int, list[int], int]:
    """(seed, output, where its first special token is): a seeded 40-token output of the
    byte-level engine with a special token in it (about one seed in three has one)."""
    core, tok = byte_level_engine
    specials = set(tok.all_special_ids)
    for seed in range(200):
        free = _run(core, max_new_tokens=40, sampling_seed=seed)["output_ids"]
        at = next((i for i, t in enumerate(free) if t in specials), None)
        if at is not None:
            return seed, free, at
    raise AssertionError("no seed gave a special token")


@pytest.mark.parametrize("skip", [True, False])
def test_a_stop_string_naming_a_special_token_stops_there(
    byte_level_engine: Any, special_output: tuple[int, list[int], int], skip: bool
) -> None:
    """SGLang looks for stop strings in the output decoded with its special tokens kept, so a
    stop string that names one (a chat template's end marker, `<|im_end|>`) stops the request
    there — with the default `skip_special_tokens` too, whose `text` leaves the token out. The
    engine looked only in the decoding without special tokens and ran on to `max_new_tokens`."""
    core, tok = byte_level_engine
    seed, free, at = special_output
    marker = str(tok.convert_ids_to_tokens(free[at]))
    assert engine_rule(tok, free, [marker], skip=skip) == (at + 1, marker)
    got = _run(
        core, max_new_tokens=40, sampling_seed=seed, stop=(marker,), skip_special_tokens=skip
    )
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": marker}
    assert got["output_ids"] == free[: at + 1]
    assert got["text"] == _expected_text(tok, free[: at + 1], marker, skip=skip, trim=True)
    assert marker not in got["text"]


def test_each_token_decodes_a_bounded_tail_not_the_whole_output(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check decoded the whole output after every token: 600 tokens decoded 180,300 ids
    (quadratic; 3,000 tokens took 1.3× as long as without a stop string). Now each token
    decodes a tail of a few ids, and the answer's `text` the output once."""
    core = EngineCore(context_length=700)
    try:
        assert core.update_weights_from_disk(str(tiny_model))[0]
        tok = core._tokenizer
        decoded: list[int] = []
        real = tok.decode

        def counted(ids: Sequence[int], **kw: Any) -> Any:
            decoded.append(len(ids))
            return real(ids, **kw)

        monkeypatch.setattr(tok, "decode", counted)
        tokens = 600
        r = _run(core, max_new_tokens=tokens, sampling_seed=1, stop=("#", "never"))
        assert r["meta_info"]["finish_reason"] == {"type": "length", "length": tokens}
        assert sum(decoded) - tokens < 8 * tokens, f"{sum(decoded)} ids decoded"
    finally:
        core.shutdown()
