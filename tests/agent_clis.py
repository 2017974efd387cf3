"""The real coding-agent CLIs against `hetero serve`, inside a network namespace with only loopback.

    unshare -n python tests/agent_clis.py SPEC.json RESULT.json   (unshare -r -n when not root)

Claude Code, Codex CLI and OpenCode are installed from npm at the pinned versions below into a cache folder
(`install`), once per pin set. A session (`run_session`) brings up `lo`, starts `hetero serve` on a model, runs the
spec's turns of one CLI one after another (a later turn continues the CLI's last session), stops the server, and
returns each turn's exit status, output, the reply the client shows, the usage it reports, its wall time, and the
server's access-log lines (prompt, cached and completion tokens and TTFT of every request). `session` runs one
under `unshare -n` from outside, so that no request can leave the machine. The configuration each CLI gets here is
the one docs/server.md gives users ("Using hetero with coding agents").
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

PINS = {  # CLI -> (npm package, version): bump together with the table in docs/server.md
    "claude": ("@anthropic-ai/claude-code", "2.1.332"),
    "codex": ("@openai/codex", "0.171.0"),
    "opencode": ("opencode-ai", "1.18.33"),
}
CACHE = Path(os.environ.get("HETERO_AGENT_CLI_CACHE", Path.home() / ".cache" / "hetero" / "agent-clis"))
ALIASES = ["claude-*=MODEL", "gpt-*=MODEL"]  # the names the CLIs send for their main and background calls
ACCESS = re.compile(r'"(?P<method>\w+) (?P<path>\S+)" (?P<status>\d+)(?: prompt_tokens=(?P<prompt>\d+) '
                    r'cached_tokens=(?P<cached>\d+) completion_tokens=(?P<completion>\d+) ttft=(?P<ttft>[\d.]+)s)? '
                    r'(?P<seconds>[\d.]+)s$')


class Unavailable(RuntimeError):
    """npm, node or network namespaces are missing here: the CLIs cannot run."""


def install(cache: Path = CACHE) -> Path:
    """The CLIs at their pinned versions, installed from npm once into `cache`; returns node_modules/.bin.

    The install goes to a temporary folder renamed into place when complete, so a cut-off install is never used;
    processes that ask at once (pytest-xdist's workers) wait on a lock for the one that installs."""
    key = hashlib.sha256(json.dumps(PINS, sort_keys=True).encode()).hexdigest()[:12]
    target = cache / key
    if (target / "complete").is_file():
        return target / "node_modules" / ".bin"
    if shutil.which("npm") is None or shutil.which("node") is None:
        raise Unavailable("npm and node are needed to install the agent CLIs (Debian: apt install nodejs npm)")
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "complete").is_file():  # else another process installed it while this one waited
            _npm_install(target)
    return target / "node_modules" / ".bin"


def _npm_install(target: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=target.parent))
    packages = [f"{name}@{version}" for name, version in PINS.values()]
    done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error", "--prefix", str(work),
                           *packages], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        raise RuntimeError(f"npm install {' '.join(packages)} failed:\n{done.stderr[-2000:]}")
    (work / "complete").write_text(json.dumps(PINS) + "\n")
    shutil.rmtree(target, ignore_errors=True)  # a folder left without its `complete` mark
    work.rename(target)


# a network namespace of its own; a user who is not root also maps itself to root in a user namespace to get one
UNSHARE = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-r", "-n"]


def namespaces_available() -> str | None:
    """None when a network namespace with a working loopback can be made here, else why not."""
    if shutil.which("unshare") is None:
        return "`unshare` (util-linux) is not installed"
    probe = subprocess.run([*UNSHARE, sys.executable, __file__, "--probe"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"`{' '.join(UNSHARE)}` is refused here: {probe.stderr.strip()[-300:]}"


def loopback_up() -> None:
    """Bring up `lo` in this (new) network namespace, as `ip link set lo up` does (SIOCSIFFLAGS on the interface)."""
    get_flags, set_flags, up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, get_flags, request)[:18])[1]
        fcntl.ioctl(s, set_flags, struct.pack("16sH", b"lo", flags | up))


# ----------------------------------------------------------------------------------------------------------
# Each CLI's configuration, command line and output


def configure(cli: str, home: Path, work: Path, port: int) -> dict[str, str]:
    """Write the CLI's configuration for a server on `port` under `home` / `work`; returns its environment."""
    url = f"http://127.0.0.1:{port}"
    env = {"HOME": str(home), "PATH": os.environ["PATH"], "TERM": "dumb", "NO_COLOR": "1", "LANG": "C.UTF-8"}
    if cli == "claude":
        env.update(ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY="hetero", DISABLE_TELEMETRY="1",
                   DISABLE_AUTOUPDATER="1", DISABLE_ERROR_REPORTING="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
    elif cli == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(
            'model = "hetero"\nmodel_provider = "hetero"\n\n[model_providers.hetero]\nname = "hetero"\n'
            f'base_url = "{url}/v1"\nwire_api = "responses"\n')
        env.update(CODEX_HOME=str(codex_home))
    elif cli == "opencode":
        config = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
                  "model": "hetero/hetero", "permission": {"bash": "allow", "read": "allow"},
                  "provider": {"hetero": {"npm": "@ai-sdk/openai-compatible", "name": "hetero",
                                          "options": {"baseURL": f"{url}/v1", "apiKey": "hetero"},
                                          "models": {"hetero": {"name": "hetero"}}}}}
        (work / "opencode.json").write_text(json.dumps(config, indent=2) + "\n")
    else:
        raise ValueError(f"unknown CLI {cli!r}: one of {sorted(PINS)}")
    return env


def command(cli: str, bin_dir: Path, prompt: str, resume: bool, tools: list[str] | None = None) -> list[str]:
    """The CLI's non-interactive command for one turn; `resume` continues its most recent session. `tools`
    (Claude Code only) narrows its tool list, and lets those tools run without asking."""
    if cli == "claude":
        extra = ["--tools", *tools, "--allowedTools", *tools] if tools else []
        return [str(bin_dir / "claude"), "-p", prompt, "--output-format", "json", "--model", "claude-sonnet-4-5",
                *(["--continue"] if resume else []), *extra]
    if cli == "codex":
        flags = ["--skip-git-repo-check", "--json", "--dangerously-bypass-approvals-and-sandbox"]
        return [str(bin_dir / "codex"), "exec", *(["resume", "--last"] if resume else []), *flags, prompt]
    return [str(bin_dir / "opencode"), "run", "--format", "json", *(["--continue"] if resume else []), prompt]


def stream_json_command(bin_dir: Path, system: str | None = None) -> list[str]:
    """Claude Code reading user messages (Anthropic content, images too) as stream-json on stdin, as its SDK and
    IDE integrations send a pasted screenshot; no tools, and `system` in place of its own system prompt."""
    return [str(bin_dir / "claude"), "-p", "--input-format", "stream-json", "--output-format", "stream-json",
            "--verbose", "--model", "claude-sonnet-4-5", "--tools", "",
            *(["--system-prompt", system] if system else [])]


@dataclass
class Reply:
    """What the client shows of a turn: the reply's text, the tools it ran, and the usage and time it reports."""

    text: str = ""
    tools: list[str] = field(default_factory=list)
    error: str | None = None
    cached_tokens: int | None = None
    client_seconds: float | None = None


def _json_lines(out: str) -> list[dict]:
    events = []
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return events


def parse(cli: str, stdout: str) -> Reply:
    """The reply as the CLI's JSON output gives it."""
    reply = Reply()
    if cli == "claude":
        result = next((e for e in _json_lines(stdout) if e.get("type") == "result"), None)
        if result is None:
            return Reply(error=f"no result in Claude Code's output: {stdout[-500:]!r}")
        reply.text = result.get("result") or ""
        reply.error = reply.text if result.get("is_error") else None
        reply.cached_tokens = (result.get("usage") or {}).get("cache_read_input_tokens")
        reply.client_seconds = result["duration_ms"] / 1000 if "duration_ms" in result else None
        return reply
    for e in _json_lines(stdout):
        kind = e.get("type")
        if cli == "codex":
            item = e.get("item") or {}
            if kind == "item.completed" and item.get("type") == "agent_message":
                reply.text += item.get("text", "")
            elif kind == "item.completed" and item.get("type") == "command_execution":
                reply.tools.append(item.get("command", ""))
            elif kind == "turn.completed":
                reply.cached_tokens = (e.get("usage") or {}).get("cached_input_tokens")
            elif kind in ("error", "turn.failed"):
                reply.error = json.dumps(e)[:500]
        else:
            part = e.get("part") or {}
            if kind == "text":
                reply.text += part.get("text", "")
            elif kind == "tool_use":
                reply.tools.append(json.dumps((part.get("state") or {}).get("input", {})))
            elif kind == "step_finish":
                cache = ((part.get("tokens") or {}).get("cache") or {}).get("read")
                reply.cached_tokens = (reply.cached_tokens or 0) + (cache or 0)
            elif kind == "error":
                reply.error = json.dumps(e)[:500]
    return reply


# ----------------------------------------------------------------------------------------------------------
# A session, inside the namespace


@dataclass
class Turn:
    prompt: str
    returncode: int
    seconds: float
    reply: Reply
    requests: list[dict]  # the access-log lines of the requests this turn made
    stdout: str
    stderr: str


def _wait_healthy(port: int, server: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"hetero serve exited with status {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"hetero serve was not healthy within {timeout:.0f} s")


def _access_lines(log: Path, start: int) -> tuple[list[dict], int]:
    text = log.read_text(errors="replace")
    found = []
    for line in text[start:].splitlines():
        if "hetero.access" in line and (m := ACCESS.search(line)):
            found.append({k: v for k, v in m.groupdict().items() if v is not None})
    return found, len(text)


def main_request(turn: dict) -> dict | None:
    """A turn's conversation request: the generating one with the longest prompt (titles and probes are short);
    None when the turn generated nothing."""
    generated = [r for r in turn["requests"] if "prompt" in r]
    return max(generated, key=lambda r: int(r["prompt"])) if generated else None


def run_session(spec: dict) -> dict:
    """Run one spec inside the current (already isolated) network namespace; see the module docstring."""
    loopback_up()
    root = Path(spec["dir"])
    home, work = root / "home", root / "work"
    for d in (home, work):
        d.mkdir(parents=True, exist_ok=True)
    port, cli = spec.get("port", 8080), spec["cli"]
    log = root / "server.log"
    aliases = [a.replace("MODEL", "hetero") for a in ALIASES]
    serve = [sys.executable, "-m", "hetero", "serve", "--model", spec["model"], "--port", str(port),
             "--served-model-name", "hetero", "--no-session-cache", *spec.get("serve_args", [])]
    serve += [arg for alias in aliases for arg in ("--model-alias", alias)]
    env = configure(cli, home, work, port)
    repo = str(Path(__file__).resolve().parents[1])  # the checkout under test, not whatever hetero is installed
    server_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as sink:
        server = subprocess.Popen(serve, stdout=sink, stderr=subprocess.STDOUT, cwd=root, env=server_env)
    turns, seen = [], 0
    try:
        _wait_healthy(port, server)
        _, seen = _access_lines(log, 0)
        for i, prompt in enumerate(spec["turns"]):
            argv = command(cli, Path(spec["bin"]), prompt, resume=i > 0, tools=spec.get("tools"))
            feed = {"stdin": subprocess.DEVNULL}
            if isinstance(prompt, list):  # Claude Code fed user messages as its SDK sends them (pasted images)
                argv = stream_json_command(Path(spec["bin"]), spec.get("system"))
                feed = {"input": "".join(json.dumps({"type": "user", "message": {"role": "user", "content": m}})
                                         + "\n" for m in prompt)}
            t0 = time.perf_counter()
            done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True,
                                  timeout=spec.get("timeout", 600), **feed)
            seconds = time.perf_counter() - t0
            time.sleep(0.3)  # the access line is written once the response has ended
            requests, seen = _access_lines(log, seen)
            turns.append(Turn(prompt, done.returncode, seconds, parse(cli, done.stdout), requests,
                              done.stdout[-20000:], done.stderr[-5000:]))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    return {"cli": cli, "version": PINS[cli][1], "model": spec["model"], "turns": [asdict(t) for t in turns],
            "server_log": log.read_text(errors="replace")[-20000:], "files": sorted(p.name for p in work.iterdir())}


def session(cli: str, model: str, turns: list, root: Path, bin_dir: Path, tools: list[str] | None = None,
            timeout: float = 600, serve_args: list[str] = (), system: str | None = None) -> dict:
    """Run a session of `cli` against `hetero serve --model model` under `unshare -n`; returns its result. A turn
    is a prompt, or (Claude Code) a list of user messages' content fed as stream-json in one run (`system` then
    replaces its system prompt)."""
    root.mkdir(parents=True, exist_ok=True)
    spec = {"cli": cli, "model": str(model), "turns": turns, "dir": str(root), "bin": str(bin_dir), "tools": tools,
            "timeout": timeout, "serve_args": list(serve_args), "system": system}
    (root / "spec.json").write_text(json.dumps(spec, indent=2))
    out = root / "result.json"
    done = subprocess.run([*UNSHARE, sys.executable, __file__, str(root / "spec.json"), str(out)],
                          capture_output=True, text=True, timeout=timeout * (len(turns) + 1) + 240)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"the {cli} session failed (status {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


if __name__ == "__main__":
    if sys.argv[1] == "--probe":  # in a new namespace: loopback up, and a socket served on it
        loopback_up()
        with socket.create_server(("127.0.0.1", 0)) as listener:
            socket.create_connection(listener.getsockname(), timeout=5).close()
        sys.exit(0)
    result = run_session(json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(result, indent=2))
