"""Decision-model speed: one pass per question vs one pass per option, and training examples/s.

    .venv/bin/python bench/bench_model_speed.py [--questions 96] [--options 8]

Same model (the packaged MiniLM with the CPU recipe's LoRA and head), same
inputs: built-in benchmark states with an 8-option choice question. The
one-pass readout encodes question + all marked options + state once and reads
every option's marker; the per-option alternative (a cross-encoder) encodes
question + one option + state once per option and reads its marker. Prints
questions/s for both and the ratio (target: one-pass ≥ 3x at 8 options), then
training examples/s of the one-pass readout.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from envloop_pipelines.core.benchmark import BenchmarkConfig, generate_benchmark  # noqa: E402
from envloop_pipelines.core.model.decision_head import option_text  # noqa: E402
from envloop_pipelines.core.model.readout import Encoded, QuestionInput, fit_state, tokenize_unique  # noqa: E402
from envloop_pipelines.core.model.recipe import DEFAULT_RECIPE, load_recipe  # noqa: E402
from envloop_pipelines.core.model.trainable_model import build_trainable_model  # noqa: E402
from envloop_pipelines.core.model.training import train_checkpoint  # noqa: E402
from envloop_pipelines.core.data.json_text import render_value  # noqa: E402
from envloop_pipelines.core.data.records import records_from_objects  # noqa: E402
from envloop_pipelines.core.progress import configure_command_line  # noqa: E402

OPTION_NAMES = ("calendar", "email", "bank", "travel", "shopping", "notes", "photos", "ask_user", "music", "maps",
                "weather", "health")


def eight_option_questions(n: int, k: int) -> list[QuestionInput]:
    objs = generate_benchmark(BenchmarkConfig(n_users=max(8, n // 4), records_per_user=4))
    records = records_from_objects([(o, i) for i, o in enumerate(objs, 1)], file="bench", token_budget=None)
    out = []
    for r in records[:n]:
        out.append(QuestionInput(record_id=r.id, question_id="route", type="choice", family="route",
                                 state_text=render_value(r.state),
                                 instructions_text="Which connected service should handle this, or should the agent ask?",
                                 option_keys=OPTION_NAMES[:k], option_texts=(None,) * k, label=0))
    return out


def per_option_encodings(model, questions: list[QuestionInput]) -> list[list[Encoded]]:  # noqa: ANN001
    """One sequence per option: [CLS] question [SEP] [M] option [SEP] state [SEP]."""
    texts = [t for q in questions for t in (q.state_text, q.instructions_text,
                                            *(option_text(q.type, k, x) for k, x in zip(q.option_keys, q.option_texts)))]
    ids = tokenize_unique(model.tokenizer, texts)
    out = []
    for q in questions:
        seqs = []
        for key, text in zip(q.option_keys, q.option_texts):
            block = [model.cls_id, *ids[q.instructions_text], model.sep_id, model.marker_id]
            block += ids[option_text(q.type, key, text)]
            end = len(block)
            block.append(model.sep_id)
            state, dropped = fit_state(ids[q.state_text], model.max_length - len(block) - 1)
            seqs.append(Encoded(input_ids=tuple(block + state + [model.sep_id]),
                                token_type_ids=tuple([0] * len(block) + [1] * (len(state) + 1)),
                                option_positions=(len(ids[q.instructions_text]) + 2,), option_ends=(end,), label_ids=(),
                                n_options=1, truncated=dropped > 0, n_state_tokens_dropped=dropped))
        out.append(seqs)
    return out


def timed(fn, repeats: int = 2) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def forward_all(model, encoded: list[Encoded], batch_size: int) -> None:  # noqa: ANN001
    """Every sequence through the model once, in batches of similar length, on the model's device.

    On a GPU it waits for the last kernel, so that a timer around it measures the work, not its launch.
    """
    device = next(model.parameters()).device
    order = np.argsort([len(e) for e in encoded])
    with torch.inference_mode():
        for i in range(0, len(order), batch_size):
            batch = model.collate([encoded[j] for j in order[i:i + batch_size]])
            model(**{k: v.to(device) for k, v in batch.items()})
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pass_ratio(model, questions: list[QuestionInput], batch_size: int) -> dict[str, float]:  # noqa: ANN001
    """Questions/s of one pass per question and of one pass per option (best of two runs each), and their ratio."""
    one_pass = model.encode_many(questions)
    per_option = [e for seqs in per_option_encodings(model, questions) for e in seqs]
    forward_all(model, one_pass[:batch_size], batch_size)  # warm-up
    t_one = timed(lambda: forward_all(model, one_pass, batch_size))
    t_per = timed(lambda: forward_all(model, per_option, batch_size))
    return {"one_pass_qps": len(questions) / t_one, "per_option_qps": len(questions) / t_per, "ratio": t_per / t_one,
            "one_pass_sequences": len(one_pass), "per_option_sequences": len(per_option),
            "one_pass_mean_tokens": float(np.mean([len(e) for e in one_pass])),
            "per_option_mean_tokens": float(np.mean([len(e) for e in per_option]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=96)
    parser.add_argument("--options", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--train-questions", type=int, default=160)
    args = parser.parse_args()
    configure_command_line()  # progress: a bar on a terminal, lines elsewhere (ENVLOOP_PROGRESS)
    recipe = load_recipe(DEFAULT_RECIPE)
    model, _ = build_trainable_model(recipe)
    model.eval()
    questions = eight_option_questions(args.questions, args.options)
    passes = pass_ratio(model, questions, args.batch_size)
    print(f"threads={torch.get_num_threads()} questions={len(questions)} options={args.options} "
          f"batch={args.batch_size} max_length={recipe.max_length}")
    print(f"one pass per question : {passes['one_pass_sequences']:5d} sequences "
          f"(mean {passes['one_pass_mean_tokens']:.0f} tokens)  {passes['one_pass_qps']:7.1f} questions/s")
    print(f"one pass per option   : {passes['per_option_sequences']:5d} sequences "
          f"(mean {passes['per_option_mean_tokens']:.0f} tokens)  {passes['per_option_qps']:7.1f} questions/s")
    print(f"ratio one-pass / per-option: {passes['ratio']:.2f}x (target >= 3x at 8 options)")

    train_q = questions[: args.train_questions]
    for i, q in enumerate(train_q):
        object.__setattr__(q, "label", i % args.options)
    small = recipe.replace(epochs=1, max_steps=None)
    t0 = time.perf_counter()
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        train_checkpoint(train_q, train_q[:16], small, Path(tmp) / "ckpt", data_hash="bench")
    elapsed = time.perf_counter() - t0
    print(f"training (one pass, LoRA + head, batch {small.batch_size}): {len(train_q) / elapsed:.1f} examples/s "
          f"({len(train_q)} examples in {elapsed:.0f}s including load, calibration and checkpoint)")


if __name__ == "__main__":
    from envloop_pipelines.console import quiet_third_party

    quiet_third_party()  # the bench prints what it measures, not a library's notes on itself
    main()
