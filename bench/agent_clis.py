"""The real coding-agent CLIs against `hetero serve` on the bundled model: per CLI, the first turn's TTFT, the second
turn's TTFT read from the prefix cache against the same second turn with the cache off, and the whole turn as the
client reports it.

    python bench/agent_clis.py                      # all three CLIs; JSON under bench/results/agent_clis.json
    python bench/agent_clis.py --clis codex --repeats 3

Needs npm (the CLIs at the versions pinned in tests/agent_clis.py are installed once into ~/.cache/hetero) and
`unshare -n` (each session runs in a network namespace with only loopback). Each session starts `hetero serve`,
asks "Say hello.", then continues the session with a second prompt. A session runs twice per repeat, alternated: with
the RAM prefix cache (the default) and with `--prefix-cache-max-gb 0`, its baseline. TTFT is the server's (access
log, from the start of the request's prefill); "turn" is the CLI's own duration where it reports one (Claude Code),
else the wall time of its command, which includes the CLI's start-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import agent_clis  # noqa: E402

from hetero.checkpoint.source import BUNDLED_MODEL  # noqa: E402

TURNS = ["Say hello.", "Thanks. Say it once more."]


def summarize(result: dict) -> dict:
    turns = []
    for turn in result["turns"]:
        main = agent_clis.main_request(turn)
        turns.append({
            "ok": turn["returncode"] == 0 and turn["reply"]["error"] is None,
            "prompt_tokens": int(main["prompt"]) if main else None,
            "cached_tokens": int(main["cached"]) if main else None,
            "completion_tokens": int(main["completion"]) if main else None,
            "ttft_s": float(main["ttft"]) if main else None,
            "turn_s": turn["reply"]["client_seconds"] or turn["seconds"],
            "requests": len(turn["requests"]),
            "reply": turn["reply"]["text"][:200],
        })
    return {"turns": turns}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clis", nargs="+", choices=sorted(agent_clis.PINS), default=sorted(agent_clis.PINS))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--model", default=str(BUNDLED_MODEL))
    ap.add_argument("--out", default=str(ROOT / "bench/results/agent_clis.json"))
    a = ap.parse_args()
    why = agent_clis.namespaces_available()
    if why:
        raise SystemExit(f"cannot run the agent CLIs here: {why}")
    bin_dir = agent_clis.install()
    runs: dict[str, dict[str, list]] = {cli: {"cached": [], "uncached": []} for cli in a.clis}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            for cli in a.clis:
                for mode in (("cached", "uncached") if r % 2 == 0 else ("uncached", "cached")):
                    args = ["--prefix-cache-max-gb", "0"] if mode == "uncached" else []
                    t0 = time.perf_counter()
                    result = agent_clis.session(cli, a.model, TURNS, Path(tmp) / f"{cli}-{mode}-{r}", bin_dir,
                                                serve_args=args)
                    summary = summarize(result)
                    runs[cli][mode].append(summary)
                    first, second = summary["turns"]
                    print(f"{cli} {mode}: turn 1 TTFT {first['ttft_s']} s ({first['prompt_tokens']} tokens), turn 2 "
                          f"TTFT {second['ttft_s']} s ({second['cached_tokens']} of {second['prompt_tokens']} cached), "
                          f"turns {first['turn_s']:.1f} / {second['turn_s']:.1f} s, ok {first['ok']}/{second['ok']} "
                          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    table = {}
    for cli in a.clis:
        def median(mode, i, key):
            values = [s["turns"][i][key] for s in runs[cli][mode] if s["turns"][i][key] is not None]
            return statistics.median(values) if values else None

        second_cold, second_cached = median("uncached", 1, "ttft_s"), median("cached", 1, "ttft_s")
        table[cli] = {
            "version": agent_clis.PINS[cli][1],
            "first_turn_prompt_tokens": median("cached", 0, "prompt_tokens"),
            "first_turn_ttft_s": median("cached", 0, "ttft_s"),
            "second_turn_cached_tokens": median("cached", 1, "cached_tokens"),
            "second_turn_ttft_s": second_cached,
            "second_turn_ttft_without_cache_s": second_cold,
            "second_turn_speedup": second_cold / second_cached if second_cold and second_cached else None,
            "first_turn_s": median("cached", 0, "turn_s"),
            "second_turn_s": median("cached", 1, "turn_s"),
            "all_turns_ok": all(t["ok"] for mode in runs[cli].values() for s in mode for t in s["turns"]),
        }
    print(f"\n| CLI | first turn: prompt tokens, TTFT | second turn: cached tokens, TTFT (without cache) | "
          f"whole turn 1 / 2 |")
    for cli, row in table.items():
        print(f"| {cli} {row['version']} | {row['first_turn_prompt_tokens']}, {row['first_turn_ttft_s']:.2f} s | "
              f"{row['second_turn_cached_tokens']}, {row['second_turn_ttft_s']:.2f} s "
              f"({row['second_turn_ttft_without_cache_s']:.2f} s, {row['second_turn_speedup']:.0f}x) | "
              f"{row['first_turn_s']:.1f} / {row['second_turn_s']:.1f} s |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"table": table, "runs": runs, "model": a.model, "turns": TURNS}, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
