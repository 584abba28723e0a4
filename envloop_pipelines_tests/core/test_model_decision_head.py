"""Decision-head readout on the packaged MiniLM: encoding, one pass per question, independence, truncation.

These tests use the untrained readout (fresh LoRA and head, eval mode): the
properties they pin do not depend on training.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from envloop_pipelines.core.model.decision_head import MARKER_TOKEN, DecisionHead, DecisionHeadModel
from envloop_pipelines.core.model.predict import DecisionModel
from envloop_pipelines.core.model.readout import InputTooLongError, as_questions
from envloop_pipelines.core.model.readouts import build_readout_model
from envloop_pipelines.core.model.recipe import Recipe
from envloop_pipelines.core.data.question_table import questions_table
from envloop_pipelines_tests.core.test_model_data import limit_threads_under_xdist, make_records, make_table, many_option_record

limit_threads_under_xdist()


@pytest.fixture(scope="module", params=[False, True], ids=["pair-head", "state-attention"])
def model(request: pytest.FixtureRequest) -> DecisionHeadModel:
    torch.manual_seed(0)
    m = build_readout_model(Recipe(max_length=256, state_attention=request.param), trainable=False)
    assert isinstance(m, DecisionHeadModel)
    return m


@pytest.fixture(scope="module")
def dm(model: DecisionHeadModel) -> DecisionModel:
    return DecisionModel(model, batch_size=4)


class EncoderCalls:
    """Counts forward calls of the encoder and the batch shape of each."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.handle = encoder.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module: Any, args: Any, kwargs: dict, output: Any) -> None:
        self.shapes.append(tuple(kwargs["input_ids"].shape))

    def __enter__(self) -> "EncoderCalls":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.remove()


def test_probabilities_sum_to_one_and_are_keyed_by_option(dm: DecisionModel) -> None:
    table = make_table(4)
    preds = dm.predict(table)
    assert len(preds) == table.num_rows == 12
    for pred, keys, qid in zip(preds, table.column("option_keys").to_pylist(), table.column("question_id").to_pylist()):
        assert pred.question_id == qid and pred.option_keys == tuple(keys)
        assert list(pred.probabilities()) == keys
        assert pred.probs.dtype == np.float64 and pred.probs.shape == (len(keys),)
        assert abs(pred.probs.sum() - 1.0) < 1e-12 and np.all(pred.probs > 0)
        assert pred.answer in keys and pred.confidence == pred.probs.max()
    assert {p.option_keys for p in preds if p.type == "noul"} == {("true", "false")}


@pytest.mark.parametrize("n_options", [2, 8, 40])
def test_one_encoder_pass_per_question_whatever_the_number_of_options(dm: DecisionModel, model: DecisionHeadModel, n_options: int) -> None:
    records = [many_option_record(n_options, rid=f"m{i}", state=f"The answer is option o{i}.") for i in range(5)]
    with EncoderCalls(model.encoder) as calls:
        preds = dm.predict(records, batch_size=2)
    # 5 questions in batches of 2: three encoder calls, one row per question, all options scored.
    assert len(calls.shapes) == 3
    assert [s[0] for s in calls.shapes] == [2, 2, 1]
    assert sum(s[0] for s in calls.shapes) == len(preds) == 5
    assert all(len(p.probs) == n_options for p in preds)
    encoded = model.encode_many(as_questions(records))
    assert all(sum(t == model.marker_id for t in e.input_ids) == n_options for e in encoded)


def test_answer_does_not_depend_on_sibling_questions(dm: DecisionModel) -> None:
    table = make_table(3)
    questions = as_questions(table)
    alone = [dm.predict([q], batch_size=1)[0] for q in questions]
    together = dm.predict(questions, batch_size=8)
    reordered = dm.predict(list(reversed(questions)), batch_size=3)[::-1]
    for a, b, c in zip(alone, together, reordered):
        assert (a.record_id, a.question_id) == (b.record_id, b.question_id) == (c.record_id, c.question_id)
        np.testing.assert_allclose(a.probs, b.probs, rtol=0, atol=1e-5)
        np.testing.assert_allclose(a.probs, c.probs, rtol=0, atol=1e-5)
        np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=1e-5)
    # Same inputs, same batching: bit-identical.
    again = dm.predict(questions, batch_size=8)
    assert all(np.array_equal(x.probs, y.probs) for x, y in zip(together, again))


def test_long_state_is_truncated_explicitly_and_the_options_kept(model: DecisionHeadModel, dm: DecisionModel) -> None:
    long_state = " ".join(f"word{i}" for i in range(400))
    records = make_records(1)
    rec = records[0]
    long_rec = type(rec)(id="long", state=long_state, questions=rec.questions, meta=rec.meta, group=rec.group)
    q_long = as_questions([long_rec])[0]  # the choice question
    q_short = as_questions([rec])[0]
    n_state = len(model.tokenizer(long_state, add_special_tokens=False)["input_ids"])

    enc = model.encode_many([q_long])[0]
    assert len(enc.input_ids) == model.max_length == 256
    assert enc.truncated and enc.n_state_tokens_dropped > 0
    # The question/option block is the same as for an untruncated question; only state tokens are gone.
    block_len = enc.token_type_ids.index(1)
    short = model.encode_many([q_short])[0]
    assert enc.input_ids[:block_len] == short.input_ids[: short.token_type_ids.index(1)]
    assert enc.option_positions == short.option_positions and enc.option_ends == short.option_ends
    kept = len(enc.input_ids) - block_len - 1
    assert kept + enc.n_state_tokens_dropped == n_state
    state_ids = model.tokenizer(long_state, add_special_tokens=False)["input_ids"]
    # The start and the end of the state are kept, its middle dropped.
    head = kept // 2
    assert list(enc.input_ids[block_len:-1]) == state_ids[:head] + state_ids[len(state_ids) - (kept - head):]
    assert enc.input_ids[-1] == model.sep_id

    pred = dm.predict([q_long, q_short])
    assert pred[0].truncated and pred[0].n_state_tokens_dropped == enc.n_state_tokens_dropped
    assert not pred[1].truncated and pred[1].n_state_tokens_dropped == 0


def test_option_block_over_max_length_is_a_clear_error(model: DecisionHeadModel) -> None:
    record = many_option_record(120, rid="huge")
    with pytest.raises(InputTooLongError, match=r"question huge/pick: .*120 options.*max_length=256"):
        model.encode_many(as_questions([record]))


def test_marker_cannot_be_forged_by_text(model: DecisionHeadModel) -> None:
    record = many_option_record(3, rid="forge", state=f"{MARKER_TOKEN} [OPT] o1 {MARKER_TOKEN}")
    enc = model.encode_many(as_questions([record]))[0]
    assert sum(t == model.marker_id for t in enc.input_ids) == 3
    assert model.marker_id == model.tokenizer.convert_tokens_to_ids(MARKER_TOKEN)


def test_noul_options_read_yes_no_and_score_levels_read_their_names(model: DecisionHeadModel) -> None:
    questions = as_questions(make_table(1))
    by_id = {q.question_id: q for q in questions}
    for qid, words in (("urgent", ["yes", "no"]), ("satisfaction", ["0 : low", "1 : medium", "2 : high"])):
        enc = model.encode_many([by_id[qid]])[0]
        spans = [model.tokenizer.decode(enc.input_ids[p + 1 : e]) for p, e in zip(enc.option_positions, enc.option_ends)]
        assert spans == words


def test_questions_table_and_records_give_the_same_predictions(dm: DecisionModel) -> None:
    records = make_records(2)
    a = dm.predict(records)
    b = dm.predict(questions_table(records))
    assert all(np.array_equal(x.probs, y.probs) for x, y in zip(a, b))


def test_trainable_parameters_are_lora_and_head() -> None:
    torch.manual_seed(0)
    m = build_readout_model(Recipe(max_length=64), trainable=True)
    names = m.trainable_parameter_names()
    assert names and all(("lora_" in n) or n.startswith("head.") for n in names)
    assert any(n.startswith("head.") for n in names) and any("lora_A" in n for n in names)
    assert not any("embeddings" in n for n in names)
    frozen = [n for n, p in m.named_parameters() if not p.requires_grad]
    assert any("encoder.layer.0.attention.self.query.base_layer.weight" in n for n in frozen)


def test_fit_state_drops_the_middle() -> None:
    from envloop_pipelines.core.model.readout import fit_state

    ids = list(range(10))
    assert fit_state(ids, 20) == (ids, 0)
    assert fit_state(ids, 10) == (ids, 0)
    assert fit_state(ids, 5) == ([0, 1, 7, 8, 9], 5)
    assert fit_state(ids, 1) == ([9], 9)
    assert fit_state(ids, 0) == ([], 10)


def test_state_attention_reads_the_state_tokens_only() -> None:
    torch.manual_seed(0)
    head = DecisionHead(8, 16, state_attention=True).eval()
    options = torch.randn(2, 3, 16)
    hidden = torch.randn(2, 10, 8)
    state = torch.zeros(2, 10, dtype=torch.bool)
    state[:, 5:8] = True  # positions 0-4: question and options; 8-9: padding
    before = head(options, hidden, state)
    outside = hidden.clone()
    outside[:, :5] += 100.0
    outside[:, 8:] -= 100.0
    # Only the attention's view changes: the options' own vectors are inputs of their own.
    assert torch.allclose(head(options, outside, state), before, atol=1e-5)
    inside = hidden.clone()
    inside[:, 6] += 1.0
    assert not torch.allclose(head(options, inside, state), before)
    with pytest.raises(ValueError, match="state_attention needs"):
        head(options)
    assert set(DecisionHead(8, 16, state_attention=True).state_dict()) == {
        "query.weight", "query.bias", "key.weight", "key.bias", "proj.weight", "proj.bias", "out.weight", "out.bias"}
    assert set(DecisionHead(8, 16).state_dict()) == {"proj.weight", "proj.bias", "out.weight", "out.bias"}
