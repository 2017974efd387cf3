"""Tokenizer, chat template, streaming detokenizer and the bundled tokenizer's training corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, normalizers

from hetero.training.tokenizer_train import (
    CHAT_TEMPLATE, SPECIAL_TOKENS, corpus_files, load_corpus, save_tokenizer, train_tokenizer,
)
from hetero.checkpoint.tokenizer import StreamingDetokenizer, Tokenizer
from hetero.errors import HeteroError

MULTIBYTE = "é€🙂中文"
SAMPLE = "def f(x):\n    return x + 1  # héllo € 🙂 中文\n\n\tclass A: pass\n"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny (vocab 400) tokenizer trained on a few KB of stdlib source, saved like the bundled one."""
    train_text, _ = load_corpus(max_bytes=8_000)
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(train_text, vocab_size=400), out)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable char map that byte-level BPE uses for its 256 base tokens."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


# --- encode / decode ------------------------------------------------------------------------------------------

def test_round_trip_including_non_ascii(tok: Tokenizer) -> None:
    for text in [SAMPLE, MULTIBYTE, "  leading spaces", "ü" * 7, ""]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == 400


def test_special_tokens_written_literally_are_single_ids(tok: Tokenizer) -> None:
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(special) == i
        assert tok.encode(special) == [i]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and 0 not in ids
    assert tok.eos_token_ids == {2}
    assert tok.token_to_id("no-such-token") is None


# --- chat template --------------------------------------------------------------------------------------------

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
CHAT_EXPECTED = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                 "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_renders_chatml(tok: Tokenizer) -> None:
    assert tok.has_chat_template
    assert tok.apply_chat_template(CHAT) == CHAT_EXPECTED
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False) == CHAT_EXPECTED.removesuffix(
        "<|im_start|>assistant\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image"},
                                          {"type": "text", "text": " there"}]}]
    assert tok.apply_chat_template(parts) == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_jinja_file_wins_and_gets_hf_globals(tok_dir: Path, tmp_path: Path) -> None:
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}"
        "{{ tools | tojson }}|{{ eos_token }}|{{ flag }}|{{ strftime_now('%Y') | length }}"
        "{% if add_generation_prompt %}>{% endif %}", encoding="utf-8")
    t = Tokenizer.from_dir(tmp_path)
    out = t.apply_chat_template([{"role": "user", "content": "é"}], tools=[{"name": "ü"}], flag=7)
    assert out == '[user]é\n[{"name": "ü"}]|<|im_end|>|7|4>'

    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}", encoding="utf-8")
    with pytest.raises(HeteroError, match="no system role"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(CHAT)


def test_template_list_form_and_dict_tokens(tok_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    config = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
              "eos_token": {"content": "<|endoftext|>", "special": True}, "bos_token": "<|im_start|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    t = Tokenizer.from_dir(tmp_path)
    assert t.apply_chat_template(CHAT) == "D"
    assert t.eos_token_ids == {0} and t.bos_token == "<|im_start|>"


def test_no_template_is_a_user_error(tok_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    t = Tokenizer.from_dir(tmp_path)  # no tokenizer_config.json at all
    assert not t.has_chat_template and t.eos_token_ids == set()
    with pytest.raises(HeteroError, match="no chat template; run without --chat or add chat_template.jinja"):
        t.apply_chat_template(CHAT)


def test_missing_or_bad_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(HeteroError, match="tokenizer.json") as e:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(HeteroError, match="tokenizer.json") as e:
        Tokenizer.from_dir(tmp_path)
    assert "\n" not in str(e.value)


def test_bad_tokenizer_config_names_the_file(tok_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("{", encoding="utf-8")
    with pytest.raises(HeteroError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)


# --- streaming detokenizer ------------------------------------------------------------------------------------

def _stream(t: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    d = t.detokenizer()
    chunks = [d.add(i) for i in ids]
    tail = d.finalize()
    assert d.text == "".join(chunks) + tail
    return chunks, tail


def _interesting_ids(t: Tokenizer) -> list[int]:
    """Byte tokens of the pieces of multibyte characters, plus whole-character and special tokens."""
    byte_char = _bytes_to_unicode()
    ids = {t.token_to_id(byte_char[b]) for b in MULTIBYTE.encode("utf-8")}
    ids |= set(t.encode(MULTIBYTE + " é€")) | {0, 1, 2}
    assert None not in ids
    return sorted(ids)


@settings(max_examples=100, deadline=None, database=None)
@given(data=st.data())
def test_streaming_detokenizer_matches_decode(tok: Tokenizer, data: st.DataObject) -> None:
    token = st.one_of(st.sampled_from(_interesting_ids(tok)), st.integers(0, tok.vocab_size - 1))
    ids = data.draw(st.lists(token, max_size=40))
    chunks, tail = _stream(tok, ids)
    assert "".join(chunks) + tail == tok.decode(ids)
    assert not any(c.endswith("\ufffd") for c in chunks)  # never a split character mid-stream


TEXT_PIECES = [*"ab \n\t(),é€🙂中文", "  ", "def ", "<|im_end|>"]


@settings(max_examples=50, deadline=None, database=None)
@given(text=st.lists(st.sampled_from(TEXT_PIECES), max_size=40).map("".join))
def test_streaming_valid_text_never_shows_replacement(tok: Tokenizer, text: str) -> None:
    chunks, tail = _stream(tok, tok.encode(text))
    assert "".join(chunks) + tail == text
    assert "\ufffd" not in "".join(chunks)


def test_streaming_emits_each_character_once_complete(tok: Tokenizer) -> None:
    byte_char = _bytes_to_unicode()
    ids = [tok.token_to_id(byte_char[b]) for b in "a🙂".encode("utf-8")]
    d = tok.detokenizer()
    assert [d.add(i) for i in ids] == ["a", "", "", "", "🙂"]
    assert d.finalize() == ""


def test_streaming_flushes_garbage_bytes(tok: Tokenizer) -> None:
    byte_char = _bytes_to_unicode()
    cont = tok.token_to_id(byte_char[0x80])  # a lone continuation byte: invalid forever
    ids = [cont] * 300
    chunks, tail = _stream(tok, ids)
    assert "".join(chunks) + tail == tok.decode(ids) == "\ufffd" * 300
    assert len(tail) < 300  # flushed before finalize, so add() stays O(1)


@pytest.fixture(scope="module")
def metaspace_tok() -> Tokenizer:
    """A SentencePiece-style (Llama 2) tokenizer: byte fallback, and the decoder strips the first leading space."""
    chars = list("▁abcdefghijklmnopqrstuvwxyz")
    vocab = {"<unk>": 0} | {f"<0x{b:02X}>": 1 + b for b in range(256)}
    vocab |= {c: 257 + i for i, c in enumerate(chars)} | {"▁a": 257 + len(chars), "▁b": 258 + len(chars)}
    t = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁", "b")], byte_fallback=True,
                                        unk_token="<unk>"))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    return Tokenizer(t)


@settings(max_examples=50, deadline=None, database=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab cz") + list(MULTIBYTE)), max_size=40))
def test_streaming_keeps_leading_spaces_with_metaspace(metaspace_tok: Tokenizer, text: str) -> None:
    ids = metaspace_tok.encode(text)
    chunks, tail = _stream(metaspace_tok, ids)
    assert "".join(chunks) + tail == metaspace_tok.decode(ids)
    assert not any(c.endswith("\ufffd") for c in chunks)


def test_detokenizer_type(tok: Tokenizer) -> None:
    assert isinstance(tok.detokenizer(), StreamingDetokenizer)


# --- corpus ---------------------------------------------------------------------------------------------------

def test_corpus_files_deterministic_and_without_tests() -> None:
    files = corpus_files()
    assert files and files == corpus_files()
    assert all(f.suffix == ".py" and f.stat().st_size <= 200_000 for f in files)
    excluded = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages"}
    assert not any(excluded.intersection(f.parts) for f in files)
    assert any(f.name == "argparse.py" for f in files)


def test_load_corpus_split_is_disjoint_and_capped() -> None:
    train, valid = load_corpus()
    train_docs = set(train.split("\n<|endoftext|>\n"))
    valid_docs = valid.split("\n<|endoftext|>\n")
    assert len(valid_docs) == len(corpus_files()) // 20
    assert not train_docs.intersection(valid_docs)
    capped, valid2 = load_corpus(max_bytes=5_000)
    assert len(capped.encode("utf-8")) <= 5_000 and train.startswith(capped) and valid2 == valid


# --- transformers parity --------------------------------------------------------------------------------------

def test_hf_auto_tokenizer_parity(tok: Tokenizer, tok_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    text = SAMPLE + "<|im_start|>user\nhi<|im_end|>"
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert hf.decode(tok.encode(text)) == text
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>"
    assert hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == CHAT_EXPECTED
    assert hf.chat_template == CHAT_TEMPLATE
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    assert fast.encode(text, add_special_tokens=False) == tok.encode(text)
