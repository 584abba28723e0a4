"""A trained policy as training writes it and serving loads it: the chat rendering, the model, the checkpoint.

Training (:mod:`~envloop_pipelines.core.model.causal_sft`) renders its rows and writes its checkpoint with
these, and serving (:mod:`~envloop_pipelines.core.serve.generation`) renders its prompts and loads the
checkpoint with the same, so the two cannot drift apart:

* :func:`render` (through :func:`ensure_chat_template` and :func:`template_messages`): a conversation as
  text by the tokenizer's chat template, or :data:`CHAT_TEMPLATE` for a tokenizer without one;
* :func:`load_tokenizer` and :func:`load_policy`: the base model's tokenizer and the causal LM with its
  LoRA adapter merged;
* :class:`PolicyCheckpoint` and :func:`read_policy_checkpoint`: the checkpoint directory (its layout is
  described in :mod:`~envloop_pipelines.core.model.causal_sft`), its manifest verified.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import yaml

from envloop_pipelines.core.model.checkpoint import MANIFEST, identity_of, sha256_file

FORMAT = "envloop-policy-checkpoint/1"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
RECIPE_FILE = "recipe.yaml"
DATA_FILE = "data.json"
METRICS_FILE = "metrics.json"
PROVENANCE_FILE = "provenance.json"
ADAPTER_DIR = "adapter"

#: A Qwen2.5-style chat template for tokenizers that have none (tiny test models). Tool calls render as
#: ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``: the format generation parses back.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + (tool_call.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
#: End-of-turn markers generation stops at (besides the tokenizer's eos), when the vocabulary has them.
END_OF_TURN_TOKENS: tuple[str, ...] = ("<|im_end|>", "<|eot_id|>", "<|end|>")


class ChatTemplateError(ValueError):
    """A row cannot be rendered, or the template rewrites earlier turns (its masks would be wrong)."""


def ensure_chat_template(tokenizer: Any) -> str:
    """The tokenizer's chat template, set to :data:`CHAT_TEMPLATE` first when it has none."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer.chat_template


def template_messages(messages: Sequence[Mapping[str, Any]], *, where: str = "row") -> list[dict[str, Any]]:
    """Chat-format messages as chat templates expect them: tool-call ``arguments`` as objects, not JSON text.

    The OpenAI wire format carries ``arguments`` as a JSON string; Hugging Face templates (Qwen's
    among them) dump them with ``tojson``, which would quote the string a second time.

    Raises:
        ChatTemplateError: a message without a role, or arguments that are not a JSON object.
    """
    out: list[dict[str, Any]] = []
    for n, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"{where}: messages[{n}] is not a chat message with a role")
        m = {k: v for k, v in message.items() if v is not None or k == "content"}
        if m.get("content") is None:
            m["content"] = ""
        calls = []
        for c, call in enumerate(message.get("tool_calls") or []):
            fn = dict(call.get("function") or {})
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise ChatTemplateError(f"{where}: messages[{n}].tool_calls[{c}].function.arguments is not JSON: "
                                            f"{args[:80]!r}") from None
            fn["arguments"] = args
            calls.append({**{k: v for k, v in call.items() if k != "function"}, "function": fn})
        if calls:
            m["tool_calls"] = calls
        else:
            m.pop("tool_calls", None)
        out.append(m)
    return out


def render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = (), *,
           add_generation_prompt: bool = False) -> str:
    """The conversation as text through the tokenizer's chat template (``tools`` passed through; messages
    normalised by :func:`template_messages`)."""
    ensure_chat_template(tokenizer)
    return tokenizer.apply_chat_template(template_messages(messages), tools=list(tools) or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def load_tokenizer(base_model: str | Path, chat_template: str | None = None) -> Any:
    """The base model's tokenizer, with ``chat_template`` (or its own, or :data:`CHAT_TEMPLATE`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_model))
    if chat_template:
        tokenizer.chat_template = chat_template
    ensure_chat_template(tokenizer)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(base_model: str | Path, adapter_dir: str | Path | None = None, *, device: str | None = None,
                dtype: torch.dtype | None = None) -> Any:
    """The causal LM, with the LoRA adapter in ``adapter_dir`` applied when given (eval mode)."""
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=dtype)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
        model = model.merge_and_unload()  # one plain LM: faster generation, same outputs
    return model.to(device).eval()


@dataclass(frozen=True)
class PolicyCheckpoint:
    """A trained policy: where it is, its identity, and the base model it adapts."""

    path: str
    sha256: str
    base_model: str

    @property
    def adapter_dir(self) -> Path:
        return Path(self.path) / ADAPTER_DIR

    @property
    def chat_template(self) -> str:
        return (Path(self.path) / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")

    def metrics(self) -> dict[str, Any]:
        return json.loads((Path(self.path) / METRICS_FILE).read_text(encoding="utf-8"))


def policy_manifest(root: Path) -> dict[str, str]:
    """sha256 of every file below ``root`` but the manifest itself, by relative path."""
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def read_policy_checkpoint(path: str | Path) -> PolicyCheckpoint:
    """A policy checkpoint, its manifest verified.

    Raises:
        ValueError: a file is missing, extra or changed (named).
    """
    root = Path(path)
    if not (root / MANIFEST).is_file():
        raise ValueError(f"{root}: not a policy checkpoint (no {MANIFEST}; train one with train_causal_sft)")
    manifest = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{root / MANIFEST}: not a policy checkpoint (format {manifest.get('format')!r}, expected {FORMAT!r})")
    found = policy_manifest(root)
    for name in sorted(set(found) | set(manifest["files"])):
        if found.get(name) != manifest["files"].get(name):
            what = "missing" if name not in found else "not in the manifest" if name not in manifest["files"] else "changed"
            raise ValueError(f"policy checkpoint {root}: {name}: {what}")
    recipe = yaml.safe_load((root / RECIPE_FILE).read_text(encoding="utf-8"))
    return PolicyCheckpoint(str(root), identity_of(manifest["files"]), str(recipe["base_model"]))


__all__ = [
    "ADAPTER_DIR",
    "CHAT_TEMPLATE",
    "CHAT_TEMPLATE_FILE",
    "DATA_FILE",
    "END_OF_TURN_TOKENS",
    "FORMAT",
    "METRICS_FILE",
    "PROVENANCE_FILE",
    "RECIPE_FILE",
    "ChatTemplateError",
    "PolicyCheckpoint",
    "ensure_chat_template",
    "load_policy",
    "load_tokenizer",
    "policy_manifest",
    "read_policy_checkpoint",
    "render",
    "template_messages",
]
