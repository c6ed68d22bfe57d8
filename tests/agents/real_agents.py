"""Real coding agents (pinned in package.json and requirements.txt) run headless against a kvroute server, through
the capture proxy.

Each client gets a home of its own (HOME, XDG dirs and its config dir under one temporary folder), a working
directory inside it, an environment built from nothing but PATH and that home (no host API keys leak in), its
telemetry, update checks and error reporting switched off by its own settings, and an HTTP(S) proxy that refuses
every connection except to loopback, so anything it tries to reach beyond the server fails at once (not for Cline,
whose runtime sends loopback requests to a proxy too).

`run_conversation(client, server_url, api_key, model, root)` runs two turns (the second resumes the first's
session; Cline's is a new task) and returns what happened: exit codes, the client's own error text, and per model
request the proxy's timings and the usage the server reported.

Record the fixture corpus (tests/fixtures/agents/<client>-<version>/NNN.json) with
    .venv/bin/python tests/agents/real_agents.py [--client NAME ...] [--upstream URL --api-key KEY --model NAME]
which starts its own `kvroute serve` unless --upstream is given.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capture import CaptureProxy

HERE = Path(__file__).resolve().parent
BIN = HERE / "node_modules" / ".bin"
# the agents published on PyPI (requirements.txt), in a virtualenv of their own: their pins are not kvroute's
PYVENV = HERE / "pyvenv"
REPO = HERE.parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "agents"

PROMPT_1 = "Say hello in one word."
PROMPT_2 = "Now say goodbye in one word."
TURN_TIMEOUT_S = 900
# Where every connection that is not to loopback goes: a closed port, so it fails at once.
DEAD_PROXY = "http://127.0.0.1:9"
API_KEY = "sk-kvroute-agents"
# the server the agents run against: a context for their long system prompts, greedy (they send no temperature):
# sampled at 1.0, the small model sometimes calls tools until the context is full. Its output cap leaves room for the
# long tool call (test_long_tool_call.py runs on the same server, so it shares the agents' prompts); every other reply
# is capped at REPLY_CAP tokens by the proxy (`capped`): the agents ask for 32k, and the default model seldom ends one.
# The default model's template has no tool syntax: --generic-tools shows it the agents' tools, so that their tool round
# trips run here (a default `kvroute serve` does not: codex_runs.py runs Codex against one).
SERVER_CAP = 2048
REPLY_CAP = 64
SERVE_FLAGS = (
    *("--workers", "1", "--slots", "2", "--ctx-per-slot", "32768"),
    *("--max-tokens", str(SERVER_CAP), "--temp", "0", "--threads", "2", "--generic-tools"),
)


COPILOT_SESSION = "6b1f0c8e-2d4a-4e57-9a3c-5f7e8d9b0a12"  # Copilot's session id on turn 1 (its `--session-id`)


def pypi_python() -> str | None:
    """An interpreter the PyPI agents install with (aider: 3.10-3.12), as scripts/test looks for one; None if none."""
    for name in (str(REPO / ".venv" / "bin" / "python"), "python3.12", "python3.11", "python3.10"):
        exe = shutil.which(name)
        if exe and subprocess.run([exe, "-c", "import sys; sys.exit(not (3, 10) <= sys.version_info < (3, 13))"]).returncode == 0:
            return exe
    return None


@dataclass
class Client:
    name: str
    package: str
    version: str
    binary: str
    api: str  # the path the model requests go to
    # the client's words for giving up on replies cut at the output cap: the default model (270M, a base model) seldom
    # ends a reply by itself, and Claude Code fails a turn whose replies all end at max_tokens, with llama-server too
    cut_at_cap: str | None = None
    pypi: bool = False  # installed from PyPI into PYVENV by scripts/test, not from npm
    # turn 2's request starts with turn 1's whole prompt (False: the client puts the history before other context, or
    # turn 2 is a new task, so only the head the two share can be reused; the test measures that head)
    whole_history: bool = True

    @property
    def exe(self) -> Path:
        return (PYVENV / "bin" if self.pypi else BIN) / self.binary

    def installed(self) -> str | None:
        """None when it can run, else why not."""
        if self.pypi:
            dist = f"{self.package.replace('-', '_')}-{self.version}.dist-info"
            if self.exe.exists() and any(PYVENV.glob(f"lib/python3*/site-packages/{dist}")):
                return None
            return f"{self.package}=={self.version} is not in {PYVENV} (scripts/test installs it: see requirements.txt)"
        if not self.exe.exists():
            return f"{self.exe} is missing (scripts/test installs it: cd tests/agents && npm ci)"
        pkg = HERE / "node_modules" / self.package / "package.json"
        got = json.loads(pkg.read_text()).get("version") if pkg.exists() else None
        if got != self.version:
            return f"{self.package} is {got}, the test pins {self.version} (cd tests/agents && npm ci)"
        return None


CLIENTS = {
    c.name: c
    for c in (
        Client(
            "claude-code",
            "@anthropic-ai/claude-code",
            "2.1.328",
            "claude",
            "/v1/messages",
            cut_at_cap=r"response exceeded the \d+ output token maximum",
        ),
        # (a Responses reply cut at the request's own max_output_tokens is `incomplete`, which Codex reports)
        Client(
            "codex",
            "@openai/codex",
            "0.169.0",
            "codex",
            "/v1/responses",
            cut_at_cap="Incomplete response returned, reason: max_output_tokens",
        ),
        Client("opencode", "opencode-ai", "1.18.33", "opencode", "/v1/chat/completions"),
        Client("qwen-code", "@qwen-code/qwen-code", "0.24.4", "qwen", "/v1/chat/completions"),
        Client("pi", "@mariozechner/pi-coding-agent", "0.73.1", "pi", "/v1/chat/completions"),
        Client("copilot", "@github/copilot", "1.0.102", "copilot", "/v1/chat/completions"),
        # Copilot CLI's other wire: OpenAI Responses (COPILOT_PROVIDER_WIRE_API=responses)
        Client("copilot-responses", "@github/copilot", "1.0.102", "copilot", "/v1/responses"),
        Client("aider", "aider-chat", "0.86.2", "aider", "/v1/chat/completions", pypi=True, whole_history=False),
        # (its turn 2 is a new task: cline resumes a session in its interactive mode only)
        Client(
            "cline",
            "cline",
            "3.0.65",
            "cline",
            "/v1/chat/completions",
            cut_at_cap="maximum output token limit",
            whole_history=False,
        ),
    )
}


@dataclass
class Turn:
    argv: list[str]
    rc: int | None = None
    wall_s: float = 0.0
    stdout: str = ""
    stderr: str = ""
    errors: list[str] = field(default_factory=list)  # what the client itself reported as an error
    cut: list[str] = field(default_factory=list)  # errors that only say the model's replies ran into the output cap
    session: str | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        model = [r for r in self.requests if r.get("method") == "POST"]
        main = max(model, key=lambda r: prompt_tokens(r)[0], default=None)
        return {
            "rc": self.rc,
            "wall_s": round(self.wall_s, 2),
            "errors": self.errors,
            "cut_at_cap": self.cut,
            "session": self.session,
            "requests": len(self.requests),
            "statuses": [r["response"].get("status") for r in self.requests],
            "first_ttft_s": next((r["response"].get("ttft_s") for r in model if r["response"].get("ttft_s") is not None), None),
            "main": None
            if main is None
            else {
                "path": main["path"],
                "ttft_s": main["response"].get("ttft_s"),
                "total_s": main["response"].get("total_s"),
                "prompt_tokens": prompt_tokens(main)[0],
                "cached_tokens": prompt_tokens(main)[1],
            },
            "max_prompt_tokens": max((prompt_tokens(r)[0] for r in model), default=0),
            "max_cached_tokens": max((prompt_tokens(r)[1] for r in model), default=0),
            "refusals": [refusal(r) for r in self.requests if (r["response"].get("status") or 0) >= 400],
        }


def prompt_tokens(record: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, of them cached) from the usage the server reported, whatever the API; from llama-server's
    `timings` for a stream that did not ask for its usage (aider's)."""
    u = (record.get("response") or {}).get("usage") or {}
    timings = (record.get("response") or {}).get("timings")
    if not u and timings:
        return timings["cache_n"] + timings["prompt_n"], timings["cache_n"]
    if "cache_read_input_tokens" in u or record["path"].startswith("/v1/messages"):
        cached = u.get("cache_read_input_tokens") or 0
        return (u.get("input_tokens") or 0) + cached + (u.get("cache_creation_input_tokens") or 0), cached
    if "prompt_tokens" in u:
        return u.get("prompt_tokens") or 0, (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return u.get("input_tokens") or 0, (u.get("input_tokens_details") or {}).get("cached_tokens") or 0


def refusal(record: dict[str, Any]) -> str:
    err = record["response"].get("error")
    if isinstance(err, dict):
        err = (err.get("error") or {}).get("message") if isinstance(err.get("error"), dict) else err
    return f"{record['response'].get('status')} {record['method']} {record['path']}: {str(err)[:400]}"


class Conversation:
    """One client's home, environment and commands; `turn(1)` then `turn(2)`."""

    def __init__(self, client: Client, base_url: str, api_key: str, model: str, root: Path, home: Path | None = None) -> None:
        self.client = client
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.model = model
        self.home = home or root / f"home-{client.name}"
        self.work = self.home / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.env = self._base_env()
        self.config: dict[str, str] = {}  # files written into the home, by path relative to it
        getattr(self, "_setup_" + client.name.replace("-", "_"))()
        for rel, text in self.config.items():
            (self.home / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.home / rel).write_text(text)

    def _base_env(self) -> dict[str, str]:
        h = str(self.home)
        return {
            "PATH": f"{BIN}:{Path(shutil.which('node') or '/usr/bin/node').parent}:/usr/local/bin:/usr/bin:/bin",
            "HOME": h,
            "USER": "agent",
            "LOGNAME": "agent",
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "NO_COLOR": "1",
            "CI": "1",
            "TMPDIR": str(self.home / "tmp"),
            "XDG_CONFIG_HOME": f"{h}/.config",
            "XDG_CACHE_HOME": f"{h}/.cache",
            "XDG_DATA_HOME": f"{h}/.local/share",
            "XDG_STATE_HOME": f"{h}/.local/state",
            # nothing but loopback can be reached
            "HTTP_PROXY": DEAD_PROXY,
            "HTTPS_PROXY": DEAD_PROXY,
            "ALL_PROXY": DEAD_PROXY,
            "http_proxy": DEAD_PROXY,
            "https_proxy": DEAD_PROXY,
            "all_proxy": DEAD_PROXY,
            "NO_PROXY": "127.0.0.1,localhost,::1",
            "no_proxy": "127.0.0.1,localhost,::1",
        }

    # --- Claude Code: Anthropic Messages at ANTHROPIC_BASE_URL --------------------------------------------------
    def _setup_claude_code(self) -> None:
        self.env |= {
            "ANTHROPIC_BASE_URL": self.base_url,
            "ANTHROPIC_API_KEY": self.api_key,
            "ANTHROPIC_MODEL": self.model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": self.model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": self.model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": self.model,
            "CLAUDE_CONFIG_DIR": str(self.home / ".claude"),
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_BUG_COMMAND": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
        }

    def _argv_claude_code(self, n: int, prompt: str) -> list[str]:
        # -p: print mode, tools that need permission are refused (nothing asks); turn 2 continues the newest session
        return [
            str(self.client.exe),
            "-p",
            *(["--continue"] if n == 2 else []),
            "--model",
            self.model,
            "--output-format",
            "json",
            prompt,
        ]

    # --- Codex CLI: OpenAI Responses through a model provider in CODEX_HOME/config.toml ---------------------------
    def _setup_codex(self) -> None:
        self.env |= {"CODEX_HOME": str(self.home / ".codex"), "KVROUTE_API_KEY": self.api_key}
        self.config[".codex/config.toml"] = (
            f'model = "{self.model}"\n'
            'model_provider = "kvroute"\n'
            "check_for_update_on_startup = false\n"
            "\n[model_providers.kvroute]\n"
            'name = "kvroute"\n'
            f'base_url = "{self.base_url}/v1"\n'
            'env_key = "KVROUTE_API_KEY"\n'
            'wire_api = "responses"\n'
            "request_max_retries = 0\n"
            "stream_max_retries = 0\n"
            "\n[analytics]\nenabled = false\n"
            "\n[feedback]\nenabled = false\n"
        )

    def _argv_codex(self, n: int, prompt: str) -> list[str]:
        # exec: headless, read-only sandbox by default; turn 2 resumes the newest session
        resume = ["resume", "--last"] if n == 2 else []
        return [str(self.client.exe), "exec", *resume, "--strict-config", "--skip-git-repo-check", "--json", prompt]

    # --- opencode: OpenAI Chat Completions through an @ai-sdk/openai-compatible provider -------------------------
    def _setup_opencode(self) -> None:
        config = {
            "$schema": "https://opencode.ai/config.json",
            "autoupdate": False,
            "share": "disabled",
            "model": f"kvroute/{self.model}",
            "small_model": f"kvroute/{self.model}",
            # the small model may call any tool: nothing that writes, runs or fetches
            "permission": {"edit": "deny", "bash": "deny", "webfetch": "deny"},
            # a bound on tool calls per turn, as a headless run should have: greedy, the small model can call tools until
            # the context is full (363 calls, 470 s on one CPU); past it opencode asks for a text-only reply
            "agent": {"build": {"steps": 8}},
            "provider": {
                "kvroute": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "kvroute",
                    "options": {"baseURL": f"{self.base_url}/v1", "apiKey": "{env:KVROUTE_API_KEY}"},
                    "models": {self.model: {"name": self.model}},
                }
            },
        }
        self.config[".config/opencode/opencode.json"] = json.dumps(config, indent=2) + "\n"
        self.env |= {
            "KVROUTE_API_KEY": self.api_key,
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
            "OPENCODE_DISABLE_SHARE": "1",
            "OPENCODE_DISABLE_CLAUDE_CODE": "1",
            "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1",
        }

    def _argv_opencode(self, n: int, prompt: str) -> list[str]:
        return [str(self.client.exe), "run", *(["--continue"] if n == 2 else []), "--format", "json", prompt]

    # --- Qwen Code: OpenAI Chat Completions at OPENAI_BASE_URL -----------------------------------------------------
    def _setup_qwen_code(self) -> None:
        settings = {
            "general": {"enableAutoUpdate": False},
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False},
            "ui": {"enableUserFeedback": False},
            "security": {"auth": {"selectedType": "openai"}},
            # its background memory extraction resends the turn under a prompt of its own, sharing no prefix with the
            # main one (a cold ~11k tokens, ~45 s here): off, as the many-agents tests cover unrelated prompts
            "memory": {"enableManagedAutoMemory": False},
        }
        self.config[".qwen/settings.json"] = json.dumps(settings, indent=2) + "\n"
        self.env |= {
            "OPENAI_BASE_URL": f"{self.base_url}/v1",
            "OPENAI_API_KEY": self.api_key,
            "OPENAI_MODEL": self.model,
            "QWEN_TELEMETRY_ENABLED": "false",
            "QWEN_USAGE_STATISTICS_ENABLED": "false",
        }

    def _argv_qwen_code(self, n: int, prompt: str) -> list[str]:
        # a positional prompt is one-shot; default approval mode refuses edits and shell commands headless
        return [str(self.client.exe), *(["--continue"] if n == 2 else []), "--output-format", "json", prompt]

    # --- pi: OpenAI Chat Completions through a provider in ~/.pi/agent/models.json (its docs' minimal example) -----
    def _setup_pi(self) -> None:
        provider = {"baseUrl": f"{self.base_url}/v1", "api": "openai-completions", "apiKey": "KVROUTE_API_KEY"}
        models = {"providers": {"kvroute": {**provider, "models": [{"id": self.model}]}}}
        self.config[".pi/agent/models.json"] = json.dumps(models, indent=2) + "\n"
        # PI_OFFLINE: no update check, package check or install telemetry at start
        self.env |= {"KVROUTE_API_KEY": self.api_key, "PI_OFFLINE": "1", "PI_TELEMETRY": "0"}

    def _argv_pi(self, n: int, prompt: str) -> list[str]:
        # -p: one prompt, then exit; turn 2 continues the newest session
        model = f"kvroute/{self.model}"
        return [str(self.client.exe), "-p", *(["--continue"] if n == 2 else []), "--mode", "json", "--model", model, prompt]

    # --- GitHub Copilot CLI: its own provider (BYOK) from COPILOT_PROVIDER_* ------------------------------------------
    def _setup_copilot(self, wire: str = "completions") -> None:
        self.env |= {
            "COPILOT_PROVIDER_BASE_URL": f"{self.base_url}/v1",
            "COPILOT_PROVIDER_API_KEY": self.api_key,
            "COPILOT_PROVIDER_WIRE_API": wire,
            "COPILOT_MODEL": self.model,
            "COPILOT_OFFLINE": "true",  # talks to nothing but the provider; telemetry off
        }

    def _setup_copilot_responses(self) -> None:
        self._setup_copilot("responses")

    def _argv_copilot(self, n: int, prompt: str) -> list[str]:
        # -p: one prompt, then exit; without --allow-all-tools every tool needing permission is refused. The session's
        # folder (session-state/<id>) is in the system prompt before the tools: one id (the home is fresh each test)
        # lets the Responses run reuse the whole ~11.6k-token prefix the Chat run computed, not its first 4.7k
        cont = ["--continue"] if n == 2 else ["--session-id", COPILOT_SESSION]
        return [str(self.client.exe), "-p", prompt, *cont, "--output-format", "json", "--disable-client-telemetry"]

    _argv_copilot_responses = _argv_copilot

    # --- aider: OpenAI Chat Completions through litellm's `openai/` provider at OPENAI_API_BASE --------------------
    def _setup_aider(self) -> None:
        self.env |= {"OPENAI_API_BASE": f"{self.base_url}/v1", "OPENAI_API_KEY": self.api_key}

    def _argv_aider(self, n: int, prompt: str) -> list[str]:
        # --message: one prompt, then exit; turn 2 restores the chat history aider wrote into the working directory
        flags = ["--no-git", "--yes-always", "--no-check-update", "--analytics-disable", "--no-show-model-warnings"]
        flags += ["--no-pretty", "--no-fancy-input", "--no-show-release-notes"]
        history = ["--restore-chat-history"] if n == 2 else []
        return [str(self.client.exe), "--model", f"openai/{self.model}", "--message", prompt, *history, *flags]

    # --- Cline CLI: its openai-compatible provider, set with its own `cline auth` (it writes ~/.cline/data/settings) ---
    def _setup_cline(self) -> None:
        # local sessions: no hub daemon started that outlives the turn; no proxy: its runtime (Bun) sends even
        # loopback requests to one, whatever NO_PROXY says
        self.env |= {"CLINE_SESSION_BACKEND_MODE": "local", "CLINE_NO_AUTO_UPDATE": "1"}
        for k in [k for k in self.env if k.lower().endswith("_proxy")]:
            del self.env[k]
        auth = ["auth", "-p", "openai", "-b", f"{self.base_url}/v1", "-k", self.api_key, "-m", self.model]
        subprocess.run([str(self.client.exe), *auth], cwd=self.work, env=self.env, capture_output=True, timeout=120, check=True)

    def _argv_cline(self, n: int, prompt: str) -> list[str]:
        return [str(self.client.exe), "--json", prompt]

    # --- running -------------------------------------------------------------------------------------------------
    def argv(self, n: int, prompt: str) -> list[str]:
        return getattr(self, "_argv_" + self.client.name.replace("-", "_"))(n, prompt)

    def turn(self, n: int, prompt: str, proxy: CaptureProxy) -> Turn:
        (self.home / "tmp").mkdir(exist_ok=True)
        t = Turn(self.argv(n, prompt))
        proxy.take()
        start = time.monotonic()
        # (a session of its own: on a timeout the whole client goes, not only its launcher; Codex's npm launcher
        # left its native binary running, and its request with it, into the next turn)
        p = subprocess.Popen(
            t.argv, cwd=self.work, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        try:
            out, err = p.communicate(timeout=TURN_TIMEOUT_S)
            t.rc = p.returncode
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            t.rc = None
            t.errors.append(f"timed out after {TURN_TIMEOUT_S} s")
        t.wall_s = time.monotonic() - start
        t.stdout, t.stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        time.sleep(0.2)  # the proxy saves a record when the reply's last byte has gone
        t.requests = sorted(proxy.take(), key=lambda r: r["n"])
        self._read_output(t)
        return t

    def _read_output(self, t: Turn) -> None:
        """The client's own account of the turn: its session id and any error it reported."""
        events = []
        for line in (t.stdout + "\n" + t.stderr).splitlines():  # (cline writes its last error event to stderr)
            line = line.strip()
            if line.startswith(("{", "[")):
                with contextlib.suppress(ValueError):
                    events.append(json.loads(line))
        if not events and t.stdout.strip().startswith(("{", "[")):
            with contextlib.suppress(ValueError):
                events.append(json.loads(t.stdout))
        flat: list[Any] = []
        for e in events:
            flat.extend(e if isinstance(e, list) else [e])
        for e in flat:
            if not isinstance(e, dict):
                continue
            kind = e.get("type")
            t.session = t.session or e.get("session_id") or e.get("thread_id") or e.get("sessionID") or e.get("sessionId")
            t.session = t.session or e.get("taskId")  # cline's
            if kind == "session" and not t.session:  # pi's first line
                t.session = e.get("id")
            message = e.get("message") if isinstance(e.get("message"), dict) else {}
            if kind == "result" and (e.get("is_error") or e.get("subtype", "success") != "success" or e.get("exitCode")):
                t.errors.append(str(e.get("result") or e.get("error") or e.get("subtype") or e)[:600])
            elif kind in ("error", "turn.failed", "session.error"):
                t.errors.append(json.dumps(e.get("error") or e.get("message") or e.get("data") or e)[:600])
            elif kind == "message_end" and message.get("stopReason") in ("error", "aborted"):  # pi exits 0 after these
                t.errors.append(str(message.get("errorMessage") or message.get("stopReason"))[:600])
        # aider prints its model errors as text (litellm's exception names) and exits 0
        t.errors += re.findall(r"^litellm\.\w+Error: .*$", t.stdout, re.MULTILINE)
        cap = self.client.cut_at_cap
        t.cut = [e for e in t.errors if cap and re.search(cap, e)]
        t.errors = [e for e in t.errors if e not in t.cut]
        if t.rc != 0 and not t.errors and not t.cut:
            t.errors.append(f"exit {t.rc}: {(t.stderr.strip() or t.stdout.strip())[-600:]}")
        for r in t.requests:
            if (r["response"].get("status") or 0) >= 400 and r["method"] == "POST":
                t.errors.append(refusal(r))

    def sanitize(self, text: str) -> str:
        """The home's absolute path (and the forms clients derive from it), and the checkout's (where a client's
        prompt names its own install), as stable placeholders."""
        home = str(self.home)
        for old, new in (
            (home, "/home/agent"),
            (str(REPO), "/kvroute"),
            (home.lstrip("/"), "home/agent"),
            (re.sub(r"[^A-Za-z0-9]", "-", home), "-home-agent"),
        ):
            text = text.replace(old, new)
        return text


DONE = {"type": "string", "enum": ["done"]}


def ending(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A model request made to end the turn: no tool call, a one-word reply, in the API of `path`. (The prompt is
    unchanged: tools render whatever tool_choice says, so what is cached is what it would be.)"""
    body = json.loads(json.dumps(body))
    if path.startswith("/v1/messages"):
        body["tool_choice"] = {"type": "none"}
        body["output_config"] = {**(body.get("output_config") or {}), "format": {"type": "json_schema", "schema": DONE}}
    elif path.startswith("/v1/responses"):
        body["tool_choice"] = "none"
        body["text"] = {**(body.get("text") or {}), "format": {"type": "json_schema", "name": "done", "schema": DONE}}
    else:  # Chat Completions
        body["tool_choice"] = "none"
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "done", "schema": DONE}}
    body["ended_by_test"] = True  # (a hint: counted, and marks the record)
    return body


def after_tool_result(body: dict[str, Any]) -> bool:
    """The request sends a tool's result back (the agent ran a call the model wrote), in any of the three APIs."""
    items = body.get("messages") if "messages" in body else body.get("input")
    if not isinstance(items, list) or not items or not isinstance(items[-1], dict):
        return False
    last = items[-1]
    if last.get("role") == "tool" or last.get("type") in ("function_call_output", "custom_tool_call_output"):
        return True
    content = last.get("content")
    return isinstance(content, list) and any(isinstance(b, dict) and b.get("type") == "tool_result" for b in content)


def one_tool_round(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The proxy's rewrite for the two-turn test: once the agent sends a tool's result back, that request ends the turn.
    The 270M model answers an agent's prompt with a call (often cut at the REPLY_CAP); the agent runs it, gets an
    error back, and the model writes the same call again, at temperature 0 forever (Claude Code made 76 requests in
    its 900 s). One round trip of a call and its result is served as the client sent it; the loop is not."""
    body = capped(path, body)
    return ending(path, body) if after_tool_result(body) else body


MODEL_PATHS = {"/v1/messages": "max_tokens", "/v1/responses": "max_output_tokens", "/v1/chat/completions": "max_tokens"}


def capped(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A model request's output cap lowered to REPLY_CAP, in the field its API reads (set where the client sent none;
    Chat's `max_completion_tokens` where the client uses that one). Any other request passes unchanged."""
    key = MODEL_PATHS.get(path.split("?", 1)[0])
    if key is None:
        return body
    if key == "max_tokens" and "max_completion_tokens" in body:
        key = "max_completion_tokens"
    asked = body.get(key)
    if isinstance(asked, int) and asked <= REPLY_CAP:
        return body
    return {**body, key: REPLY_CAP}


def fresh_home(homes: Path, client: Client) -> Path:
    """An empty home for `client` under `homes`, at one path per agent package: its prompts name its working directory,
    so each test that runs the agent from there sends the same prompt, and a later one reuses what an earlier computed
    (Copilot's Chat and Responses runs; tests/agents/conftest.py)."""
    home = homes / f"home-{client.package.lstrip('@').replace('/', '-')}"
    shutil.rmtree(home, ignore_errors=True)
    return home


def run_conversation(
    client: Client, server_url: str, api_key: str, model: str, root: Path, home: Path | None = None
) -> tuple[Conversation, list[Turn], CaptureProxy]:
    proxy = CaptureProxy(server_url, root / f"capture-{client.name}", rewrite=one_tool_round).start()
    try:
        conv = Conversation(client, proxy.url, api_key, model, root, home)
        first = conv.turn(1, PROMPT_1, proxy)
        second = conv.turn(2, PROMPT_2, proxy)
    finally:
        proxy.stop()
    return conv, [first, second], proxy


def write_fixtures(conv: Conversation, turns: list[Turn], proxy: CaptureProxy, dest_root: Path = FIXTURES) -> Path:
    """The captured requests, in order, as dest_root/<client>-<version>/NNN.json, plus manifest.json."""
    dest = dest_root / f"{conv.client.name}-{conv.client.version}"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    n = 0
    for i, t in enumerate(turns, 1):
        for r in t.requests:
            n += 1
            r = {**r, "n": n, "turn": i}
            r["headers"] = {k: v for k, v in r["headers"].items() if k.lower() not in ("host", "content-length")}
            (dest / f"{n:03d}.json").write_text(conv.sanitize(json.dumps(r, indent=1, ensure_ascii=False)) + "\n")
    secret_env = {"ANTHROPIC_API_KEY", "OPENAI_API_KEY", "KVROUTE_API_KEY", "COPILOT_PROVIDER_API_KEY"}
    manifest = {
        "client": conv.client.name,
        "package": f"{conv.client.package}@{conv.client.version}",
        "captured": time.strftime("%Y-%m-%d"),
        "kvroute_commit": _git_head(),
        "prompts": [PROMPT_1, PROMPT_2],
        "turns": [
            {
                "argv": [Path(a).name if i == 0 else a for i, a in enumerate(t.argv)],
                "rc": t.rc,
                "errors": t.errors,
                "cut_at_cap": t.cut,
                "requests": [r["n"] for r in t.requests],
            }
            for t in turns
        ],
        "env": {k: ("REDACTED" if k in secret_env else v) for k, v in conv.env.items() if k not in ("PATH",)},
        "config_files": conv.config,
    }
    text = conv.sanitize(json.dumps(manifest, indent=1, ensure_ascii=False)).replace(proxy.url, "http://127.0.0.1:PROXY")
    (dest / "manifest.json").write_text(text + "\n")
    return dest


def _git_head() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description="capture the agents' requests as fixtures")
    ap.add_argument("--client", action="append", choices=sorted(CLIENTS), help="default: all")
    ap.add_argument("--upstream", help="a running kvroute's base URL (default: start one)")
    ap.add_argument("--api-key", default=API_KEY)
    ap.add_argument("--model", default="gemma-3-270m-q4_k_m")
    ap.add_argument("--out", type=Path, default=FIXTURES)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvagents-"))
    served = None
    if not args.upstream:
        sys.path.insert(0, str(REPO / "tests" / "frontdoor"))
        from served import Served

        served = Served(*SERVE_FLAGS, api_key=args.api_key, log=root / "serve.log")
        args.upstream = served.url
    try:
        for name in args.client or sorted(CLIENTS):
            client = CLIENTS[name]
            why = client.installed()
            if why:
                print(f"{name}: skipped: {why}", flush=True)
                continue
            conv, turns, proxy = run_conversation(client, args.upstream, args.api_key, args.model, root)
            dest = write_fixtures(conv, turns, proxy, args.out)
            print(
                json.dumps({"client": name, "fixtures": str(dest), "turns": [t.summary() for t in turns]}, indent=1), flush=True
            )
    finally:
        if served is not None:
            served.stop()


if __name__ == "__main__":
    main()
