"""The agent runner: one agent, one episode, one attempt.

Terminal environments (``episode.tools == ("bash",)``): the agent gets a system
message, the environment's instruction, and one tool, ``bash``
(``{"command": string}``). Each tool call runs as one command in this
attempt's sandbox (:meth:`Episode.run`: a fresh sandboxed process in the
attempt's working directory, with the environment's limits; files persist
between calls, processes do not); the tool result is the exit code and the
tails of stdout and stderr. The attempt ends when the agent answers without a
tool call, or when a limit runs out (turns, completion tokens, wall time).
Then the verifier judges the final state.

Decision environments (``episode.tools == ()``): the question goes to the
agent once. A ``chat`` agent reads it in the plain-text question format of
``envloop serve``'s chat (``docs/serving.md``) and answers with an option key
(or a JSON object option → probability); a ``jev`` agent is asked through
``POST /systemone`` and its answer distribution is submitted as is.

Nothing the agent does ends the run: a dead endpoint, an HTTP error, a
timeout, an answer that is not a chat completion and a malformed tool call
(arguments that are not JSON, an unknown tool, no ``command``) end *that
attempt* with status ``error`` and the reason in ``Attempt.error``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from envloop_pipelines.core.agents.attempts import Attempt
from envloop_pipelines.core.agents.client import AgentError, AgentSpec, ChatClient, JevClient
from envloop_pipelines.core.environments.base import Score
from envloop_pipelines.core.sandbox.base import SandboxResult

log = logging.getLogger(__name__)

BASH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": ("Run one bash command in the task's working directory. Each call is a fresh shell: files "
                        "persist between calls, background processes and variables do not. There is no network. "
                        "Returns the exit code and the end of stdout and stderr."),
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The bash command or script to run."}},
            "required": ["command"],
            "additionalProperties": False,
        },
    },
}
TOOLS: dict[str, dict[str, Any]] = {"bash": BASH_TOOL}

TERMINAL_SYSTEM_PROMPT = (
    "You are an agent in a Linux sandbox with no network. Do the user's task in the current working directory "
    "with the bash tool. When the task is done, reply with a short summary and no tool call."
)
DECISION_SYSTEM_PROMPT = (
    "Answer the question with the key of one option and nothing else (or a JSON object mapping every option key "
    "to its probability)."
)


@dataclass(frozen=True)
class AttemptLimits:
    """Bounds of one attempt.

    Attributes:
        max_turns: model calls per attempt.
        max_tokens: completion tokens per attempt, over all calls (each call asks for at most what is left).
        wall_s: seconds per attempt, model calls and tool calls together (each request's timeout is the
            time left, at most ``request_timeout_s``; each tool call has the environment's own limits too).
        request_timeout_s: the most one model call may take.
        tool_output_chars: characters of stdout and of stderr returned to the agent per tool call (the tail).
    """

    max_turns: int = 16
    max_tokens: int = 8192
    wall_s: float = 300.0
    request_timeout_s: float = 60.0
    tool_output_chars: int = 4000

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens", "tool_output_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AttemptLimits.{name} must be a positive integer, got {value!r}")
        for name in ("wall_s", "request_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"AttemptLimits.{name} must be a positive number of seconds, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sampling_seed(environment_id: str, seed: int, attempt: int) -> int:
    """The ``seed`` sent with the chat requests of one attempt: stable, distinct per attempt, < 2**31."""
    digest = hashlib.sha256(f"{environment_id}\x00{seed}\x00{attempt}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def tool_result_text(result: SandboxResult, max_chars: int) -> str:
    """What the agent reads back from one command: status, exit code, and the tails of its output."""
    head = f"exit_code: {result.exit_code}" if result.exit_code is not None else f"killed: {result.detail or result.status}"
    if result.status not in ("ok", "error"):
        head += f" ({result.status}: {result.detail})"
    out = _compact_nul(result.stdout_tail[-max_chars:])
    err = _compact_nul(result.stderr_tail[-max_chars:])
    return f"{head}\nstdout:\n{out}\nstderr:\n{err}"


_NUL_RUN = re.compile("\x00+")


def _compact_nul(text: str) -> str:
    """NUL characters as ``\\x00`` (a run of them as ``\\x00*N``): JSON would store each as six bytes."""
    return _NUL_RUN.sub(lambda m: "\\x00" if len(m.group()) == 1 else f"\\x00*{len(m.group())}", text)


def question_text(question: Mapping[str, Any]) -> str:
    """A decision question in ``envloop serve``'s plain-text chat format (type, instructions, options, state)."""
    lines = [f"Type: {question['type']}", str(question.get("instructions_text") or "").strip()]
    for key, text in zip(question["option_keys"], question.get("option_texts") or [None] * len(question["option_keys"])):
        lines.append(f"- {key}: {text}" if text else f"- {key}")
    lines += ["State:", str(question.get("state_text") or "")]
    return "\n".join(line for line in lines if line != "")


def parse_decision_answer(content: str | None, option_keys: list[str]) -> Any:
    """An option key, or ``{option: probability}``, from the agent's reply; raises AgentError otherwise."""
    text = (content or "").strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError:
            raise AgentError(f"the answer is neither an option nor a JSON object: {text[:100]!r}") from None
        if not isinstance(raw, dict) or sorted(map(str, raw)) != sorted(option_keys) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in raw.values()):
            raise AgentError(f"a JSON answer must map every option {option_keys} to a probability, got {text[:100]!r}")
        return {str(k): float(v) for k, v in raw.items()}
    cleaned = text.strip("`'\". ")
    if cleaned in option_keys:
        return cleaned
    raise AgentError(f"the answer {text[:100]!r} is not one of the options {option_keys}")


class _Budget:
    def __init__(self, limits: AttemptLimits) -> None:
        self.limits = limits
        self.start = time.monotonic()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.turns = 0
        self.tool_calls = 0

    def left_s(self) -> float:
        return self.limits.wall_s - (time.monotonic() - self.start)

    def exhausted(self) -> str | None:
        if self.turns >= self.limits.max_turns:
            return f"turn limit: {self.limits.max_turns} model calls"
        if self.completion_tokens >= self.limits.max_tokens:
            return f"token limit: {self.completion_tokens} of {self.limits.max_tokens} completion tokens used"
        if self.left_s() <= 0:
            return f"wall-time limit: {self.limits.wall_s:g} s"
        return None


def _tool_command(call: Mapping[str, Any], tools: tuple[str, ...]) -> str:
    """The command of a well-formed bash call; AgentError names what is malformed."""
    fn = call["function"]
    name = fn.get("name")
    if name not in tools:
        raise AgentError(f"malformed tool call {call['id']}: unknown tool {name!r} (tools: {', '.join(tools) or 'none'})")
    try:
        args = json.loads(fn.get("arguments") or "")
    except (json.JSONDecodeError, TypeError):
        raise AgentError(f"malformed tool call {call['id']}: arguments are not JSON: {str(fn.get('arguments'))[:100]!r}") from None
    if not isinstance(args, dict) or not isinstance(args.get("command"), str):
        raise AgentError(f"malformed tool call {call['id']}: arguments need a string 'command', got {str(args)[:100]}")
    return args["command"]


def _drive_terminal(episode: Any, client: ChatClient, messages: list[dict[str, Any]], budget: _Budget,
                    seed: int) -> str:
    """The tool-call loop; returns why it stopped when a limit did it ("" when the agent finished)."""
    tools = [TOOLS[t] for t in episode.tools]
    while True:
        reason = budget.exhausted()
        if reason:
            return reason
        turn = client.complete(messages, tools=tools, seed=seed,
                               max_tokens=budget.limits.max_tokens - budget.completion_tokens,
                               timeout_s=min(budget.limits.request_timeout_s, budget.left_s()))
        budget.turns += 1
        budget.prompt_tokens += turn.prompt_tokens
        budget.completion_tokens += turn.completion_tokens
        messages.append(turn.message)
        calls = turn.message.get("tool_calls") or []
        if not calls:
            return ""
        for call in calls:
            try:
                command = _tool_command(call, tuple(episode.tools))
            except AgentError as exc:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"error: {exc}"})
                raise
            result = episode.run(command)
            budget.tool_calls += 1
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": tool_result_text(result, budget.limits.tool_output_chars)})


ORACLE_DONE = "Done: ran the task's reference solution."


def _drive_oracle(episode: Any, messages: list[dict[str, Any]], budget: _Budget) -> None:
    """The oracle agent: one bash call with the task's own reference solution (Harbor's oracle agent)."""
    spec = getattr(episode, "spec", None)
    solution = getattr(spec, "solution", None)
    if not episode.tools:
        raise AgentError("the oracle agent acts in terminal environments (a decision environment has no solution script)")
    if not solution:
        raise AgentError(f"{episode.environment_id} has no reference solution (a Harbor task's solution/solve.sh)")
    call = {"id": "call_oracle", "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": solution}, ensure_ascii=False)}}
    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    budget.turns += 1
    result = episode.run(solution)
    budget.tool_calls += 1
    messages.append({"role": "tool", "tool_call_id": call["id"],
                     "content": tool_result_text(result, budget.limits.tool_output_chars)})
    messages.append({"role": "assistant", "content": ORACLE_DONE})
    if result.status != "ok":
        log.info("%s: the reference solution ended %s (%s)", episode.environment_id, result.status, result.detail)


def _drive_decision(episode: Any, agent: AgentSpec, messages: list[dict[str, Any]], budget: _Budget, seed: int,
                    timeout_s: float) -> Any:
    """Ask the question once; submits the answer and returns it."""
    question = dict(episode.question)
    keys = [str(k) for k in question["option_keys"]]
    if agent.kind == "jev":
        jev = JevClient(agent, timeout_s=timeout_s)
        try:
            body = jev.request(question)
            messages.append({"role": "user", "content": json.dumps(body, ensure_ascii=False)})
            raw, probs, tokens = jev.answer(body, question, timeout_s=min(timeout_s, budget.left_s()))
        finally:
            jev.close()
        budget.turns += 1
        budget.prompt_tokens += tokens
        messages.append({"role": "assistant", "content": json.dumps(raw, ensure_ascii=False)})
        episode.submit(probs)
        return probs
    client = ChatClient(agent, timeout_s=timeout_s)
    try:
        messages.append({"role": "user", "content": question_text(question)})
        turn = client.complete(messages, seed=seed, max_tokens=min(256, budget.limits.max_tokens),
                               timeout_s=min(timeout_s, budget.left_s()))
    finally:
        client.close()
    budget.turns += 1
    budget.prompt_tokens += turn.prompt_tokens
    budget.completion_tokens += turn.completion_tokens
    messages.append(turn.message)
    answer = parse_decision_answer(turn.message.get("content"), keys)
    episode.submit(answer)
    return answer


def run_attempt(
    episode: Any,
    agent: AgentSpec,
    *,
    dataset: str,
    dataset_version: str,
    split: str,
    seed: int,
    attempt: int,
    limits: AttemptLimits = AttemptLimits(),
) -> Attempt:
    """Let ``agent`` act in ``episode`` (already open; the caller closes it), then verify.

    Args:
        episode: the live environment (core.environments' ``Episode``).
        agent: the agent's endpoint.
        dataset: the dataset name (recorded).
        dataset_version: its version (recorded).
        split: the environment's split (recorded).
        seed: the environment's seed (recorded).
        attempt: the attempt's index for this environment; with the seed it gives the requests' ``seed``.
        limits: turns, tokens and wall time.

    Returns:
        The attempt; never raises for anything the agent or its endpoint did.
    """
    budget = _Budget(limits)
    s_seed = sampling_seed(episode.environment_id, seed, attempt)
    terminal = bool(episode.tools)
    tools = [TOOLS[t] for t in episode.tools if t in TOOLS]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": TERMINAL_SYSTEM_PROMPT if terminal else DECISION_SYSTEM_PROMPT}]
    if terminal:
        messages.append({"role": "user", "content": episode.instruction})
    agent_error = ""
    limit_note = ""
    answer: Any = None
    try:
        if agent.kind == "oracle":
            _drive_oracle(episode, messages, budget)
        elif terminal:
            if agent.kind != "chat":
                raise AgentError(f"a {agent.kind} agent cannot act in a terminal environment (it has no tools)")
            client = ChatClient(agent, timeout_s=limits.request_timeout_s)
            try:
                limit_note = _drive_terminal(episode, client, messages, budget, s_seed)
            finally:
                client.close()
        else:
            answer = _drive_decision(episode, agent, messages, budget, s_seed, limits.request_timeout_s)
    except AgentError as exc:
        agent_error = str(exc)
    except Exception as exc:  # the episode failed under the agent: that attempt's error, not the run's
        log.exception("attempt %s/%d: the episode failed", episode.environment_id, attempt)
        agent_error = f"episode: {type(exc).__name__}: {exc}"
    score: Score | None = None
    verify_error = ""
    try:
        score = episode.verify()
    except Exception as exc:
        verify_error = f"verifier: {type(exc).__name__}: {exc}"
    try:
        final_state = dict(episode.final_state())
    except Exception as exc:
        final_state = {"error": f"{type(exc).__name__}: {exc}"}
    if not terminal and answer is not None:
        final_state.setdefault("answer", answer)  # what replay re-submits
    passed = score is not None and score.passed and not agent_error
    if agent_error or verify_error or (score is not None and score.status == "error"):
        status = "error"
    else:
        status = "passed" if passed else "failed"
    if score is not None and score.status == "error" and not verify_error:
        verify_error = f"verifier: {score.details.get('error') or 'the verifier could not decide'}"
    errors = [e for e in (agent_error, verify_error, limit_note) if e]
    return Attempt(
        dataset=dataset, dataset_version=dataset_version, environment_id=episode.environment_id, split=split,
        seed=seed, attempt=attempt, sampling_seed=s_seed, agent=agent.to_dict(), messages=messages, tools=tools,
        final_state=final_state, score=None if score is None else score.to_dict(), passed=passed, status=status,
        error="; ".join(errors), prompt_tokens=budget.prompt_tokens, completion_tokens=budget.completion_tokens,
        turns=budget.turns, tool_calls=budget.tool_calls, wall_s=round(time.monotonic() - budget.start, 4),
    )


def replay_in(attempt: Attempt, episode: Any) -> Score:
    """Re-run ``attempt``'s tool calls (or re-submit its answer) in a fresh ``episode`` and verify.

    The agent is not asked again: the transcript's assistant turns are the actions. A terminal
    attempt's malformed call (which ended it) is skipped, as it never ran.
    """
    if episode.environment_id != attempt.environment_id:
        raise ValueError(f"replay: the episode is {episode.environment_id!r}, the attempt {attempt.environment_id!r}")
    if episode.tools:
        for message in attempt.messages:
            for call in message.get("tool_calls") or [] if message.get("role") == "assistant" else []:
                try:
                    command = _tool_command(call, tuple(episode.tools))
                except AgentError:
                    continue
                episode.run(command)
    elif "answer" in attempt.final_state:
        episode.submit(attempt.final_state["answer"])
    return episode.verify()


__all__ = ["AttemptLimits", "BASH_TOOL", "DECISION_SYSTEM_PROMPT", "TERMINAL_SYSTEM_PROMPT", "TOOLS",
           "parse_decision_answer", "question_text", "replay_in", "run_attempt", "sampling_seed", "tool_result_text"]
