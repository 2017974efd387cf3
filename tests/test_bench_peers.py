"""bench/peers.py's own logic: the mlx-vlm copy of a checkpoint (mrope_section added, the original untouched) and
the greedy-identity check across engines. The measuring itself is the bench's, not a test's."""

import hashlib
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is not installed: import it from the tree
from bench.peers import (  # noqa: E402
    decode_rate,
    failure_line,
    first_difference,
    mismatches,
    mlx_vlm_checkpoint,
    mrope_section,
    thread_command,
    with_mrope_section,
)
from hetero.checkpoint.source import BUNDLED_MODEL  # noqa: E402


def _digests(folder):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir()) if f.is_file()}


def test_mrope_section_splits_the_rotary_pairs_as_qwen3_5_does():
    # Qwen3.5's full-size attention: head_dim 256, a quarter of it rotary -> 32 frequency pairs -> [11, 11, 10]
    assert mrope_section({"head_dim": 256, "rope_parameters": {"partial_rotary_factor": 0.25}}) == [11, 11, 10]
    # the bundled model: head_dim 64 -> 8 pairs
    assert mrope_section({"head_dim": 64, "rope_parameters": {"partial_rotary_factor": 0.25}}) == [3, 3, 2]


def test_with_mrope_section_adds_it_and_leaves_the_input_alone():
    config = json.loads((BUNDLED_MODEL / "config.json").read_text())
    before = json.dumps(config, sort_keys=True)
    out = with_mrope_section(config)
    assert json.dumps(config, sort_keys=True) == before
    rope = out["text_config"]["rope_parameters"]
    assert rope["mrope_section"] == [3, 3, 2]
    assert {k: v for k, v in rope.items() if k != "mrope_section"} == config["text_config"]["rope_parameters"]
    # a section already there is kept, not recomputed
    assert with_mrope_section(out)["text_config"]["rope_parameters"]["mrope_section"] == [3, 3, 2]
    custom = json.loads(json.dumps(out))
    custom["text_config"]["rope_parameters"]["mrope_section"] = [4, 4, 0]
    assert with_mrope_section(custom)["text_config"]["rope_parameters"]["mrope_section"] == [4, 4, 0]


def test_mlx_vlm_checkpoint_links_the_weights_and_never_writes_the_original(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(BUNDLED_MODEL, src)
    before = _digests(src)
    copy = mlx_vlm_checkpoint(src, tmp_path / "vlm")
    mlx_vlm_checkpoint(src, tmp_path / "vlm")  # a second call over the same folder is fine
    assert _digests(src) == before
    assert sorted(p.name for p in copy.iterdir()) == sorted(before)
    rewritten = ("config.json", "tokenizer.json", "tokenizer_config.json")
    for name in before:
        if name not in rewritten:
            assert (copy / name).is_symlink() and (copy / name).resolve() == (src / name).resolve()
    assert not any((copy / name).is_symlink() for name in rewritten)
    config = json.loads((copy / "config.json").read_text())
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [3, 3, 2]


def test_the_mlx_vlm_copy_names_every_id_of_a_vocabulary_larger_than_its_tokenizer(tmp_path):
    """The large random checkpoint borrows the bundled tokenizer for twice its vocabulary: the copy's tokenizer, as
    transformers loads it, names every id below the config's vocab_size, and encodes text to the same ids."""
    from transformers import AutoTokenizer

    src = tmp_path / "src"
    shutil.copytree(BUNDLED_MODEL, src)
    config = json.loads((src / "config.json").read_text())
    vocab = config["text_config"]["vocab_size"]
    config["text_config"]["vocab_size"] = 2 * vocab
    (src / "config.json").write_text(json.dumps(config))
    original = AutoTokenizer.from_pretrained(str(src))
    padded = AutoTokenizer.from_pretrained(str(mlx_vlm_checkpoint(src, tmp_path / "vlm")))
    assert len(original) == vocab and len(padded) == 2 * vocab
    assert sorted(padded.get_vocab().values()) == list(range(2 * vocab))
    text = "def f(x):\n    return x + 1  # <|im_end|>"
    assert padded.encode(text) == original.encode(text)
    assert padded.decode(list(range(vocab, vocab + 3))) == "".join(f"<|bench_pad_{i}|>" for i in range(vocab, vocab + 3))


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2
    assert first_difference([], []) is None


def test_mismatches_names_every_engine_round_and_prompt_that_differs():
    reference = [[1, 2, 3, 4], [7, 8, 9]]
    runs = {
        "hetero": [reference, reference],
        "peer a": [reference, [[1, 2, 3, 4], [7, 8, 0]]],  # second round, second prompt, from index 2
        "peer b": [[[1, 2, 3], [7, 8, 9]]],  # one token short on the first prompt
    }
    found = mismatches(reference, runs)
    assert [(m["engine"], m["round"], m["prompt"], m["first_difference"]) for m in found] == [
        ("peer a", 1, 1, 2), ("peer b", 0, 0, 3)]
    assert found[0]["reference_tokens"] == [9] and found[0]["tokens"] == [0]
    assert found[1]["reference_length"] == 4 and found[1]["length"] == 3
    assert mismatches(reference, {"hetero": [reference]}) == []


def test_decode_rate_weighs_prompts_by_their_time():
    assert decode_rate([{"tokens_timed": 10, "decode_s": 1.0}, {"tokens_timed": 30, "decode_s": 1.0}]) == 20.0
    # 20 tok/s then 6.7 tok/s: 20 tokens in 2 s is 10 tok/s (the mean of the two rates would say 13.3)
    assert decode_rate([{"tokens_timed": 10, "decode_s": 0.5}, {"tokens_timed": 10, "decode_s": 1.5}]) == 10.0
    assert decode_rate([]) == 0.0


def test_thread_command_pins_cores_only_where_there_are_more():
    prefix, env = thread_command(1, 2)
    assert env == {"MKL_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    if shutil.which("taskset"):
        assert prefix == ["taskset", "-c", "0"]
    assert thread_command(2, 2) == ([], {"MKL_NUM_THREADS": "2", "OMP_NUM_THREADS": "2"})


def test_failure_line_is_the_exception_and_where_it_was_raised():
    traceback = """WARNING: something loud first
Traceback (most recent call last):
  File "/work/bench/peers.py", line 260, in worker
    generate(ids)
  File "/venv/lib/python3.11/site-packages/mlx_vlm/tokenizer_utils.py", line 232, in add_token
    v = self.tokenmap[token]
IndexError: list index out of range
"""
    assert failure_line(traceback, 1) == "IndexError: list index out of range (in add_token, mlx_vlm/tokenizer_utils.py:232)"
    assert failure_line("no such model\n", 2) == "no such model"
    assert failure_line("", -9) == "exit status -9"
    assert len(failure_line("x" * 1000, 1)) == 300
