"""Harbor's verifier contract as it runs here: the tests' world, their reward, and why they could not judge.

A Harbor task's ``tests/test.sh`` runs after the agent is gone, with the final state at the task's working
directory, the tests at :data:`TESTS_PATH` and a fresh ``logs/verifier`` at :data:`LOGS_PATH` (the episode
that runs it: :class:`~.terminal_episode.TerminalEpisode`). Here:

* links of the final state that would reach the verifier's own world are severed first (:func:`sever_links`);
* where the sandbox cannot show Harbor's paths, the tests' files get them mapped to local folders
  (:func:`map_paths`);
* the reward is what the tests wrote (:func:`read_reward`);
* a reward below 1 is the verifier's error, not the agent's failure, when the tests could not run
  (:func:`verifier_breakage`) or need the network (:func:`network_needs`, named at import; :func:`offline_reason`).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path, PurePosixPath
from typing import Mapping, Sequence

from envloop_pipelines.core.environments.harbor_format import logical_lines
from envloop_pipelines.core.sandbox.mounts import PRIVATE_TMP_DIRS
from envloop_pipelines.core.sandbox.tree import walk

#: Where the tests of a Harbor task and its logs are, in the verifier's phase only (Harbor's paths).
TESTS_PATH, LOGS_PATH = "/tests", "/logs"
#: The verifier's own HOME, made empty in its private /tmp: nothing the agent wrote is a dotfile there.
VERIFIER_HOME = "/tmp/home"
#: What a link of the final state that would reach the verifier's own world points to instead (nowhere).
SEVERED_LINK = "/.envloop-severed-link"

#: Commands that reach the network (package managers, downloads, uv's runners). Environments here have none.
NETWORK_COMMANDS = re.compile(
    r"(?:^|[\s;&|(`]|\$\()((?:apt-get|apt|apk|yum|dnf)\s+(?:-\S+\s+)*(?:update|install|upgrade)\b.*"
    r"|(?:curl|wget)\s.*|(?:pip3?|python3?\s+-m\s+pip|uv\s+pip)\s+install\b.*|uvx\s.*|uv\s+(?:run|sync|add|tool)\b.*"
    r"|(?:npm|yarn|pnpm)\s+(?:install|ci|add)\b.*|git\s+clone\b.*)")


def network_needs(files: Mapping[str, str]) -> list[str]:
    """``file:line: command`` for each line of the tests' shell scripts that reaches the network.

    Harbor runs ``tests/test.sh`` in a container that may have one (``network_mode = "public"``); here the tests
    run without, so such a line fails, and the verdict says so (an ``error``, not the agent's failure).
    """
    found = []
    for rel, text in sorted(files.items()):
        if not rel.endswith(".sh"):
            continue
        for n, line in logical_lines(text):
            m = NETWORK_COMMANDS.search(line.strip())
            # `command -v uvx`, `which curl`: a check for the program, not a use of the network.
            if m and not line.strip()[:m.start(1)].rstrip().endswith(("command -v", "which", "type", "hash")):
                found.append(f"{rel}:{n}: {m.group(1).strip()[:200]}")
    return found


def _agent_world_trail(path: str, app: Path, workdir: str, max_links: int = 40) -> list[str]:
    """Every path that resolving ``path`` passes through in the agent's world, the last one where it ends.

    The agent's world is this host's filesystem with the final state at ``workdir`` (read from ``app``) and
    empty private temp dirs; links are followed as the kernel follows them (at most ``max_links``).
    """
    parts = list(PurePosixPath(path).parts[1:])
    cur, trail, hops = "/", [], 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        nxt = os.path.dirname(cur) if part == ".." else os.path.join(cur, part)
        host = (app / os.path.relpath(nxt, workdir)) if _is_below(nxt, workdir) else Path(nxt)
        trail.append(nxt)
        try:
            st = os.lstat(host)
            if any(_is_below(nxt, t) for t in PRIVATE_TMP_DIRS) and not _is_below(nxt, workdir):
                raise FileNotFoundError(nxt)  # empty for the agent: its temp dirs were its own commands' own
        except OSError:
            cur = nxt
            continue
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > max_links:
                break
            target = os.readlink(host)
            parts = [*PurePosixPath(target).parts[1 if target.startswith("/") else 0:], *parts]
            cur = "/" if target.startswith("/") else cur
            continue
        cur = nxt
    return trail


def _is_below(path: str, top: str) -> bool:
    top = top.rstrip("/") or "/"
    return path == top or path.startswith(top + "/") or top == "/"


def sever_links(app: Path, workdir: str, verifier_only: Sequence[str]) -> list[dict[str, str]]:
    """Make every link of the final state resolve as in the agent's world before the verifier runs.

    A link whose resolution in the agent's world passes through one of ``verifier_only`` (``/tests``, ``/logs``,
    ``/proc``, the temp dirs, the episode's own folder: what is there for the verifier is not what the agent
    had) would name the verifier's files, so it is pointed at :data:`SEVERED_LINK`, where nothing is: reading
    it fails as it did for the agent. Links that stay inside the working directory, or reach the host's
    shared files, are kept as they are. Returns ``[{"path", "target", "reaches"}]`` of the severed links.
    """
    severed = []
    for dirpath, _dirs, files in walk(app):
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                continue
            rel = os.path.relpath(path, app)
            trail = _agent_world_trail(os.path.join(workdir, rel), app, workdir)
            reached = next((t for t in trail if any(_is_below(t, v) for v in verifier_only)), None)
            if reached is None:
                continue
            target = os.readlink(path)
            os.unlink(path)
            os.symlink(SEVERED_LINK, path)
            severed.append({"path": rel, "target": target, "reaches": reached})
    return severed


def map_paths(script: str, mapping: Mapping[str, Path]) -> str:
    """Replace the absolute paths a Harbor script names (``/tests``, ``/logs``, its workdir) by local ones.

    A path is replaced where it stands alone or starts a longer path (``/tests/x``), not inside another
    path (``/opt/tests``) or a word.
    """
    for prefix in sorted(mapping, key=len, reverse=True):
        pattern = re.compile(r"(?<![\w./-])" + re.escape(prefix) + r"(?=/|[\s\"'`;:)|&<>]|$)", re.MULTILINE)
        script = pattern.sub(lambda _m, p=str(mapping[prefix]): p, script)
    return script


#: What a test run prints when the tests themselves could not run (the verifier broke, not the agent's work).
_BREAKAGE = (
    (re.compile(r"(?m)^(?:pytest|[\w./-]*pytest[\w.-]*): error: (.*)$"), "pytest refused its command line: {0}"),
    (re.compile(r"(?m)^ERROR: usage: .*$"), "pytest refused its command line"),
    (re.compile(r"(?m)^ERROR: file or directory not found: (.*)$"), "the tests are not where test.sh looks: {0}"),
    (re.compile(r"(?m)^INTERNALERROR>.*$"), "pytest crashed (INTERNALERROR)"),
    (re.compile(r"(?m)^ImportError while importing test module '([^']*)'"),
     "the test module {0} could not be imported (a package the tests need is not installed here)"),
    (re.compile(r"(?m)^(?:.*: )?(pytest|py\.test|uvx|uv|pip3?|python3?|apt-get|curl): (?:command )?not found$"),
     "{0} is not installed here"),
    (re.compile(r"(?m)^=+ no tests ran in .*$"), "pytest found no tests"),
)


def verifier_breakage(output: str) -> str | None:
    """Why the tests could not run, from their output (pytest's usage errors, a missing program), or None.

    A reward of 0 with one of these is the verifier's error, not the agent's failure.
    """
    for pattern, message in _BREAKAGE:
        m = pattern.search(output)
        if m:
            return "the tests could not run: " + message.format(*(g.strip() for g in m.groups()))
    return None


def offline_reason(lines: Sequence[str]) -> str:
    """Why tests that need the network could not judge the attempt (``file:line: command`` of the first)."""
    more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
    return f"the tests could not run: they need the network, which environments here do not have: {lines[0]}{more}"


def read_reward(logs: Path) -> float:
    """The reward the tests wrote: ``reward.json`` (its ``reward`` key, or its only number) wins over ``reward.txt``.

    Raises:
        ValueError: no reward file, or one that is not a regular file, too large or not a number.
    """
    for name in ("reward.json", "reward.txt"):
        path = logs / name
        if not os.path.lexists(path):
            continue
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > 4096:
            raise ValueError(f"{path}: not a regular file of at most 4096 bytes")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as fh:
            text = fh.read().decode("utf-8", errors="replace").strip()
        try:
            if name == "reward.txt":
                return float(text)
            raw = json.loads(text)
            numbers = {k: v for k, v in raw.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if "reward" in numbers:
                return float(numbers["reward"])
            if len(numbers) == 1:
                return float(next(iter(numbers.values())))
            raise ValueError(f"no 'reward' key among {sorted(numbers)}")
        except (ValueError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a reward: {exc}") from None
    raise ValueError(f"the tests wrote no reward file in {logs}")


__all__ = ["LOGS_PATH", "NETWORK_COMMANDS", "SEVERED_LINK", "TESTS_PATH", "VERIFIER_HOME", "map_paths",
           "network_needs", "offline_reason", "read_reward", "sever_links", "verifier_breakage"]
