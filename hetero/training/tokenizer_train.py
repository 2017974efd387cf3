"""Corpus and byte-level BPE tokenizer for the bundled tiny model.

The corpus is the Python standard library's own source, so training needs no download and every CPython
install can rebuild it. The tokenizer is saved as a HF-compatible tokenizer.json + tokenizer_config.json.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

EOS_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TEXT, "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
DOC_SEPARATOR = f"\n{EOS_TEXT}\n"
VALID_EVERY = 20  # every 20th corpus file is validation
MAX_FILE_BYTES = 200_000  # skips generated tables such as pydoc_data/topics.py
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo"}

# ChatML as Qwen writes it; list-of-parts content keeps only the text parts, joined.
CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {%- if message['content'] is string %}\n"
    "        {%- set content = message['content'] %}\n"
    "    {%- elif message['content'] is none %}\n"
    "        {%- set content = '' %}\n"
    "    {%- else %}\n"
    "        {%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files() -> list[Path]:
    """The standard library's .py files, sorted by relative path, minus tests, tools and huge generated files."""
    root = _stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        dirs = rel.parts[:-1]
        if _EXCLUDED_DIRS.intersection(dirs):
            continue
        # build-specific files (sysconfig data, config-3.x-<platform>/) differ between installs
        if rel.name.startswith("_sysconfigdata") or (dirs and dirs[0].startswith("config-")):
            continue
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            continue
        files.append(rel)
    return [root / rel for rel in sorted(files, key=lambda r: r.as_posix())]


def corpus_sources() -> Iterator[tuple[str, str, bool]]:
    """(module name, source text, held out?) for each corpus file; every 20th file is held out for validation."""
    root = _stdlib_root()
    for i, path in enumerate(corpus_files()):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        yield module, path.read_bytes().decode("utf-8", errors="replace"), i % VALID_EVERY == VALID_EVERY - 1


def load_corpus(max_bytes: int | None = None) -> tuple[str, str]:
    """(train_text, valid_text): every 20th file is validation, files joined by "\\n<|endoftext|>\\n".

    `max_bytes` truncates the train text to at most that many UTF-8 bytes.
    """
    train, valid = [], []
    for _, text, held_out in corpus_sources():
        (valid if held_out else train).append(text)
    train_text = DOC_SEPARATOR.join(train)
    if max_bytes is not None:
        # drop a multibyte character cut in half by the cap rather than keep a broken byte
        train_text = train_text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
    return train_text, DOC_SEPARATOR.join(valid)


def _documents(text_iter: Iterable[str] | str) -> Iterator[str]:
    """Split on <|endoftext|> so special tokens never enter BPE statistics and the trainer gets parallel work."""
    if isinstance(text_iter, str):
        text_iter = [text_iter]
    for text in text_iter:
        for doc in text.split(EOS_TEXT):
            if doc:
                yield doc


def train_tokenizer(text_iter: Iterable[str] | str, vocab_size: int = 4096) -> tokenizers.Tokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style, all 256 bytes in the alphabet) with ChatML special tokens."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # as Qwen's tokenizer.json: offsets only
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is a token, so any text encodes
        show_progress=False,
    )
    tok.train_from_iterator(_documents(text_iter), trainer=trainer)
    return tok


def save_tokenizer(tok: tokenizers.Tokenizer, out_dir: Path, max_length: int = 65536) -> None:
    """Write tokenizer.json and a transformers-compatible tokenizer_config.json (with CHAT_TEMPLATE) to out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                 "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": EOS_TEXT,
        "model_max_length": max_length,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,  # transformers would otherwise rewrite " ," etc. on decode
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
